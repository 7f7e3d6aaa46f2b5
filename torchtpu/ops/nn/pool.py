"""Neural-network ops: convolution, pooling, normalization, softmax, losses.

Float work runs at full precision (Precision.HIGHEST) and bf16/f16 inputs
compute in float32, as PyTorch's CPU kernels do. Backward ops that have a
simple forward are lowered as the JAX vjp of that forward, so forward and
backward agree by construction.
"""
import itertools
import math
import warnings
from functools import partial
from functools import reduce as functools_reduce

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..registry import ctx, lower
from .. import random as rng
from ..util import ctx_dtype, rounder

aten = torch.ops.aten
HIGHEST = lax.Precision.HIGHEST


def _compute_dtype(dtype):
    """Low precision floats compute in float32."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype in (jnp.bfloat16, jnp.float16) else dtype


def _up(x):
    return x.astype(_compute_dtype(x.dtype))


def _out_shape(i=0):
    return tuple(ctx.out[i].shape)


# ---- convolution ------------------------------------------------------------

def _conv(x, w, stride, padding, dilation, transposed, output_padding, groups):
    """aten.convolution without bias, on (N, C, *spatial) inputs."""
    nd = x.ndim - 2
    spatial = "DHW"[3 - nd:] if nd <= 3 else None
    dn = lax.conv_dimension_numbers(x.shape, w.shape,
                                    ("NC" + spatial, "OI" + spatial, "NC" + spatial))
    acc = _compute_dtype(x.dtype)
    if not transposed:
        return lax.conv_general_dilated(
            x, w, window_strides=stride, padding=[(p, p) for p in padding],
            rhs_dilation=dilation, feature_group_count=groups, dimension_numbers=dn,
            precision=HIGHEST, preferred_element_type=acc)
    # A transposed convolution is the input-gradient of a convolution: dilate
    # the input by the stride, pad by dilation*(k-1)-p, and convolve with the
    # spatially flipped kernel with in/out channels swapped per group.
    cin, cout_g = w.shape[:2]
    k = w.shape[2:]
    w = w.reshape((groups, cin // groups, cout_g) + k)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + k)
    w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
    pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op)
            for kk, p, d, op in zip(k, padding, dilation, output_padding)]
    dn = lax.conv_dimension_numbers(x.shape, w.shape,
                                    ("NC" + spatial, "OI" + spatial, "NC" + spatial))
    return lax.conv_general_dilated(
        x, w, window_strides=(1,) * nd, padding=pads, lhs_dilation=stride,
        rhs_dilation=dilation, feature_group_count=groups, dimension_numbers=dn,
        precision=HIGHEST, preferred_element_type=acc)


def _expand(v, nd):
    v = list(v)
    return v * nd if len(v) == 1 else v


def _conv_args(x, stride, padding, dilation, output_padding):
    nd = x.ndim - 2
    return (_expand(stride, nd), _expand(padding, nd), _expand(dilation, nd),
            _expand(output_padding, nd))


@lower(aten.convolution.default)
def convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    unbatched = x.ndim == w.ndim - 1
    if unbatched:
        x = x[None]
    stride, padding, dilation, output_padding = _conv_args(x, stride, padding, dilation,
                                                           output_padding)
    out = _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + _up(bias).reshape((1, -1) + (1,) * (out.ndim - 2))
    out = out.astype(x.dtype)
    return out[0] if unbatched else out


@lower(aten.convolution_backward.default)
def convolution_backward(grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    stride, padding, dilation, output_padding = _conv_args(x, stride, padding, dilation,
                                                           output_padding)

    def f(x_, w_):
        return _conv(x_, w_, stride, padding, dilation, transposed, output_padding, groups)

    acc = _compute_dtype(x.dtype)
    out, vjp = jax.vjp(f, x.astype(acc), w.astype(acc))
    gx, gw = vjp(grad.astype(out.dtype))
    gb = jnp.sum(_up(grad), axis=(0,) + tuple(range(2, grad.ndim))) if output_mask[2] else None
    return (gx.astype(x.dtype) if output_mask[0] else None,
            gw.astype(w.dtype) if output_mask[1] else None,
            gb.astype(grad.dtype) if gb is not None else None)


# ---- pooling ----------------------------------------------------------------

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


# ---- softmax ----------------------------------------------------------------

# softmax.int / log_softmax.int decompose before dispatch; their lowerings
# serve the out= variants, which reach the dispatcher.
@lower(aten._softmax.default, aten.softmax.int)
def softmax(x, dim, half_to_float=None):
    return jax.nn.softmax(_up(x), axis=dim).astype(ctx_dtype())


@lower(aten._log_softmax.default, aten.log_softmax.int)
def log_softmax(x, dim, half_to_float=None):
    return jax.nn.log_softmax(_up(x), axis=dim).astype(ctx_dtype())


@lower(aten._softmax_backward_data.default)
def softmax_backward_data(grad, out, dim, input_dtype):
    g, o = _up(grad), _up(out)
    return (o * (g - jnp.sum(g * o, axis=dim, keepdims=True))).astype(ctx_dtype())


@lower(aten._log_softmax_backward_data.default)
def log_softmax_backward_data(grad, out, dim, input_dtype):
    g, o = _up(grad), _up(out)
    return (g - jnp.exp(o) * jnp.sum(g, axis=dim, keepdims=True)).astype(ctx_dtype())


# ---- attention ----------------------------------------------------------------
# scaled_dot_product_attention is a composite op. On a PrivateUse1 device
# PyTorch runs its math path: about 20 ops forward and 25 backward, ~1.3 ms
# of host time per call, and a fused backend for a device can only be chosen
# from C++. So torchtpu takes the op at its autograd key (device.py) and runs
# the math path's computation as one op each way: torchtpu::attention and
# torchtpu::attention_backward, defined here with their meta kernels. With
# dropout, both take the random state (seed, offset) of the call as dynamic
# scalars: backward draws the forward's mask again instead of keeping it.

_ATTENTION_ARGS = "Tensor? mask, bool is_causal, float scale, float dropout_p, Scalar seed, Scalar offset"
_ATTENTION_LIB = torch.library.Library("torchtpu", "DEF")
_ATTENTION_LIB.define(f"attention(Tensor q, Tensor k, Tensor v, {_ATTENTION_ARGS}) -> Tensor")
# mask_grad: whether to return the mask's gradient (else an empty tensor).
_ATTENTION_LIB.define(f"attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, {_ATTENTION_ARGS}, "
                      "bool mask_grad) -> (Tensor, Tensor, Tensor, Tensor)")
_ATTENTION_LIB.define("attention_dropout_keep(Tensor q, Tensor k, float dropout_p, Scalar seed, "
                      "Scalar offset) -> Tensor")
_ATTENTION_LIB.impl("attention", lambda q, k, v, *args: q.new_empty(q.shape[:-1] + v.shape[-1:]), "Meta")
_ATTENTION_LIB.impl("attention_backward", lambda grad, q, k, v, mask, *args: (
    torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
    torch.empty_like(mask) if args[-1] else q.new_empty(0)), "Meta")
_ATTENTION_LIB.impl("attention_dropout_keep", lambda q, k, *args: torch.empty(
    q.shape[:-1] + k.shape[-2:-1], dtype=torch.bool, device=q.device), "Meta")


def _dropout_keep(shape, dropout_p, seed, offset):
    """Which attention weights dropout keeps, keyed by the call's random state."""
    return rng.dropout_keep(rng.key_from(seed, offset), shape, dropout_p)


