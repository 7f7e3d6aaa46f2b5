"""Whole-tensor and per-dim reductions: sums, products, any/all, extrema and
their indices, moments, logsumexp, vector norms (with the _foreach_ norms and
renorm) and hash_tensor."""
import jax.numpy as jnp
from jax import lax

from ..registry import ctx, lower
from ..util import KIND, ctx_dtype, jdt, promote
from .common import _acc, _isnan, _require

from ...compat import aten


def _axes(x, dim):
    """The axes a reduction over `dim` reduces (None or [] mean all)."""
    if x.ndim == 0:
        return ()
    if dim is None:
        return tuple(range(x.ndim))
    if isinstance(dim, int):
        dim = [dim]
    if len(dim) == 0:
        return tuple(range(x.ndim))
    return tuple(sorted({d % x.ndim for d in dim}))


def _truth(x):
    return x if x.dtype == jnp.bool_ else x != 0


def _numel(x, axes):
    n = 1
    for a in axes:
        n *= x.shape[a]
    return n


# ---- sums and products -----------------------------------------------------

def _accumulate(jfn):
    def lowering(x, dim=None, keepdim=False, *, dtype=None):
        out = ctx_dtype()
        return jfn(x.astype(_acc(out)), axis=_axes(x, dim), keepdims=keepdim).astype(out)
    return lowering


lower(aten.sum.default, aten.sum.dim_IntList)(_accumulate(jnp.sum))
lower(aten.mean.default, aten.mean.dim)(_accumulate(jnp.mean))


@lower(aten.prod.default, aten.prod.dim_int)
def prod(x, dim=None, keepdim=False, *, dtype=None):
    out = ctx_dtype()
    return jnp.prod(x.astype(_acc(out)), axis=_axes(x, dim), keepdims=keepdim).astype(out)


@lower(aten.nansum.default)
def nansum(x, dim=None, keepdim=False, *, dtype=None):
    out = ctx_dtype()
    x = jnp.where(_isnan(x), 0, x).astype(_acc(out))
    return jnp.sum(x, axis=_axes(x, dim), keepdims=keepdim).astype(out)


@lower(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero(x, dim=None):
    return jnp.sum(_truth(x), axis=_axes(x, dim), dtype=jnp.int64)


@lower(aten.any.default, aten.any.dim, aten.any.dims)
def any_(x, dim=None, keepdim=False):
    return jnp.any(_truth(x), axis=_axes(x, dim), keepdims=keepdim)


@lower(aten.all.default, aten.all.dim, aten.all.dims)
def all_(x, dim=None, keepdim=False):
    return jnp.all(_truth(x), axis=_axes(x, dim), keepdims=keepdim)


# (torch.distributions' argument checks: a bool tensor's all/any, as a 0-dim tensor.)
@lower(aten._is_all_true.default)
def is_all_true(x):
    return jnp.all(x)


@lower(aten._is_any_true.default)
def is_any_true(x):
    return jnp.any(x)


# ---- extrema (NaN propagates; indices are the first max/min) ---------------

@lower(aten.amax.default, aten.max.default)
def amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=_axes(x, dim), keepdims=keepdim)


@lower(aten.amin.default, aten.min.default)
def amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=_axes(x, dim), keepdims=keepdim)


def _arg(jfn, x, dim, keepdim):
    if x.ndim == 0:
        return jnp.zeros((), jnp.int64)
    if dim is None:
        idx = jfn(x.reshape(-1))
        return idx.reshape((1,) * x.ndim) if keepdim else idx
    # jnp.argmax/argmin return the first extremum, and the first NaN if any.
    return jfn(x, axis=dim % x.ndim, keepdims=keepdim)


@lower(aten.argmax.default)
def argmax(x, dim=None, keepdim=False):
    _require(x.dtype != jnp.bool_, RuntimeError, "argmax(): does not support bool input")
    return _arg(jnp.argmax, x, dim, keepdim).astype(jnp.int64)


@lower(aten.argmin.default)
def argmin(x, dim=None, keepdim=False):
    _require(x.dtype != jnp.bool_, RuntimeError, "argmin(): does not support bool input")
    return _arg(jnp.argmin, x, dim, keepdim).astype(jnp.int64)


@lower(aten.max.dim)
def max_dim(x, dim, keepdim=False):
    return amax(x, dim, keepdim), _arg(jnp.argmax, x, dim, keepdim).astype(jnp.int64)


