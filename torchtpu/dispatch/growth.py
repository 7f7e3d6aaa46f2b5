"""Bounded dynamism for tensors that grow step by step: a key/value cache or
the token ids extended by torch.cat in a decoding loop, an attention mask
one longer each step. Without it, every op on such a tensor sees a new shape
each step and compiles a new kernel (or, in fused mode, a new graph).

The second torch.cat along the same dim in a chain (`x = torch.cat([x,
new], d)`, where x was itself a cat's result) gives a tensor whose storage
is a GrownStorage (torchtpu.tensor): its values live in a tpu tensor padded
along d to a bucket (GROWTH_MIN, default 128, a TPU tile's width, doubled
until it holds the tensor; zeros past the extent). From then on:

- a cat that extends it writes the new slice at the extent, an offset the
  kernel takes at run time (torchtpu::write_at), into the same bucket, or
  into the next bucket when it is full: one kernel per bucket, not per step;
- a view of it (`ids[:, -1]`, `ids[:, -1:]`) is read from the padded array
  at a run-time offset (the dispatcher's FedArg records, dispatch/keys.py), by
  one clone kernel per bucket that every op reading such a view shares (the
  op itself then compiles once, for the view's shape; in fused mode the
  read is folded into the op, as graphs compile per bucket anyway);
- scaled_dot_product_attention over a grown key and value (the decode step)
  attends over the padded length with the keys past the extent masked out:
  exactly the same weights, since a masked key's weight is 0;
- any other op reads the exact array, cut from the padded one once per
  storage: correct, and compiled per length (the advisor names the line).

A write to the tensor (an in-place op) ends its growth: the storage keeps
the exact array. Set TORCHTPU_GROWTH=off to turn this off, and
TORCHTPU_GROWTH_MIN to change the smallest bucket (default 128).
"""
import weakref

import torch

from .. import advisor, config, errors, metrics
from ..tensor import GrownStorage, TpuTensor, whole_tensor
from .core import _run_lowered, dispatch, plan_of
from .plans import SPECIAL

from ..compat import aten

ENABLED = config.GROWTH.on()
GROWTH_MIN = max(1, config.GROWTH_MIN.number())

# Storages a cat made, with the dim it joined along: the next cat of one of
# them along the same dim starts a growth.
_cat_results = weakref.WeakKeyDictionary()


def bucket(n):
    """The padded length for a grown dim of length n."""
    size = GROWTH_MIN
    while size < n:
        size *= 2
    return size


def _pad(t, axis, length):
    """t padded with zeros along axis to length (constant_pad_nd pads the last
    dims first)."""
    pad = [0, 0] * (t.dim() - 1 - axis) + [0, length - t.shape[axis]]
    return dispatch(aten.constant_pad_nd.default, (t, pad, 0), {})


def grown_tensor(grown, axis, extent, dtype, exact=None):
    shape = list(grown.shape)
    shape[axis] = extent
    return whole_tensor(GrownStorage(grown, axis, extent, _cut, exact), tuple(shape), dtype)


def _joinable(first, others, axis):
    """Whether a cat of first and others along axis is a plain join a grown
    storage can take: tpu tensors of one dtype and device, the same shape
    but along axis."""
    shape = first.shape
    for t in others:
        if (type(t) is not TpuTensor or t.dtype != first.dtype or t.dim() != first.dim()
                or t._storage.device != first._storage.device
                or any(a != b for i, (a, b) in enumerate(zip(t.shape, shape)) if i != axis)):
            return False
    return True


def _cat(tensors, dim=0):
    plan = plan_of(aten.cat.default)
    if not ENABLED or len(tensors) < 2 or type(tensors[0]) is not TpuTensor or tensors[0].dim() == 0:
        return _run_lowered(plan, (tensors, dim), {})
    first = tensors[0]
    axis = dim % first.dim()
    storage = first._storage
    if not _joinable(first, tensors[1:], axis):
        return _run_lowered(plan, (tensors, dim), {})
    if (type(storage) is GrownStorage and storage.grown is not None and first._view is None
            and storage.axis == axis):
        return _extend(first, tensors[1:], axis)
    if plan.padded is not None and any(type(t._storage) is GrownStorage for t in tensors):
        out = plan.padded(plan.func, (tensors, dim), {})  # along another dim (dispatch.lengths)
        if out is not NotImplemented:
            return out
    out = _run_lowered(plan, (tensors, dim), {})
    if _cat_results.get(storage) == axis and first._view is None:
        # The second cat of a chain along this axis: it grows.
        n = out.shape[axis]
        grown = _pad(out, axis, bucket(n))
        out = grown_tensor(grown, axis, n, out.dtype, out._storage.array)
    else:
        _cat_results[out._storage] = axis
    return out


def _extend(first, others, axis):
    storage = first._storage
    grown = storage.grown
    new = others[0] if len(others) == 1 else _run_lowered(plan_of(aten.cat.default), (others, axis), {})
    if new._view is not None:
        # One write_at kernel per bucket, whatever the new slice's layout (a
        # key projection's transpose): the copy's kernel is the same in all.
        new = dispatch(aten.clone.default, (new,), {"memory_format": torch.contiguous_format})
    extent = storage.extent + new.shape[axis]
    if extent > grown.shape[axis]:
        grown = _pad(grown, axis, bucket(extent))
    grown = dispatch(torch.ops.torchtpu.write_at.default, (grown, new, axis, storage.extent), {})
    return grown_tensor(grown, axis, extent, first.dtype)


def _grown_whole(t, axis):
    """The GrownStorage of t when t is all of it, grown along axis."""
    if type(t) is not TpuTensor or t._view is not None:
        return None
    storage = t._storage
    if type(storage) is not GrownStorage or storage.grown is None or storage.axis != axis % t.dim():
        return None
    return storage


def _attention(q, k, v, mask, is_causal, scale, dropout_p, seed, offset):
    plan = plan_of(torch.ops.torchtpu.attention.default)
    args = (q, k, v, mask, is_causal, scale, dropout_p, seed, offset)
    if k.dim() < 2 or is_causal or dropout_p != 0:
        return _run_lowered(plan, args, {})
    ks, vs = _grown_whole(k, -2), _grown_whole(v, -2)
    if ks is None or vs is None or ks.extent != vs.extent or ks.grown.shape[-2] != vs.grown.shape[-2]:
        return _run_lowered(plan, args, {})
    extent, length = ks.extent, ks.grown.shape[-2]
    if mask is not None:
        ms = _grown_whole(mask, -1)
        if ms is not None and ms.extent == extent and ms.grown.shape[-1] == length:
            mask = ms.grown
        elif mask.dim() and mask.shape[-1] != 1:
            return _run_lowered(plan, args, {})
    return dispatch(torch.ops.torchtpu.attention_grown.default,
                    (q, ks.grown, vs.grown, mask, scale, extent), {})


def _cut(storage, reader="a read"):
    """The exact array of a grown storage, for an op (reader, its name for
    the advisor where the dispatcher knows it) that reads it whole."""
    grown, axis = storage.grown, storage.axis
    metrics.M.extra["grown_cuts"] = metrics.M.extra.get("grown_cuts", 0) + 1
    advisor.note_grown_cut(reader, errors.user_line(), axis, storage.extent, grown.shape[axis])
    part = dispatch(aten.slice.Tensor, (grown, axis, 0, storage.extent), {})
    return dispatch(aten.clone.default, (part,), {"memory_format": torch.contiguous_format})._storage.array


SPECIAL[aten.cat.default] = _cat
SPECIAL[torch.ops.torchtpu.attention.default] = _attention
