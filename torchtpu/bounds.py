"""Out-of-range indices in strict and fused mode: checked on device, raised at
the next sync point (as CUDA's device-side assert, with a clear message).

Each indexing kernel (BOUNDS, below, names the ops and their index arguments)
checks its indices on device and merges the outcome into one small int64
flag per device that every checked kernel there takes and returns
(`running`): how many ops it covers, which of them was the first out of
range, that value, its position, the dimension and its size. The dispatcher hands the new flag here
(note) with the op and the user's line; nothing is read then. At each sync
point the executors call check(): the flag is read, in one small transfer,
and the first out-of-range index raises the exception CPU raises.

What a bad op produced is garbage, and so is what was computed from it
before its flag was read (a loss, gradients, parameters an optimizer
updated). While flags are unread the dispatcher tracks which storages
depend on which flags (propagate); when a flag says out of range, those
storages are marked Lost with the error, so reading them raises it instead
of giving a garbage value, while tensors that do not depend on the bad op
keep theirs. Debug mode checks on the host before the op runs
(check_on_host) and records nothing here.
"""
import bisect
import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import config, errors, runtime  # noqa: F401  (runtime first: int64 flags need x64)
from .compat import aten as _aten
from .tensor import Lost, Pending, Storage


# ---- index bounds ------------------------------------------------------------
# JAX clamps out-of-range gathers and drops out-of-range scatters; PyTorch
# raises. BOUNDS says, per op, which arguments index what: its spec lists one
# (index, dim, size, negative_ok[, allowed]) per index argument, reading only
# shapes and static arguments, so it serves torch tensors (the host check:
# debug mode, the CPU fallback) and JAX arrays (the flag each indexing kernel
# computes on device in strict and fused mode, below) alike.
# `allowed` is a value let through anyway (nll_loss's ignore_index).

class Bound:
    """One op's index arguments (spec), the exception type CPU raises for an
    out-of-range one, and how its message reads."""
    __slots__ = ("spec", "exc", "message")

    def __init__(self, spec, exc, message):
        self.spec, self.exc, self.message = spec, exc, message


def _index_message(value, dim, size, position=0):
    return f"index {value} is out of bounds for dimension {dim} with size {size}"


def _take_message(value, dim, size, position=0):
    return f"out of range: tried to access index {value} on a tensor of {size} elements."


def _bag_message(value, dim, size, position=0):
    return f"Index {position} of input takes value {value} which is not in the valid range [0, {size})"


def _target_message(value, dim, size, position=0):
    return f"Target {value} is out of bounds."


def op_name(func):
    """'aten.embedding' for aten.embedding.default, else the overload's name."""
    name = str(func)
    return name[:-len(".default")] if name.endswith(".default") else name


def out_of_range(bound, func, line, value, dim, size, position):
    """The exception for an out-of-range index of func issued at line."""
    what = bound.message(value, dim, size, position)
    return bound.exc(f"torchtpu: {what} ({op_name(func)} at {line})")


def _is_mask(t):
    return t.dtype in (torch.bool, torch.uint8, jax.numpy.bool_, jax.numpy.uint8)


def _dim(d, ndim):
    return d % ndim if ndim else 0


def _numel(x):
    n = 1
    for s in x.shape:
        n *= s
    return n


def _spec_indices(x, indices, *rest, **kw):
    # Advanced indexing: each index tensor addresses the next dim of x; a
    # None (a full slice) skips one, a mask as many as it has.
    out, d = [], 0
    for idx in indices:
        if idx is None:
            d += 1
        elif _is_mask(idx):
            d += idx.ndim
        else:
            if d < x.ndim:
                out.append((idx, d, x.shape[d], True))
            d += 1
    return out


def _spec_dim(negative_ok):
    def spec(x, dim, index, *rest, **kw):
        d = _dim(dim, x.ndim)
        return [(index, d, x.shape[d] if x.ndim else 1, negative_ok)]
    return spec


