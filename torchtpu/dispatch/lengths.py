"""Bounded dynamism for lengths that vary from step to step: a batch of rows
sliced from data on the device at a new length each step (`data[i:i + n]`
with n varying, a last short batch), a batch uploaded from the host with a
dim marked dynamic or found varying between uploads from one line
(marked_upload), and the tensors computed from them.
Without it every op on them compiles one kernel per length (in fused mode,
one graph per length).

Once slices of one storage take a row count other than the first one a new
kernel met, an op with a rule below reads such a slice as rows padded to a
bucket (a power of two, at least PAD_MIN, or that first count where it lies
between; zeros past the true count) by one torchtpu::read_rows kernel per
bucket, and computes on the padded arrays. Its result's storage is a
GrownStorage, padded along one dim with zeros past its extent, as
torch.cat's growth makes (torchtpu.dispatch.growth), so the ops after it
compile once per bucket too. Slices of the first count keep their exact
kernels: batches of one length with a last short one (a language model's
bptt slices) run their full batches as they did before the short one, not
padded to the next power of two.

The rules, each giving exactly the values of the op at the true extent:
- the ops PyTorch tags pointwise (not random ones): computed on the padded
  arrays, then the positions past the extent set back to zero
  (torchtpu::mask_past), so that sums over the padded dim stay exact;
- mm and addmm: padded rows or columns pass through; a contraction over the
  padded dim is exact as it is (zeros add nothing);
- sum and mean: over the padded dim exact as it is (a mean divides by the
  true count), over others still padded;
- a dtype conversion; torch.cat along another dim;
- constant_pad_nd: along the padded dim, the padded array padded to the
  result's length (exact: a mask padded to a static cache's length);
- softmax and log_softmax, and their backwards, over another dim;
- nll_loss (cross_entropy) and its backward: targets past the extent
  become ignore_index, so neither the loss nor its mean counts them;
- embedding, and its backward (not with scale_grad_by_freq);
- native_dropout: it draws for the padded positions too, and drops them.
A view of such a tensor (a reshape, a transpose, a select along another dim)
is read from the padded array when the padded dim is the outermost one the
view's largest-stride dim spans, in whole. Any other op, and any view that
cuts into the padded dim, reads the exact array, cut from the padded one: the
same values, compiled per length (the advisor names the line).

TORCHTPU_LENGTHS=off (ENABLED) pads no slice and no stack.
"""
import contextlib
import math
import sys
import typing
import weakref

import torch

from .. import config, errors, metrics
from ..ops import LOWERINGS
from ..tensor import GrownStorage, Storage, TpuTensor, View, make_view, view_tensor, whole_tensor
from .core import _run_lowered, dispatch, plan_of
from .growth import grown_tensor
from .host import to_tpu
from .plans import PADDED, SPECIAL

from ..compat import aten

ENABLED = config.LENGTHS.on()
PAD_MIN = 8

# Storage -> the row count of the first slice of it that a new kernel read.
_first_rows = weakref.WeakKeyDictionary()
# (item shape, dtype) -> the first count (at least PAD_MIN) of a torch.stack
# of such items (an RNN's steps).
_stacked = {}


def bucket(n, first=None):
    """The padded length of a varying length n: a power of two, or the length
    met first where that lies between n and the power."""
    size = PAD_MIN
    while size < n:
        size *= 2
    return first if first is not None and n <= first < size else size


class Operand(typing.NamedTuple):
    """A tensor argument as its padded values: `padded` holds them along dim,
    zeros from extent to capacity."""
    padded: TpuTensor
    dim: int
    extent: int
    capacity: int


