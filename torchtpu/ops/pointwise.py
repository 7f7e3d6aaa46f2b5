"""Pointwise math, comparisons, logic, activations and the _foreach_ ops.

Arguments are promoted with PyTorch's rules (util.promote): reduced floats
(bf16/fp16) compute in float32 and round once at the end, as PyTorch's
opmath does; integers stay exact.
"""
import math

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
import torch
from jax import lax

from .registry import LOWERINGS, lower
from .util import KIND, cast, ctx_dtype, promote

aten = torch.ops.aten


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


# ---- unary math -----------------------------------------------------------

def _sigmoid(x):
    return jax.nn.sigmoid(x) if not _is_complex(x) else 1 / (1 + jnp.exp(-x))


def _digamma(x):
    # PyTorch: digamma(0) = -inf (signed like the zero), poles at negative ints are nan.
    out = lax.digamma(x)
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x).astype(x.dtype), out)


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


def _trigamma(x):
    """PyTorch's trigamma: reflection below 0.5, six recurrence steps, then
    the asymptotic series (jax's polygamma(1, x) is wrong for x < 0)."""
    neg = x < 0.5
    sin_pi_x = jnp.sin(jnp.pi * x)
    result = jnp.where(neg, -(jnp.pi * jnp.pi) / (sin_pi_x * sin_pi_x), 0).astype(x.dtype)
    x = jnp.where(neg, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1. / 6 - ixx * (1. / 30 - ixx * (1. / 42)))) / x
    return jnp.where(neg, -result, result)


@lower(aten.polygamma.default)
def polygamma(n, x):
    (x,), res = promote(x, kind=KIND.INT_TO_FLOAT)
    if n == 0:
        return _digamma(x).astype(res)
    if n == 1:
        return _trigamma(x).astype(res)
    # PyTorch: (+-1) * exp(lgamma(n + 1)) * zeta(n + 1, x), the factor in the
    # input's float type (float32 for bf16), the zeta rounded to the input's.
    fdt = jnp.float32 if jnp.dtype(res).itemsize < 4 else res
    # exp(lgamma(n + 1)) as libm rounds it in fdt (not exactly n!).
    lg = np.asarray(math.lgamma(n + 1), fdt)
    fact = np.asarray(math.exp(float(lg)), fdt) * (1 if n % 2 else -1)
    z = _zeta(jnp.asarray(n + 1.0, x.dtype), x, res).astype(res).astype(fdt)
    return (fact * z).astype(res)


@lower(aten.mvlgamma.default)
def mvlgamma(x, p):
    (x,), res = promote(x, kind=KIND.INT_TO_FLOAT)
    return jss.multigammaln(x, p).astype(res)


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
        return lax.div(a, b)
    return jnp.trunc(a / b)


def _fmod(a, b):
    return lax.rem(a, b)


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


_ZETA_A = [12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18]


