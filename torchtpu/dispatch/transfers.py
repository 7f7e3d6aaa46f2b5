"""Copies, transfers and resizes: copy_ between host and device (an upload
into a whole storage becomes that storage's array), .to(), .item(), pinned
memory, resize_, and the out= form of ops whose result size depends on
values."""
import sys

import jax
import torch

from .. import modes, pinned, properties, runtime
from . import lengths
from ..tensor import Lost, Storage, TpuTensor
from .core import _run_lowered, plan_of, resize
from .host import device_array, download, to_tpu
from .plans import SPECIAL

from ..compat import aten


def _copy_(dst, src, non_blocking=False):
    if isinstance(dst, TpuTensor) and not isinstance(src, TpuTensor):
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"copy_(): argument 'src' must be Tensor, not {type(src).__name__}")
        torch.empty(dst.shape, dtype=dst.dtype, device="meta").copy_(src.to("meta"))
        # From pinned memory, non_blocking starts the transfer and returns.
        non_blocking = non_blocking and pinned.is_pinned(src)
        host = src.to(dst.dtype).expand(dst.shape).contiguous()
        if dst._view is not None or type(dst._storage.array) is Lost:
            src = to_tpu(host, non_blocking, dst._storage.device)  # copied in below
        else:
            # dst is its whole storage (as .to("tpu") makes it): the upload
            # becomes the storage's array, with no copy kernel.
            modes.current().replaced(dst._storage)
            # Held by dst alone (no view of it): a dim marked dynamic, or
            # found varying between uploads from the user's line, comes
            # padded, in a storage of its own.
            padded = lengths.marked_upload(src, host, dst._storage.device, sys._getframe(1)) \
                if sys.getrefcount(dst._storage) == 2 else None
            if padded is not None:
                dst._storage = padded._storage
            else:
                dst._storage.assign(to_tpu(host, non_blocking, dst._storage.device)._storage.array)
            if modes.current().waits_each_op:
                runtime.wait_transfers()  # debug mode waits for each op
            return dst
    elif not isinstance(dst, TpuTensor):
        # dst on CPU, src on tpu
        dst.copy_(download(src))
        return dst
    elif src._storage.device != dst._storage.device:
        src = to_device(src, dst._storage.device)
    return _run_lowered(plan_of(aten.copy_.default), (dst, src), {})


def to_device(x, index):
    """A copy of tpu tensor x on tpu:index, copied device to device (in fused
    mode x's value is computed first: a sync point)."""
    arr = jax.device_put(device_array(x, "device_copy"), runtime.DEVICES[index])
    return TpuTensor(Storage(arr, index), tuple(x.shape), x.dtype)


def _local_scalar_dense(x):
    return download(x, "item").item()


def _copy_from(src, dst, non_blocking=False):
    return _copy_(dst, src, non_blocking)


def _pin_memory(x, device=None):
    raise RuntimeError(f"cannot pin '{x.type()}' only dense CPU tensors can be pinned")


def _resize_(t, size, memory_format=None):
    if memory_format not in (None, torch.contiguous_format):
        raise RuntimeError(f"resize_: memory format {memory_format} is not supported on tpu")
    return resize(t, size)


def _resize_as_(t, template, memory_format=None):
    return _resize_(t, template.shape, memory_format)


SPECIAL.update({
    aten._local_scalar_dense.default: _local_scalar_dense,
    # What .item() reaches under inference mode, and its decomposition.
    aten.item.default: _local_scalar_dense,
    torch.ops.prims.item.default: _local_scalar_dense,
    aten.copy_.default: _copy_,
    aten._copy_from.default: _copy_from,
    aten.resize_.default: _resize_,
    aten.resize_as_.default: _resize_as_,
})


_TO_COPY_KWARGS = frozenset({"dtype", "memory_format"})


def _to_copy_handler(x, **kwargs):
    if kwargs.keys() <= _TO_COPY_KWARGS:
        # The common case (autocast's casts, .float()): the kernel takes these as they are.
        return _run_lowered(plan_of(aten._to_copy.default), (x,), kwargs)
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        out = download(x, "cpu")
        dtype = kwargs.get("dtype")
        return out.to(dtype) if dtype is not None else out
    if device is not None and torch.device(device).type == "meta":
        # Shape, strides and dtype only, as from any device (no sync).
        meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return aten._to_copy.default(meta, **kwargs)
    kwargs.pop("device", None)
    kwargs.pop("layout", None)
    kwargs.pop("pin_memory", None)
    kwargs.pop("non_blocking", None)
    if device is not None:
        index = properties.checked_index(device)
        if index != x._storage.device:
            x = to_device(x, index)
            if not kwargs:
                return x
    return _run_lowered(plan_of(aten._to_copy.default), (x,), kwargs)


SPECIAL[aten._to_copy.default] = _to_copy_handler
# Device memory is never pinned host memory.
SPECIAL[aten.is_pinned.default] = lambda x, device=None: False
SPECIAL[aten._pin_memory.default] = _pin_memory


def _into(fn):
    """The out= form of fn: out is resized to the result and written."""
    def out_variant(*args, out, **kwargs):
        result = fn(*args, **kwargs)
        resize(out, result.shape)
        return _copy_(out, result)
    return out_variant
