"""Errors as PyTorch raises them, at the user's line.

The dispatcher sends every exception raised while running an op through
`user_error`:
- PyTorch's own errors (meta-kernel shape/dtype checks, CPU fallback) and
  torchtpu's deliberate ones keep their type and message;
- failures inside a lowering, a JAX trace or the XLA runtime become the
  exception type PyTorch would raise, with a message naming the aten op,
  its inputs' shapes/dtypes and, in one line, what went wrong.

Either way the traceback is cut at the dispatcher: no JAX or lowering frames.
The few torch/torchtpu frames left between the user's line and the
dispatcher are marked `__tracebackhide__` (pytest and IPython hide them), and
an uncaught one is printed (sys.excepthook) ending at the user's line.
TORCHTPU_FULL_TRACEBACK=1 keeps everything.

Which arguments of which ops are indices, and how an out-of-range one is
reported, is torchtpu.bounds's; the NaN/Inf checks are torchtpu.modes.checks's.
"""
import contextlib
import os
import sys
import typing

import jax
import torch

from . import config


def _dir(module):
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


try:
    import jaxlib
    _JAX = (_dir(jax), _dir(jaxlib))
except ImportError:  # pragma: no cover
    _JAX = (_dir(jax),)
# (contextlib's frames stand between a with block and torchtpu's context
# managers: the user's line is the block's.)
_SKIP = (_dir(torch), os.path.dirname(os.path.abspath(__file__)) + os.sep,
         os.path.abspath(contextlib.__file__)) + _JAX
_OPS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops") + os.sep
_KERNEL_BUILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dispatch", "build.py")
_TRACER_ERRORS = tuple(getattr(jax.errors, n) for n in (
    "ConcretizationTypeError", "TracerBoolConversionError",
    "TracerIntegerConversionError", "TracerArrayConversionError") if hasattr(jax.errors, n))
_RUNTIME_ERRORS = tuple(getattr(jax.errors, n) for n in ("JaxRuntimeError",)
                        if hasattr(jax.errors, n))
_PYTORCH_TYPES = (IndexError, TypeError, ValueError, NotImplementedError)


def full_traceback():
    return config.FULL_TRACEBACK.on()


# ---- where the user is -----------------------------------------------------

def is_internal(filename):
    # (FX's generated code, "<eval_with_key>.N", is torch's too: the user's
    # line is the one that called the compiled module. A package imported
    # through a path such as "scripts/.." or a relative one has code named
    # by that path: it is compared normalized.)
    if filename.startswith(("<frozen", "<eval_with_key>")):
        return True
    return filename.startswith(_SKIP) or os.path.abspath(filename).startswith(_SKIP)


# code object -> whether it is torchtpu's, torch's or JAX's, so that finding
# the user's line (for each checked op, each flush) is a few dict lookups.
_internal_code = {}


def user_frame(frame=None):
    """The innermost frame outside torchtpu, torch and JAX."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        internal = _internal_code.get(code)
        if internal is None:
            internal = _internal_code[code] = is_internal(code.co_filename)
        if not internal:
            return frame
        frame = frame.f_back
    return None


def user_site(frame=None):
    """(file, line) of the user's innermost frame, or ("<unknown>", 0)."""
    frame = user_frame(frame or sys._getframe(1))
    if frame is None:
        return "<unknown>", 0
    return frame.f_code.co_filename, frame.f_lineno


def user_line(frame=None):
    """'file:line' of the user's innermost frame (a cheap stack walk)."""
    frame = user_frame(frame or sys._getframe(1))
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


# ---- describing an op call -------------------------------------------------

def _short_dtype(dtype):
    return str(dtype).replace("torch.", "")


