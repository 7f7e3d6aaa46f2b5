"""FFTs: the three aten primitives every torch.fft function reduces to.

Transforms run unnormalized and are then scaled as PyTorch's fft_norm_mode
says (0: none, 1: 1/sqrt(n), 2: 1/n), n being the product of the signal's
sizes along the transformed dims: the input's for r2c and c2c, the output's
(last_dim_size along the last dim) for c2r, as in aten/native/SpectralOps.cpp.
"""
import math

import jax.numpy as jnp

from .registry import lower
from .util import ctx_dtype

from ..compat import aten


def _dims(x, dim):
    return tuple(d % x.ndim for d in dim) if x.ndim else tuple(dim)


def _scale(out, n, normalization):
    if normalization == 1:
        return out * (1 / math.sqrt(n))
    if normalization == 2:
        return out * (1 / n)
    return out


def _size(shape, dims):
    return math.prod(shape[d] for d in dims)


@lower(aten._fft_r2c.default)
def fft_r2c(x, dim, normalization, onesided):
    dims = _dims(x, dim)
    res = ctx_dtype()
    # Compute in the real counterpart of the output dtype: float32 in, complex64 out.
    x = x.astype(jnp.finfo(res).dtype)
    if not dims:
        return x.astype(res)
    out = jnp.fft.rfftn(x, axes=dims) if onesided else jnp.fft.fftn(x.astype(res), axes=dims)
    return _scale(out, _size(x.shape, dims), normalization).astype(res)


@lower(aten._fft_c2r.default)
def fft_c2r(x, dim, normalization, last_dim_size):
    dims = _dims(x, dim)
    res = ctx_dtype()
    x = x.astype(jnp.result_type(res, jnp.complex64))
    sizes = [x.shape[d] for d in dims[:-1]] + [last_dim_size]
    # norm="forward" leaves the inverse transform unscaled.
    out = jnp.fft.irfftn(x, s=sizes, axes=dims, norm="forward")
    return _scale(out, math.prod(sizes), normalization).astype(res)


@lower(aten._fft_c2c.default)
def fft_c2c(x, dim, normalization, forward):
    dims = _dims(x, dim)
    res = ctx_dtype()
    x = x.astype(res)
    if not dims:
        return x
    out = jnp.fft.fftn(x, axes=dims) if forward else jnp.fft.ifftn(x, axes=dims, norm="forward")
    return _scale(out, _size(x.shape, dims), normalization).astype(res)
