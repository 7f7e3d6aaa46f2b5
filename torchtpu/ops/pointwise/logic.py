"""Comparisons (isin among them), logical and bitwise ops and shifts,
selection (where) and clamping."""
import jax.numpy as jnp
from jax import lax

from ..registry import lower
from ..util import KIND, promote
from .common import _binary, guard

from ...compat import aten


# ---- comparisons, logic, bits ---------------------------------------------

for _op, _fn in [(aten.eq, jnp.equal), (aten.ne, jnp.not_equal), (aten.lt, jnp.less),
                 (aten.le, jnp.less_equal), (aten.gt, jnp.greater), (aten.ge, jnp.greater_equal)]:
    lower(_op.Tensor, _op.Scalar)(_binary(_fn, KIND.ALWAYS_BOOL))


@lower(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor)
def isin(elements, test_elements, assume_unique=False, invert=False):
    # One kernel: PyTorch's decomposition is several ops, and Hugging Face's
    # logits processors and stopping criteria call isin at every token.
    (elements, test_elements), _ = promote(elements, test_elements)
    return jnp.isin(elements, test_elements, invert=invert)


def _truth(x):
    return x if x.dtype == jnp.bool_ else x != 0


for _op, _fn in [(aten.logical_and, jnp.logical_and), (aten.logical_or, jnp.logical_or),
                 (aten.logical_xor, jnp.logical_xor)]:
    lower(_op.default)(lambda a, b, _fn=_fn: _fn(_truth(a), _truth(b)))


@lower(aten.logical_not.default)
def logical_not(x):
    return jnp.logical_not(_truth(x))


def _bitwise(bool_fn, int_fn):
    def lowering(a, b):
        (a, b), res = promote(a, b)
        return (bool_fn if a.dtype == jnp.bool_ else int_fn)(a, b).astype(res)
    return lowering


for _name, _bfn, _ifn in [("and", jnp.logical_and, jnp.bitwise_and),
                          ("or", jnp.logical_or, jnp.bitwise_or),
                          ("xor", jnp.logical_xor, jnp.bitwise_xor)]:
    _packet = getattr(aten, f"bitwise_{_name}")
    _l = guard(f"bitwise_{_name}", "f")(_bitwise(_bfn, _ifn))
    lower(_packet.Tensor, _packet.Scalar, _packet.Scalar_Tensor)(_l)
    lower(getattr(aten, f"__{_name}__").Tensor, getattr(aten, f"__{_name}__").Scalar)(_l)


@lower(aten.bitwise_not.default)
@guard("bitwise_not", "f")
def bitwise_not(x):
    return jnp.logical_not(x) if x.dtype == jnp.bool_ else jnp.invert(x)


@guard("lshift", "bf")
def _lshift(a, b):
    (a, b), res = promote(a, b)
    # XLA gives 0 for shifts >= the bit width (and negative ones), as PyTorch.
    return lax.shift_left(*jnp.broadcast_arrays(a, b)).astype(res)  # (lax's ops do not broadcast)


@guard("rshift", "bf")
def _rshift(a, b):
    (a, b), res = promote(a, b)
    a, b = jnp.broadcast_arrays(a, b)
    if jnp.issubdtype(a.dtype, jnp.unsignedinteger):
        return lax.shift_right_logical(a, b).astype(res)
    return lax.shift_right_arithmetic(a, b).astype(res)


lower(aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
      aten.bitwise_left_shift.Scalar_Tensor, aten.__lshift__.Tensor, aten.__lshift__.Scalar)(_lshift)
lower(aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
      aten.bitwise_right_shift.Scalar_Tensor, aten.__rshift__.Tensor, aten.__rshift__.Scalar)(_rshift)


# ---- selection and clamping -----------------------------------------------

def clamp(x, min=None, max=None):
    (x, lo, hi), res = promote(x, min, max)
    # maximum/minimum propagate NaN (input or bound); min > max gives max.
    if x.dtype == jnp.bool_:
        lo_fn, hi_fn = jnp.logical_or, jnp.logical_and
    else:
        lo_fn, hi_fn = jnp.maximum, jnp.minimum
    if lo is not None:
        x = lo_fn(x, lo)
    if hi is not None:
        x = hi_fn(x, hi)
    return x.astype(res)


@lower(aten.clamp_min.Tensor)
def clamp_min(x, min):
    return clamp(x, min, None)


@lower(aten.clamp_max.Tensor)
def clamp_max(x, max):
    return clamp(x, None, max)


# PyTorch's CPU kernels take bool only in clamp_min/clamp_max with tensor bounds.
lower(aten.clamp.default)(guard("clamp_scalar", "b")(clamp))
lower(aten.clamp.Tensor)(guard("clamp", "b")(clamp))
lower(aten.clamp_min.default)(guard("clamp_min_scalar", "b")(clamp_min))
lower(aten.clamp_max.default)(guard("clamp_max_scalar", "b")(clamp_max))


@lower(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(cond, a, b):
    (a, b), res = promote(a, b, kind=KIND.NO_OPMATH)
    return jnp.where(_truth(cond), a, b).astype(res)
