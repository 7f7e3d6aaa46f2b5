"""Resampling: upsampling (nearest, nearest-exact, linear, bicubic,
antialiased) as one matrix per dim, and grid sampling, with their backwards."""
import itertools
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ..registry import lower
from ..util import rounder
from .common import _apply_mats, _up, aten


def _nearest_matrix(size, out, scale, exact=False):
    """(out, size) 0/1 matrix of PyTorch's nearest rule: src = floor(dst * scale)
    (nearest-exact: floor((dst + 0.5) * scale)), in float32 as on CPU."""
    s = np.float32(1.0 / scale) if scale else np.float32(size) / np.float32(out)
    dst = np.arange(out, dtype=np.float32) + (np.float32(0.5) if exact else np.float32(0))
    src = np.minimum(np.floor(dst * s).astype(np.int64), size - 1)
    m = np.zeros((out, size))
    m[np.arange(out), src] = 1.0
    return m


def _linear_matrix(size, out, align_corners, scale):
    """(out, size) weights of PyTorch's linear interpolation along one dim."""
    dst = np.arange(out, dtype=np.float64)
    if align_corners:
        src = dst * ((size - 1) / (out - 1) if out > 1 else 0.0)
    else:
        s = 1.0 / scale if scale else size / out
        src = np.maximum((dst + 0.5) * s - 0.5, 0.0)
    i0 = np.minimum(np.floor(src).astype(np.int64), size - 1)
    i1 = np.minimum(i0 + 1, size - 1)
    lam = src - i0
    m = np.zeros((out, size))
    np.add.at(m, (np.arange(out), i0), 1 - lam)
    np.add.at(m, (np.arange(out), i1), lam)
    return m


def _area_scale(size, out, align_corners, scale):
    """PyTorch's area_pixel_compute_scale."""
    if align_corners:
        return (size - 1) / (out - 1) if out > 1 else 0.0
    return 1.0 / scale if scale else size / out


def _cubic_conv(A):
    """Keys' cubic convolution pieces for |x| <= 1 and 1 < |x| < 2."""
    def near(x):
        return ((A + 2) * x - (A + 3)) * x * x + 1

    def far(x):
        return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A
    return near, far


def _cubic_matrix(size, out, align_corners, scale):
    """(out, size) weights of PyTorch's bicubic (A = -0.75) along one dim, with
    the taps clamped to the border."""
    s = _area_scale(size, out, align_corners, scale)
    dst = np.arange(out, dtype=np.float64)
    src = dst * s if align_corners else (dst + 0.5) * s - 0.5
    i0 = np.floor(src).astype(np.int64)
    t = src - i0
    near, far = _cubic_conv(-0.75)
    m = np.zeros((out, size))
    for k, w in enumerate((far(t + 1), near(t), near(1 - t), far(2 - t))):
        np.add.at(m, (np.arange(out), np.clip(i0 - 1 + k, 0, size - 1)), w)
    return m


def _aa_filter(mode):
    """PyTorch's antialias filters: (filter, half width in source pixels)."""
    if mode == "aa_linear":
        return (lambda x: np.maximum(0.0, 1.0 - np.abs(x))), 1.0
    near, far = _cubic_conv(-0.5)

    def cubic(x):
        x = np.abs(x)
        return np.where(x < 1, near(x), np.where(x < 2, far(x), 0.0))
    return cubic, 2.0


def _aa_matrix(mode, size, out, align_corners, scale):
    """(out, size) weights of PyTorch's antialiased resampling along one dim:
    the filter widened by the downscale factor, normalized per row."""
    filt, half = _aa_filter(mode)
    s = _area_scale(size, out, align_corners, scale)
    support = half * s if s >= 1.0 else half
    invscale = 1.0 / s if s >= 1.0 else 1.0
    m = np.zeros((out, size))
    for i in range(out):
        center = s * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), size)
        w = filt((np.arange(lo, hi) - center + 0.5) * invscale)
        total = w.sum()
        m[i, lo:hi] = w / total if total != 0 else w
    return m


def _resample_mats(mode, in_sizes, out_sizes, align_corners, scales):
    scales = list(scales) + [None] * (len(out_sizes) - len(scales))
    matrix = {"linear": _linear_matrix, "cubic": _cubic_matrix,
              "aa_linear": partial(_aa_matrix, "aa_linear"),
              "aa_cubic": partial(_aa_matrix, "aa_cubic")}.get(mode)
    if matrix is not None:
        return [matrix(i, o, align_corners, sc) for i, o, sc in zip(in_sizes, out_sizes, scales)]
    return [_nearest_matrix(i, o, sc, exact=mode == "exact")
            for i, o, sc in zip(in_sizes, out_sizes, scales)]

def _upsample_lowerings(op, op_backward, mode, nd):
    has_align = mode in ("linear", "cubic", "aa_linear", "aa_cubic")

    def forward(x, output_size, *rest):
        align = rest[0] if has_align else None
        scales = rest[1:] if has_align else rest
        mats = _resample_mats(mode, x.shape[-nd:], output_size, align, scales)
        return _apply_mats(x, mats).astype(x.dtype)

    def backward(grad, output_size, input_size, *rest):
        align = rest[0] if has_align else None
        scales = rest[1:] if has_align else rest
        mats = _resample_mats(mode, input_size[-nd:], output_size, align, scales)
        return _apply_mats(grad, mats, transpose=True).astype(grad.dtype)

    lower(op)(forward)
    lower(op_backward)(backward)