def operand(t):
    """t as an Operand, or None when it is not padded (nor a slice of rows
    whose count varies)."""
    if type(t) is not TpuTensor:
        return None
    storage, view = t._storage, t._view
    if type(storage) is GrownStorage:
        grown = storage.grown
        if grown is None:
            return None
        axis = storage.axis
        if view is None:
            return Operand(grown, axis, storage.extent, grown.shape[axis])
        if type(view) is not View or math.prod(grown.shape[:axis]) != 1:
            return None  # a dtype view, or logical elements that are no prefix of the padded ones
        return _viewed(t, grown, axis, storage.extent, 0)
    if type(view) is not View or type(storage) is not Storage or not ENABLED:
        return None
    rows = _rows(view, t._key[1])
    if rows is None:
        return None
    start, count = rows
    first = _first_rows.setdefault(storage, count)
    if count == first:
        return None
    whole = whole_tensor(storage, t._key[1], t.dtype)
    padded = dispatch(torch.ops.torchtpu.read_rows.default, (whole, start, count, bucket(count, first)), {})
    return _viewed(t, padded, 0, count, start * math.prod(t._key[1][1:]))


def _rows(view, storage_shape):
    """(first row, row count) of the rows of a storage of storage_shape that
    view reaches, or None when it reaches them all (a weight's transpose)."""
    if len(storage_shape) == 0 or 0 in view.shape:
        return None
    inner = math.prod(storage_shape[1:])
    if inner == 0:
        return None
    last = view.offset + sum((n - 1) * st for n, st in zip(view.shape, view.stride))
    start, end = view.offset // inner, last // inner + 1
    if start == 0 and end == storage_shape[0]:
        return None
    return start, end - start


def _viewed(t, base, axis, extent, offset0):
    """The Operand of view t of logical rows that are the first `extent` along
    base's padded axis (outermost in base: no dim before it is longer than
    1), t's offset counted from offset0: the same view of base, its
    largest-stride dim spanning the capacity."""
    shape, stride, offset = t._view
    offset -= offset0
    inner = math.prod(base.shape[axis + 1:])
    capacity = base.shape[axis]
    dims = [i for i, (n, st) in enumerate(zip(shape, stride)) if n > 1 and st != 0]
    if not dims or offset < 0 or min(stride) < 0:
        return None
    d = max(dims, key=lambda i: stride[i])
    if shape[d] * stride[d] != extent * inner or (capacity * inner) % stride[d]:
        return None
    if offset + sum((shape[i] - 1) * stride[i] for i in dims if i != d) >= stride[d]:
        return None
    padded_shape = list(shape)
    padded_shape[d] = capacity * inner // stride[d]
    padded_shape = tuple(padded_shape)
    key = (t.dtype, tuple(base.shape), make_view(base.shape, padded_shape, stride, offset), t._key[3])
    return Operand(view_tensor(base._storage, padded_shape, tuple(stride), offset, key),
                   d, shape[d], padded_shape[d])


def _masked(t, dim, extent, fill=0):
    return dispatch(torch.ops.torchtpu.mask_past.default, (t, dim, extent, fill), {})


def _result(out, dim, extent, mask=True):
    """A padded result as the tensor of its extent: zeros past it."""
    if mask:
        out = _masked(out, dim, extent)
    return grown_tensor(out, dim, extent, out.dtype)


def _same(*operands):
    return len({(o.extent, o.capacity) for o in operands}) == 1


def _aligned(*operands):
    """operands padded alike, as the first one is (cut or padded with zeros
    past the extent: targets flattened on the host come padded as [batch *
    length] rows, the scores for them as [length] rows of batch; a result
    keeps the first operand's capacity, so that the ops after it, the
    backward of the view that flattened the scores, read it padded), or
    None when their extents differ."""
    if len({o.extent for o in operands}) != 1:
        return None
    capacity = operands[0].capacity
    return [o if o.capacity == capacity else Operand(
        dispatch(aten.slice.Tensor, (o.padded, o.dim, 0, capacity), {}) if o.capacity > capacity else
        dispatch(aten.constant_pad_nd.default,
                 (o.padded, [0, 0] * (o.padded.dim() - 1 - o.dim) + [0, capacity - o.capacity], 0), {}),
        o.dim, o.extent, capacity) for o in operands]


# ---- the rules -----------------------------------------------------------------