def _spec_embedding(weight, indices, *rest, **kw):
    return [(indices, 0, weight.shape[0], False)]


def _spec_flat(x, index, *rest, **kw):
    return [(index, -1, _numel(x), True)]


def _spec_weight_rows(grad, indices, num_weights, *rest, **kw):
    return [(indices, 0, num_weights, False)]


def _spec_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices,
                       num_weights, *rest, **kw):
    return [(indices, 0, num_weights, False)]


def _spec_target(x, target, weight, reduction, ignore_index, *rest, **kw):
    classes = x.shape[1] if x.ndim >= 2 else x.shape[0]
    return [(target, 1 if x.ndim >= 2 else 0, classes, False, ignore_index)]


_INDEX = Bound(_spec_indices, IndexError, _index_message)
_GATHER = Bound(_spec_dim(False), RuntimeError, _index_message)
_ALONG = Bound(_spec_dim(False), IndexError, _index_message)
_FILL = Bound(_spec_dim(True), IndexError, _index_message)
_FLAT = Bound(_spec_flat, IndexError, _take_message)
# Per op (in-place and out= forms through their functional op, bound_for).
BOUNDS = {
    _aten.index.Tensor: _INDEX,
    _aten.index_put.default: _INDEX,
    _aten._index_put_impl_.default: _INDEX,
    _aten.gather.default: _GATHER,
    _aten.scatter.src: _GATHER,
    _aten.scatter.value: _GATHER,
    _aten.scatter.reduce: _GATHER,
    _aten.scatter.value_reduce: _GATHER,
    _aten.scatter_add.default: _GATHER,
    _aten.scatter_reduce.two: _GATHER,
    _aten.index_select.default: _ALONG,
    _aten.index_add.default: _ALONG,
    _aten.index_copy.default: _ALONG,
    _aten.index_reduce.default: _ALONG,
    _aten.index_fill.int_Scalar: _FILL,
    _aten.index_fill.int_Tensor: _FILL,
    _aten.embedding.default: Bound(_spec_embedding, IndexError, _index_message),
    _aten._embedding_bag.default: Bound(_spec_embedding, RuntimeError, _bag_message),
    _aten._embedding_bag_forward_only.default: Bound(_spec_embedding, RuntimeError, _bag_message),
    _aten.take.default: _FLAT,
    _aten.put.default: _FLAT,
    # Backward ops that write rows picked by an index (CPU skips out-of-range
    # rows there; a forward with the same indices raised before).
    _aten.embedding_dense_backward.default: Bound(_spec_weight_rows, IndexError, _index_message),
    _aten._embedding_bag_backward.default: Bound(_spec_bag_backward, IndexError, _index_message),
    _aten.nll_loss_forward.default: Bound(_spec_target, IndexError, _target_message),
    _aten.nll_loss2d_forward.default: Bound(_spec_target, IndexError, _target_message),
}


def bound_for(func, functional=None):
    """func's Bound, or its functional variant's (index_add_, index_select.out)."""
    bound = BOUNDS.get(func)
    if bound is None and functional is not None:
        bound = BOUNDS.get(functional)
    return bound


def check_on_host(func, args, kwargs, functional=None, line=None, to_host=None):
    """PyTorch's range check for func's index arguments, on the host (syncs:
    debug mode and the CPU fallback only). Raises what CPU raises, naming
    the op and the user's line. to_host(t) reads a tpu tensor's values as a
    CPU tensor (the dispatcher's; the CPU fallback passes CPU tensors)."""
    bound = bound_for(func, functional)
    if bound is None:
        return
    for index, dim, size, negative_ok, *allowed in bound.spec(*args, **kwargs):
        if not isinstance(index, torch.Tensor) or index.numel() == 0:
            continue
        values = (to_host(index) if index.device.type == "tpu" else index.detach()).reshape(-1)
        bad = (values < (-size if negative_ok else 0)) | (values >= size)
        if allowed:
            bad &= values != allowed[0]
        if bool(bad.any()):
            position = int(bad.nonzero()[0, 0])
            raise out_of_range(bound, func, line or errors.user_line(sys._getframe(1)),
                               int(values[position]), dim, size, position)

