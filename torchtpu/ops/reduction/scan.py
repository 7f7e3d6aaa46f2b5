"""Scans along one dim: cumsum, cumprod, logcumsumexp, cummax and cummin."""
import jax.numpy as jnp
from jax import lax

from ..registry import lower
from ..util import KIND, ctx_dtype, promote
from .common import _acc, _isnan, _require

from ...compat import aten


def _scan(jfn):
    def lowering(x, dim, *, dtype=None):
        out = ctx_dtype()
        x = x.astype(_acc(out))
        if x.ndim == 0:
            return x.astype(out)
        return jfn(x, axis=dim % x.ndim).astype(out)
    return lowering


lower(aten.cumsum.default)(_scan(jnp.cumsum))
lower(aten.cumprod.default)(_scan(jnp.cumprod))


@lower(aten.logcumsumexp.default)
def logcumsumexp(x, dim):
    _require(jnp.issubdtype(x.dtype, jnp.inexact), NotImplementedError,
             f'"logcumsumexp_out_cpu" not implemented for \'{x.dtype}\'')
    (x,), res = promote(x, kind=KIND.INT_TO_FLOAT)
    if x.ndim == 0:
        return x.astype(res)
    return lax.associative_scan(jnp.logaddexp, x, axis=dim % x.ndim).astype(res)


def _cum_extreme(x, dim, better):
    """Running extreme with PyTorch's index rule: a later element wins on ties
    (>= / <=) and NaN, once seen, sticks (the latest NaN's index)."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    idx = lax.broadcasted_iota(jnp.int64, x.shape, dim)

    def combine(a, b):
        va, ia = a
        vb, ib = b
        take_b = _isnan(vb) | (~_isnan(va) & better(vb, va))
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)
    return lax.associative_scan(combine, (x, idx), axis=dim)


@lower(aten.cummax.default)
def cummax(x, dim):
    return _cum_extreme(x, dim, lambda b, a: b >= a)


@lower(aten.cummin.default)
def cummin(x, dim):
    return _cum_extreme(x, dim, lambda b, a: b <= a)
