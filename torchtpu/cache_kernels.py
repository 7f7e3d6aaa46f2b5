"""Per-op kernels through their records (cache.py): each kernel's executable,
loaded or compiled at its first call; fused mode's abstract evaluation of
an op (its trace, kept for the compile that may follow); and compile_ahead,
which compiles a graph's new kernels side by side before it runs op by op."""
import concurrent.futures
import os
import time

import jax

from . import metrics
from .cache import (KERNEL_PREFIX, STATS, _DAMAGED, _compile, _decode_avals, _decoded, _disk, _encode,
                    _note_startup, _read, _record_key, _stored_executable, _tl, _trace_header, decode_tree,
                    jit)


def module_name(op_name):
    """The name a per-op kernel's executables go by."""
    return "tpu_" + "".join(c if c.isalnum() else "_" for c in op_name)


def jit_kernel(owner, fn, name, device=0, graph=False):
    """owner.jitted (owner: a dispatch Kernel), pending until its first call
    stores there the executable loaded from its record (with out_tree) or
    compiled (from fused mode's trace, if made). graph: fn is a graph of ops.
    Its resolve(args) does that without the call (compile_ahead)."""
    from . import runtime
    disk = _disk()

    def resolve(args):
        options = None if graph else runtime.kernel_options(args)
        if owner.stable_key is not None and disk is not None:
            owner.jitted = _kernel_executable(disk, owner, fn, name, device, args, options)
        elif owner.traced is not None:  # fused mode's trace (of a kernel with a stable key)
            owner.jitted = owner.traced.lower().compile(options)
        else:
            owner.jitted = jit(fn, name, device=device, options=options)
        owner.traced = owner.trace_args = None
        return owner.jitted

    def first_call(*args):
        return resolve(args)(*args)
    first_call.pending = True
    first_call.resolve = resolve
    return first_call


def _kernel_executable(disk, owner, fn, name, device, args, options):
    key = _record_key(KERNEL_PREFIX, owner.stable_key, args, device)
    _note_startup(key, device)
    header, compiled = _stored_executable(disk, key, device)
    if compiled is not None:
        tree = _decoded(disk, key, lambda: decode_tree(header["out_tree"]))
        if tree is not _DAMAGED:
            owner.out_tree = tree
            STATS.kernels_loaded += 1
            return compiled
    traced, owner.traced = owner.traced, None
    compiled = _compile(fn, name, key, args, (), device, traced, options)  # tracing fn sets owner.out_tree
    header = _trace_header(owner.out_tree, compiled.out_info)
    if header is not None:
        disk.put(key, _encode(header, compiled))
    return compiled


def eval_shape_kernel(owner, args):
    """jax.eval_shape(owner.fn, *args) for a per-op kernel (fused mode's), through
    its record; sets owner.out_tree. Its trace is kept (owner.traced, for
    owner.trace_args): a new graph runs op by op, and each new kernel's
    compile lowers it, not tracing again."""
    disk = _disk()
    if owner.stable_key is None:
        return jax.eval_shape(owner.fn, *args)
    key = _record_key(KERNEL_PREFIX, owner.stable_key, args, owner.device)
    header = None if disk is None else _read(disk, key)[0]
    if header is not None:
        got = _decoded(disk, key, lambda: (_decode_avals(header), decode_tree(header["out_tree"])))
        if got is not _DAMAGED:
            avals, owner.out_tree = got
            STATS.traces_loaded += 1
            return avals
    owner.traced = jit(owner.fn, f"{module_name(owner.name)}_{key[-16:]}", (), owner.device).trace(*args)
    owner.trace_args = args
    avals = owner.traced.out_info
    header = _trace_header(owner.out_tree, avals)
    if header is not None and disk is not None:
        disk.put(key, _encode(header))
    return avals


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def compile_ahead(kernels):
    """Compile now, side by side on the host's cores, the executables of
    those kernels still to be compiled whose trace fused mode made: a graph
    about to run op by op knows all its new kernels before the first runs,
    where strict mode meets each as its op runs and compiles one at a time.
    XLA compiles without holding the GIL. A compile that fails here is
    left to the op's own call, which raises it in its turn (the ops before
    it keep their values). compile_seconds counts the time waited for
    XLA: the batch's, in the share of its workers' time XLA compiled."""
    todo = {id(k): k for k in kernels if getattr(k, "traced", None) is not None and not k.compiled}
    if len(todo) < 2:  # (every replay asks: most find nothing to compile)
        return
    workers = min(len(todo), _cores())
    if workers < 2:
        return
    compiling = []  # seconds of each of XLA's compilations (cache._on_duration)

    def resolve(kernel):
        _tl.compiling_ahead = compiling
        started = time.perf_counter()
        try:
            kernel.jitted.resolve(kernel.trace_args)
        except Exception:  # noqa: BLE001 (raised by the op's own call, in order)
            pass
        finally:
            _tl.compiling_ahead = None
        return time.perf_counter() - started
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="torchtpu-compile-ahead") as pool:
        busy = sum(pool.map(resolve, todo.values()))
    if busy > 0:
        metrics.M.compile_seconds += (time.perf_counter() - started) * min(1.0, sum(compiling) / busy)