# The check's switch (for measuring its cost; kernels read it when built).
ON = config.INDEX_CHECKS.on()
# Checked ops at which the flag is read (a loop that never syncs would
# otherwise keep a record of every indexing op).
MAX_UNREAD = 1024


def set_enabled(on):
    """Build indexing kernels with (True) or without the device check; drops
    the compiled kernels and graphs so that new ones are built."""
    global ON
    from . import cache
    check()
    ON = bool(on)
    cache.clear()


def kernel_bound(plan):
    """The Bound an op's kernel checks on device, or None."""
    if not ON:
        return None
    return bound_for(plan.func, plan.functional)


# ---- on device ---------------------------------------------------------------
# One flag for all checked ops since the last check, threaded through their
# kernels (each takes the flag so far and returns it merged with its own), so a
# sync point reads one small array and a fused graph has one more output:
# int64[7] = (checked ops merged, 1 + which of them was the first out of range
# or 0, how many were, then that first one's value, flat position, dim, size).
_FLAG_SIZE = 7


def device_flag(bound, args, kwargs, before):
    """The flag `before` merged with this call's (traced inside the op's kernel)."""
    hit = jnp.zeros((), jnp.bool_)
    found = (jnp.zeros((), jnp.int64),) * 4
    checks = bound.spec(*args, **kwargs)
    # The first bad index argument wins: fold from the last.
    for index, dim, size, negative_ok, *allowed in reversed(checks):
        if index is None or getattr(index, "size", 0) == 0:
            continue
        flat = index.reshape(-1).astype(jnp.int64)
        bad = (flat < (-size if negative_ok else 0)) | (flat >= size)
        if allowed:
            bad = bad & (flat != allowed[0])
        pos = jnp.argmax(bad)
        mine = (flat[pos], pos.astype(jnp.int64), jnp.int64(dim), jnp.int64(size))
        found = tuple(jnp.where(bad[pos], m, f) for m, f in zip(mine, found))
        hit = hit | bad[pos]
    count = before[0] + 1
    first = hit & (before[1] == 0)
    head = (count, jnp.where(first, count, before[1]), before[2] + hit.astype(jnp.int64))
    tail = tuple(jnp.where(first, f, b) for f, b in zip(found, before[3:]))
    return jnp.stack(head + tail)




class _Flags:
    """One device's flags: the merged flag of the checked ops issued there
    since the last check (a Storage: fused mode materializes what one
    holds), the one debug mode passes (it checked on the host; its flag is
    dropped), and the positions in unread of the ops merged into it."""
    __slots__ = ("running", "idle", "blank", "positions", "snapshots")

    def __init__(self, index):
        # A kernel and its inputs share a device (a flag too). A host array
        # put there, not jnp.zeros: that would compile a kernel at start-up.
        self.blank = jax.device_put(np.zeros((_FLAG_SIZE,), np.int64), runtime.DEVICES[index])
        self.running = Storage(self.blank, index)
        self.idle = Storage(self.blank, index)
        self.positions = []
        # (flag array, n): the running flag as a fused graph left it, covering
        # positions[:n] (note_flushed); held, so no later graph donates it.
        self.snapshots = []


_flags = {}  # device index -> _Flags


def _flags_of(index):
    f = _flags.get(index)
    if f is None:
        f = _flags[index] = _Flags(index)
    return f


def flag_input(debug, device=0):
    f = _flags_of(device)
    if debug:
        return f.idle
    _restore_if_lost(f)
    return f.running