@lower(aten.min.dim)
def min_dim(x, dim, keepdim=False):
    return amin(x, dim, keepdim), _arg(jnp.argmin, x, dim, keepdim).astype(jnp.int64)


@lower(aten.aminmax.default)
def aminmax(x, *, dim=None, keepdim=False):
    return amin(x, dim, keepdim), amax(x, dim, keepdim)


# ---- moments ----------------------------------------------------------------

def _var_mean(x, dim, correction, keepdim):
    _require(jnp.issubdtype(x.dtype, jnp.inexact), RuntimeError,
             "std and var only support floating point and complex dtypes")
    (x,), _ = promote(x, kind=KIND.COMPLEX_TO_FLOAT)
    axes = _axes(x, dim)
    n = _numel(x, axes)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    d = x - mean
    sq = (d.real * d.real + d.imag * d.imag) if jnp.iscomplexobj(d) else d * d
    c = 1 if correction is None else correction
    dof = jnp.maximum(jnp.asarray(n, sq.dtype) - jnp.asarray(c, sq.dtype), 0)
    var = jnp.sum(sq, axis=axes, keepdims=keepdim) / dof
    if not keepdim:
        mean = jnp.squeeze(mean, axes) if axes else mean
    return var, mean


@lower(aten.var.correction)
def var(x, dim=None, *, correction=None, keepdim=False):
    return _var_mean(x, dim, correction, keepdim)[0]


@lower(aten.std.correction)
def std(x, dim=None, *, correction=None, keepdim=False):
    return jnp.sqrt(_var_mean(x, dim, correction, keepdim)[0])


@lower(aten.var_mean.correction)
def var_mean(x, dim=None, *, correction=None, keepdim=False):
    return _var_mean(x, dim, correction, keepdim)


@lower(aten.std_mean.correction)
def std_mean(x, dim=None, *, correction=None, keepdim=False):
    v, m = _var_mean(x, dim, correction, keepdim)
    return jnp.sqrt(v), m


@lower(aten.logsumexp.default)
def logsumexp(x, dim, keepdim=False):
    (x,), res = promote(x, kind=KIND.INT_TO_FLOAT)
    axes = _axes(x, dim)
    if x.size == 0:
        return jnp.log(jnp.sum(jnp.exp(x), axis=axes, keepdims=keepdim)).astype(res)
    m = jnp.max(x, axis=axes, keepdims=True)
    # PyTorch zeroes infinite maxima so that inf - inf never happens.
    m = jnp.where(jnp.isinf(m), 0, m)
    out = jnp.log(jnp.sum(jnp.exp(x - m), axis=axes, keepdims=True)) + m
    return (out if keepdim else jnp.squeeze(out, axes)).astype(res)


# ---- norms -------------------------------------------------------------------

def _vector_norm(x, ord, dim, keepdim, out_dtype):
    acc = _acc(out_dtype)
    x = jnp.abs(x)
    if jnp.iscomplexobj(x):
        x = x.real
    x = x.astype(acc)
    axes = _axes(x, dim)
    ord = float(ord)
    if ord == float("inf"):
        out = jnp.max(x, axis=axes, keepdims=keepdim) if x.size else jnp.zeros(
            jnp.sum(x, axis=axes, keepdims=keepdim).shape, acc)
    elif ord == float("-inf"):
        out = jnp.min(x, axis=axes, keepdims=keepdim)
    elif ord == 0:
        out = jnp.sum((x != 0).astype(acc), axis=axes, keepdims=keepdim)
    elif ord == 1:
        out = jnp.sum(x, axis=axes, keepdims=keepdim)
    elif ord == 2:
        out = jnp.sqrt(jnp.sum(x * x, axis=axes, keepdims=keepdim))
    else:
        out = jnp.sum(x ** ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)
    return out.astype(out_dtype)


@lower(aten.linalg_vector_norm.default)
def linalg_vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    return _vector_norm(x, ord, dim, keepdim, ctx_dtype())


linalg_vector_norm.static_args = ("ord",)


@lower(aten.norm.Scalar, aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dtype,
       aten.norm.ScalarOpt_dim_dtype)
def norm(x, p=2, dim=None, keepdim=False, dtype=None):
    return _vector_norm(x, 2 if p is None else p, dim, keepdim, ctx_dtype())


norm.static_args = ("p",)


@lower(aten._foreach_norm.Scalar)
def foreach_norm(tensors, ord=2, dtype=None):
    return [_vector_norm(x, ord, None, False, jdt(m.dtype)) for x, m in zip(tensors, ctx.out)]