def _zeta(x, q, scalar=None):
    """Hurwitz zeta as PyTorch's CPU kernel (Cephes): inf at x = 1 and at the
    poles q = 0, -1, ...; nan for x < 1 and for q < 0 with x not an integer.
    The direct sum also covers negative q (polygamma of negative x), where
    jax's zeta does not. Computed in PyTorch's accumulation type for the
    kernel's dtype `scalar` (default q's): float64 for float32, float32 for
    bf16/fp16; rounded to q's dtype."""
    out_dtype = q.dtype
    scalar = jnp.dtype(scalar or q.dtype)
    acc = jnp.float64 if scalar in (jnp.float32, jnp.float64) else jnp.float32
    x, q = jnp.broadcast_arrays(x.astype(acc), q.astype(acc))
    machep = 1.11022302462515654042E-16

    def small(s, b):
        return (-machep * s < b) & (b < machep * s)

    # s = q^-x + (q+1)^-x + ... while fewer than 9 terms were added or a <= 9.
    def cond(st):
        i, a, b, s, done = st
        return jnp.any(~done & ((i < 9) | (a <= 9)))

    def body(st):
        i, a, b, s, done = st
        live = ~done & ((i < 9) | (a <= 9))
        a2 = a + 1
        b2 = jnp.power(a2, -x)
        s2 = s + b2
        return (i + 1, jnp.where(live, a2, a), jnp.where(live, b2, b), jnp.where(live, s2, s),
                done | (live & small(s2, b2)))

    pole = (q <= 0) & (q == jnp.floor(q))
    bad = (x < 1) | ((q <= 0) & ~pole & (x != jnp.floor(x)))
    skip = (x == 1) | pole | bad
    qq = jnp.where(skip, 2, q)
    init = (0, qq, jnp.zeros_like(qq), jnp.power(qq, -x), skip)
    _, a, b, s, done = lax.while_loop(cond, body, init)
    # Euler-Maclaurin tail.
    w = a
    s = jnp.where(done, s, s + b * w / (x - 1) - 0.5 * b)
    a, k = jnp.ones_like(s), 0.0
    for c in _ZETA_A:
        a = a * (x + k)
        b = b / w
        t = a * b / c
        s = jnp.where(done, s, s + t)
        done = done | (jnp.abs(t / s) < machep)
        k += 1
        a = a * (x + k)
        b = b / w
        k += 1
    out = jnp.where(x == 1, jnp.inf, jnp.where(x < 1, jnp.nan, jnp.where(
        pole, jnp.inf, jnp.where(bad, jnp.nan, s))))
    return out.astype(out_dtype)


@lower(aten.special_zeta.default, aten.special_zeta.self_scalar, aten.special_zeta.other_scalar)
@guard("zeta", "h")
def zeta(x, q):
    (x, q), res = promote(x, q, kind=KIND.INT_TO_FLOAT)
    return _zeta(x, q).astype(res)


@lower(aten.igamma.default)
@guard("igamma", "bi")
def igamma(a, x):
    (a, x), res = promote(a, x, kind=KIND.INT_TO_FLOAT)
    return jss.gammainc(a, x).astype(res)


@lower(aten.igammac.default)
@guard("igammac", "bi")
def igammac(a, x):
    (a, x), res = promote(a, x, kind=KIND.INT_TO_FLOAT)
    return jss.gammaincc(a, x).astype(res)


@lower(aten.heaviside.default)
def heaviside(x, values):
    if x.dtype != values.dtype:
        raise RuntimeError("heaviside is not yet implemented for tensors with different dtypes.")
    (x, values), res = promote(x, values)
    return jnp.where(x == 0, values, (x > 0).astype(x.dtype)).astype(res)


# ---- comparisons, logic, bits ---------------------------------------------

for _op, _fn in [(aten.eq, jnp.equal), (aten.ne, jnp.not_equal), (aten.lt, jnp.less),
                 (aten.le, jnp.less_equal), (aten.gt, jnp.greater), (aten.ge, jnp.greater_equal)]:
    lower(_op.Tensor, _op.Scalar)(_binary(_fn, KIND.ALWAYS_BOOL))


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
    return lax.shift_left(a, b).astype(res)


@guard("rshift", "bf")
def _rshift(a, b):
    (a, b), res = promote(a, b)
    if jnp.issubdtype(a.dtype, jnp.unsignedinteger):
        return lax.shift_right_logical(a, b).astype(res)
    return lax.shift_right_arithmetic(a, b).astype(res)


lower(aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
      aten.bitwise_left_shift.Scalar_Tensor, aten.__lshift__.Tensor, aten.__lshift__.Scalar)(_lshift)
lower(aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
      aten.bitwise_right_shift.Scalar_Tensor, aten.__rshift__.Tensor, aten.__rshift__.Scalar)(_rshift)


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
    out = jnp.abs(lax.div(a, jnp.where(g == 0, 1, g)) * b)
    return jnp.where(g == 0, 0, out).astype(res)


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


# ---- selection, clamping, interpolation -----------------------------------

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


# ---- activations and their backward ops -----------------------------------

def _opmath(*xs):
    """xs in their computation dtype, and the dtype of the result."""
    return promote(*xs)