def describe_arg(x):
    if isinstance(x, torch.Tensor):
        where = "" if x.device.type == "tpu" else f", {x.device.type}"
        return f"{_short_dtype(x.dtype)}{list(x.shape)}{where}"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(describe_arg(v) for v in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if x is None:
        return "None"
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def describe_call(func, args=(), kwargs=None):
    """'aten.add.Tensor(float32[3], float32[4], alpha=2)'."""
    parts = [describe_arg(a) for a in args]
    parts += [f"{k}={describe_arg(v)}" for k, v in (kwargs or {}).items()]
    return f"{func}({', '.join(parts)})"


def _first_line(e):
    text = str(e).strip()
    lines = text.splitlines() or [type(e).__name__]
    line = lines[0]
    if "Traceback (most recent call last)" in line and len(lines) > 1:
        # A host callback's error: its last line says what went wrong.
        line = line.split("Traceback (most recent call last)")[0] + lines[-1].strip()
    return line if len(line) <= 300 else line[:297] + "..."


# ---- translating an exception ----------------------------------------------

def _frames(tb):
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def _origin(tb):
    """(ran through JAX, ran through a lowering)."""
    in_jax = in_lowering = False
    for frame in _frames(tb):
        name = frame.f_code.co_filename
        if name.startswith(_OPS_DIR) or (name == _KERNEL_BUILD and frame.f_code.co_name == "fn"):
            in_lowering = True  # inside a lowering, or the kernel tracing it
        elif name.startswith(_JAX):
            in_jax = True
    return in_jax, in_lowering


class FusedGraphFailure(typing.NamedTuple):
    """What a fused flush was running when an error went through it."""
    ops: list    # each node's op name, and its issuing line where recorded
    reason: str  # why the graph was flushed


def note_fused_graph(e, g, reason, lines=None):
    """Mark e as raised while fused mode flushed graph g (for reason), so
    that its message names the graph's ops (and the lines that issued them,
    where NaN checks recorded lines); the innermost flush's mark stays."""
    if getattr(e, "_torchtpu_fused_graph", None) is not None:
        return
    ops = [kernel.name + (f" at {lines[i]}" if lines and lines[i] else "")
           for i, (kernel, _) in enumerate(g.nodes)]
    try:
        e._torchtpu_fused_graph = FusedGraphFailure(ops, reason)
    except AttributeError:  # an exception type without attributes: the op's message stays
        pass


# memory_holders() -> text naming the largest live tensors (torchtpu.memory
# registers it: out-of-memory errors name them).
_memory_holders = [lambda: ""]


def register_memory_holders(fn):
    _memory_holders[0] = fn


def over_memory_limit(rest):
    """The torch.OutOfMemoryError of going over the limit set by
    torch.tpu.set_per_process_memory_fraction, raised where a storage is
    made: its message, "at <line> ..." (rest), gets the op in front at the
    dispatcher (user_error), which knows it."""
    e = torch.OutOfMemoryError(f"torchtpu: an op {rest}")
    e._torchtpu_limit_rest = rest
    return e


def _out_of_memory(e, msg):
    """A device allocation that failed (XLA's RESOURCE_EXHAUSTED, or where
    the op was queued behind others, an INTERNAL error at its results' read
    naming the allocation) raises torch.OutOfMemoryError, as CUDA's does,
    naming what holds the memory."""
    if "RESOURCE_EXHAUSTED" not in str(e) and "Out of memory allocating" not in str(e):
        return None
    try:
        holders = _memory_holders[0]()
    except Exception:  # the message must come out whatever else fails
        holders = ""
    return torch.OutOfMemoryError(msg.rstrip(".") + (f". {holders}" if holders else ""))


def _translate(e, func, args, kwargs):
    in_jax, in_lowering = _origin(e.__traceback__)
    # JAX's C++ fast path raises runtime errors without any JAX frame.
    on_device = isinstance(e, _RUNTIME_ERRORS)
    if not (in_jax or in_lowering or on_device):
        return e  # PyTorch's own check, or torchtpu's deliberate error
    call = describe_call(func, args, kwargs)
    what = f"{type(e).__name__}: {_first_line(e)}"
    graph = getattr(e, "_torchtpu_fused_graph", None)
    if graph is not None:
        names = graph.ops
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        msg = (f"torchtpu: a fused graph of {len(names)} ops ({shown}) failed at a sync "
               f"point ({graph.reason}): {what}")
        return _out_of_memory(e, msg) or RuntimeError(msg)
    if isinstance(e, _TRACER_ERRORS) and _traced_by_user(args, kwargs):
        return RuntimeError(f"torchtpu: {call} reads a tensor's values on the host (.item(), "
                            "bool(), a branch on a value, a data-dependent shape), which a function "
                            f"traced by JAX cannot: {what}")
    if isinstance(e, _TRACER_ERRORS):
        return RuntimeError(f"torchtpu: {call}: its tpu lowering depends on tensor values, "
                            f"which are not known while tracing (a torchtpu bug): {what}")
    if on_device:
        msg = f"torchtpu: {call} failed on the device: {what}"
        return _out_of_memory(e, msg) or RuntimeError(msg)
    cls = next((c for c in _PYTORCH_TYPES if isinstance(e, c)), RuntimeError)
    return cls(f"torchtpu: {call} failed in its tpu lowering (a torchtpu bug; "
               f"TORCHTPU_FULL_TRACEBACK=1 shows where): {what}")


def _traced_by_user(args, kwargs):
    """Whether the op's tensors hold JAX tracers: the user's program is being
    traced by JAX (torchtpu.jax.functionalize), not a lowering by torchtpu."""
    for a in (*args, *(kwargs or {}).values()):
        storage = getattr(a, "_storage", None)
        if storage is not None and isinstance(getattr(storage, "array", None), jax.core.Tracer):
            return True
    return False


def user_error(e, func, args=(), kwargs=None):
    """The exception to raise, from the dispatcher's except block, for e
    raised while running func: `raise errors.user_error(e, func, args, kwargs)`."""
    if full_traceback():
        # Re-raising adds the dispatcher's frame again: drop its old entry.
        tb = e.__traceback__
        return e.with_traceback(tb.tb_next if tb is not None else None)
    err = e if getattr(e, "_torchtpu", False) else _translate(e, func, args, kwargs)
    rest = getattr(err, "_torchtpu_limit_rest", None)
    if rest is not None:
        err.args = (f"torchtpu: {describe_call(func, args, kwargs)} {rest}",)
        err._torchtpu_limit_rest = None
    if err is not e:
        err.__cause__ = None
    err.__suppress_context__ = True
    err._torchtpu = True
    _hide_internal_frames(sys._getframe(1))
    _install_excepthook()
    return err.with_traceback(None)


def in_backward():
    """Whether an autograd backward pass is running on this thread."""
    return torch._C._current_graph_task_id() != -1


# Backward passes (graph task ids) with an error queued to raise at their end.
_failed_passes = set()


def raise_after_backward(err):
    """Raise err when the running backward pass ends; the pass's first error
    wins. torch 2.13 cannot carry an exception raised in __torch_dispatch__
    out of a backward op on a PyTorch device: the engine's stream guard calls
    into Python while the error is still set, and the process aborts. An
    exception from a callback queued on the engine reaches the caller of
    backward() intact."""
    task = torch._C._current_graph_task_id()
    if task in _failed_passes:
        return
    _failed_passes.add(task)

    def raise_it():
        __tracebackhide__ = True
        _failed_passes.discard(task)
        raise err
    torch.autograd.Variable._execution_engine.queue_callback(raise_it)


def report_unrecoverable(e, func):
    """An op failed in a backward pass and no stand-in results could be
    made (raise_after_backward): the process is about to abort; say what
    failed first."""
    print(f"torchtpu: {func} failed during a backward pass: {type(e).__name__}: {e}",
          file=sys.stderr, flush=True)


def _hide_internal_frames(frame):
    """Mark the torch/torchtpu frames between the dispatcher and the user's
    line so that pytest and IPython leave them out of the traceback."""
    while frame is not None and is_internal(frame.f_code.co_filename):
        try:
            frame.f_locals["__tracebackhide__"] = True
        except Exception:  # pragma: no cover - a frame without a locals dict
            pass
        frame = frame.f_back


def trim(tb):
    """tb cut after its last frame outside torchtpu, torch and JAX."""
    last = None
    for t in _tb_entries(tb):
        if not is_internal(t.tb_frame.f_code.co_filename):
            last = t
    if last is not None:
        last.tb_next = None
    return tb


def _tb_entries(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


_previous_hook = None


def _excepthook(etype, value, tb):
    if getattr(value, "_torchtpu", False) and not full_traceback():
        tb = trim(tb)
        value.__traceback__ = tb
    (_previous_hook or sys.__excepthook__)(etype, value, tb)


def _install_excepthook():
    global _previous_hook
    if sys.excepthook is not _excepthook:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook
    if "IPython" in sys.modules:
        install_ipython_handler()


def _ipython_handler(shell, etype, value, tb, tb_offset=None):
    if getattr(value, "_torchtpu", False) and not full_traceback():
        tb = trim(tb)
        value.__traceback__ = tb
    elif issubclass(etype, SyntaxError):
        shell.showsyntaxerror()  # what IPython does without a custom handler
        return
    # IPython discards a handler's result when running code: show it here.
    shell.showtraceback((etype, value, tb), tb_offset=tb_offset)


def install_ipython_handler(shell=None):
    """In IPython/Jupyter, show torchtpu's errors ending at the cell's line
    (IPython never hides the innermost frame by itself). Leaves a custom
    handler the user installed alone."""
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:  # pragma: no cover
            return
        shell = get_ipython()
    if shell is None or getattr(shell, "custom_exceptions", ()) not in ((), (Exception,)):
        return
    if shell.custom_exceptions == ():
        shell.set_custom_exc((Exception,), _ipython_handler)
