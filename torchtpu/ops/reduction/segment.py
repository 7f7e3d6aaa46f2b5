"""Segment reductions: segment_reduce and its backward, over segments given
by lengths or offsets along one axis."""
import jax
import jax.numpy as jnp
from jax import lax

from ..registry import lower
from .common import _acc

from ...compat import aten


def _segment_layout(data, lengths, offsets, axis):
    """data as (outer, N, inner); each position's segment (outer, N), S where
    it lies in none; the segment lengths (outer, S)."""
    axis = axis % data.ndim
    outer = 1
    for s in data.shape[:axis]:
        outer *= s
    d = data.reshape(outer, data.shape[axis], -1)
    if lengths is not None:
        n = lengths.reshape(outer, -1).astype(jnp.int64)
        ends = jnp.cumsum(n, 1)
        starts = ends - n
    else:
        off = offsets.reshape(outer, -1).astype(jnp.int64)
        starts, ends = off[:, :-1], off[:, 1:]
    count = starts.shape[1]
    j = jnp.arange(d.shape[1], dtype=jnp.int64)
    seg = jnp.sum(ends[:, None, :] <= j[None, :, None], axis=2)  # segments ended by j
    inside = (seg < count) & (j[None] >= jnp.take_along_axis(starts, jnp.minimum(seg, count - 1), 1))
    return d, jnp.where(inside, seg, count), ends - starts


def _segment_apply(fn, d, seg, count):
    return jax.vmap(lambda v, s: fn(v, s, num_segments=count))(d, seg)


@lower(aten.segment_reduce.default)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0,
                   unsafe=False, initial=None):
    out_dtype = data.dtype
    d, seg, n = _segment_layout(data, lengths, offsets, axis)
    d = d.astype(_acc(out_dtype))
    count = n.shape[1]
    n = n[:, :, None]
    init = None if initial is None else jnp.asarray(initial).astype(d.dtype)
    if reduce in ("max", "min"):
        fn = jax.ops.segment_max if reduce == "max" else jax.ops.segment_min
        out = _segment_apply(fn, d, seg, count)
        if init is not None:
            out = jnp.maximum(out, init) if reduce == "max" else jnp.minimum(out, init)
        # NaN sticks once met
        nan = _segment_apply(jax.ops.segment_max, jnp.isnan(d), seg, count)
        out = jnp.where(nan, jnp.nan, out)
    elif reduce == "prod":
        out = _segment_apply(jax.ops.segment_prod, d, seg, count)
        out = out if init is None else init * out
    else:
        out = _segment_apply(jax.ops.segment_sum, d, seg, count)
        out = out if init is None else init + out
        if reduce == "mean":
            empty = jnp.nan if init is None else init
            out = jnp.where(n == 0, empty, jnp.where(jnp.isnan(out), out, out / jnp.maximum(n, 1)))
    shape = list(data.shape)
    shape[axis % data.ndim] = count
    return out.reshape(shape).astype(out_dtype)


def _segmented_scan(op, x, seg):
    """Inclusive scan of op along axis 1 restarting at each new segment."""
    def combine(a, b):
        (sa, va), (sb, vb) = a, b
        return sb, jnp.where(sa == sb, op(va, vb), vb)
    return lax.associative_scan(combine, (jnp.broadcast_to(seg[:, :, None], x.shape), x), axis=1)[1]


@lower(aten._segment_reduce_backward.default)
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0,
                            initial=None):
    out_dtype = data.dtype
    d, seg, n = _segment_layout(data, lengths, offsets, axis)
    acc = _acc(out_dtype)
    d = d.astype(acc)
    count = n.shape[1]
    g = grad.reshape(d.shape[0], count, -1).astype(acc)
    o = output.reshape(d.shape[0], count, -1).astype(acc)
    inside = (seg < count)[:, :, None]
    at = jnp.minimum(seg, count - 1)[:, :, None]
    gs = jnp.where(inside, jnp.take_along_axis(g, at, 1), 0)
    os_ = jnp.take_along_axis(o, at, 1)
    if reduce == "sum":
        out = gs
    elif reduce == "mean":
        out = gs / jnp.maximum(jnp.take_along_axis(n[:, :, None], at, 1), 1).astype(acc)
    elif reduce in ("max", "min"):
        hit = inside & (jnp.isnan(d) | (d == os_))
        out = jnp.where(hit, gs, 0)
        ties = jnp.take_along_axis(_segment_apply(jax.ops.segment_sum, hit.astype(acc), seg, count), at, 1)
        # CPU shares the gradient among ties only where it is positive.
        out = jnp.where((ties >= 2) & (out > 0), out / ties, out)
    else:  # prod
        one = jnp.ones((), acc)
        start = one if initial is None else jnp.asarray(initial).astype(acc)
        before = _segmented_scan(jnp.multiply, d, seg)
        after = jnp.flip(_segmented_scan(jnp.multiply, jnp.flip(d, 1), jnp.flip(seg, 1)), 1)
        # the product of the segment's other elements: before it times after it
        shift_b = jnp.concatenate([jnp.ones_like(before[:, :1]), before[:, :-1]], 1)
        seg_b = jnp.concatenate([jnp.full_like(seg[:, :1], -1), seg[:, :-1]], 1)[:, :, None]
        shift_a = jnp.concatenate([after[:, 1:], jnp.ones_like(after[:, :1])], 1)
        seg_a = jnp.concatenate([seg[:, 1:], jnp.full_like(seg[:, :1], -1)], 1)[:, :, None]
        segc = seg[:, :, None]
        excl = start * jnp.where(seg_b == segc, shift_b, one) * jnp.where(seg_a == segc, shift_a, one)
        special = jnp.isnan(d) | (d == 0)
        out = jnp.where(inside, jnp.where(special, gs * excl, (gs * os_) / jnp.where(special, one, d)), 0)
    return out.reshape(data.shape).astype(out_dtype)
