"""Values between host and device: a CPU tensor uploaded, a tpu tensor's
concrete array (waiting for its executor) and its download."""
import functools
import math

import torch

from .. import cache, errors, modes, profiling, runtime
from ..compat import aten
from ..tensor import GrownStorage, Lost, Storage, TpuTensor, View, Window, grown_view, read_view, read_view_at


def no_sparse(*args, **kwargs):
    raise NotImplementedError("tpu tensors are dense: sparse layouts are not supported on tpu (keep sparse "
                              "tensors on the CPU; nn.Embedding and nn.EmbeddingBag take sparse=False)")


def to_tpu(t, non_blocking=False, device=0):
    """A CPU tensor -> a new TpuTensor on tpu:device holding a copy;
    non_blocking (from a pinned tensor) starts the transfer and returns
    (runtime.to_device)."""
    if t.layout != torch.strided:  # a sparse result of the CPU fallback
        no_sparse()
    with profiling.span(lambda: f"torchtpu upload {list(t.shape)} {t.dtype}"):
        arr = runtime.to_device(t, runtime.DEVICES[device], non_blocking=non_blocking)
    return TpuTensor(Storage(arr, device), tuple(t.shape), t.dtype)


@functools.lru_cache(maxsize=None)
def _reader(view):
    return cache.jit(lambda arr: read_view(arr, view), name="tpu_read_view", device=None)


@functools.lru_cache(maxsize=None)
def _reader_at(view):
    return cache.jit(lambda arr, offset: read_view_at(arr, view, offset), name="tpu_read_view",
                     device=None)


def device_array(t, reason="read"):
    """The concrete JAX array of t's values (in t's shape), syncing if
    needed; reason names why (fused mode reports it per flush)."""
    storage = t._storage
    if type(storage) is GrownStorage and t._view is not None and storage.grown is not None:
        # A view of a grown storage (ids[:, -1]): read from its padded array.
        found = grown_view(t)
        if found is not None:
            return _reader_at(found[0])(_concrete(storage.grown._storage, reason), found[1])
    return _viewed(_concrete(storage, reason), t._view)


def _concrete(storage, reason, to_host=False):
    """storage's array, waiting for its executor; a lost value raises.
    to_host: it is downloaded next (its copy may start early)."""
    arr = modes.current().concrete(storage, reason, to_host)
    if type(arr) is Lost:
        arr.fail()
    return arr


def _viewed(arr, view):
    """The elements view selects of arr, by a reader kernel."""
    if view is None:
        return arr
    if type(view) is View:
        # At its offset fed at run time: one reader per view shape, not per
        # position (print(data[i]) at a moving i).
        return _reader_at(Window(view.shape, view.stride))(arr, view.offset)
    return _reader(view)(arr)


# A view's whole storage is downloaded, and the view taken on the host, when
# the storage is at most this size or twice the view's.
_HOST_VIEW_MAX_BYTES = 1 << 20


def _host_array(t, reason):
    """t's values as a CPU tensor; a whole grown storage not yet cut (a
    generate() call's token ids) is cut on the host: no kernel per length."""
    storage = t._storage
    if (type(storage) is GrownStorage and t._view is None and storage.grown is not None
            and storage._exact is None):
        padded = runtime.to_host(device_array(storage.grown, reason), t.dtype)
        return padded.narrow(storage.axis, 0, storage.extent).clone()
    view = t._view
    if type(view) is View and type(storage) is Storage:
        arr = _concrete(storage, reason)
        if arr.size * arr.dtype.itemsize <= _HOST_VIEW_MAX_BYTES or arr.size <= 2 * math.prod(view.shape):
            # The view is taken on the host: no reader kernel to compile
            # for a view downloaded once (printing x[:, 0]).
            whole = runtime.to_host(arr, t.dtype).reshape(-1)
            return whole.as_strided(view.shape, view.stride, view.offset).clone()
        return runtime.to_host(_viewed(arr, view), t.dtype)
    if view is None and type(storage) is Storage:
        return runtime.to_host(_concrete(storage, reason, to_host=True), t.dtype)
    return runtime.to_host(device_array(t, reason), t.dtype)


def download(t, reason="read"):
    """A TpuTensor -> a new CPU tensor with its values: a sync point, for
    reason ("item", "print", ...)."""
    try:
        return modes.sync_point(reason, lambda reason: _host_array(t, reason))
    finally:
        # Pinned sources are free again after a sync. Waited for after the
        # read, so that a fused graph runs while uploads issued ahead of it
        # (DeviceLoader's next batches) are still in flight.
        runtime.wait_transfers()


def user_download(t, reason):
    """download, for a caller outside the dispatcher (repr): an error is
    raised as an op's is, PyTorch's type at the user's line."""
    try:
        return download(t, reason)
    except Exception as e:
        raise errors.user_error(e, aten._to_copy.default, (t,), {"device": "cpu"})


def host_values(t):
    """A tpu tensor's values as a CPU tensor, without counting a sync (the
    host-side checks read indices through it)."""
    return runtime.to_host(device_array(t))