def _attention(q, k, v, mask, is_causal, scale, dropout_p, seed, offset):
    """The math path of scaled_dot_product_attention: bf16/f16 computed in
    float32 and rounded once at the end, as PyTorch's math path does; q and k
    each scaled by sqrt(|scale|); their product plus the mask (a bool mask as
    0/-inf), then -inf above the diagonal if is_causal; a softmax that gives
    0 on fully masked rows; dropout; the product with v. k and v with fewer
    heads than q (enable_gqa): each of their heads serves that many
    consecutive heads of q."""
    dtype = q.dtype
    q, k, v = _up(q), _up(k), _up(v)
    if k.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = jnp.repeat(k, group, axis=-3), jnp.repeat(v, group, axis=-3)
    root = math.sqrt(abs(scale))
    s = jnp.matmul(q * (-root if scale < 0 else root), jnp.swapaxes(k * root, -1, -2),
                   precision=HIGHEST)
    if mask is not None:
        s = s + (jnp.where(mask, 0, -jnp.inf).astype(s.dtype) if mask.dtype == jnp.bool_
                 else mask.astype(s.dtype))
    if is_causal:
        # With a mask as well, both apply (as on CPU; the math path refuses).
        s = jnp.where(jnp.tril(jnp.ones((q.shape[-2], k.shape[-2]), jnp.bool_)), s, -jnp.inf)
    # Softmax of a finite stand-in on fully masked rows: their gradient is 0,
    # not the NaN a softmax of -inf alone would give.
    masked = jnp.all(s == -jnp.inf, axis=-1, keepdims=True)
    p = jnp.where(masked, 0, jax.nn.softmax(jnp.where(masked, 0, s), axis=-1))
    if dropout_p >= 1:
        p = jnp.zeros_like(p)
    elif dropout_p > 0:
        p = jnp.where(_dropout_keep(p.shape, dropout_p, seed, offset), p * (1 / (1 - dropout_p)), 0)
    return jnp.matmul(p, v, precision=HIGHEST).astype(dtype)


@lower(torch.ops.torchtpu.attention.default)
def attention(q, k, v, mask, is_causal, scale, dropout_p, seed, offset):
    return _attention(q, k, v, mask, is_causal, scale, dropout_p, seed, offset)


