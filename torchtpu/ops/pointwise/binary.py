"""Binary arithmetic (add, sub, mul, the divisions and remainders, pow,
maximum/minimum, xlogy, heaviside, gcd/lcm) and the ternary lerp, addcmul
and addcdiv."""
import jax.numpy as jnp
from jax import lax

from ..registry import lower
from ..util import KIND, cast, promote
from .common import _binary, _is_complex, _is_int, guard

from ...compat import aten


# ---- binary arithmetic ----------------------------------------------------

def _scale(b, alpha):
    """b * alpha, with alpha possibly a traced scalar; alpha=1 costs nothing."""
    if isinstance(alpha, (int, bool)) and alpha == 1:
        return b
    if b.dtype == jnp.bool_:
        return jnp.logical_and(b, cast(alpha, jnp.bool_))
    return b * cast(alpha, b.dtype)


@lower(aten.add.Tensor, aten.add.Scalar)
def add(a, b, alpha=1):
    (a, b), res = promote(a, b)
    b = _scale(b, alpha)
    return (a + b if a.dtype != jnp.bool_ else jnp.logical_or(a, b)).astype(res)


_SUB_BOOL = ("Subtraction, the `-` operator, with a bool tensor is not supported. If you are "
             "trying to invert a mask, use the `~` or `logical_not()` operator instead.")


def _is_bool(v):
    return isinstance(v, bool) or getattr(v, "dtype", None) == jnp.bool_


@lower(aten.sub.Tensor, aten.sub.Scalar)
def sub(a, b, alpha=1):
    if _is_bool(a) or _is_bool(b):
        raise RuntimeError(_SUB_BOOL)
    (a, b), res = promote(a, b)
    return (a - _scale(b, alpha)).astype(res)


