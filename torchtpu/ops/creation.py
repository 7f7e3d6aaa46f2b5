"""Factories, copies and dtype conversion."""
import jax.numpy as jnp
import torch

from . import lower
from .util import ctx_dtype

aten = torch.ops.aten


@lower(aten.empty.memory_format, aten.empty_strided.default, aten.zeros.default,
       aten.new_empty.default, aten.new_empty_strided.default, aten.new_zeros.default)
def zeros(*args, **kwargs):
    from . import ctx
    return jnp.zeros(tuple(ctx.out[0].shape), ctx_dtype())


@lower(aten.ones.default, aten.new_ones.default)
def ones(*args, **kwargs):
    from . import ctx
    return jnp.ones(tuple(ctx.out[0].shape), ctx_dtype())


@lower(aten.full.default, aten.new_full.default)
def full(*args, fill_value=None, **kwargs):
    from . import ctx
    if fill_value is None:
        fill_value = args[-1]
    return jnp.full(tuple(ctx.out[0].shape), fill_value, ctx_dtype())


@lower(aten.scalar_tensor.default)
def scalar_tensor(value, **kwargs):
    return jnp.asarray(value, ctx_dtype())


@lower(aten.fill.Scalar, aten.fill.Tensor)
def fill(x, value):
    return jnp.full(x.shape, value, x.dtype)


@lower(aten.zero.default)
def zero(x):
    return jnp.zeros_like(x)


@lower(aten.copy.default)
def copy(dst, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(dst.dtype), dst.shape)


@lower(aten._to_copy.default, aten.clone.default)
def to_copy(x, **kwargs):
    return x.astype(ctx_dtype())