def _restore_if_lost(f):
    """A fused graph that failed (its error raised at its flush) leaves the
    running flag it was to return lost. Before the flag is used again (by a
    checked op, or read), it goes back to the flag the graph before it
    returned (its last snapshot; none: the blank one). The checks made after
    that are unknown: what depends on them is lost with the graph's error
    (its own results are already)."""
    lost = f.running.array
    if type(lost) is not Lost:
        return
    arr, n = f.snapshots[-1] if f.snapshots else (f.blank, 0)
    gone, f.positions = f.positions[n:], f.positions[:n]
    f.running.assign(arr)
    if gone:
        _mark_lost(sum(1 << p for p in gone), lost.error)


# ---- what depends on unread checks ----------------------------------------------

class _Check:
    """A checked op whose flag is unread: the op, where the user issued it
    (file, line), how to report it."""
    __slots__ = ("bound", "func", "where")

    def __init__(self, bound, func, where):
        self.bound = bound
        self.func = func
        self.where = where


unread = []  # _Check per op merged into a `running` flag, in issue order
# Each storage's `marks`: (generation, bits), the unread checks its value
# depends on (bit k for unread[k]), current while the generation is. Reading
# the flags starts a new generation, every mark then stale at once.
_generation = 0


def _taint(storages, deps):
    gen = _generation
    for s in storages:
        m = s.marks
        if m is None or m[0] != gen:
            s.marks = (gen, deps)
        elif deps | m[1] != m[1]:
            s.marks = (gen, m[1] | deps)


def _deps(storages):
    deps = 0
    gen = _generation
    for s in storages:
        m = s.marks
        if m is not None and m[0] == gen:
            deps |= m[1]
    return deps


def flag_pending():
    """Whether a flag with unread checks merged into it is still pending
    (in fused mode's graph)."""
    return any(f.positions and type(f.running.array) is Pending for f in _flags.values())


def depends_on_unread(storage):
    """Whether storage's value depends on an index check not read yet."""
    return bool(_deps((storage,)))


def note(bound, func, flag, inputs, produced, frame, device=0):
    """A checked op ran (or was recorded) on tpu:device, called from `frame`:
    `flag` merges its check into that device's running one; what it produced
    depends on it and on what its inputs depend on. True: MAX_UNREAD checks
    are unread and their flag is pending (fused mode's graph): the caller
    syncs, so that a loop that never reads has them read."""
    f = _flags_of(device)
    f.running.assign(flag)
    f.positions.append(len(unread))
    _taint(produced, _deps(inputs) | (1 << len(unread)))
    unread.append(_Check(bound, func, errors.user_site(frame)))
    if len(unread) >= MAX_UNREAD:
        check()
    return len(unread) >= MAX_UNREAD


def unread_checks():
    """The checked ops noted and not read yet, oldest first (graph capture
    keeps the ones its region recorded, for note_replayed)."""
    return tuple(unread)


def note_replayed(checks, flag, inputs, produced, device=0):
    """A replayed graph ran the checked ops `checks` (from unread_checks(),
    each keeping its captured line): `flag` merges their checks into
    tpu:device's running one; what the graph produced depends on all of them
    and on what its inputs depend on. One call per replay, not per op."""
    f = _flags_of(device)
    f.running.assign(flag)
    first = len(unread)
    f.positions.extend(range(first, first + len(checks)))
    _taint(produced, _deps(inputs) | (((1 << len(checks)) - 1) << first))
    unread.extend(checks)
    if len(unread) >= MAX_UNREAD:
        check()


def propagate(inputs, produced):
    """An op ran while flags are unread: what it produced depends on what its
    inputs depend on."""
    # (_deps inline: this runs for every op while a check is unread.)
    deps = 0
    gen = _generation
    for s in inputs:
        m = s.marks
        if m is not None and m[0] == gen:
            deps |= m[1]
    if deps:
        _taint(produced, deps)


