"""torch.tpu.set_per_process_memory_fraction(f): a limit on the memory
torchtpu's tensors hold on a device, f times the device's memory
(torch.tpu.mem_get_info's total: on the CPU platform, the host's memory).

Going over it raises torch.OutOfMemoryError naming the largest live
tensors, as a real out-of-memory error does:
- debug and strict mode: at the op that makes the storage going over, at the
  user's line (its result is dropped; nothing else changes);
- fused mode: at the sync point that would run the graph, before it runs,
  counting the graph's results (its recorded ops stay pending, so nothing
  is lost: free tensors and the next sync runs them).

While no fraction is set nothing is checked: the checking hooks are put in
place by the setter (tensor.watch_storages, fused mode's flush check) and
taken away by a fraction of 1.0, so ops pay nothing then. While one is set,
each new device array is counted (a dict entry and a weakref finalizer:
freed arrays leave the count), and over the limit the count is redone
exactly from the live arrays before anything is raised.

An array counts its size on the device (a TPU pads arrays to its tiles),
and where the platform reports its bytes in use (TPU, GPU) what it holds
beyond the counted arrays (compiled programs, the runtime's own buffers)
counts too, as of the last exact count: the figure the limit bounds is
then torch.tpu.memory_allocated()'s, as a fraction computed from it
expects.
"""
import gc
import weakref

import jax
import torch

from . import errors, memory, properties

# Per device index, while a fraction below 1 is set there: (fraction, limit
# in bytes, the device's memory in bytes).
LIMITS = {}
# id(array) -> (device index, bytes) of the device arrays counted, and the
# bytes counted per device index.
_counted = {}
_totals = {}
# Per device index: the platform's bytes in use beyond the counted arrays,
# as of the last exact count (0 where the platform reports none).
_overhead = {}


def _mib(n):
    return f"{n / 2**20:.1f} MiB"


def set_per_process_memory_fraction(fraction, device=None):
    """Limit torchtpu's device memory on `device` to fraction times the
    device's memory; 1.0 removes the limit (the device's own size bounds it)."""
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    # (Deferred, as in memory.py: the device is registered first.)
    from . import tensor
    from .modes import fused
    index = properties.checked_index(device)
    if fraction == 1.0:
        LIMITS.pop(index, None)
    else:
        total = memory.mem_get_info(index)[1]
        LIMITS[index] = (fraction, int(fraction * total), total)
        _totals.setdefault(index, 0)
        _recount(index)
    if LIMITS:
        tensor.watch_storages("memory limit", made=_made, assigned=_assigned)
        fused.check_memory_with(_check_graph)
    else:
        tensor.watch_storages("memory limit")
        fused.check_memory_with(None)
        _counted.clear()
        _totals.clear()
        _overhead.clear()


def get_per_process_memory_fraction(device=None):
    return LIMITS.get(properties.checked_index(device), (1.0,))[0]


def _forget(key):
    entry = _counted.pop(key, None)
    if entry is not None:
        _totals[entry[0]] -= entry[1]


def _count(array, index):
    key = id(array)
    if key not in _counted:
        n = _device_bytes(array)
        _counted[key] = (index, n)
        _totals[index] = _totals.get(index, 0) + n
        weakref.finalize(array, _forget, key)


def _device_bytes(array):
    """An array's bytes on its device, padding included."""
    try:
        return array.on_device_size_in_bytes()
    except Exception:  # (a platform or JAX without the call)
        return array.size * array.dtype.itemsize


def _held(index):
    return _totals[index] + _overhead.get(index, 0)


def _recount(index, collect=False):
    """The bytes held on tpu:index, counted exactly: the live arrays (arrays
    made where no storage saw them, freed ones still referenced: donated
    inputs), plus what the platform holds beyond them; collect: first free
    the garbage that holds arrays (a caught error's traceback holds its
    frames' tensors in a reference cycle)."""
    if collect:
        gc.collect()
    live = {id(a): a for a in memory.live_arrays(index)}
    for key in [k for k, (i, _) in _counted.items() if i == index and k not in live]:
        _forget(key)
    for a in live.values():
        _count(a, index)
    stats = properties.platform_memory_stats(index)
    in_use = stats.get("bytes_in_use") if stats else None
    _overhead[index] = max(0, int(in_use) - _totals[index]) if in_use is not None else 0
    return _held(index)


def _device_array(storage):
    a = storage.array
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
        return a
    return None  # a pending value (fused mode checks its graph), lost, traced


def _assigned(storage):
    array = _device_array(storage)
    if array is not None and storage.device in LIMITS:
        _count(array, storage.device)


def _made(storage):
    array = _device_array(storage)
    index = storage.device
    if array is None or index not in LIMITS:
        return
    _count(array, index)
    if _held(index) > LIMITS[index][1] and _recount(index, collect=True) > LIMITS[index][1]:
        raise errors.over_memory_limit(
            f"at {errors.user_line()} would take {_mib(array.nbytes)}, bringing "
            + _over(index, _held(index)))


def _over(index, total, pending=()):
    fraction, limit, size = LIMITS[index]
    holders = memory._holders_text(pending=pending)
    return (f"the memory torchtpu holds on tpu:{index} to {_mib(total)}, over its limit of "
            f"{_mib(limit)} (torch.tpu.set_per_process_memory_fraction({fraction}) of "
            f"{_mib(size)})." + (f" {holders}" if holders else ""))


def _check_graph(index, results, describe, entry):
    """Fused mode's flush, before it runs a graph on tpu:index whose kept
    results are `results` ((Pending, its storage) pairs): raise if they would
    go over the limit. entry: the graph's cache entry, if it has one."""
    if index not in LIMITS:
        return
    result_bytes = sum(memory.pending_bytes(p) for p, _ in results)
    total = _recount(index) + result_bytes
    if total > LIMITS[index][1]:
        total = _recount(index, collect=True) + result_bytes
    if total > LIMITS[index][1]:
        raise torch.OutOfMemoryError(
            f"torchtpu: {describe()} would keep {_mib(result_bytes)} of results, bringing "
            + _over(index, total, results).rstrip(".") + "." + _planned(entry)
            + " Its ops stay pending: free tensors and sync again.")


def _planned(entry):
    """What XLA's compiled memory analysis plans for a run of the graph, if
    it is compiled: the peak of its temporaries comes on top of the rest."""
    from .modes import graph
    executable = graph.executable_of(entry)
    if executable is None:
        return ""
    stats = executable.memory_analysis()
    return (f" XLA plans the graph {_mib(stats.temp_size_in_bytes)} of temporaries at its peak "
            f"(its compiled memory analysis), beside {_mib(stats.argument_size_in_bytes)} of "
            f"arguments and {_mib(stats.output_size_in_bytes)} of results.")


NAMES = ("set_per_process_memory_fraction", "get_per_process_memory_fraction")
