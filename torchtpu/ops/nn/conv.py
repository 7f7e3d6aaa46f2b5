"""Convolution (plain and transposed, any groups) and its backward, the
backward as the JAX vjp of the forward."""
import jax
import jax.numpy as jnp
from jax import lax

from ..registry import lower
from ..util import matmul_precision
from .common import _compute_dtype, _expand, _up, aten


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
            precision=matmul_precision(), preferred_element_type=acc)
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
        precision=matmul_precision(), preferred_element_type=acc)

def _conv_args(x, stride, padding, dilation, output_padding):
    nd = x.ndim - 2
    return (_expand(stride, nd), _expand(padding, nd), _expand(dilation, nd),
            _expand(output_padding, nd))


@lower(aten.convolution.default, matmul=True)
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


@lower(aten.convolution_backward.default, matmul=True)
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
