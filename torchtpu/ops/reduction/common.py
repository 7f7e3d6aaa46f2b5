"""Helpers the reduction sub-modules share: accumulation dtypes, NaN tests,
and PyTorch's dtype rejections.

Reduced floats (bf16/fp16) accumulate in float32 as PyTorch's CPU kernels
do; integer and bool sums accumulate in the output dtype (int64), exactly.
"""
import jax.numpy as jnp

_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _acc(dtype):
    """The accumulation dtype for an output dtype."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) in _HALF else jnp.dtype(dtype)


def _isnan(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.isnan(x)
    return jnp.zeros(x.shape, jnp.bool_)


def _require(ok, exc, message):
    """Raise what PyTorch raises for an input dtype its kernel rejects."""
    if not ok:
        raise exc(message)