@lower(torch.ops.torchtpu.attention_backward.default)
def attention_backward(grad, q, k, v, mask, is_causal, scale, dropout_p, seed, offset, mask_grad):
    def attend(q_, k_, v_, mask_=mask):
        return _attention(q_, k_, v_, mask_, is_causal, scale, dropout_p, seed, offset)
    grad = grad.astype(q.dtype)
    if mask_grad:
        return jax.vjp(attend, q, k, v, mask)[1](grad)
    return (*jax.vjp(attend, q, k, v)[1](grad), jnp.zeros((0,), q.dtype))


@lower(torch.ops.torchtpu.attention_dropout_keep.default)
def attention_dropout_keep(q, k, dropout_p, seed, offset):
    return _dropout_keep(q.shape[:-1] + k.shape[-2:-1], dropout_p, seed, offset)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, *args):
        ctx.save_for_backward(q, k, v, mask)
        ctx.args = args  # is_causal, scale, dropout_p, seed, offset
        return torch.ops.torchtpu.attention(q, k, v, mask, *args)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask = ctx.saved_tensors
        mask_grad = ctx.needs_input_grad[3]
        if torch.is_grad_enabled():
            # create_graph=True: gradients that are differentiable in turn,
            # through PyTorch's composite.
            wanted = (q, k, v, mask)
            inputs = [t for t, w in zip(wanted, ctx.needs_input_grad) if w]
            grads = iter(torch.autograd.grad(_composite_attention(q, k, v, mask, *ctx.args),
                                             inputs, grad, create_graph=True))
            grads = tuple(next(grads) if w else None for w in ctx.needs_input_grad[:4])
        else:
            grads = torch.ops.torchtpu.attention_backward(grad, q, k, v, mask, *ctx.args, mask_grad)
            grads = grads[:3] + (grads[3] if mask_grad else None,)
        return grads + (None,) * len(ctx.args)


def _composite_attention(q, k, v, mask, is_causal, scale, dropout_p, seed, offset):
    """The same attention through PyTorch's math path, op by op: a bool mask
    as 0/-inf (as scaled_dot_product_attention gives it to the math path), a
    causal mask folded into it (the math path takes one of them), the dropout
    mask the one op draws."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    if is_causal and mask is not None:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = mask.masked_fill(~causal, float("-inf"))
        is_causal = False
    keep = None
    if dropout_p > 0:
        keep = torch.ops.torchtpu.attention_dropout_keep(q, k, dropout_p, seed, offset)
    with warnings.catch_warnings():
        # Its note that an explicit dropout mask is meant for tests.
        warnings.simplefilter("ignore")
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, mask, dropout_p, is_causal, dropout_mask=keep, scale=scale,
            enable_gqa=q.dim() >= 3 and q.shape[-3] != k.shape[-3])[0]


def _attention_applies(q, k, v, mask, dropout_p, is_causal, enable_gqa):
    """Whether one attention op computes this call as the math path would;
    other calls (a batch that broadcasts, invalid input, heads that differ
    without enable_gqa, a mask that needs a gradient with is_causal, which
    the math path refuses) take PyTorch's composite, its checks and errors
    included."""
    if not (0.0 <= dropout_p <= 1.0) or not q.is_floating_point():
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dim() == k.dim() == v.dim() >= 2):
        return False
    same_heads = q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
    if not same_heads and enable_gqa and q.dim() >= 3:
        # Grouped-query attention: k and v have fewer heads.
        same_heads = (q.shape[:-3] == k.shape[:-3] == v.shape[:-3] and k.shape[-3] == v.shape[-3]
                      and k.shape[-3] > 0 and q.shape[-3] % k.shape[-3] == 0)
    if not (same_heads and q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2]):
        return False
    if mask is None:
        return True
    if (mask.requires_grad and is_causal) or mask.device != q.device or mask.dtype not in (
            torch.bool, torch.float32, q.dtype):
        return False
    try:
        return torch.broadcast_shapes(mask.shape, q.shape[:-1] + k.shape[-2:-1]) == q.shape[:-1] + k.shape[-2:-1]
    except RuntimeError:
        return False


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                 scale=None, enable_gqa=False):
    """aten.scaled_dot_product_attention at the tpu autograd key."""
    if not _attention_applies(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa):
        return torch.ops.aten.scaled_dot_product_attention.default.decompose(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    dropout_p = float(dropout_p)
    # The random state this call draws its dropout mask with (none without).
    seed, offset = rng.next_key() if dropout_p > 0 else (0, 0)
    args = (is_causal, scale, dropout_p, seed, offset)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, attn_mask)):
        return _Attention.apply(q, k, v, attn_mask, *args)
    return torch.ops.torchtpu.attention(q, k, v, attn_mask, *args)


# ---- normalization ----------------------------------------------------------

def _bcast_channel(v, ndim):
    """A per-channel vector shaped to broadcast over (N, C, *spatial)."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _batch_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - _bcast_channel(mean, x.ndim)), axis=axes)
    return mean, var, math.prod(x.shape[a] for a in axes)