@lower(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(a, b, alpha=1):
    return sub(b, a, alpha)


@lower(aten.mul.Tensor, aten.mul.Scalar)
def mul(a, b):
    (a, b), res = promote(a, b)
    return (jnp.logical_and(a, b) if a.dtype == jnp.bool_ else a * b).astype(res)


def _trunc_div(a, b):
    if _is_int(a):
        return lax.div(*jnp.broadcast_arrays(a, b))
    return jnp.trunc(a / b)


def _fmod(a, b):
    return lax.rem(*jnp.broadcast_arrays(a, b))  # (lax's ops do not broadcast)


def _floor_div(a, b):
    if _is_int(a):
        return jnp.floor_divide(a, b)
    if _is_complex(a):
        return jnp.floor(a / b)
    # PyTorch's div_floor_floating: floor of the exact quotient via fmod.
    mod = _fmod(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    fl = jnp.floor(div)
    fl = jnp.where(div - fl > 0.5, fl + 1, fl)
    fl = jnp.where(div == 0, jnp.copysign(jnp.zeros_like(div), a / b), fl)
    return jnp.where(b == 0, a / b, fl)


@lower(aten.div.Tensor, aten.div.Scalar, aten.true_divide.Tensor, aten.true_divide.Scalar)
def div(a, b):
    (a, b), res = promote(a, b, kind=KIND.INT_TO_FLOAT)
    return (a / b).astype(res)


@lower(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(a, b, *, rounding_mode=None):
    if rounding_mode is None:
        return div(a, b)
    (a, b), res = promote(a, b)
    if a.dtype == jnp.bool_:
        if rounding_mode == "floor":
            raise RuntimeError("torch.bool not supported for floor_divide")
        raise NotImplementedError(f'"div_{rounding_mode}_cpu" not implemented for \'Bool\'')
    fn = _trunc_div if rounding_mode == "trunc" else _floor_div
    return fn(a, b).astype(res)


@lower(aten.floor_divide.default, aten.floor_divide.Scalar)
@guard("floor_divide", "b", RuntimeError, "torch.bool not supported for floor_divide")
def floor_divide(a, b):
    (a, b), res = promote(a, b)
    return _floor_div(a, b).astype(res)


def _remainder(a, b):
    if _is_int(a):
        return jnp.remainder(a, b)
    mod = _fmod(a, b)
    return jnp.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


@lower(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
@guard("remainder", "b")
def remainder(a, b):
    (a, b), res = promote(a, b)
    return _remainder(a, b).astype(res)


@lower(aten.fmod.Tensor, aten.fmod.Scalar)
@guard("fmod", "b")
def fmod(a, b):
    (a, b), res = promote(a, b)
    return _fmod(a, b).astype(res)


@lower(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar)
def pow_(a, b):
    if isinstance(b, bool):
        # PyTorch special-cases exponents 1 (a copy) and 0 (ones), bools included.
        return a if b else jnp.ones_like(a)
    return _pow(a, b)


@guard("pow", "b")
def _pow(a, b):
    (a, b), res = promote(a, b, kind=KIND.BOOL_TO_LONG)
    if _is_int(a):
        # Integer powers stay exact (repeated squaring); negative exponents
        # give 0 except for bases 1 and -1, as in PyTorch.
        neg = b < 0
        out = jnp.power(a, jnp.where(neg, 0, b))
        inv = jnp.where(a == 1, 1, jnp.where(a == -1, jnp.where(b % 2 == 0, 1, -1), 0))
        return jnp.where(neg, inv.astype(a.dtype), out).astype(res)
    return jnp.power(a, b).astype(res)


for _op, _fn in [(aten.atan2, jnp.arctan2), (aten.arctan2, jnp.arctan2)]:
    lower(_op.default)(_binary(_fn, KIND.INT_TO_FLOAT))
lower(aten.copysign.Tensor, aten.copysign.Scalar)(_binary(jnp.copysign, KIND.INT_TO_FLOAT))
# Float-only kernels in PyTorch: integer and bool inputs are errors.
for _op, _fn in [(aten.logaddexp, jnp.logaddexp), (aten.logaddexp2, jnp.logaddexp2)]:
    lower(_op.default)(guard(_op.__name__, "bi")(_binary(_fn, KIND.INT_TO_FLOAT)))
for _op, _fn in [(aten.hypot, jnp.hypot), (aten.nextafter, jnp.nextafter)]:
    lower(_op.default)(guard(_op.__name__, "bi")(_binary(_fn)))
for _op, _fn in [(aten.fmax, jnp.fmax), (aten.fmin, jnp.fmin)]:
    lower(_op.default)(_binary(_fn))


@lower(aten.maximum.default, aten.max.other)
def maximum(a, b):
    (a, b), res = promote(a, b)
    return (jnp.logical_or(a, b) if a.dtype == jnp.bool_ else jnp.maximum(a, b)).astype(res)


@lower(aten.minimum.default, aten.min.other)
def minimum(a, b):
    (a, b), res = promote(a, b)
    return (jnp.logical_and(a, b) if a.dtype == jnp.bool_ else jnp.minimum(a, b)).astype(res)


def _xlogy(x, y, log):
    (x, y), res = promote(x, y, kind=KIND.INT_TO_FLOAT)
    safe = jnp.where(x == 0, 1, y)
    out = jnp.where(x == 0, 0, x * log(safe))
    return jnp.where(jnp.isnan(y), jnp.nan, out).astype(res)


@lower(aten.xlogy.Tensor, aten.xlogy.Scalar_Self, aten.xlogy.Scalar_Other,
       aten.special_xlogy.default, aten.special_xlogy.self_scalar, aten.special_xlogy.other_scalar)
def xlogy(x, y):
    return _xlogy(x, y, jnp.log)


@lower(aten.special_xlog1py.default, aten.special_xlog1py.self_scalar,
       aten.special_xlog1py.other_scalar)
def xlog1py(x, y):
    return _xlogy(x, y, jnp.log1p)


@lower(aten.heaviside.default)
def heaviside(x, values):
    if x.dtype != values.dtype:
        raise RuntimeError("heaviside is not yet implemented for tensors with different dtypes.")
    (x, values), res = promote(x, values)
    return jnp.where(x == 0, values, (x > 0).astype(x.dtype)).astype(res)


# ---- integer arithmetic ---------------------------------------------------

def _gcd(a, b):
    # PyTorch's calc_gcd: Euclid on |a|, |b| with C's truncated remainder
    # (|INT64_MIN| stays negative and so can the result, as on CPU).
    a, b = jnp.broadcast_arrays(jnp.abs(a), jnp.abs(b))

    def body(s):
        a, b = s
        nz = a != 0
        return jnp.where(nz, lax.rem(b, jnp.where(nz, a, 1)), 0), jnp.where(nz, a, b)

    return lax.while_loop(lambda s: jnp.any(s[0] != 0), body, (a, b))[1]


@lower(aten.gcd.default)
@guard("gcd", "bf")
def gcd(a, b):
    (a, b), res = promote(a, b)
    return _gcd(a, b).astype(res)


@lower(aten.lcm.default)
@guard("lcm", "bf")
def lcm(a, b):
    (a, b), res = promote(a, b)
    g = _gcd(a, b)
    # |a / g * b| with truncating division and wrapping overflow, as on CPU,
    # where C++ computes types narrower than int in int.
    if jnp.dtype(res).itemsize < 4:
        a, b, g = a.astype(jnp.int32), b.astype(jnp.int32), g.astype(jnp.int32)
    out = jnp.abs(lax.div(*jnp.broadcast_arrays(a, jnp.where(g == 0, 1, g))) * b)
    return jnp.where(g == 0, 0, out).astype(res)


# ---- interpolation, fused multiply-add and -divide ------------------------

@lower(aten.lerp.Scalar, aten.lerp.Tensor)
@guard("lerp_kernel_scalar", "bi")
def lerp(start, end, weight):
    (start, end, weight), res = promote(start, end, weight)
    diff = end - start
    # PyTorch's two-sided formula keeps lerp exact at both ends.
    out = jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))
    return out.astype(res)


@lower(aten.addcmul.default)
def addcmul(x, t1, t2, value=1):
    (x, t1, t2), res = promote(x, t1, t2)
    prod = t1 * t2 if x.dtype != jnp.bool_ else jnp.logical_and(t1, t2)
    return add(x, prod, value).astype(res)


@lower(aten.addcdiv.default)
def addcdiv(x, t1, t2, value=1):
    (x, t1, t2), res = promote(x, t1, t2)
    return (x + cast(value, x.dtype) * (t1 / t2)).astype(res)
