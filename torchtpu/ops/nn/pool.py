"""Pooling: average, max (with indices), adaptive average and max, and
fractional max pooling over 2d and 3d windows, with their backwards."""
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..registry import lower
from ..util import rounder
from .common import _apply_mats, _compute_dtype, _expand, _up, aten


def _pool_geometry(size, k, s, p, d, ceil_mode):
    """Output size and the high-side padding a pooling window needs (PyTorch's
    rule: with ceil_mode the last window must start inside the padded input)."""
    span = d * (k - 1) + 1
    num = size + 2 * p - span
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    hi = max(0, (out - 1) * s + span - size - p)
    return out, hi


def _pool_args(x, kernel_size, stride, padding, n=2):
    k = _expand(kernel_size, n)
    s = _expand(stride, n) if stride else k
    p = _expand(padding, n)
    return k, s, p


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
              n):
    """avg_pool over the last n dims."""
    k, s, p = _pool_args(x, kernel_size, stride, padding, n)
    sizes = x.shape[-n:]
    geo = [_pool_geometry(sz, kk, ss, pp, 1, ceil_mode) for sz, kk, ss, pp in zip(sizes, k, s, p)]
    lead = x.ndim - n
    xs = _up(x)
    summed = lax.reduce_window(
        xs, np.array(0, xs.dtype), lax.add, (1,) * lead + tuple(k), (1,) * lead + tuple(s),
        [(0, 0)] * lead + [(pp, hi) for pp, (_, hi) in zip(p, geo)])
    if divisor_override:
        return summed / divisor_override
    counts = np.ones(())
    for sz, kk, ss, pp, (out, _) in zip(sizes, k, s, p, geo):
        start = np.arange(out) * ss - pp
        end = np.minimum(start + kk, sz + pp)
        if not count_include_pad:
            end = np.minimum(end, sz)
            start = np.maximum(start, 0)
        counts = np.multiply.outer(counts, (end - start).astype(np.float64))
    return summed / jnp.asarray(counts, xs.dtype)


def _avg_pool_lowerings(op, op_backward, n):
    def forward(x, kernel_size, stride=(), padding=(0,), ceil_mode=False,
                count_include_pad=True, divisor_override=None):
        return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                         divisor_override, n).astype(x.dtype)

    def backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                 divisor_override):
        def f(x_):
            return _avg_pool(x_, kernel_size, stride, padding, ceil_mode, count_include_pad,
                             divisor_override, n)
        _, vjp = jax.vjp(f, _up(x))
        return vjp(_up(grad))[0].astype(x.dtype)

    lower(op)(forward)
    lower(op_backward)(backward)


_avg_pool_lowerings(aten.avg_pool2d.default, aten.avg_pool2d_backward.default, 2)
_avg_pool_lowerings(aten.avg_pool3d.default, aten.avg_pool3d_backward.default, 3)


def _windows(pos, valid, sizes):
    """Per-dim window positions pos[d] (..., out_d, k_d) (input coordinates,
    valid[d] where inside the input) -> the flat input index and validity of
    every window element, shaped (..., *out, K) with K = prod(k_d) in
    row-major window order. numpy in, numpy out (static windows); jax for
    per-plane windows."""
    n = len(pos)
    xp = np if all(isinstance(p, np.ndarray) for p in pos + valid) else jnp
    flat, ok = 0, True
    stride = 1
    for d in reversed(range(n)):
        o, k = pos[d].shape[-2:]
        shape = (pos[d].shape[:-2] + (1,) * d + (o,) + (1,) * (n - 1 - d)
                 + (1,) * d + (k,) + (1,) * (n - 1 - d))
        vshape = (valid[d].shape[:-2] + shape[-2 * n:])
        flat = flat + xp.reshape(pos[d], shape) * stride
        ok = ok & xp.reshape(valid[d], vshape)
        stride *= sizes[d]
    flat, ok = xp.broadcast_arrays(flat, ok)
    lead = flat.shape[:-n]
    K = math.prod(flat.shape[-n:])
    return xp.reshape(flat, lead + (K,)).astype(xp.int64), xp.reshape(ok, lead + (K,))