def _bn_apply(x, mean, invstd, weight, bias):
    out = (x - _bcast_channel(mean, x.ndim)) * _bcast_channel(invstd, x.ndim)
    if weight is not None:
        out = out * _bcast_channel(_up(weight), x.ndim)
    if bias is not None:
        out = out + _bcast_channel(_up(bias), x.ndim)
    return out


def _bn_train(x, weight, bias, running_mean, running_var, momentum, eps):
    xs = _up(x)
    mean, var, n = _batch_stats(xs)
    invstd = lax.rsqrt(var + eps)
    out = _bn_apply(xs, mean, invstd, weight, bias).astype(x.dtype)
    new_rm = new_rv = None
    if running_mean is not None:
        new_rm = ((1 - momentum) * _up(running_mean) + momentum * mean).astype(running_mean.dtype)
    if running_var is not None:
        unbiased = var * (n / max(n - 1, 1))
        new_rv = ((1 - momentum) * _up(running_var) + momentum * unbiased).astype(running_var.dtype)
    return out, mean, invstd, new_rm, new_rv


@lower(aten._native_batch_norm_legit_functional.default)
def batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        out, mean, invstd, rm, rv = _bn_train(x, weight, bias, running_mean, running_var,
                                              momentum, eps)
        return out, mean, invstd, rm, rv
    out, mean, invstd = batch_norm_no_training(x, weight, bias, running_mean, running_var,
                                               momentum, eps)
    return out, mean, invstd, running_mean, running_var


@lower(aten._native_batch_norm_legit.no_stats)
def batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    out, mean, invstd, _, _ = _bn_train(x, weight, bias, None, None, momentum, eps)
    return out, mean, invstd


@lower(aten._native_batch_norm_legit_no_training.default)
def batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    xs = _up(x)
    invstd = lax.rsqrt(_up(running_var) + eps)
    out = _bn_apply(xs, _up(running_mean), invstd, weight, bias).astype(x.dtype)
    return out, jnp.zeros((0,), xs.dtype), jnp.zeros((0,), xs.dtype)


def _stats_dtypes(meta_dtypes, x, *params, **kwargs):
    # CPU keeps the saved mean/invstd in the input's dtype unless a parameter
    # has another dtype (then float32); the meta kernels always say float32.
    tensors = [p for p in params if isinstance(p, torch.Tensor)]
    if all(p.dtype == x.dtype for p in tensors):
        return [meta_dtypes[0], x.dtype, x.dtype, *meta_dtypes[3:]]
    return meta_dtypes


for _fn in (batch_norm_functional, batch_norm_no_stats, batch_norm_no_training):
    _fn.result_dtypes = _stats_dtypes


@lower(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean,
                               save_invstd, train, eps, output_mask):
    xs, g = _up(x), _up(grad)
    axes = (0,) + tuple(range(2, x.ndim))
    if train:
        mean, invstd = _up(save_mean), _up(save_invstd)
    else:
        mean, invstd = _up(running_mean), lax.rsqrt(_up(running_var) + eps)
    xhat = (xs - _bcast_channel(mean, x.ndim)) * _bcast_channel(invstd, x.ndim)
    gb = jnp.sum(g, axis=axes)
    gw = jnp.sum(g * xhat, axis=axes)
    w = _up(weight) if weight is not None else jnp.ones_like(mean)
    scale = _bcast_channel(w * invstd, x.ndim)
    if train:
        n = math.prod(x.shape[a] for a in axes)
        gi = scale * (g - _bcast_channel(gb / n, x.ndim) - xhat * _bcast_channel(gw / n, x.ndim))
    else:
        gi = g * scale
    wdt = weight.dtype if weight is not None else x.dtype
    return (gi.astype(x.dtype) if output_mask[0] else None,
            gw.astype(wdt) if output_mask[1] else None,
            gb.astype(wdt) if output_mask[2] else None)


def _layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * _up(weight)
    if bias is not None:
        out = out + _up(bias)
    return out, mean, rstd


@lower(aten.native_layer_norm.default)
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    out, mean, rstd = _layer_norm(_up(x), normalized_shape, weight, bias, eps)
    return out.astype(x.dtype), mean, rstd


native_layer_norm.result_dtypes = _stats_dtypes


def _norm_input_grad(gxhat, xhat, rstd, axes):
    """d(loss)/dx of xhat = (x - mean) * rstd with the statistics over axes."""
    m = math.prod(gxhat.shape[a] for a in axes)
    s1 = jnp.sum(gxhat, axis=axes, keepdims=True)
    s2 = jnp.sum(gxhat * xhat, axis=axes, keepdims=True)
    return rstd * (gxhat - s1 / m - xhat * (s2 / m))