def _pointwise(func, args, kwargs):
    if any(type(v) is TpuTensor for v in kwargs.values()):
        return NotImplemented
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if not tensors:
        return NotImplemented
    ndim = max(args[i].dim() for i in tensors)
    new, found = list(args), None
    for i in tensors:
        o = operand(args[i])
        if o is None:
            continue
        place = (ndim - args[i].dim() + o.dim, o.extent, o.capacity)
        if found is not None and place != found:
            return NotImplemented
        found, new[i] = place, o.padded
    if found is None:
        return NotImplemented
    at = found[0]
    for i in tensors:
        j = at - (ndim - args[i].dim())
        if new[i] is args[i] and j >= 0 and args[i].shape[j] != 1:
            return NotImplemented  # an exact tensor of the extent's length
    out = dispatch(func, tuple(new), kwargs)
    if type(out) is tuple:  # frexp's mantissa and exponent
        return tuple(_result(o, at, found[1]) for o in out)
    return _result(out, at, found[1])


def _product(a, b):
    """(a, b) as padded arrays for a matrix product, and where its result is
    padded ((dim, extent), or None for a contraction over the padded dim);
    None when the product cannot take them."""
    oa, ob = operand(a), operand(b)
    if oa is not None and ob is None and oa.dim == a.dim() - 2:
        return oa.padded, b, (oa.dim, oa.extent)
    if ob is not None and oa is None and ob.dim == b.dim() - 1:
        return a, ob.padded, (ob.dim, ob.extent)
    if (oa is not None and ob is not None and oa.dim == a.dim() - 1 and ob.dim == b.dim() - 2
            and _same(oa, ob)):
        return oa.padded, ob.padded, None
    return None


def _mm(func, args, kwargs):
    found = _product(args[0], args[1]) if not kwargs else None
    if found is None:
        return NotImplemented
    a, b, place = found
    out = dispatch(func, (a, b), {})
    return out if place is None else _result(out, *place)


def _addmm(func, args, kwargs):
    bias = args[0]
    if operand(bias) is not None:
        return NotImplemented
    found = _product(args[1], args[2])
    if found is None:
        return NotImplemented
    a, b, place = found
    if place is not None and bias.dim() - 2 + place[0] >= 0 and bias.shape[bias.dim() - 2 + place[0]] != 1:
        return NotImplemented  # a bias of the extent's length
    out = dispatch(func, (bias, a, b, *args[3:]), kwargs)
    return out if place is None else _result(out, *place)


def _reduced(func, x, o, args, kwargs):
    """(the dims a sum or mean reduces x over, keepdim, and the padded dim's
    place in its result: None when it is one of them)."""
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if func in (aten.sum.default, aten.mean.default) or not dims:
        dims = set(range(x.dim()))
    else:
        dims = {d % x.dim() for d in dims}
    if o.dim in dims:
        return dims, keepdim, None
    return dims, keepdim, o.dim if keepdim else o.dim - sum(1 for d in dims if d < o.dim)


def _sum(func, args, kwargs):
    o = operand(args[0])
    if o is None:
        return NotImplemented
    out = dispatch(func, (o.padded, *args[1:]), kwargs)
    at = _reduced(func, args[0], o, args, kwargs)[2]
    # Over the padded dim the zeros add nothing; sums of zeros are zeros.
    return out if at is None else _result(out, at, o.extent, mask=False)


def _mean(func, args, kwargs):
    x = args[0]
    o = operand(x)
    if o is None or not (x.is_floating_point() or x.is_complex() or kwargs.get("dtype")):
        return NotImplemented  # (CPU's error for an integer mean, from the exact path)
    dims, keepdim, at = _reduced(func, x, o, args, kwargs)
    if at is not None:  # means of zeros are zeros
        return _result(dispatch(func, (o.padded, *args[1:]), kwargs), at, o.extent, mask=False)
    # Over the padded dim: the padded sum (the zeros add nothing) over the true count.
    total = dispatch(aten.sum.dim_IntList, (o.padded, sorted(dims), keepdim), {"dtype": kwargs.get("dtype")})
    return dispatch(aten.div.Scalar, (total, math.prod(x.shape[d] for d in dims)), {})