def _max_windows(x, flat, ok, n):
    """Max of x (..., *spatial) over windows given as flat indices into the
    last n dims (with validity), as PyTorch's CPU kernels pick it: the first
    maximum, or the last NaN. Returns (values, flat input indices)."""
    lead = x.shape[:-n]
    xf = x.reshape(lead + (math.prod(x.shape[-n:]),))
    safe = np.where(ok, flat, 0) if isinstance(flat, np.ndarray) else jnp.where(ok, flat, 0)
    if isinstance(safe, np.ndarray):
        patches = xf[..., safe]
    else:
        shape = safe.shape
        per_plane = safe.reshape(lead + (math.prod(shape[len(lead):]),))
        patches = jnp.take_along_axis(xf, per_plane, -1).reshape(shape)
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    fill = -jnp.inf if floating else jnp.iinfo(x.dtype).min
    best = jnp.max(jnp.where(ok, patches, fill), axis=-1, keepdims=True)
    arg = jnp.argmax(ok & (patches == best), axis=-1)
    if floating:
        nan = ok & jnp.isnan(patches)
        last_nan = nan.shape[-1] - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
        arg = jnp.where(jnp.any(nan, axis=-1), last_nan, arg)
    vals = jnp.take_along_axis(patches, arg[..., None], -1)[..., 0]
    idx = jnp.take_along_axis(jnp.broadcast_to(safe, patches.shape), arg[..., None], -1)[..., 0]
    return vals, idx.astype(jnp.int64)


def _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, n):
    k, s, p = _pool_args(x, kernel_size, stride, padding, n)
    d = _expand(dilation, n)
    sizes = x.shape[-n:]
    pos, valid = [], []
    for sz, kk, ss, pp, dd in zip(sizes, k, s, p, d):
        out, _ = _pool_geometry(sz, kk, ss, pp, dd, ceil_mode)
        q = np.arange(out)[:, None] * ss + np.arange(kk)[None, :] * dd - pp
        pos.append(q)
        valid.append((q >= 0) & (q < sz))
    return _max_windows(x, *_windows(pos, valid, sizes), n)


@lower(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(x, kernel_size, stride=(), padding=(0,), dilation=(1,),
                            ceil_mode=False):
    return _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, 2)


@lower(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(x, kernel_size, stride=(), padding=(0,), dilation=(1,),
                            ceil_mode=False):
    return _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, 3)


def _max_backward(grad, x, indices, n):
    """Scatter-add grad to the flat input positions indices name."""
    S = math.prod(x.shape[-n:])
    g = _up(grad).reshape(math.prod(grad.shape[:-n]), math.prod(grad.shape[-n:]))
    idx = indices.reshape(g.shape)
    out = jnp.zeros((g.shape[0], S), g.dtype).at[jnp.arange(g.shape[0])[:, None], idx].add(g)
    return out.reshape(x.shape).astype(x.dtype)


@lower(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation,
                                     ceil_mode, indices):
    return _max_backward(grad, x, indices, 2)


@lower(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation,
                                     ceil_mode, indices):
    return _max_backward(grad, x, indices, 3)


def _adaptive_bounds(size, out):
    """Window i is [floor(i*size/out), ceil((i+1)*size/out))."""
    i = np.arange(out)
    return (i * size) // out, -(-((i + 1) * size) // out)


def _adaptive_avg(x, out_size):
    """Adaptive average over the last len(out_size) dims, one averaging matrix per dim."""
    mats = []
    for size, out in zip(x.shape[x.ndim - len(out_size):], out_size):
        a, b = _adaptive_bounds(size, out)
        j = np.arange(size)
        mats.append(((j >= a[:, None]) & (j < b[:, None])) / (b - a)[:, None])
    return _apply_mats(x, mats)


def _adaptive_avg3d_lowp(x, out_size):
    """PyTorch's contiguous CPU kernel for 3d bf16/f16: sums each window in the
    input dtype in window order, then divides by kd, kh, kw in turn, rounding
    every step."""
    sizes = x.shape[-3:]
    pos, valid, counts = [], [], []
    for size, out in zip(sizes, out_size):
        a, b = _adaptive_bounds(size, out)
        q = a[:, None] + np.arange(max(b - a))[None, :]
        pos.append(q)
        valid.append(q < b[:, None])
        counts.append((b - a).astype(np.float32))
    flat, ok = _windows(pos, valid, sizes)
    patches = _up(x).reshape(x.shape[:-3] + (math.prod(sizes),))[..., np.where(ok, flat, 0)]
    patches = jnp.where(ok, patches, 0)
    rnd = rounder(x.dtype)
    acc, _ = lax.scan(lambda c, v: (rnd(c + v), None), jnp.zeros(patches.shape[:-1], patches.dtype),
                      jnp.moveaxis(patches, -1, 0))
    for d, c in enumerate(counts):
        acc = rnd(acc / c.reshape([-1 if i == d else 1 for i in range(3)]))
    return acc.astype(x.dtype)


