"""Values between host and device: a CPU tensor uploaded, a tpu tensor's
concrete array (waiting for its executor) and its download."""
import functools

from .. import advisor, cache, metrics, modes, runtime
from ..tensor import Lost, Storage, TpuTensor, read_view


def to_tpu(t, non_blocking=False, device=0):
    """A CPU tensor -> a new TpuTensor on tpu:device holding a copy;
    non_blocking (from a pinned tensor) starts the transfer and returns
    (runtime.to_device)."""
    arr = runtime.to_device(t, runtime.DEVICES[device], non_blocking=non_blocking)
    return TpuTensor(Storage(arr, device), tuple(t.shape), t.dtype)


@functools.lru_cache(maxsize=None)
def _reader(view):
    return cache.jit(lambda arr: read_view(arr, view), name="tpu_read_view")


def device_array(t):
    """The concrete JAX array of t's values (in t's shape), syncing if needed."""
    arr = modes.current().concrete(t._storage)
    if type(arr) is Lost:
        arr.fail()
    if t._view is None:
        return arr
    return _reader(t._view)(arr)


def download(t):
    """A TpuTensor -> a new CPU tensor with its values."""
    metrics.M.syncs += 1
    runtime.wait_transfers()  # a sync point: pinned sources are free again after it
    if advisor.ON:
        return advisor.sync_point(lambda: runtime.to_host(device_array(t), t.dtype))
    return runtime.to_host(device_array(t), t.dtype)


def host_values(t):
    """A tpu tensor's values as a CPU tensor, without counting a sync (the
    host-side checks read indices through it)."""
    return runtime.to_host(device_array(t))