def _to_copy(func, args, kwargs):
    if set(kwargs) - {"dtype", "memory_format"}:
        return NotImplemented  # (the transfer handler left only these for the tpu)
    o = operand(args[0])
    if o is None:
        return NotImplemented
    # A zero converts to a zero in every dtype: nothing past the extent to set.
    return _result(dispatch(func, (o.padded, *args[1:]), kwargs), o.dim, o.extent, mask=False)


def _pad(func, args, kwargs):
    """constant_pad_nd. Along the padded dim: the padded array padded (or
    cropped) to the result's length, its zeros past the extent standing for
    the pad (set to the value where it is not 0); the result is exact. So a
    mask padded to a static cache's length each step (by a pad that shrinks
    as the mask grows) compiles once per bucket, not once per length."""
    x, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    o = operand(x)
    if o is None or set(kwargs) - {"value"}:
        return NotImplemented
    i = 2 * (x.dim() - 1 - o.dim)  # where the padded dim's pair is in pad
    if len(pad) % 2 or len(pad) > 2 * x.dim():
        return NotImplemented  # (CPU's error, from the exact path)
    if i >= len(pad) or pad[i] == pad[i + 1] == 0:  # other dims only: still padded along o.dim
        out = dispatch(func, (o.padded, pad, value), {})
        return _result(out, o.dim, o.extent, mask=value != 0)
    before, after = pad[i], pad[i + 1]
    if before + o.extent + after < 0:
        return NotImplemented  # (CPU's error, from the exact path)
    pad[i + 1] = o.extent + after - o.capacity
    out = dispatch(func, (o.padded, pad, value), {})
    return out if value == 0 else _masked(out, o.dim, before + o.extent, value)


def _cat(func, args, kwargs):
    """torch.cat along another dim than the padded one (growth's cat calls it
    for tensors of one shape but along dim)."""
    tensors, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not tensors:
        return NotImplemented
    found = [operand(t) for t in tensors]
    if any(o is None for o in found) or len({(o.dim, o.extent, o.capacity) for o in found}) != 1:
        return NotImplemented
    at = found[0].dim
    if dim % tensors[0].dim() == at:
        return NotImplemented
    return _result(dispatch(func, ([o.padded for o in found], dim), {}), at, found[0].extent, mask=False)


def _softmax(func, args, kwargs):
    x, dim = args[0], args[1]
    o = operand(x)
    if o is None or kwargs or o.dim == dim % x.dim():
        return NotImplemented
    return _result(dispatch(func, (o.padded, *args[1:]), {}), o.dim, o.extent)


def _softmax_backward(func, args, kwargs):
    grad, output, dim = args[0], args[1], args[2]
    og, oo = operand(grad), operand(output)
    if og is None or oo is None or kwargs or og.dim != oo.dim or og.dim == dim % grad.dim():
        return NotImplemented
    found = _aligned(oo, og)  # (the gradient of a loss over targets of their own capacity)
    if found is None:
        return NotImplemented
    oo, og = found
    return _result(dispatch(func, (og.padded, oo.padded, *args[2:]), {}), og.dim, og.extent)


def _nll_inputs(x, target, ignore_index, *others):
    """(x, target, *others) padded alike along the batch (others: Operands),
    the targets past the extent ignored; None unless all are padded along
    it to one extent."""
    ox, ot = operand(x), operand(target)
    if ox is None or ot is None or x.dim() != 2 or ox.dim != 0 or ot.dim != 0:
        return None
    found = _aligned(ox, ot, *others)
    if found is None:
        return None
    ox, ot, *others = found
    return (ox, _masked(ot.padded, 0, ot.extent, ignore_index), *others)


def _nll_loss(func, args, kwargs):
    if len(args) != 5:
        return NotImplemented
    x, target, weight, reduction, ignore_index = args
    found = _nll_inputs(x, target, ignore_index) if not kwargs else None
    if found is None or operand(weight) is not None:
        return NotImplemented
    ox, target = found
    out, total = dispatch(func, (ox.padded, target, weight, reduction, ignore_index), {})
    if reduction == 0:  # none: one loss a row, padded
        out = _result(out, 0, ox.extent)
    return out, total


