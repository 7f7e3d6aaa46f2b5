"""Reductions, scans, sorting and selection.

Reduced floats (bf16/fp16) accumulate in float32 as PyTorch's CPU kernels
do; integer and bool sums accumulate in the output dtype (int64), exactly.
"""
import jax.numpy as jnp
import torch
from jax import lax

from . import lower
from .util import KIND, ctx_dtype, jdt, promote

aten = torch.ops.aten

_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


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


def _acc(dtype):
    """The accumulation dtype for an output dtype."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) in _HALF else jnp.dtype(dtype)


def _isnan(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.isnan(x)
    return jnp.zeros(x.shape, jnp.bool_)


def _truth(x):
    return x if x.dtype == jnp.bool_ else x != 0


def _require(ok, exc, message):
    """Raise what PyTorch raises for an input dtype its kernel rejects."""
    if not ok:
        raise exc(message)


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
    from . import ctx
    return [_vector_norm(x, ord, None, False, jdt(m.dtype)) for x, m in zip(tensors, ctx.out)]


foreach_norm.static_args = ("ord",)


@lower(aten._foreach_powsum.Scalar)
def foreach_powsum(tensors, ord=2, dtype=None):
    from . import ctx
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


# ---- scans -------------------------------------------------------------------

def _scan(jfn):
    def lowering(x, dim, *, dtype=None):
        out = ctx_dtype()
        x = x.astype(_acc(out))
        if x.ndim == 0:
            return x.astype(out)
        return jfn(x, axis=dim % x.ndim).astype(out)
    return lowering


lower(aten.cumsum.default)(_scan(jnp.cumsum))
lower(aten.cumprod.default)(_scan(jnp.cumprod))


@lower(aten.logcumsumexp.default)
def logcumsumexp(x, dim):
    _require(jnp.issubdtype(x.dtype, jnp.inexact), NotImplementedError,
             f'"logcumsumexp_out_cpu" not implemented for \'{x.dtype}\'')
    (x,), res = promote(x, kind=KIND.INT_TO_FLOAT)
    if x.ndim == 0:
        return x.astype(res)
    return lax.associative_scan(jnp.logaddexp, x, axis=dim % x.ndim).astype(res)


def _cum_extreme(x, dim, better):
    """Running extreme with PyTorch's index rule: a later element wins on ties
    (>= / <=) and NaN, once seen, sticks (the latest NaN's index)."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    idx = lax.broadcasted_iota(jnp.int64, x.shape, dim)

    def combine(a, b):
        va, ia = a
        vb, ib = b
        take_b = _isnan(vb) | (~_isnan(va) & better(vb, va))
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)
    return lax.associative_scan(combine, (x, idx), axis=dim)


@lower(aten.cummax.default)
def cummax(x, dim):
    return _cum_extreme(x, dim, lambda b, a: b >= a)


@lower(aten.cummin.default)
def cummin(x, dim):
    return _cum_extreme(x, dim, lambda b, a: b <= a)


# ---- sorting and selection ---------------------------------------------------

def _sort(x, dim, descending):
    """Stable sort along dim; NaN sorts as the largest value. Descending sorts
    the reversed array ascending and reverses back, which keeps equal elements
    in their original order as PyTorch's stable sort does."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    n = x.shape[dim]
    if descending:
        x = jnp.flip(x, dim)
    idx = lax.broadcasted_iota(jnp.int64, x.shape, dim)
    v, i = lax.sort((x, idx), dimension=dim, num_keys=1, is_stable=True)
    if descending:
        v = jnp.flip(v, dim)
        i = (n - 1) - jnp.flip(i, dim)
    return v, i


@lower(aten.sort.default)
def sort(x, dim=-1, descending=False):
    return _sort(x, dim, descending)


@lower(aten.sort.stable)
def sort_stable(x, *, stable=None, dim=-1, descending=False):
    return _sort(x, dim, descending)


@lower(aten.argsort.default)
def argsort(x, dim=-1, descending=False):
    return _sort(x, dim, descending)[1]


@lower(aten.argsort.stable)
def argsort_stable(x, *, stable, dim=-1, descending=False):
    return _sort(x, dim, descending)[1]


@lower(aten.topk.default)
def topk(x, k, dim=-1, largest=True, sorted=True):
    v, i = _sort(x, dim, largest)
    if x.ndim == 0:
        return v, i
    dim = dim % x.ndim
    return lax.slice_in_dim(v, 0, k, axis=dim), lax.slice_in_dim(i, 0, k, axis=dim)


def _pick(v, i, pos, dim, keepdim):
    """Element `pos` (per-slice int array, or int) along dim of sorted v, i."""
    pos = jnp.broadcast_to(jnp.asarray(pos, jnp.int64), v.shape[:dim] + (1,) + v.shape[dim + 1:])
    vv = jnp.take_along_axis(v, pos, axis=dim)
    ii = jnp.take_along_axis(i, pos, axis=dim)
    if not keepdim:
        vv, ii = jnp.squeeze(vv, dim), jnp.squeeze(ii, dim)
    return vv, ii


@lower(aten.kthvalue.default)
def kthvalue(x, k, dim=-1, keepdim=False):
    _require(x.dtype != jnp.bool_, NotImplementedError, '"kthvalue_cpu" not implemented for \'Bool\'')
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    v, i = _sort(x, dim, False)
    return _pick(v, i, k - 1, dim, keepdim)


def _median(x, dim, keepdim, ignore_nan):
    _require(x.dtype != jnp.bool_, NotImplementedError, '"median_cpu" not implemented for \'Bool\'')
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    v, i = _sort(x, dim, False)
    n_valid = jnp.sum(~_isnan(x), axis=dim, keepdims=True).astype(jnp.int64)
    n = x.shape[dim]
    if ignore_nan:
        # Lower median of the non-NaN values; all-NaN slices give NaN.
        pos = jnp.maximum((n_valid - 1) // 2, 0)
    else:
        # Any NaN makes the median NaN: the first NaN (sorted last, stably).
        pos = jnp.where(n_valid < n, n_valid, (n - 1) // 2)
    return _pick(v, i, pos, dim, keepdim)


@lower(aten.median.dim)
def median_dim(x, dim, keepdim=False):
    return _median(x, dim, keepdim, False)


@lower(aten.nanmedian.dim)
def nanmedian_dim(x, dim, keepdim=False):
    return _median(x, dim, keepdim, True)


@lower(aten.median.default)
def median(x):
    return _median(x.reshape(-1), 0, False, False)[0]


@lower(aten.nanmedian.default)
def nanmedian(x):
    return _median(x.reshape(-1), 0, False, True)[0]