@lower(aten.relu.default)
@guard("relu", "b", RuntimeError, "Boolean inputs not supported for relu")
def relu(x):
    return jnp.maximum(x, jnp.zeros((), x.dtype)) if x.dtype != jnp.bool_ else x


@lower(aten.threshold.default)
def threshold(x, threshold, value):
    t = cast(threshold, x.dtype)
    return jnp.where(x <= t, cast(value, x.dtype), x)


@lower(aten.threshold_backward.default)
def threshold_backward(grad, x, threshold):
    (grad, x), res = _opmath(grad, x)
    return jnp.where(x <= cast(threshold, x.dtype), 0, grad).astype(res)


_SQRT1_2 = 1 / math.sqrt(2)
_GELU_BETA = math.sqrt(2) * (2 / math.sqrt(math.pi)) * 0.5  # sqrt(2/pi)
_GELU_KAPPA = 0.044715


@lower(aten.gelu.default)
def gelu(x, *, approximate="none"):
    (x,), res = _opmath(x)
    if approximate == "tanh":
        inner = _GELU_BETA * (x + _GELU_KAPPA * x * x * x)
        out = 0.5 * x * (1 + jnp.tanh(inner))
    else:
        out = x * 0.5 * (1 + lax.erf(x * _SQRT1_2))
    return out.astype(res)


@lower(aten.gelu_backward.default)
def gelu_backward(grad, x, *, approximate="none"):
    (grad, x), res = _opmath(grad, x)
    if approximate == "tanh":
        x_sq = x * x
        inner = _GELU_BETA * (x + _GELU_KAPPA * x_sq * x)
        t = jnp.tanh(inner)
        left_d = 0.5 * (1 + t)
        right_d = 0.5 * x * (1 - t * t) * _GELU_BETA * (1 + 3 * _GELU_KAPPA * x_sq)
        out = grad * (left_d + right_d)
    else:
        cdf = 0.5 * (1 + lax.erf(x * _SQRT1_2))
        pdf = jnp.exp(-0.5 * x * x) * (2 / math.sqrt(math.pi) * _SQRT1_2 * 0.5)
        out = grad * (cdf + x * pdf)
    return out.astype(res)


@lower(aten.silu.default)
def silu(x):
    (x,), res = _opmath(x)
    return (x * jax.nn.sigmoid(x)).astype(res)


@lower(aten.silu_backward.default)
def silu_backward(grad, x):
    (grad, x), res = _opmath(grad, x)
    s = jax.nn.sigmoid(x)
    return (grad * s * (1 + x * (1 - s))).astype(res)


@lower(aten.hardtanh.default)
def hardtanh(x, min_val=-1, max_val=1):
    return clamp(x, min_val, max_val)


@lower(aten.hardtanh_backward.default)
def hardtanh_backward(grad, x, min_val, max_val):
    (grad, x), res = _opmath(grad, x)
    out = jnp.where((x <= cast(min_val, x.dtype)) | (x >= cast(max_val, x.dtype)), 0, grad)
    return out.astype(res)


@lower(aten.leaky_relu.default)
def leaky_relu(x, negative_slope=0.01):
    (x,), res = _opmath(x)
    return jnp.where(x > 0, x, x * cast(negative_slope, x.dtype)).astype(res)


@lower(aten.leaky_relu_backward.default)
def leaky_relu_backward(grad, x, negative_slope, self_is_result):
    (grad, x), res = _opmath(grad, x)
    return jnp.where(x > 0, grad, grad * cast(negative_slope, grad.dtype)).astype(res)


@lower(aten.elu.default)
def elu(x, alpha=1, scale=1, input_scale=1):
    (x,), res = _opmath(x)
    alpha, scale, input_scale = (cast(v, x.dtype) for v in (alpha, scale, input_scale))
    out = jnp.where(x > 0, x * scale, jnp.expm1(x * input_scale) * alpha * scale)
    return out.astype(res)