def note_flushed(device=0):
    """A fused graph ran on tpu:device: the running flag it returned covers
    the checks noted there so far. A value computed by then can have its
    checks read from it (checked_for) while later graphs still run."""
    f = _flags.get(device)
    if f is None or not f.positions:
        return
    arr = f.running.array
    if isinstance(arr, jax.Array) and (not f.snapshots or f.snapshots[-1][1] != len(f.positions)):
        f.snapshots.append((arr, len(f.positions)))


def checked_for(storage):
    """Read the index checks storage's value depends on, and only those:
    from the flags of the graphs that computed it, not waiting for graphs
    issued after them (a training step's backward, while its loss is read).
    True if every one was in range. False where that cannot be told so (no
    such flag; an index out of range among them): the caller then reads
    every flag with check(), which raises. The checks it read stay unread,
    for check() at a later sync point to read with the rest."""
    deps = _deps((storage,))
    if not deps:
        return True
    need = deps.bit_length()  # the checks at positions below it
    arrays = []
    for f in _flags.values():
        count = bisect.bisect_left(f.positions, need)
        if not count:
            continue
        arr = next((a for a, n in f.snapshots if n >= count), None)
        if arr is None or arr.is_deleted():
            return False
        arrays.append(arr)
    return not any(flag[1] for flag in _read(arrays))


# ---- at sync points --------------------------------------------------------------

def _read(arrays):
    """The flag arrays' values on the host. Their copies start first, queued
    behind the programs that compute them, so each arrives as its program
    ends rather than one round trip after (a TPU host's round trip is about
    a millisecond); then waited for, so that a failed program raises its
    error (runtime.to_host's why)."""
    for a in arrays:
        a.copy_to_host_async()
    return jax.device_get(jax.block_until_ready(arrays))


def check():
    """Read the running flags once the ops merged into them have run (one
    small transfer per device that ran checked ops); raise the first
    out-of-range index, after marking what depends on a bad op Lost."""
    if not unread:
        return
    for f in _flags.values():
        _restore_if_lost(f)
    used = [f for f in _flags.values() if f.positions]
    if any(type(f.running.array) is Pending for f in used):
        return
    flags = list(zip(used, _read([f.running.array for f in used])))
    checks = unread[:]
    del unread[:]
    failed, first = 0, None
    for f, flag in flags:
        positions, f.positions = f.positions, []
        f.snapshots = []
        f.running.assign(f.blank)
        if not flag[1]:
            continue
        k = int(flag[1]) - 1
        # Only the first bad value is known: with more than one bad op, the
        # values of every op checked after it are lost too.
        failed |= sum(1 << p for p in (positions[k:k + 1] if flag[2] == 1 else positions[k:]))
        if first is None or positions[k] < first[0]:
            first = (positions[k], flag)
    if first is None:
        _new_generation()
        return
    position, flag = first
    bad = checks[position]
    line = "%s:%d" % bad.where
    err = out_of_range(bad.bound, bad.func, line, int(flag[3]), int(flag[5]),
                       int(flag[6]), int(flag[4]))
    _mark_lost(failed, err)
    _new_generation()
    raise err


def _new_generation():
    global _generation
    _generation += 1


def _mark_lost(failed, err):
    """Storages whose value depends on a failed check (a bit of `failed`)
    hold Lost(err). They are found among all live objects: a failed check
    is rare, while a list of the storages marked would cost every op an
    object that lives until the flags are read (and, in a long step, the
    garbage collector's full passes)."""
    gen = _generation
    for s in gc.get_objects():
        # type(), not isinstance: that reads __class__ (a dead weakref.proxy
        # raises, a deprecated object warns). A storage made without its
        # __init__ (a copy's) may have no marks.
        if not issubclass(type(s), Storage):
            continue
        m = getattr(s, "marks", None)
        if m is None or m[0] != gen or not m[1] & failed:
            continue
        arr = s.array
        if type(arr) is not Lost:
            s.assign(Lost(err, arr.shape, arr.dtype))