def _adaptive_avg_lowerings(op, op_backward, n):
    def forward(x, output_size):
        if n == 3 and _compute_dtype(x.dtype) != x.dtype:
            return _adaptive_avg3d_lowp(x, _expand(output_size, n))
        return _adaptive_avg(_up(x), _expand(output_size, n)).astype(x.dtype)

    def backward(grad, x):
        _, vjp = jax.vjp(lambda x_: _adaptive_avg(x_, grad.shape[-n:]), _up(x))
        return vjp(_up(grad))[0].astype(x.dtype)

    lower(op)(forward)
    lower(op_backward)(backward)


_adaptive_avg_lowerings(aten._adaptive_avg_pool2d.default,
                        aten._adaptive_avg_pool2d_backward.default, 2)
_adaptive_avg_lowerings(aten._adaptive_avg_pool3d.default,
                        aten._adaptive_avg_pool3d_backward.default, 3)


def _adaptive_max_lowerings(op, op_backward, n):
    def forward(x, output_size):
        sizes = x.shape[-n:]
        pos, valid = [], []
        for size, out in zip(sizes, _expand(output_size, n)):
            a, b = _adaptive_bounds(size, out)
            q = a[:, None] + np.arange(max(b - a))[None, :]
            pos.append(q)
            valid.append(q < b[:, None])
        return _max_windows(x, *_windows(pos, valid, sizes), n)

    def backward(grad, x, indices):
        return _max_backward(grad, x, indices, n)

    lower(op)(forward)
    lower(op_backward)(backward)


_adaptive_max_lowerings(aten.adaptive_max_pool2d.default,
                        aten.adaptive_max_pool2d_backward.default, 2)
_adaptive_max_lowerings(aten.adaptive_max_pool3d.default,
                        aten.adaptive_max_pool3d_backward.default, 3)


def _fractional_starts(sample, size, out, k):
    """Window starts per plane (..., out), PyTorch's generate_intervals in the
    samples' dtype: int((i + u) * alpha) - int(u * alpha), the last at size - k."""
    last = jnp.full(sample.shape + (1,), size - k, jnp.int64)
    if out == 1:
        return last
    dt = sample.dtype
    alpha = jnp.asarray(size - k, dt) / jnp.asarray(out - 1, dt)
    i = jnp.arange(out - 1).astype(dt)
    seq = (((i + sample[..., None]) * alpha).astype(jnp.int64)
           - (sample * alpha).astype(jnp.int64)[..., None])
    return jnp.concatenate([seq, last], axis=-1)


def _fractional_max_lowerings(op, op_backward, n, sample_dims):
    # sample_dims: which spatial dim each of a plane's samples drives.
    def forward(x, kernel_size, output_size, samples):
        sizes = x.shape[-n:]
        k, out = _expand(kernel_size, n), _expand(output_size, n)
        samples = samples.reshape(x.shape[:-n] + (n,))
        pos, valid = [None] * n, [None] * n
        for j, d in enumerate(sample_dims):
            starts = _fractional_starts(samples[..., j], sizes[d], out[d], k[d])
            pos[d] = starts[..., None] + jnp.arange(k[d])
            valid[d] = np.ones((out[d], k[d]), bool)
        return _max_windows(x, *_windows(pos, valid, sizes), n)

    def backward(grad, x, kernel_size, output_size, indices):
        return _max_backward(grad, x, indices, n)

    lower(op)(forward)
    lower(op_backward)(backward)


_fractional_max_lowerings(aten.fractional_max_pool2d.default,
                          aten.fractional_max_pool2d_backward.default, 2, (1, 0))
_fractional_max_lowerings(aten.fractional_max_pool3d.default,
                          aten.fractional_max_pool3d_backward.default, 3, (0, 1, 2))
