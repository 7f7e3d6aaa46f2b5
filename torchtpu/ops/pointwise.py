"""Pointwise math and comparisons."""
import jax.numpy as jnp
import torch
from jax import lax

from . import lower
from .util import KIND, cast, promote

aten = torch.ops.aten


def _unary(jfn, kind=KIND.INT_TO_FLOAT):
    def lowering(x):
        (x,), res = promote(x, kind=kind)
        return jfn(x).astype(res)
    return lowering


def _binary(jfn, kind=KIND.DEFAULT):
    def lowering(a, b):
        (a, b), res = promote(a, b, kind=kind)
        return jfn(a, b).astype(res)
    return lowering


for _op, _fn in [(aten.exp, jnp.exp), (aten.log, jnp.log), (aten.sqrt, jnp.sqrt),
                 (aten.rsqrt, lax.rsqrt), (aten.tanh, jnp.tanh), (aten.sin, jnp.sin),
                 (aten.cos, jnp.cos), (aten.sigmoid, lambda x: 1 / (1 + jnp.exp(-x))),
                 (aten.erf, lax.erf), (aten.log1p, jnp.log1p), (aten.expm1, jnp.expm1)]:
    lower(_op.default)(_unary(_fn))

for _op, _fn in [(aten.neg, jnp.negative), (aten.abs, jnp.abs)]:
    lower(_op.default)(_unary(_fn, KIND.DEFAULT))

for _op, _fn in [(aten.eq, jnp.equal), (aten.ne, jnp.not_equal), (aten.lt, jnp.less),
                 (aten.le, jnp.less_equal), (aten.gt, jnp.greater), (aten.ge, jnp.greater_equal)]:
    lower(_op.Tensor, _op.Scalar)(_binary(_fn, KIND.ALWAYS_BOOL))

for _op, _fn in [(aten.maximum, jnp.maximum), (aten.minimum, jnp.minimum)]:
    lower(_op.default)(_binary(_fn))


@lower(aten.add.Tensor, aten.add.Scalar)
def add(a, b, alpha=1):
    (a, b), res = promote(a, b)
    if not (isinstance(alpha, int) and alpha == 1):
        b = b * cast(alpha, b.dtype) if b.dtype != jnp.bool_ else jnp.logical_and(b, alpha)
    return (a + b if a.dtype != jnp.bool_ else jnp.logical_or(a, b)).astype(res)


@lower(aten.sub.Tensor, aten.sub.Scalar)
def sub(a, b, alpha=1):
    (a, b), res = promote(a, b)
    if not (isinstance(alpha, int) and alpha == 1):
        b = b * cast(alpha, b.dtype)
    return (a - b).astype(res)


@lower(aten.mul.Tensor, aten.mul.Scalar)
def mul(a, b):
    (a, b), res = promote(a, b)
    return (jnp.logical_and(a, b) if a.dtype == jnp.bool_ else a * b).astype(res)


@lower(aten.div.Tensor, aten.div.Scalar)
def div(a, b):
    (a, b), res = promote(a, b, kind=KIND.INT_TO_FLOAT)
    return (a / b).astype(res)


@lower(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar)
def pow_(a, b):
    (a, b), res = promote(a, b, kind=KIND.BOOL_TO_LONG)
    return jnp.power(a, b).astype(res)


@lower(aten.where.self)
def where(cond, a, b):
    (a, b), res = promote(a, b, kind=KIND.NO_OPMATH)
    return jnp.where(cond, a, b).astype(res)