for _op, _bw, _mode, _nd in [
        (aten.upsample_nearest1d.default, aten.upsample_nearest1d_backward.default, "nearest", 1),
        (aten.upsample_nearest2d.default, aten.upsample_nearest2d_backward.default, "nearest", 2),
        (aten.upsample_nearest3d.default, aten.upsample_nearest3d_backward.default, "nearest", 3),
        (aten._upsample_nearest_exact1d.default, aten._upsample_nearest_exact1d_backward.default,
         "exact", 1),
        (aten._upsample_nearest_exact2d.default, aten._upsample_nearest_exact2d_backward.default,
         "exact", 2),
        (aten._upsample_nearest_exact3d.default, aten._upsample_nearest_exact3d_backward.default,
         "exact", 3),
        (aten.upsample_linear1d.default, aten.upsample_linear1d_backward.default, "linear", 1),
        (aten.upsample_bilinear2d.default, aten.upsample_bilinear2d_backward.default, "linear", 2),
        (aten.upsample_trilinear3d.default, aten.upsample_trilinear3d_backward.default, "linear", 3),
        (aten.upsample_bicubic2d.default, aten.upsample_bicubic2d_backward.default, "cubic", 2),
        (aten._upsample_bilinear2d_aa.default, aten._upsample_bilinear2d_aa_backward.default,
         "aa_linear", 2),
        (aten._upsample_bicubic2d_aa.default, aten._upsample_bicubic2d_aa_backward.default,
         "aa_cubic", 2)]:
    _upsample_lowerings(_op, _bw, _mode, _nd)


# ---- grid sampling ----------------------------------------------------------
# interpolation_mode 0/1/2 = bilinear/nearest/bicubic; padding_mode 0/1/2 =
# zeros/border/reflection, as PyTorch's GridSamplerInterpolation/Padding.

def _identity(v):
    return v


def _grid_unnormalize(c, size, align_corners, rnd):
    if align_corners:
        return rnd(rnd(rnd(c + 1) / 2) * (size - 1))
    return rnd(rnd(rnd(rnd(c + 1) * size) - 1) / 2)


def _grid_clip(c, size):
    # Zero gradient where clipped (ties included), as CPU's clip_coordinates_set_grad.
    return jnp.where(c <= 0, 0.0, jnp.where(c >= size - 1, size - 1.0, c)).astype(c.dtype)


def _grid_reflect(c, twice_low, twice_high, rnd):
    if twice_low == twice_high:
        return jnp.zeros_like(c)
    lo, span = twice_low / 2, (twice_high - twice_low) / 2
    c = rnd(c - lo)
    c = jnp.where(c < 0, -c, c)
    extra = rnd(jnp.fmod(c, span))
    flips = jnp.floor(rnd(c / span))
    return jnp.where(flips % 2 == 0, rnd(extra + lo), rnd(rnd(span - extra) + lo))


def _grid_pad(c, size, padding_mode, align_corners, rnd):
    if padding_mode == 1:
        return _grid_clip(c, size)
    if padding_mode == 2:
        c = (_grid_reflect(c, 0, 2 * (size - 1), rnd) if align_corners
             else _grid_reflect(c, -1, 2 * size - 1, rnd))
        return _grid_clip(c, size)
    return c


def _grid_taps(c, size, mode, padding_mode, align_corners, rnd):
    """The taps one grid coordinate reads along one dim: (index, weight)."""
    c = _grid_unnormalize(c, size, align_corners, rnd)
    if mode == 2:
        # Bicubic: each of the 4 taps goes through the padding on its own.
        i0 = jnp.floor(c)
        t = c - i0
        near, far = _cubic_conv(-0.75)
        pos = [jnp.trunc(_grid_pad(i0 - 1 + k, size, padding_mode, align_corners, rnd))
               for k in range(4)]
        return list(zip(pos, (far(t + 1), near(t), near(1 - t), far(2 - t))))
    c = _grid_pad(c, size, padding_mode, align_corners, rnd)
    if mode == 1:
        return [(jnp.round(c), jnp.ones_like(c))]
    i0 = jnp.floor(c)
    return [(i0, rnd(i0 + 1 - c)), (i0 + 1, rnd(c - i0))]


def _grid_sample(x, grid, mode, padding_mode, align_corners, rnd=_identity):
    """x (N, C, *S), grid (N, *O, nd) with the last dim in (x, y[, z]) order."""
    nd = grid.shape[-1]
    N, C, S = x.shape[0], x.shape[1], x.shape[2:]
    O = grid.shape[1:-1]
    xf = x.reshape(N, C, math.prod(S))
    per_dim = [_grid_taps(grid[..., nd - 1 - d], S[d], mode, padding_mode, align_corners, rnd)
               for d in range(nd)]
    out = jnp.zeros((N, C) + O, x.dtype)
    # Taps in CPU's order (the last dim fastest), weights multiplied x first.
    for combo in itertools.product(*per_dim):
        flat, w, ok = 0, 1, True
        for size, (i, _) in zip(S, combo):
            inside = (i >= 0) & (i <= size - 1)
            flat = flat * size + jnp.where(inside, i, 0).astype(jnp.int32)
            ok = ok & inside
        for _, wt in reversed(combo):
            w = rnd(w * wt)
        vals = jax.vmap(lambda xn, idx: xn[:, idx])(xf, flat.reshape(N, -1))
        out = rnd(out + rnd(vals.reshape((N, C) + O) * jnp.where(ok, w, 0)[:, None]))
    return out


@lower(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler(x, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(_up(x), _up(grid), interpolation_mode, padding_mode, align_corners,
                        rounder(x.dtype)).astype(x.dtype)


@lower(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def grid_sampler_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners,
                          output_mask):
    _, vjp = jax.vjp(lambda x_, g_: _grid_sample(x_, g_, interpolation_mode, padding_mode,
                                                 align_corners), _up(x), _up(grid))
    gx, gg = vjp(_up(grad))
    return (gx.astype(x.dtype) if output_mask[0] else None), gg.astype(grid.dtype)
