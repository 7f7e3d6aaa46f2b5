"""Helpers the nn lowerings share: bf16/f16 computed in float32, matmuls at
full precision, per-dim arguments given once for all dims, and one matrix
applied per trailing dim (resampling, adaptive average pooling)."""
import jax.numpy as jnp
from jax import lax

from ...compat import aten
HIGHEST = lax.Precision.HIGHEST


def _compute_dtype(dtype):
    """Low precision floats compute in float32."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype in (jnp.bfloat16, jnp.float16) else dtype


def _up(x):
    return x.astype(_compute_dtype(x.dtype))


def _expand(v, nd):
    v = list(v)
    return v * nd if len(v) == 1 else v


def _apply_mats(x, mats, transpose=False):
    """Apply one (out, in) matrix per trailing dim (its transpose for backward)."""
    x = _up(x)
    for i, m in enumerate(mats):
        axis = x.ndim - len(mats) + i
        m = jnp.asarray(m.T if transpose else m, x.dtype)
        x = jnp.moveaxis(jnp.tensordot(x, m, axes=([axis], [1]), precision=HIGHEST), -1, axis)
    return x