foreach_norm.static_args = ("ord",)


@lower(aten._foreach_powsum.Scalar)
def foreach_powsum(tensors, ord=2, dtype=None):
    out = []
    for x, m in zip(tensors, ctx.out):
        acc = _acc(jdt(m.dtype))
        a = jnp.abs(x)
        a = (a.real if jnp.iscomplexobj(a) else a).astype(acc)
        out.append(jnp.sum(a ** ord).astype(jdt(m.dtype)))
    return out


@lower(aten._foreach_max.default)
def foreach_max(tensors):
    return [jnp.max(x) for x in tensors]


@lower(aten.renorm.default)
def renorm(x, p, dim, maxnorm):
    """CPU: each slice's norm in the accumulation type, the factor
    maxnorm / (norm + 1e-7) rounded to x's dtype, then x * factor."""
    dim = dim % x.ndim
    acc = _acc(x.dtype)
    norm = _vector_norm(x, p, [d for d in range(x.ndim) if d != dim], True, acc)
    cap = jnp.asarray(maxnorm).astype(acc)
    factor = jnp.where(norm > cap, cap / (norm + jnp.asarray(1e-7, acc)), jnp.ones((), acc))
    factor = factor.astype(x.dtype).astype(acc)
    return (x.astype(acc) * factor).astype(x.dtype)


renorm.static_args = ("p",)


# (exponent bits, mantissa bits) of the floating types hash_tensor widens
# to float64 through their bits.
_FLOAT_FIELDS = {jnp.dtype(jnp.float16): (5, 10), jnp.dtype(jnp.bfloat16): (8, 7),
                 jnp.dtype(jnp.float32): (8, 23)}


def _float64_bits(x):
    """The bits of float64(x) for a float16, bfloat16 or float32 x, as
    uint64, built with integer ops: a TPU has no float64 (XLA emulates it
    with float32 pairs, whose range and bits are not IEEE double's) and
    flushes subnormals, so converting there loses the exact bit pattern
    CPU's conversion gives. Subnormals become normal doubles, NaNs keep
    their payload with the quiet bit set, as the CPU's conversion does."""
    ew, mw = _FLOAT_FIELDS[x.dtype]
    bias = (1 << (ew - 1)) - 1
    u = lax.bitcast_convert_type(x, jnp.uint16 if x.dtype.itemsize == 2 else jnp.uint32).astype(jnp.uint64)
    one = jnp.uint64(1)
    sign = u >> (ew + mw)
    exp = ((u >> mw) & ((one << ew) - one)).astype(jnp.int64)
    man = u & ((one << mw) - one)
    # A subnormal's highest set bit p makes it 2^(p + 1 - bias - mw) * 1.f.
    p = 63 - lax.clz(man).astype(jnp.int64)
    sub_exp = p + 1 - bias - mw + 1023
    sub_man = (man - (one << jnp.maximum(p, 0).astype(jnp.uint64))) << (52 - jnp.maximum(p, 0)).astype(jnp.uint64)
    special = exp == (1 << ew) - 1
    E = jnp.where(exp == 0, jnp.where(man == 0, 0, sub_exp),
                  jnp.where(special, 2047, exp - bias + 1023)).astype(jnp.uint64)
    M = jnp.where(exp == 0, jnp.where(man == 0, jnp.uint64(0), sub_man), man << jnp.uint64(52 - mw))
    M = jnp.where(special & (man != 0), M | (one << jnp.uint64(51)), M)
    return (sign << jnp.uint64(63)) | (E << jnp.uint64(52)) | M


@lower(aten.hash_tensor.default)
def hash_tensor(x, dim=(), *, keepdim=False, mode=0):
    """mode 0: xor of the elements as 64-bit floats / integers, bit-cast to
    uint64."""
    if mode != 0:
        raise RuntimeError(f"hash_tensor only supports mode=0 (xor_sum), got {mode}")
    if x.dtype in _FLOAT_FIELDS:
        bits = _float64_bits(x)
    else:
        wide = jnp.float64 if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.int64
        bits = lax.bitcast_convert_type(x.astype(wide), jnp.uint64)
    axes = _axes(x, dim)
    out = lax.reduce(bits, jnp.uint64(0), lax.bitwise_xor, axes)
    if keepdim:
        out = jnp.expand_dims(out, axes)
    return out
