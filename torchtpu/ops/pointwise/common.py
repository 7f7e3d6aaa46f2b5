"""Helpers the pointwise lowerings share: dtype predicates, guard (the
errors PyTorch's CPU kernels raise for dtypes they have no kernel for) and
the factories of plain unary and binary lowerings."""
import jax.numpy as jnp

from ..util import KIND, promote


def _is_int(x):
    return jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_


def _is_float(x):
    return jnp.issubdtype(x.dtype, jnp.floating)


def _is_complex(x):
    return jnp.issubdtype(x.dtype, jnp.complexfloating)


_TORCH_NAMES = {"bool": "Bool", "uint8": "Byte", "int8": "Char", "int16": "Short", "int32": "Int",
                "int64": "Long", "float16": "Half", "bfloat16": "BFloat16", "float32": "Float",
                "float64": "Double", "complex64": "ComplexFloat", "complex128": "ComplexDouble"}


def _rejects(dtype, kinds):
    dtype = jnp.dtype(dtype)
    return (("b" in kinds and dtype == jnp.bool_)
            or ("i" in kinds and jnp.issubdtype(dtype, jnp.integer))
            or ("f" in kinds and jnp.issubdtype(dtype, jnp.floating))
            or ("h" in kinds and dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))))


def guard(name, kinds, exc=NotImplementedError, message=None):
    """Raise what PyTorch's CPU kernel raises for dtypes it has no kernel
    for (kinds: b bool, i integer, f floating, h bf16/fp16), judged on the
    common dtype of the tensor and scalar arguments."""
    def deco(fn):
        def lowering(*args, **kwargs):
            operands = [a for a in args if hasattr(a, "dtype") or type(a) in (int, float, complex)]
            _, common = promote(*operands)
            if _rejects(common, kinds):
                dname = _TORCH_NAMES.get(jnp.dtype(common).name, str(common))
                raise exc(message or f'"{name}_cpu" not implemented for \'{dname}\'')
            return fn(*args, **kwargs)
        lowering.__name__ = fn.__name__
        return lowering
    return deco


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