def _nll_loss_backward(func, args, kwargs):
    if len(args) != 7:
        return NotImplemented
    grad, x, target, weight, reduction, ignore_index, total = args
    og = operand(grad) if reduction == 0 else None
    if reduction == 0 and (og is None or og.dim != 0):
        return NotImplemented
    found = _nll_inputs(x, target, ignore_index, *(() if og is None else (og,))) if not kwargs else None
    if found is None or operand(weight) is not None:
        return NotImplemented
    ox, target = found[:2]
    if reduction == 0:
        grad = found[2].padded
    out = dispatch(func, (grad, ox.padded, target, weight, reduction, ignore_index, total), {})
    return _result(out, 0, ox.extent)


def _embedding(func, args, kwargs):
    weight, indices = args[0], args[1]
    oi = operand(indices)
    if oi is None or kwargs or operand(weight) is not None:
        return NotImplemented
    return _result(dispatch(func, (weight, oi.padded, *args[2:]), {}), oi.dim, oi.extent)


def _embedding_backward(func, args, kwargs):
    if len(args) != 5:
        return NotImplemented
    grad, indices, num_weights, padding_idx, scale_grad_by_freq = args
    og, oi = operand(grad), operand(indices)
    if og is None or oi is None or kwargs or scale_grad_by_freq or og.dim != oi.dim or not _same(og, oi):
        return NotImplemented
    # Rows past the extent: zero gradients, added to the row of index 0.
    return dispatch(func, (og.padded, oi.padded, num_weights, padding_idx, False), {})


def _dropout(func, args, kwargs):
    o = operand(args[0])
    if o is None or kwargs:
        return NotImplemented
    out, keep = dispatch(func, (o.padded, *args[1:]), {})
    return _result(out, o.dim, o.extent), _result(keep, o.dim, o.extent)


def _stack(tensors, dim=0):
    """torch.stack along dim 0 of a count of items that varies: the items and
    zeros, a bucket of them, so that one kernel serves the bucket."""
    plan = plan_of(aten.stack.default)
    first = tensors[0] if len(tensors) else None
    if (not ENABLED or type(first) is not TpuTensor or dim != 0 or first.dim() == 0
            or any(type(t) is not TpuTensor or t.shape != first.shape or t.dtype != first.dtype
                   or t._storage.device != first._storage.device for t in tensors)):
        return _run_lowered(plan, (tensors, dim), {})
    n, kind = len(tensors), (tuple(first.shape), first.dtype)
    if n < PAD_MIN or (kind not in _stacked and len(_stacked) >= 4096):
        # Not noted: an RNN's final states of its few layers, stacked
        # beside its steps' outputs of the same shape.
        return _run_lowered(plan, (tensors, dim), {})
    first_n = _stacked.setdefault(kind, n)
    if n == first_n:
        return _run_lowered(plan, (tensors, dim), {})
    # Zeros of their own storages, so the kernel's key is the bucket's whatever n.
    zeros = [dispatch(aten.zeros_like.default, (first,), {}) for _ in range(bucket(n, first_n) - n)]
    out = _run_lowered(plan, (list(tensors) + zeros, 0), {})
    return grown_tensor(out, 0, n, out.dtype)


# (user's file, line, rank, dtype) -> [the shape last uploaded there and
# the training step it came at, the dim whose size changed, {size: the step
# it was first met at}, whether it varies]: where uploads have come from, as
# torch.compile's automatic dynamic shapes remember a frame's sizes.
_upload_sites = {}
_UPLOAD_SITES = 4096
VARYING_AFTER = 3  # sizes of one dim at one line, in as many training steps
_as_they_are = [0]  # > 0: uploads that are not a program's batches (a module's .to())


@contextlib.contextmanager
def uploads_as_they_are():
    """Uploads inside take no dim as varying (a module's parameters and
    buffers, moved one by one from one line, differ in shape, not length)."""
    _as_they_are[0] += 1
    try:
        yield
    finally:
        _as_they_are[0] -= 1