@lower(aten.elu_backward.default)
def elu_backward(grad, alpha, scale, input_scale, is_result, self_or_result):
    (grad, y), res = _opmath(grad, self_or_result)
    negcoef = cast(alpha, y.dtype) * cast(scale, y.dtype)
    poscoef = cast(scale, y.dtype)
    negiptcoef = cast(input_scale, y.dtype)
    if is_result:
        neg = grad * negiptcoef * (y + negcoef)
    else:
        neg = grad * negiptcoef * negcoef * jnp.exp(y * negiptcoef)
    return jnp.where(y <= 0, neg, grad * poscoef).astype(res)


@lower(aten.softplus.default)
def softplus(x, beta=1, threshold=20):
    (x,), res = _opmath(x)
    xb = x * cast(beta, x.dtype)
    out = jnp.where(xb > cast(threshold, x.dtype), x, jnp.log1p(jnp.exp(xb)) / cast(beta, x.dtype))
    return out.astype(res)


@lower(aten.softplus_backward.default)
def softplus_backward(grad, x, beta, threshold):
    (grad, x), res = _opmath(grad, x)
    xb = x * cast(beta, x.dtype)
    z = jnp.exp(xb)
    return jnp.where(xb > cast(threshold, x.dtype), grad, grad * z / (z + 1)).astype(res)


@lower(aten.sigmoid_backward.default)
def sigmoid_backward(grad, y):
    (grad, y), res = _opmath(grad, y)
    if _is_complex(y):
        y = jnp.conj(y)
    return (grad * (1 - y) * y).astype(res)


@lower(aten.tanh_backward.default)
def tanh_backward(grad, y):
    (grad, y), res = _opmath(grad, y)
    if _is_complex(y):
        y = jnp.conj(y)
    return (grad * (1 - y * y)).astype(res)


@lower(aten.hardsigmoid.default)
def hardsigmoid(x):
    (x,), res = _opmath(x)
    return (jnp.clip(x + 3, 0, 6) / 6).astype(res)