@lower(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias,
                               output_mask):
    g = _up(grad)
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    lead = tuple(range(x.ndim - len(normalized_shape)))
    xhat = (_up(x) - _up(mean)) * _up(rstd)
    gxhat = g * _up(weight) if weight is not None else g
    gx = _norm_input_grad(gxhat, xhat, _up(rstd), axes) if output_mask[0] else None
    gw = jnp.sum(g * xhat, axis=lead) if output_mask[1] and weight is not None else None
    gb = jnp.sum(g, axis=lead) if output_mask[2] and bias is not None else None
    return (gx.astype(x.dtype) if gx is not None else None,
            gw.astype(weight.dtype) if gw is not None else None,
            gb.astype(bias.dtype) if gb is not None else None)


def _group_norm(x, weight, bias, N, C, group, eps):
    xs = x.reshape(N, group, -1)
    mean = jnp.mean(xs, axis=-1)
    var = jnp.mean(jnp.square(xs - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    out = ((xs - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    if weight is not None:
        out = out * _bcast_channel(weight, x.ndim)
    if bias is not None:
        out = out + _bcast_channel(bias, x.ndim)
    return out, mean, rstd


@lower(aten.native_group_norm.default)
def native_group_norm(x, weight, bias, N, C, HxW, group, eps):
    w = _up(weight) if weight is not None else None
    b = _up(bias) if bias is not None else None
    out, mean, rstd = _group_norm(_up(x), w, b, N, C, group, eps)
    return out.astype(x.dtype), mean, rstd


@lower(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad, x, mean, rstd, weight, N, C, HxW, group, output_mask):
    g = _up(grad)
    xg = _up(x).reshape(N, group, -1)
    m, r = _up(mean)[..., None], _up(rstd)[..., None]
    xhat = (xg - m) * r
    gxhat = g * _bcast_channel(_up(weight), x.ndim) if weight is not None else g
    gx = _norm_input_grad(gxhat.reshape(N, group, -1), xhat, r, (2,)).reshape(x.shape)
    axes = (0,) + tuple(range(2, x.ndim))
    gw = jnp.sum(g * xhat.reshape(x.shape), axis=axes)
    gb = jnp.sum(g, axis=axes)
    wdt = weight.dtype if weight is not None else x.dtype
    return (gx.astype(x.dtype) if output_mask[0] else None,
            gw.astype(wdt) if output_mask[1] else None,
            gb.astype(wdt) if output_mask[2] else None)


# ---- losses -----------------------------------------------------------------

def _nll_parts(x, target, weight, ignore_index):
    """Per-element weights (0 where ignored) and the picked log-probabilities."""
    cdim = 1 if x.ndim >= 2 else 0
    valid = target != ignore_index
    safe = jnp.where(valid, target, 0)
    w = (_up(weight)[safe] if weight is not None else jnp.ones(safe.shape, _up(x).dtype))
    w = jnp.where(valid, w, 0)
    picked = jnp.take_along_axis(_up(x), jnp.expand_dims(safe, cdim), axis=cdim)
    return w, jnp.squeeze(picked, cdim), safe, cdim


@lower(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    w, picked, _, _ = _nll_parts(x, target, weight, ignore_index)
    losses = -picked * w
    total = jnp.sum(w)
    if reduction == 0:
        return losses.astype(x.dtype), jnp.zeros((), x.dtype)
    s = jnp.sum(losses)
    out = s / total if reduction == 1 else s
    return out.astype(x.dtype), total.astype(x.dtype)


@lower(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    w, _, safe, cdim = _nll_parts(x, target, weight, ignore_index)
    g = _up(grad)
    if reduction == 1:
        g = g / _up(total_weight)
    contrib = -w * g
    onehot = jax.nn.one_hot(safe, x.shape[cdim], axis=cdim, dtype=contrib.dtype)
    return (onehot * jnp.expand_dims(contrib, cdim)).astype(x.dtype)


def _reduce_loss(losses, reduction):
    if reduction == 1:
        return jnp.mean(losses)
    return jnp.sum(losses) if reduction == 2 else losses


def _multi_margin(x, target, p, margin, weight, reduction):
    """sum over i != y of w[y] * max(0, margin - x[y] + x[i])^p, over C."""
    x2 = x.reshape(-1, x.shape[-1] if x.ndim else 1)
    t = target.reshape(-1)
    xy = jnp.take_along_axis(x2, t[:, None], axis=1)
    z = margin - xy + x2
    # Strictly positive margins count (zero gradient at z == 0, as on CPU).
    h = jnp.where(z > 0, z if p == 1 else z * z, 0)
    h = jnp.where(jnp.arange(x2.shape[1]) == t[:, None], 0, h)
    if weight is not None:
        h = h * _up(weight)[t][:, None]
    losses = jnp.sum(h, axis=1) / x2.shape[1]
    return _reduce_loss(losses.reshape(target.shape), reduction)


@lower(aten.multi_margin_loss.default)
def multi_margin_loss(x, target, p=1, margin=1, weight=None, reduction=1):
    return _multi_margin(_up(x), target, p, margin, weight, reduction).astype(x.dtype)


multi_margin_loss.static_args = ("p",)


@lower(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward(grad, x, target, p, margin, weight=None, reduction=1):
    _, vjp = jax.vjp(lambda x_: _multi_margin(x_, target, p, margin, weight, reduction), _up(x))
    return vjp(_up(grad))[0].astype(x.dtype)


multi_margin_loss_backward.static_args = ("p",)


def _multilabel_margin(x, target, reduction):
    """Targets are the class indices before the first -1; the loss sums
    max(0, 1 - (x[target] - x[other])) over target/non-target pairs, over C."""
    C = x.shape[-1] if x.ndim else 1
    x2, t = x.reshape(-1, C), target.reshape(-1, C)
    valid = jnp.cumprod(t >= 0, axis=1).astype(bool)
    safe = jnp.where(valid, t, 0)
    is_target = jnp.any(valid[:, :, None] & (safe[:, :, None] == jnp.arange(C)), axis=1)
    xy = jnp.take_along_axis(x2, safe, axis=1)
    z = 1 - xy[:, :, None] + x2[:, None, :]
    h = jnp.where((z > 0) & valid[:, :, None] & ~is_target[:, None, :], z, 0)
    losses = jnp.sum(h, axis=(1, 2)) / C
    return (_reduce_loss(losses.reshape(target.shape[:-1] if target.ndim else ()), reduction),
            is_target.reshape(target.shape))


@lower(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(x, target, reduction):
    out, is_target = _multilabel_margin(_up(x), target, reduction)
    return out.astype(x.dtype), is_target.astype(x.dtype)


@lower(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad, x, target, reduction, is_target):
    _, vjp = jax.vjp(lambda x_: _multilabel_margin(x_, target, reduction)[0], _up(x))
    return vjp(_up(grad))[0].astype(x.dtype)


# ---- CTC loss ---------------------------------------------------------------
# _ctc_loss_backward is left to PyTorch's CPU kernel: its gradient,
# exp(lp) - exp(lcab + nll - lp), cancels terms of size |nll| (hundreds) in
# float32, so XLA's exp/log (a few ulps off glibc's) move results by ~1e-4
# relative, past OpInfo's tolerance. It reads this forward's nll and
# log_alpha (only t < input length, s < 2*target length + 1).

def _lse(*xs):
    """log(sum(exp(xs))) as CPU's CTC computes it (max shifted, 0 when all are
    -inf), -inf with a zero gradient when every term is -inf."""
    m = functools_reduce(jnp.maximum, xs)
    m = lax.stop_gradient(jnp.where(jnp.isneginf(m), 0, m))
    total = sum(jnp.exp(x - m) for x in xs)
    pos = total > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, total, 1)) + m, -jnp.inf)


def _ctc_labels(targets, tl, blank, max_tl, N):
    """The extended label sequence l' (N, 2*max_tl+1): blanks around each target."""
    if targets.ndim == 1:
        # Concatenated targets: sample n's start at the sum of the earlier lengths.
        starts = jnp.cumsum(tl) - tl
        j = starts[:, None] + jnp.arange(max_tl)
        targets = targets[jnp.clip(j, 0, max(targets.shape[0] - 1, 0))]
    s = jnp.arange(2 * max_tl + 1)
    if not max_tl:
        return jnp.full((N, 1), blank, jnp.int64)
    return jnp.where(s % 2 == 1, targets[:, jnp.clip((s - 1) // 2, 0, max_tl - 1)],
                     blank).astype(jnp.int64)


def _ctc(lp, targets, il, tl, blank, max_tl):
    """(neg log likelihood (N,), log_alpha (N, T, 2*max_tl+1)) of log_probs (T, N, C)."""
    T, N, _ = lp.shape
    il, tl = jnp.asarray(il, jnp.int64), jnp.asarray(tl, jnp.int64)
    lab = _ctc_labels(targets, tl, blank, max_tl, N)
    S = lab.shape[1]
    s = jnp.arange(S)
    prev2 = jnp.concatenate([jnp.full((N, 2), -1, lab.dtype), lab[:, :-2]], axis=1)
    skip = (s % 2 == 1) & (s >= 2) & (lab != prev2)
    inside = s < 2 * tl[:, None] + 1
    lp_lab = jnp.take_along_axis(lp, jnp.broadcast_to(lab, (T, N, S)), axis=2)
    neg = jnp.asarray(-jnp.inf, lp.dtype)
    a0 = jnp.where(inside & ((s == 0) | ((s == 1) & (tl[:, None] > 0))), lp_lab[0], neg)

    def shift(a, k):
        return jnp.concatenate([jnp.full((N, k), neg), a[:, :-k]], axis=1)

    def step(a, xs):
        lpt, t = xs
        new = _lse(a, shift(a, 1), jnp.where(skip, shift(a, 2), neg)) + lpt
        new = jnp.where(inside, new, neg)
        # Past its input length a sample's alphas stay put.
        new = jnp.where((t < il)[:, None], new, a)
        return new, new

    last, rest = lax.scan(step, a0, (lp_lab[1:], jnp.arange(1, T)))
    log_alpha = jnp.moveaxis(jnp.concatenate([a0[None], rest], axis=0), 0, 1)
    end = jnp.take_along_axis(last, jnp.stack([2 * tl, jnp.maximum(2 * tl - 1, 0)], 1), axis=1)
    nll = -_lse(end[:, 0], jnp.where(tl > 0, end[:, 1], neg))
    return nll, log_alpha


@lower(aten._ctc_loss.default, aten._ctc_loss.Tensor)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    if ctx.out is not None:
        max_tl = (ctx.out[1].shape[-1] - 1) // 2
    else:
        # Lengths given as tensors: log_alpha's width 2*max(target_lengths)+1
        # depends on their values, so it is sized for the longest possible target.
        max_tl = targets.shape[-1] if targets.ndim == 2 else targets.shape[0]
    nll, log_alpha = _ctc(_up(log_probs), targets, input_lengths, target_lengths, blank, max_tl)
    return nll.astype(log_probs.dtype), log_alpha.astype(log_probs.dtype)


# ---- embedding_bag ----------------------------------------------------------
# mode 0/1/2 = sum/mean/max; padding_idx -1 = none.

def _bag_layout(indices, offsets, num_bags, padding_idx):
    """Each index's bag, and whether it counts (inside a bag, not padding)."""
    L = indices.shape[0]
    pos = jnp.arange(L)
    bag = jnp.searchsorted(offsets[:num_bags], pos, side="right") - 1
    end = offsets[num_bags] if offsets.shape[0] > num_bags else L
    valid = (pos < end) & (bag >= 0)
    if padding_idx >= 0:
        valid = valid & (indices != padding_idx)
    return jnp.clip(bag, 0, max(num_bags - 1, 0)), valid


def _bag_counts(bag, valid, num_bags):
    return jax.ops.segment_sum(valid.astype(jnp.int64), bag, num_bags)


@lower(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    B = offsets.shape[0] - (1 if include_last_offset else 0)
    L = indices.shape[0]
    bag, valid = _bag_layout(indices, offsets, B, padding_idx)
    counts = _bag_counts(bag, valid, B)
    rows = _up(weight)[indices]
    if per_sample_weights is not None:
        rows = rows * _up(per_sample_weights)[:, None]
    if mode == 2:
        # The first maximum of each bag and feature (CPU's order); empty bags give 0.
        vals = jnp.where(valid[:, None], rows, -jnp.inf)
        best = jax.ops.segment_max(vals, bag, B)
        hit = valid[:, None] & (vals == best[bag])
        first = jax.ops.segment_min(jnp.where(hit, jnp.arange(L)[:, None], L), bag, B)
        empty = (counts == 0)[:, None]
        safe = jnp.where(empty, 0, first)
        out = jnp.where(empty, 0, jnp.take_along_axis(rows, safe, axis=0))
        max_indices = jnp.where(empty, 0, indices[safe])
    else:
        out = jax.ops.segment_sum(jnp.where(valid[:, None], rows, 0), bag, B)
        if mode == 1:
            out = out / jnp.maximum(counts, 1)[:, None]
    # offset2bag, bag_size and max_indices as PyTorch's CPU kernel leaves them.
    fast_sum = mode == 0 and padding_idx < 0 and _compute_dtype(weight.dtype) == jnp.float32
    offset2bag = jnp.zeros((0,), jnp.int64) if fast_sum else bag.astype(jnp.int64)
    bag_size = jnp.zeros((B,), jnp.int64) if mode == 0 else counts
    if mode != 2:
        max_indices = bag_size
    return out.astype(weight.dtype), offset2bag, bag_size, max_indices


@lower(aten._embedding_bag_backward.default)
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices,
                           num_weights, scale_grad_by_freq, mode, sparse, per_sample_weights,
                           padding_idx=-1):
    B, D = grad.shape
    g = _up(grad)
    bag, valid = _bag_layout(indices, offsets, B, padding_idx)
    if mode == 2:
        counts = _bag_counts(bag, valid, B)
        contrib = jnp.where((counts > 0)[:, None], g, 0)
        out = jnp.zeros((num_weights, D), g.dtype).at[maximum_indices, jnp.arange(D)].add(contrib)
        return out.astype(grad.dtype)
    rows = g[bag]
    if per_sample_weights is not None:
        rows = rows * _up(per_sample_weights)[:, None]
    if mode == 1:
        rows = rows / jnp.maximum(_bag_counts(bag, valid, B), 1)[bag][:, None]
    if scale_grad_by_freq:
        # PyTorch's CPU kernel scales the k-th distinct index (in sorted order)
        # by the frequency of sorted(indices)[k], not of the index itself.
        freq = jnp.zeros((num_weights,), g.dtype).at[indices].add(1)
        rank = jnp.cumsum(freq > 0) - 1
        rows = rows / freq[jnp.sort(indices)[rank[indices]]][:, None]
    out = jnp.zeros((num_weights, D), g.dtype).at[indices].add(jnp.where(valid[:, None], rows, 0))
    return out.astype(grad.dtype)


embedding_bag_backward.accepts = lambda *a, **k: not (a[9] if len(a) > 9 else k.get("sparse"))


@lower(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode,
                                              padding_idx=-1):
    bag, valid = _bag_layout(indices, offsets, grad.shape[0], padding_idx)
    out = jnp.sum(_up(grad)[bag] * _up(weight)[indices], axis=1)
    return jnp.where(valid, out, 0).astype(grad.dtype)


@lower(aten.native_dropout_backward.default)
def native_dropout_backward(grad, mask, scale):
    return (grad * mask.astype(grad.dtype) * jnp.asarray(scale).astype(grad.dtype)).astype(
        grad.dtype)


# ---- activations and products ----------------------------------------------

@lower(aten.rrelu_with_noise_functional.default, random=True)
def rrelu_with_noise_functional(x, noise, lower=0.125, upper=1.0 / 3, training=False,
                                generator=None, *, key):
    """Training: each x <= 0 is scaled by r ~ U(lower, upper), the noise keeps
    r (1 elsewhere); otherwise a leaky relu of slope (lower + upper) / 2 that
    leaves the noise alone. rrelu_with_noise (which writes noise) runs
    through this."""
    xs = _up(x)
    if not training:
        return jnp.where(xs >= 0, xs, xs * ((lower + upper) / 2)).astype(x.dtype), noise
    r = jax.random.uniform(key, x.shape, xs.dtype) * (upper - lower) + lower
    r = jnp.where(xs <= 0, r, 1)
    return (xs * r).astype(x.dtype), r.astype(noise.dtype)


@lower(aten._trilinear.default)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """sum over sumdim of i1 * i2 * i3, each with size-1 dims inserted at its
    expand positions."""
    ndim = i1.ndim + len(expand1)
    ins = [(_up(t), set(e)) for t, e in ((i1, expand1), (i2, expand2), (i3, expand3))]
    sizes = [1] * ndim
    for t, e in ins:
        kept = [d for d in range(ndim) if d not in e]
        for d, n in zip(kept, t.shape):
            if n != 1:
                sizes[d] = n
    letters = "abcdefghijklmnopqrstuvwxyz"
    operands, subs = [], []
    for t, e in ins:
        kept = [d for d in range(ndim) if d not in e]
        operands.append(jnp.broadcast_to(t, tuple(sizes[d] for d in kept)))
        subs.append("".join(letters[d] for d in kept))
    out = "".join(letters[d] for d in range(ndim) if d not in set(sumdim))
    res = jnp.einsum(",".join(subs) + "->" + out, *operands, precision=HIGHEST)
    # A dim no input has stays size 1 (unless summed).
    res = res.reshape(tuple(sizes[d] for d in range(ndim) if d not in set(sumdim)))
    return res.astype(ctx_dtype())


# ---- recurrent cells --------------------------------------------------------

@lower(aten._thnn_fused_lstm_cell.default)
def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = _up(input_gates) + _up(hidden_gates)
    if input_bias is not None:
        gates = gates + _up(input_bias)
    if hidden_bias is not None:
        gates = gates + _up(hidden_bias)
    i, f, g, o = jnp.split(gates, 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * _up(cx) + i * g
    hy = o * jnp.tanh(cy)
    # The workspace keeps the activated gates for the backward, as CUDA's does.
    workspace = jnp.concatenate([i, f, g, o], axis=-1)
    dt = cx.dtype
    return hy.astype(dt), cy.astype(dt), workspace.astype(dt)


@lower(aten._thnn_fused_lstm_cell_backward_impl.default)
def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = jnp.split(_up(workspace), 4, axis=-1)
    c = _up(cy)
    gh = _up(grad_hy) if grad_hy is not None else jnp.zeros_like(c)
    gc = _up(grad_cy) if grad_cy is not None else jnp.zeros_like(c)
    tanh_c = jnp.tanh(c)
    gcy = gh * o * (1 - tanh_c * tanh_c) + gc
    go = gh * tanh_c * o * (1 - o)
    gi = gcy * g * i * (1 - i)
    gg = gcy * i * (1 - g * g)
    gf = gcy * _up(cx) * f * (1 - f)
    grad_gates = jnp.concatenate([gi, gf, gg, go], axis=-1)
    grad_cx = gcy * f
    grad_bias = jnp.sum(grad_gates, axis=0).astype(cx.dtype) if has_bias else None
    return grad_gates.astype(cx.dtype), grad_cx.astype(cx.dtype), grad_bias


# ---- resampling -------------------------------------------------------------

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


def _apply_mats(x, mats, transpose=False):
    """Apply one (out, in) matrix per trailing dim (its transpose for backward)."""
    x = _up(x)
    for i, m in enumerate(mats):
        axis = x.ndim - len(mats) + i
        m = jnp.asarray(m.T if transpose else m, x.dtype)
        x = jnp.moveaxis(jnp.tensordot(x, m, axes=([axis], [1]), precision=HIGHEST), -1, axis)
    return x


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
