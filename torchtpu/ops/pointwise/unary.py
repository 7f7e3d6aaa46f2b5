"""Unary math (exp and log, trigonometric and error functions, rounding,
complex parts, logit, frexp) and classification (isnan, isinf, signbit,
nan_to_num)."""
import jax
import jax.numpy as jnp
import jax.scipy.special as jss
from jax import lax

from ..registry import lower
from ..util import KIND, ctx_dtype, promote
from .common import _is_complex, _is_float, _is_int, _unary, guard
from .gamma import _digamma

from ...compat import aten


# ---- unary math -----------------------------------------------------------

def _sigmoid(x):
    return jax.nn.sigmoid(x) if not _is_complex(x) else 1 / (1 + jnp.exp(-x))


def _sinc(x):
    px = jnp.pi * x
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(px) / jnp.where(x == 0, 1, px))


_FLOAT_UNARY = [
    (aten.exp, jnp.exp), (aten.exp2, jnp.exp2), (aten.expm1, jnp.expm1),
    (aten.log, jnp.log), (aten.log2, jnp.log2), (aten.log10, jnp.log10), (aten.log1p, jnp.log1p),
    (aten.sqrt, jnp.sqrt), (aten.rsqrt, lax.rsqrt), (aten.reciprocal, lambda x: 1 / x),
    (aten.sin, jnp.sin), (aten.cos, jnp.cos), (aten.tan, jnp.tan),
    (aten.asin, jnp.arcsin), (aten.acos, jnp.arccos), (aten.atan, jnp.arctan),
    (aten.sinh, jnp.sinh), (aten.cosh, jnp.cosh), (aten.tanh, jnp.tanh),
    (aten.asinh, jnp.arcsinh), (aten.acosh, jnp.arccosh), (aten.atanh, jnp.arctanh),
    (aten.erf, lax.erf), (aten.erfc, lax.erfc), (aten.erfinv, lax.erf_inv),
    (aten.lgamma, lax.lgamma), (aten.digamma, _digamma), (aten.sigmoid, _sigmoid),
    (aten.sinc, _sinc), (aten.deg2rad, jnp.deg2rad), (aten.rad2deg, jnp.rad2deg),
    (aten.i0, jss.i0), (aten.special_i0e, jss.i0e), (aten.special_i1, jss.i1),
    (aten.special_i1e, jss.i1e), (aten.special_ndtr, jss.ndtr), (aten.special_ndtri, jss.ndtri),
    (aten.special_log_ndtr, jss.log_ndtr), (aten.special_erfcx, jss.erfcx),
    (aten.special_entr, lambda x: jnp.where(x > 0, -x * jnp.log(jnp.where(x > 0, x, 1)),
                                            jnp.where(x == 0, 0, -jnp.inf)).astype(x.dtype)),
]
_NO_HALF = {aten.special_erfcx, aten.special_ndtri, aten.special_log_ndtr}
for _op, _fn in _FLOAT_UNARY:
    _l = _unary(_fn)
    lower(_op.default)(guard(_op.__name__, "h")(_l) if _op in _NO_HALF else _l)

for _op, _fn in [(aten.neg, jnp.negative), (aten.square, jnp.square)]:
    lower(_op.default)(_unary(_fn, KIND.DEFAULT))


@lower(aten.abs.default)
@guard("abs", "b")
def abs_(x):
    if x.dtype == jnp.bool_:
        return x
    return jnp.abs(x)


@lower(aten.sign.default)
def sign(x):
    if x.dtype == jnp.bool_:
        return x
    if _is_complex(x):
        return jnp.sign(x)
    # (0 < x) - (x < 0), as PyTorch: sign(nan) is 0.
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


@lower(aten.sgn.default)
def sgn(x):
    if _is_complex(x):
        a = jnp.abs(x)
        return jnp.where(a == 0, 0, x / jnp.where(a == 0, 1, a)).astype(x.dtype)
    return sign(x)


@lower(aten.angle.default)
def angle(x):
    (x,), res = promote(x, kind=KIND.INT_TO_FLOAT)
    if _is_complex(x):
        return jnp.angle(x)
    # PyTorch: 0 for x >= 0, pi for x < 0, nan stays nan.
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.pi, 0)).astype(res)


@lower(aten._conj.default, aten._conj_physical.default, aten.conj_physical.default)
def conj(x):
    # _conj is a view that sets the conjugate bit, which tpu tensors do not
    # carry: materialize the conjugate instead (the generic view path would
    # drop the bit and return x unchanged).
    return jnp.conj(x) if _is_complex(x) else x


@lower(aten._neg_view.default)
def neg_view(x):
    # The same for the negative bit (set by _neg_view, read through .imag of
    # a conjugate): materialize the negation.
    return jnp.negative(x)