def _dynamo_compiled():
    """Whether torch.compile has made a graph in this process: its inputs'
    varying sizes are Dynamo's to find (automatic dynamic shapes), and a
    compiled graph takes no padded input."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return dynamo is not None and dynamo.counters["stats"]["unique_graphs"] > 0


def _varying_dim(src, host, frame):
    """The dim of an unmarked upload that varies between uploads from the
    same line of the user's, or None. A dim varies once uploads from that
    line have had VARYING_AFTER sizes along it in as many training steps
    (optimizer steps), with the other dims, the rank and the dtype the
    same: a batch's length, which changes from step to step. Not a dataset
    moved by a helper line in two sizes (train, test), tensors moved by a
    helper between steps (inference, tests), a dim marked static
    (`torch._dynamo.mark_static(t, dim)`), nor anything once torch.compile
    has made a graph."""
    if _as_they_are[0] or host.dim() == 0:
        return None
    file, line = errors.user_site(frame)
    if not line:
        return None
    key, shape, step = (file, line, host.dim(), host.dtype), tuple(host.shape), metrics.M.steps
    seen = _upload_sites.get(key)
    if seen is None:
        if len(_upload_sites) >= _UPLOAD_SITES:
            del _upload_sites[next(iter(_upload_sites))]
        _upload_sites[key] = [shape, step, None, {}, False]
        return None
    last, last_step, dim, sizes, varies = seen
    changed = [d for d in range(len(shape)) if shape[d] != last[d]]
    seen[:2] = shape, step
    if changed and changed != [dim]:
        static = getattr(src, "_dynamo_static_indices", ())
        if len(changed) != 1 or changed[0] in static:
            seen[2:] = [None, {}, False]
            return None
        dim, sizes, varies = changed[0], {last[changed[0]]: last_step}, False
        seen[2:] = [dim, sizes, varies]
    if dim is None:
        return None
    if not varies:
        sizes.setdefault(shape[dim], step)
        varies = seen[4] = len(sizes) >= VARYING_AFTER and len(set(sizes.values())) >= VARYING_AFTER
    return dim if varies and not _dynamo_compiled() else None


def marked_upload(src, host, device, frame=None):
    """The tpu tensor an upload of src (as host: its values, contiguous)
    becomes when one dim of src varies: marked dynamic, as torch.compile's
    users mark a length that varies (`torch._dynamo.mark_dynamic(batch,
    0)`), or found varying between uploads from the user's line in frame
    (_varying_dim): padded along that dim to its bucket, zeros past the
    length; None for any other upload (as it is)."""
    if not ENABLED or src.shape != host.shape:
        return None
    dims = getattr(src, "_dynamo_dynamic_indices", None)
    if dims:
        if len(dims) != 1:
            return None
        (dim,) = dims
    else:
        dim = _varying_dim(src, host, frame)
        if dim is None:
            return None
    if not 0 <= dim < host.dim() or host.shape[dim] == 0:
        return None
    n = host.shape[dim]
    shape = list(host.shape)
    shape[dim] = bucket(n)
    padded = host.new_zeros(shape)
    padded.narrow(dim, 0, n).copy_(host)
    return grown_tensor(to_tpu(padded, device=device), dim, n, host.dtype)


SPECIAL[aten.stack.default] = _stack

for _op, _fn in LOWERINGS.items():
    if torch.Tag.pointwise in _op.tags and not _fn.random:
        PADDED.setdefault(_op, _pointwise)
PADDED.update({
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.sum.default: _sum,
    aten.sum.dim_IntList: _sum,
    aten.mean.default: _mean,
    aten.mean.dim: _mean,
    aten._to_copy.default: _to_copy,
    aten.constant_pad_nd.default: _pad,
    aten.cat.default: _cat,
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _softmax,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _softmax_backward,
    aten.nll_loss_forward.default: _nll_loss,
    aten.nll_loss_backward.default: _nll_loss_backward,
    aten.embedding.default: _embedding,
    aten.embedding_dense_backward.default: _embedding_backward,
    aten.native_dropout.default: _dropout,
})