@lower(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(grad, x):
    (grad, x), res = _opmath(grad, x)
    return jnp.where((x > -3) & (x < 3), grad / 6, 0).astype(res)


@lower(aten.hardswish.default)
def hardswish(x):
    (x,), res = _opmath(x)
    return (x * jnp.clip(x + 3, 0, 6) / 6).astype(res)


@lower(aten.hardswish_backward.default)
def hardswish_backward(grad, x):
    (grad, x), res = _opmath(grad, x)
    out = jnp.where(x <= -3, 0, jnp.where(x < 3, grad * (x / 3 + 0.5), grad))
    return out.astype(res)


def _softplus1(x):
    return jnp.where(x > 20, x, jnp.log1p(jnp.exp(x)))


@lower(aten.mish.default)
def mish(x):
    (x,), res = _opmath(x)
    return (x * jnp.tanh(_softplus1(x))).astype(res)


@lower(aten.mish_backward.default)
def mish_backward(grad, x):
    (grad, x), res = _opmath(grad, x)
    s = jax.nn.sigmoid(x)
    t = jnp.tanh(_softplus1(x))
    return (grad * (t + x * s * (1 - t * t))).astype(res)


@lower(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(x):
    (x,), res = _opmath(x)
    z = jnp.exp(-jnp.abs(x))
    # The buffer is what PyTorch's CPU kernel stores: exp(-|x|).
    return (jnp.minimum(x, 0) - jnp.log1p(z)).astype(res), z.astype(res)


@lower(aten.log_sigmoid_backward.default)
def log_sigmoid_backward(grad, x, buffer):
    (grad, x, z), res = _opmath(grad, x, buffer)
    neg = x < 0
    max_deriv = jnp.where(neg, 1, 0).astype(x.dtype)
    sgn_ = jnp.where(neg, 1, -1).astype(x.dtype)
    return ((max_deriv - sgn_ * (z / (1 + z))) * grad).astype(res)


@lower(aten.hardshrink.default)
def hardshrink(x, lambd=0.5):
    (x,), res = _opmath(x)
    lam = cast(lambd, x.dtype)
    return jnp.where((x >= -lam) & (x <= lam), 0, x).astype(res)


@lower(aten.hardshrink_backward.default, aten.softshrink_backward.default)
def shrink_backward(grad, x, lambd):
    (grad, x), res = _opmath(grad, x)
    lam = cast(lambd, x.dtype)
    return jnp.where((x >= -lam) & (x <= lam), 0, grad).astype(res)


@lower(aten.softshrink.default)
def softshrink(x, lambd=0.5):
    (x,), res = _opmath(x)
    lam = cast(lambd, x.dtype)
    return jnp.where(x > lam, x - lam, jnp.where(x < -lam, x + lam, 0)).astype(res)


# ---- _foreach_ ops: the per-tensor lowering over each list position ----------

def _foreach(elem, per_item=()):
    """A _foreach_ lowering: list arguments (Tensor[], Scalar[]) are zipped,
    the rest passed to every call; `per_item` names tensor arguments whose
    i-th element goes to the i-th call (addcmul.Tensor's scalars)."""
    def lowering(*args, **kwargs):
        n = len(next(x for x in args if isinstance(x, list)))
        out = []
        for i in range(n):
            a = [x[i] if isinstance(x, list) else x for x in args]
            k = {key: (v[i] if isinstance(v, list) or key in per_item else v)
                 for key, v in kwargs.items()}
            out.append(elem(*a, **k))
        return out
    return lowering


def _elementwise(name):
    """The lowering of the functional op that _foreach_<name> maps over."""
    packet = getattr(aten, name)
    for ov in ("Tensor", "default", "Tensor_Tensor", "Scalar"):
        if ov in packet.overloads() and getattr(packet, ov) in LOWERINGS:
            return LOWERINGS[getattr(packet, ov)]
    return None


def _register_foreach():
    # dir(aten) lists only the packets loaded so far; ask the dispatcher.
    names = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("aten::_foreach_")}
    for name in sorted(names):
        if name.endswith("_"):
            continue
        base = name[len("_foreach_"):]
        if base in ("norm", "copy", "zero", "max", "pow", "addcmul", "addcdiv"):
            continue
        elem = _elementwise(base) if hasattr(aten, base) else None
        if elem is None:
            continue
        packet = getattr(aten, name)
        for ov in packet.overloads():
            op = getattr(packet, ov)
            if op not in LOWERINGS:
                lower(op)(_foreach(elem))


_register_foreach()
lower(aten._foreach_pow.List, aten._foreach_pow.Scalar, aten._foreach_pow.ScalarList,
      aten._foreach_pow.ScalarAndTensor)(_foreach(pow_))


def _foreach_addc(elem):
    def lowering(self, t1, t2, value=1):
        if isinstance(value, list):
            return [elem(a, b, c, v) for a, b, c, v in zip(self, t1, t2, value)]
        if hasattr(value, "ndim") and value.ndim == 1:
            # The Tensor overload: one scalar per list position.
            return [elem(a, b, c, value[i]) for i, (a, b, c) in enumerate(zip(self, t1, t2))]
        return [elem(a, b, c, value) for a, b, c in zip(self, t1, t2)]
    return lowering


lower(aten._foreach_addcmul.Scalar, aten._foreach_addcmul.ScalarList,
      aten._foreach_addcmul.Tensor)(_foreach_addc(addcmul))
lower(aten._foreach_addcdiv.Scalar, aten._foreach_addcdiv.ScalarList,
      aten._foreach_addcdiv.Tensor)(_foreach_addc(addcdiv))


@lower(aten._foreach_zero.default)
def foreach_zero(self):
    return [jnp.zeros_like(x) for x in self]


@lower(aten._foreach_clone.default)
def foreach_clone(self):
    return list(self)


@lower(aten._foreach_copy.default)
def foreach_copy(self, src, non_blocking=False):
    return [jnp.broadcast_to(s.astype(d.dtype), d.shape) for d, s in zip(self, src)]