@lower(aten.complex.default)
def complex_(real, imag):
    # The decomposition writes through result.real/.imag views, which a
    # dtype-changing view cannot carry here.
    res = ctx_dtype()
    part = jnp.finfo(res).dtype
    return (real.astype(part) + 1j * imag.astype(part)).astype(res)


@lower(aten.polar.default)
def polar(abs, angle):
    # Its decomposition also writes through .real/.imag views.
    res = ctx_dtype()
    part = jnp.finfo(res).dtype
    abs, angle = abs.astype(part), angle.astype(part)
    return (abs * jnp.cos(angle) + 1j * (abs * jnp.sin(angle))).astype(res)


def _int_identity(jfn):
    """Rounding ops return integers unchanged."""
    def lowering(x):
        if _is_int(x):
            return x
        (y,), res = promote(x)
        return jfn(y).astype(res)
    return lowering


for _op, _fn in [(aten.floor, jnp.floor), (aten.ceil, jnp.ceil), (aten.trunc, jnp.trunc),
                 (aten.round, jnp.round), (aten.fix, jnp.trunc)]:
    lower(_op.default)(guard(_op.__name__, "b")(_int_identity(_fn)))

lower(aten.frac.default)(guard("frac", "i")(guard(
    "frac", "b", RuntimeError, "Subtraction, the `-` operator, with two bool tensors is not supported.")(
    _int_identity(lambda x: x - jnp.trunc(x)))))


@lower(aten.round.decimals)
@guard("round", "b")
def round_decimals(x, *, decimals=0):
    if _is_int(x):
        return x
    (x,), res = promote(x)
    ten = 10.0 ** abs(decimals)
    if decimals < 0:
        return (jnp.round(x / ten) * ten).astype(res)
    return (jnp.round(x * ten) / ten).astype(res)


@lower(aten.logit.default)
def logit(x, eps=None):
    (x,), res = promote(x, kind=KIND.INT_TO_FLOAT)
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x)).astype(res)


@lower(aten.logit_backward.default)
def logit_backward(grad, x, eps=None):
    (grad, x), res = promote(grad, x)
    g = grad / (x * (1 - x))
    if eps is None:
        g = jnp.where((x < 0) | (x > 1), jnp.nan, g)
    else:
        g = jnp.where((x < eps) | (x > 1 - eps), 0, g)
    return g.astype(res)


@lower(aten.frexp.Tensor)
def frexp(x):
    """Mantissa in [0.5, 1) and int32 exponent, from the bits: XLA's CPU code
    flushes subnormal inputs to zero, std::frexp does not. 0, inf and nan
    come back unchanged with exponent 0."""
    if not _is_float(x):
        raise RuntimeError("torch.frexp() only supports floating-point dtypes")
    info = jnp.finfo(x.dtype)
    nbits, mbits, bias = info.bits, info.nmant, info.maxexp - 1
    ut = jnp.dtype(f"uint{nbits}")
    bits = lax.bitcast_convert_type(x, ut)
    sign = bits & ut.type(1 << (nbits - 1))
    mant = (bits & ut.type((1 << mbits) - 1)).astype(jnp.int64)
    efield = ((bits >> mbits) & ut.type((1 << (nbits - 1 - mbits)) - 1)).astype(jnp.int64)
    special = (efield == (1 << (nbits - 1 - mbits)) - 1) | ((efield == 0) & (mant == 0))
    # A subnormal's leading 1 moves up to the implicit bit.
    sub = (efield == 0) & (mant != 0)
    shift = mbits - 63 + lax.clz(mant)
    mant = jnp.where(sub, (mant << jnp.where(sub, shift, 0)) & ((1 << mbits) - 1), mant)
    exp = jnp.where(sub, 1 - shift, efield) - (bias - 1)
    out = lax.bitcast_convert_type(sign | ((bias - 1) << mbits | mant).astype(ut), x.dtype)
    return jnp.where(special, x, out), jnp.where(special, 0, exp).astype(jnp.int32)


# ---- classification -------------------------------------------------------

def _classify(float_fn, int_value):
    def lowering(x):
        if _is_int(x):
            return jnp.full(x.shape, int_value, jnp.bool_)
        return float_fn(x)
    return lowering


lower(aten.isnan.default)(_classify(jnp.isnan, False))
lower(aten.isinf.default)(_classify(jnp.isinf, False))
lower(aten.isfinite.default)(_classify(jnp.isfinite, True))
lower(aten.isposinf.default)(_classify(jnp.isposinf, False))
lower(aten.isneginf.default)(_classify(jnp.isneginf, False))


@lower(aten.signbit.default)
def signbit(x):
    if x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        return jnp.zeros(x.shape, jnp.bool_)
    if _is_int(x):
        return x < 0
    return jnp.signbit(x)


@lower(aten.nan_to_num.default)
def nan_to_num(x, nan=None, posinf=None, neginf=None):
    if _is_int(x):
        return x
    return jnp.nan_to_num(x, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)
