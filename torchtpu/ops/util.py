"""Helpers shared by the lowerings: PyTorch's type promotion on JAX values."""
import jax
import jax.numpy as jnp
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND
from torch._prims_common import elementwise_dtypes

from .. import runtime

__all__ = ["KIND", "promote", "jdt", "tdt", "is_weak_scalar", "cast", "ctx_dtype", "bad_input"]


def bad_input(cls, message):
    """An error of PyTorch's type for bad arguments, raised by a lowering as
    the user's error (the dispatcher reports other errors raised in a
    lowering as torchtpu's own bugs)."""
    e = cls(message)
    e._torchtpu = True
    return e


def jdt(dtype):
    return runtime.jax_dtype(dtype)


def tdt(dtype):
    return runtime.torch_dtype(dtype)


def is_weak_scalar(x):
    return isinstance(x, jax.Array) and x.ndim == 0 and getattr(x, "weak_type", False)


def _rep(x):
    """What stands for x in PyTorch's promotion rules."""
    if isinstance(x, (bool, int, float, complex)):
        return x
    if is_weak_scalar(x):
        kind = jnp.dtype(x.dtype).kind
        return {"b": True, "i": 1, "u": 1, "f": 1.0, "c": 1j}[kind]
    return torch.empty(() if x.ndim == 0 else (1,), dtype=tdt(x.dtype), device="meta")


def promote(*args, kind=KIND.DEFAULT):
    """(args cast to the computation dtype, result jax dtype). None args pass."""
    reps = [_rep(a) for a in args if a is not None]
    comp, result = elementwise_dtypes(*reps, type_promotion_kind=kind)
    comp = jdt(comp)
    return [cast(a, comp) for a in args], jdt(result)


def cast(x, dtype):
    if x is None:
        return None
    if isinstance(x, (bool, int, float, complex)):
        return jnp.asarray(x, dtype)
    return x if x.dtype == dtype else x.astype(dtype)


def rounder(dtype):
    """Rounds a float32 value to bf16/f16 and keeps it float32, where CPU
    rounds an intermediate result (runtime.round_to); the identity for
    other dtypes."""
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.bfloat16, jnp.float16):
        return lambda v: v
    return lambda v: runtime.round_to(v, dtype)


def matmul_precision():
    """The lax.Precision of float matrix products in the lowering being
    traced (one registered with lower(matmul=True))."""
    from .registry import ctx
    return ctx.precision


def ctx_dtype(i=0):
    """The jax dtype PyTorch's meta kernel gives output i of the traced op."""
    from .registry import ctx
    return jdt(ctx.out[i].dtype)
