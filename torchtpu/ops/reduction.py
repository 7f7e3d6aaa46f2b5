"""Reductions, scans, sorting and selection.

Reduced floats (bf16/fp16) accumulate in float32 as PyTorch's CPU kernels
do; integer and bool sums accumulate in the output dtype (int64), exactly.
"""
import jax.numpy as jnp
import torch
from jax import lax

from .registry import ctx, lower
from .pointwise import _TORCH_NAMES
from .util import KIND, ctx_dtype, is_weak_scalar, jdt, promote, tdt

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
    from .registry import ctx
    return [_vector_norm(x, ord, None, False, jdt(m.dtype)) for x, m in zip(tensors, ctx.out)]


foreach_norm.static_args = ("ord",)


@lower(aten._foreach_powsum.Scalar)
def foreach_powsum(tensors, ord=2, dtype=None):
    from .registry import ctx
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


@lower(aten.hash_tensor.default)
def hash_tensor(x, dim=(), *, keepdim=False, mode=0):
    """mode 0: xor of the elements as 64-bit floats / integers, bit-cast to
    uint64."""
    if mode != 0:
        raise RuntimeError(f"hash_tensor only supports mode=0 (xor_sum), got {mode}")
    wide = jnp.float64 if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.int64
    bits = lax.bitcast_convert_type(x.astype(wide), jnp.uint64)
    axes = _axes(x, dim)
    out = lax.reduce(bits, jnp.uint64(0), lax.bitwise_xor, axes)
    if keepdim:
        out = jnp.expand_dims(out, axes)
    return out


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
#
# PyTorch's CPU sort (stable=False), topk and kthvalue run libstdc++'s
# std::sort / std::nth_element or PyTorch's own quickselect, so the indices
# of equal elements are whatever those algorithms' swaps leave. Their
# partition steps are replayed here to return the same indices. A Hoare
# partition swaps the k-th element that stops its left scan with the k-th
# that stops its right scan, for as long as the two have not crossed, so a
# whole partition is a few cumulative sums and gathers, done for every
# segment of every slice at once. The arrays are (slices, n), the sorted dim
# last; `key` is an integer key whose `<` is the algorithm's comparison.
#
# PyTorch leaves that order unspecified (CUDA's differs from CPU's), and the
# replay costs several stable sorts, so it runs only on tensors of at most
# REPLAY_MAX elements; larger ones return equal elements in index order.
REPLAY_MAX = 1 << 16

def _keys(x, descending):
    """Integer keys (slices, n) in the CPU comparators' order: NaNs equal to
    each other and beyond every number, -0.0 equal to 0.0."""
    if x.size == 0:
        key = jnp.zeros(x.shape, jnp.int32)
    elif jnp.issubdtype(x.dtype, jnp.floating):
        nan = jnp.isnan(x)
        v = jnp.where(nan | (x == 0), jnp.zeros((), x.dtype), x)
        iota = lax.broadcasted_iota(jnp.int32, x.shape, 1)
        ns, vs, i = lax.sort((nan.astype(jnp.int8), v, iota), dimension=1, num_keys=2)
        new = (ns[:, 1:] != ns[:, :-1]) | (vs[:, 1:] != vs[:, :-1])
        rank = jnp.cumsum(jnp.concatenate([jnp.zeros((x.shape[0], 1), jnp.bool_), new], 1), 1, dtype=jnp.int32)
        _, key = lax.sort((i, rank), dimension=1, num_keys=1)
    else:
        key = x.astype(jnp.int8) if x.dtype == jnp.bool_ else x
    return ~key if descending else key  # ~k = -k - 1: reversed, without overflow


def _take(a, i):
    return jnp.take_along_axis(a, jnp.clip(i, 0, a.shape[1] - 1), axis=1)


def _cum(flag):
    """Exclusive prefix counts (slices, n + 1): count in [lo, hi) is
    c[hi] - c[lo]."""
    c = jnp.cumsum(flag, axis=1, dtype=jnp.int32)
    return jnp.concatenate([jnp.zeros_like(c[:, :1]), c], 1)


def _slots(flag, slot):
    """out[slot[i]] = i for each flagged i (slots distinct per slice)."""
    n = flag.shape[1]
    rows = lax.broadcasted_iota(jnp.int32, flag.shape, 0)
    pos = lax.broadcasted_iota(jnp.int32, flag.shape, 1)
    return jnp.full(flag.shape, n, jnp.int32).at[rows, jnp.where(flag, slot, n)].set(pos, mode="drop")


def _apply(src, *arrays):
    return [_take(a, src) for a in arrays]


def _swap(pos, i, j, do):
    """Gather indices that swap positions i and j where do."""
    return jnp.where(do & (pos == i), j, jnp.where(do & (pos == j), i, pos))


def _pairs(lstop, rstop, lo_l, hi_l, lo_r, hi_r):
    """Left stops in [lo_l, hi_l) ranked from the left, right stops in
    [lo_r, hi_r) from the right: each stop's rank, the counts, and tables
    giving the position of the k-th stop at lo_l - 1 + k and lo_r - 1 + k."""
    pos = lax.broadcasted_iota(jnp.int32, lstop.shape, 1)
    cl, cr = _cum(lstop), _cum(rstop)
    kl = _take(cl, pos + 1) - _take(cl, lo_l)
    kr = _take(cr, hi_r) - _take(cr, pos)
    nl = _take(cl, hi_l) - _take(cl, lo_l)
    nr = _take(cr, hi_r) - _take(cr, lo_r)
    return kl, kr, nl, nr, _slots(lstop, lo_l - 1 + kl), _slots(rstop, lo_r - 1 + kr)


def _std_partition(key, perm, sf, sl, active):
    """std::__unguarded_partition_pivot on each active segment [sf, sl): the
    median of sf+1, mid, sl-1 swapped to sf is the pivot, then the scans run
    over [sf+1, sl) stopping at key >= pivot (left) and key <= pivot (right).
    Returns key, perm and each position's segment cut."""
    pos = lax.broadcasted_iota(jnp.int32, key.shape, 1)
    a, b, c = sf + 1, sf + (sl - sf) // 2, sl - 1
    ka, kb, kc = _take(key, a), _take(key, b), _take(key, c)
    med = jnp.where(ka < kb, jnp.where(kb < kc, b, jnp.where(ka < kc, c, a)),
                    jnp.where(ka < kc, a, jnp.where(kb < kc, c, b)))
    key, perm = _apply(_swap(pos, sf, med, active), key, perm)
    kp = _take(key, sf)
    inside = active & (pos > sf) & (pos < sl)
    lstop, rstop = inside & ~(key < kp), inside & ~(kp < key)
    kl, kr, nl, nr, posl, posr = _pairs(lstop, rstop, sf + 1, sl, sf + 1, sl)
    pr, pl = _take(posr, sf + kl), _take(posl, sf + kr)
    swl = lstop & (kl <= nr) & (pr > pos)
    swr = rstop & (kr <= nl) & (pl < pos)
    cs = _cum(swl)
    m = _take(cs, sl) - _take(cs, sf)
    # After m swaps the left scan stops at the next left stop or, before it,
    # at the last swapped right stop.
    nxt = jnp.where(m + 1 <= nl, _take(posl, sf + m + 1), sl)
    cut = jnp.minimum(nxt, jnp.where(m >= 1, _take(posr, sf + m), sl))
    key, perm = _apply(jnp.where(swl, pr, jnp.where(swr, pl, pos)), key, perm)
    return key, perm, cut


def _lg(n):
    return n.bit_length() - 1


def _introsort(key, perm):
    """std::sort: introsort down to segments of 16, then one insertion sort
    (stable, so a stable sort of the result). Segments that would reach the
    depth limit are heap-sorted by libstdc++; that is not replayed."""
    n = key.shape[1]
    if n > 16 and key.size <= REPLAY_MAX:
        pos = lax.broadcasted_iota(jnp.int32, key.shape, 1)

        def cond(s):
            return (s[0] < 2 * _lg(n)) & jnp.any(s[4] - s[3] > 16)

        def body(s):
            d, key, perm, sf, sl = s
            active = sl - sf > 16
            key, perm, cut = _std_partition(key, perm, sf, sl, active)
            sf = jnp.where(active & (pos >= cut), cut, sf)
            sl = jnp.where(active & (pos < cut), cut, sl)
            return d + 1, key, perm, sf, sl
        def replay(key, perm, done):
            key, perm = lax.while_loop(cond, body, (0, key, perm, jnp.zeros_like(pos),
                                                    jnp.full_like(pos, n)))[1:3]
            return _stable_sorted(key, perm)
        # Without ties the order is the sorted one whatever the swaps were.
        done = _stable_sorted(key, perm)
        return lax.cond(_tied(done[0]), replay, lambda k, p, d: d, key, perm, done)
    return _stable_sorted(key, perm)


def _stable_sorted(key, perm):
    return lax.sort((key, perm), dimension=1, num_keys=1, is_stable=True)


def _tied(sorted_key):
    """Whether any slice of these sorted keys holds equal keys."""
    return jnp.any(sorted_key[:, 1:] == sorted_key[:, :-1])


def _introselect(key, perm, nth):
    """std::nth_element(first, first + nth, last): partition the segment
    holding nth down to 3 elements, then insertion-sort that segment."""
    n = key.shape[1]
    pos = lax.broadcasted_iota(jnp.int32, key.shape, 1)
    sf, sl = jnp.zeros_like(pos), jnp.full_like(pos, n)
    if n > 3:
        def cond(s):
            return (s[0] < 2 * _lg(n)) & jnp.any(s[4] - s[3] > 3)

        def body(s):
            d, key, perm, sf, sl = s
            active = sl - sf > 3
            key, perm, cut = _std_partition(key, perm, sf, sl, active)
            sf = jnp.where(active & (cut <= nth), cut, sf)
            sl = jnp.where(active & (cut > nth), cut, sl)
            return d + 1, key, perm, sf, sl
        _, key, perm, sf, sl = lax.while_loop(cond, body, (0, key, perm, sf, sl))
    group = jnp.where((pos >= sf) & (pos < sl), sf, pos)
    _, key, perm = lax.sort((group, key, perm), dimension=1, num_keys=2, is_stable=True)
    return key, perm


def _quickselect(key, perm, k):
    """PyTorch's quick_select_template (kthvalue): median of three at L, then
    scans from L+2 up (stop at key >= pivot) and R-1 down (key <= pivot),
    swapping until they cross; the pivot goes to j."""
    n = key.shape[1]
    pos = lax.broadcasted_iota(jnp.int32, key.shape, 1)

    def body(s):
        key, perm, lo, hi = s
        act = hi - lo >= 2
        key, perm = _apply(_swap(pos, (lo + hi) >> 1, lo + 1, act), key, perm)
        for i, j in ((lo + 1, hi), (lo, hi), (lo + 1, lo)):
            key, perm = _apply(_swap(pos, i, j, act & (_take(key, i) > _take(key, j))), key, perm)
        kp = _take(key, lo)
        lstop = act & (pos >= lo + 2) & (pos <= hi) & ~(kp > key)
        rstop = act & (pos >= lo + 1) & (pos < hi) & ~(key > kp)
        kl, kr, nl, nr, posl, posr = _pairs(lstop, rstop, lo + 2, hi + 1, lo + 1, hi)

        def lk(k):  # position of the k-th left stop (k >= 1)
            return _take(posl, lo + 1 + k)

        def rk(k):
            return _take(posr, lo + k)
        pr, pl = rk(kl), lk(kr)
        swl = lstop & (kl <= nr) & (pr >= pos)
        swr = rstop & (kr <= nl) & (pl <= pos)
        cs = _cum(swl)
        m = _take(cs, hi + 1) - _take(cs, lo)
        big = jnp.full_like(m, n + 1)
        # Where the scans stop after the last swap; a swap of an element with
        # itself (both stops at one pivot-equal element) moves both scans on.
        tie = (m >= 1) & (lk(m) == rk(m))
        mp = jnp.where(tie, m - 1, m)
        i = jnp.minimum(jnp.where(m + 1 <= nl, lk(m + 1), big), jnp.where(mp >= 1, rk(mp), big))
        j = jnp.maximum(jnp.where(m + 1 <= nr, rk(m + 1), lo), jnp.where(mp >= 1, lk(mp), lo))
        key, perm = _apply(jnp.where(swl, pr, jnp.where(swr, pl, pos)), key, perm)
        key, perm = _apply(_swap(pos, lo, j, act), key, perm)
        lo2 = jnp.where(act & (j <= k), i, lo)
        hi2 = jnp.where(act & (j >= k), j - 1, hi)
        return key, perm, lo2, hi2
    lo, hi = jnp.zeros_like(pos), jnp.full_like(pos, n - 1)
    key, perm, lo, hi = lax.while_loop(lambda s: jnp.any(s[3] - s[2] >= 2), body, (key, perm, lo, hi))
    two = (hi == lo + 1) & (_take(key, lo) > _take(key, hi))
    key, perm = _apply(_swap(pos, lo, hi, two), key, perm)
    return key, perm


def _slices(x, dim):
    """x with dim moved last, as (slices, n), and how to undo it."""
    x = jnp.moveaxis(x, dim, -1)
    shape = x.shape
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return x.reshape(rows, shape[-1]), lambda y: jnp.moveaxis(y.reshape(shape[:-1] + y.shape[-1:]), -1, dim)


def _stable_sort(x, dim, descending):
    """A stable sort along dim, as PyTorch's stable=True."""
    x2, back = _slices(x, dim)
    perm = lax.broadcasted_iota(jnp.int64, x2.shape, 1)
    if jnp.issubdtype(x2.dtype, jnp.floating):
        # (NaN?, value) keys: NaNs together, -0.0 with 0.0, no rank needed.
        nan = jnp.isnan(x2)
        v = jnp.where(nan | (x2 == 0), jnp.zeros((), x2.dtype), x2)
        keys = ((~nan).astype(jnp.int8), -v) if descending else (nan.astype(jnp.int8), v)
    else:
        keys = (_keys(x2, descending),)
    perm = lax.sort(keys + (perm,), dimension=1, num_keys=len(keys), is_stable=True)[-1]
    return back(jnp.take_along_axis(x2, perm, 1)), back(perm)


def _sort(x, dim, descending, stable=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    if stable or x.size == 0 or x.size > REPLAY_MAX:
        return _stable_sort(x, dim, descending)
    x2, back = _slices(x, dim)
    perm = lax.broadcasted_iota(jnp.int64, x2.shape, 1)
    _, perm = _introsort(_keys(x2, descending), perm)
    return back(jnp.take_along_axis(x2, perm, 1)), back(perm)


@lower(aten.sort.default)
def sort(x, dim=-1, descending=False):
    return _sort(x, dim, descending)


@lower(aten.sort.stable)
def sort_stable(x, *, stable=None, dim=-1, descending=False):
    return _sort(x, dim, descending, bool(stable))


@lower(aten.argsort.default)
def argsort(x, dim=-1, descending=False):
    return _sort(x, dim, descending)[1]


@lower(aten.argsort.stable)
def argsort_stable(x, *, stable, dim=-1, descending=False):
    return _sort(x, dim, descending, bool(stable))[1]


@lower(aten.topk.default)
def topk(x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    n = x.shape[dim]
    if k == 0 or x.size == 0 or k * 64 <= n or x.size > REPLAY_MAX:
        # For small k CPU runs std::partial_sort (a heap), whose order on ties
        # is not replayed, nor is any on large tensors: index order.
        v, i = _stable_sort(x, dim, largest)
        return lax.slice_in_dim(v, 0, k, axis=dim), lax.slice_in_dim(i, 0, k, axis=dim)
    x2, back = _slices(x, dim)
    key = _keys(x2, largest)
    perm = lax.broadcasted_iota(jnp.int64, x2.shape, 1)

    # std::nth_element at k-1, then std::sort of the k-1 before it.
    def replay(key, perm):
        key, perm = _introselect(key, perm, k - 1)
        if sorted and k > 1:
            head = _introsort(key[:, :k - 1], perm[:, :k - 1])[1]
            return jnp.concatenate([head, perm[:, k - 1:k]], 1)
        return perm[:, :k]
    if sorted:
        # Sorted output without ties does not depend on the swaps.
        skey, sperm = _stable_sorted(key, perm)
        perm = lax.cond(_tied(skey), lambda k_, p, sp: replay(k_, p),
                        lambda k_, p, sp: sp[:, :k], key, perm, sperm)
    else:
        perm = replay(key, perm)
    return back(jnp.take_along_axis(x2, perm, 1)), back(perm)


@lower(aten.mode.default)
def mode(x, dim=-1, keepdim=False):
    """CPU std::sorts each slice and takes the first most frequent value, at
    the index of the last element of its run in that (unstable) order."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    if x.shape[dim] == 0:
        raise IndexError(f"mode(): Expected reduction dim {dim} to have non-zero size.")
    x2, _ = _slices(x, dim)
    key, perm = _introsort(_keys(x2, False), lax.broadcasted_iota(jnp.int64, x2.shape, 1))
    pos = lax.broadcasted_iota(jnp.int32, key.shape, 1)
    differs = key[:, 1:] != key[:, :-1]
    edge = jnp.ones((key.shape[0], 1), jnp.bool_)
    start = lax.cummax(jnp.where(jnp.concatenate([edge, differs], 1), pos, 0), axis=1)
    run = jnp.where(jnp.concatenate([differs, edge], 1), pos - start + 1, 0)
    best = jnp.argmax(run, axis=1)[:, None]
    idx = jnp.take_along_axis(perm, best, 1)
    val = jnp.take_along_axis(x2, idx, 1)
    shape = x.shape[:dim] + ((1,) if keepdim else ()) + x.shape[dim + 1:]
    return val.reshape(shape), idx.reshape(shape)


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
    if x.size > REPLAY_MAX:
        return _pick(*_stable_sort(x, dim, False), k - 1, dim, keepdim)
    x2, back = _slices(x, dim)
    perm = lax.broadcasted_iota(jnp.int64, x2.shape, 1)
    key = _keys(x2, False)
    # Without ties the k-th is the k-th of a sort, whatever the swaps were.
    skey, sperm = _stable_sorted(key, perm)
    perm = lax.cond(_tied(skey), lambda k_, p, sp: _quickselect(k_, p, k - 1)[1],
                    lambda k_, p, sp: sp, key, perm, sperm)
    v, i = back(jnp.take_along_axis(x2, perm, 1)), back(perm)
    return _pick(v, i, k - 1, dim, keepdim)


def _median(x, dim, keepdim, ignore_nan):
    _require(x.dtype != jnp.bool_, NotImplementedError, '"median_cpu" not implemented for \'Bool\'')
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    # CPU's nth_element there orders equal elements by index: a stable sort.
    v, i = _sort(x, dim, False, stable=True)
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


# ---- searching -----------------------------------------------------------------

def _bisect(seq, values, right, sorter):
    """CPU's binary search, step for step (so NaNs land where CPU puts them):
    per row of values (..., m) in the matching row of seq (..., n); a 1-D seq
    serves every row. The first index whose element is >= value (> if
    right)."""
    n = seq.shape[-1]
    if seq.ndim == 1:
        seq, values = seq[None], values.reshape(1, -1)
        sorter = None if sorter is None else sorter[None]
    else:
        rows = 1
        for s in seq.shape[:-1]:
            rows *= s
        values = values.reshape(rows, values.shape[-1])
        seq = seq.reshape(rows, n)
        sorter = None if sorter is None else sorter.reshape(rows, n)
    lo = jnp.zeros(values.shape, jnp.int64)
    hi = jnp.full(values.shape, n, jnp.int64)
    for _ in range(n.bit_length()):
        active = lo < hi
        mid = lo + ((hi - lo) >> 1)
        at = jnp.clip(mid, 0, max(n - 1, 0))
        if sorter is not None:
            at = jnp.clip(jnp.take_along_axis(sorter, at, axis=1), 0, max(n - 1, 0))
        mv = jnp.take_along_axis(seq, at, axis=1)
        go_right = ~(mv > values) if right else ~(mv >= values)
        lo = jnp.where(active & go_right, mid + 1, lo)
        hi = jnp.where(active & ~go_right, mid, hi)
    return lo


def _search_dtype(seq, value):
    """CPU searches in promoteTypes(boundaries, input); a Python number is a
    full (double / int64) tensor there, not a weak scalar."""
    if is_weak_scalar(value):
        kind = jnp.dtype(value.dtype).kind
        value = value.astype(jnp.float64 if kind == "f" else jnp.int64 if kind in "iu" else value.dtype)
    dt = jdt(torch.promote_types(tdt(seq.dtype), tdt(value.dtype)))
    return seq.astype(dt), value.astype(dt)


def _side(right, side):
    if side is not None:
        if side not in ("left", "right"):
            raise RuntimeError(f"torch.searchsorted(): side can only be 'left' or 'right' but got {side}")
        if right and side == "left":
            raise RuntimeError("torch.searchsorted(): side and right can't be set to opposites, "
                               "got side of left while right was True")
        return side == "right"
    return bool(right)


@lower(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(seq, x, *, out_int32=False, right=False, side=None, sorter=None):
    right = _side(right, side)
    seq, x = _search_dtype(seq, jnp.asarray(x))
    shape = ctx.out[0].shape
    if x.ndim == 0:
        x = x.reshape((1,) * max(seq.ndim, 1))
    out = _bisect(seq, x, right, sorter)
    return out.reshape(tuple(shape)).astype(ctx_dtype())


@lower(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(x, boundaries, *, out_int32=False, right=False):
    boundaries, x = _search_dtype(boundaries, jnp.asarray(x))
    return _bisect(boundaries, x, right, None).reshape(x.shape).astype(ctx_dtype())


# ---- histograms ------------------------------------------------------------------
# CPU's histogramdd kernel: an element outside [first edge, last edge] (or
# NaN) is skipped; its bin is found by binary search on the edges (edges
# given as tensors) or by division, (x - left) * bins / (right - left) in the
# input dtype, which histogram/histogramdd (not histc) then correct by a
# search among the neighbouring edges; the last bin includes its right edge.

def _hist_kernel(x, edges, weight, density, linear, local_search=True):
    """x (M, D), edges a list of D 1-D arrays: the (bins...) histogram."""
    bins = [e.shape[0] - 1 for e in edges]
    index = jnp.zeros(x.shape[0], jnp.int64)
    keep = jnp.ones(x.shape[0], jnp.bool_)
    for d, e in enumerate(edges):
        v, ne = x[:, d], e.shape[0]
        left, right = e[0], e[-1]
        keep = keep & (v >= left) & (v <= right)
        if linear:
            pos = ((v - left) * jnp.asarray(ne - 1, x.dtype) / (right - left)).astype(jnp.int64)
            if local_search:
                lo = jnp.maximum(pos - 1, 0)
                hi = jnp.minimum(pos + 2, ne)
                # upper_bound in edges[lo:hi], at most three edges
                n_le = sum(((lo + t < hi) & (e[jnp.clip(lo + t, 0, ne - 1)] <= v)).astype(jnp.int64)
                           for t in range(3))
                pos = lo + n_le - 1
        else:
            pos = _bisect(e, v, True, None).reshape(-1) - 1
        pos = jnp.where(pos == ne - 1, pos - 1, pos)
        stride = 1
        for b in bins[d + 1:]:
            stride *= b
        index = index + jnp.clip(pos, 0, bins[d] - 1) * stride
    acc = _acc(x.dtype)
    w = jnp.ones(x.shape[0], acc) if weight is None else weight.reshape(-1).astype(acc)
    total = 1
    for b in bins:
        total *= b
    hist = jnp.zeros(total, acc).at[index].add(jnp.where(keep, w, 0)).reshape(bins)
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            shape = [1] * len(bins)
            shape[d] = bins[d]
            hist = hist / jnp.diff(e.astype(acc)).reshape(shape)
    return hist.astype(x.dtype)


def _outer_edges(x, range_):
    """histogramdd's (left, right) per dim, as float64: range, or the data's
    min and max ((0, 1) for empty input); an empty range widens by 0.5."""
    d = x.shape[1]
    if range_ is not None:
        if len(range_) != 2 * d:
            raise RuntimeError(f"torch.histogramdd: for a {d}-dimensional histogram range should have "
                               f"{2 * d} elements, but got {len(range_)}")
        lo = jnp.asarray(range_[0::2], jnp.float64)
        hi = jnp.asarray(range_[1::2], jnp.float64)
    elif x.shape[0] == 0:
        lo, hi = jnp.zeros(d, jnp.float64), jnp.ones(d, jnp.float64)
    else:
        lo, hi = jnp.min(x, 0).astype(jnp.float64), jnp.max(x, 0).astype(jnp.float64)
    same = lo == hi
    return jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)


def _bin_edges(x, bins, range_):
    from .creation import _linspace
    _require(x.dtype in (jnp.float32, jnp.float64), NotImplementedError,
             f'"histogramdd" not implemented for \'{_TORCH_NAMES[jnp.dtype(x.dtype).name]}\'')
    bins = [bins] * x.shape[1] if isinstance(bins, int) else list(bins)
    if len(bins) != x.shape[1]:
        raise RuntimeError(f"torch.histogramdd: expected {x.shape[1]} sequences of bin edges for a "
                           f"{x.shape[1]}-dimensional histogram but got {len(bins)}")
    lo, hi = _outer_edges(x, range_)
    return [_linspace(lo[d], hi[d], b + 1, x.dtype) for d, b in enumerate(bins)]


def _rows(x):
    return x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)


@lower(aten.histc.default)
def histc(x, bins=100, min=0, max=0):
    from .creation import _linspace
    _require(jnp.issubdtype(x.dtype, jnp.floating), NotImplementedError,
             f'"histogram_cpu" not implemented for \'{_TORCH_NAMES[jnp.dtype(x.dtype).name]}\'')
    lo, hi = jnp.asarray(min, jnp.float64), jnp.asarray(max, jnp.float64)
    if x.size:
        same = lo == hi
        lo = jnp.where(same, jnp.min(x).astype(jnp.float64), lo)
        hi = jnp.where(same, jnp.max(x).astype(jnp.float64), hi)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    edges = _linspace(lo, hi, bins + 1, x.dtype)
    # histc divides without the neighbouring-edge correction.
    return _hist_kernel(x.reshape(-1, 1), [edges], None, False, True, local_search=False)


@lower(aten.histogram.bin_ct)
def histogram_bin_ct(x, bins=100, *, range=None, weight=None, density=False):
    edges = _bin_edges(x.reshape(-1, 1), [bins], range)
    return _hist_kernel(x.reshape(-1, 1), edges, weight, density, True), edges[0]


@lower(aten.histogram.bins_tensor)
def histogram_bins_tensor(x, bins, *, weight=None, density=False):
    return _hist_kernel(x.reshape(-1, 1), [bins.astype(x.dtype)], weight, density, False), bins


@lower(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(x, bins, *, range=None, weight=None, density=False):
    return _bin_edges(_rows(x), bins, range)


@lower(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(x, bins, *, range=None, weight=None, density=False):
    x = _rows(x)
    return _hist_kernel(x, _bin_edges(x, bins, range), weight, density, True)


@lower(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(x, bins, *, weight=None, density=False):
    return _hist_kernel(_rows(x), [b.astype(x.dtype) for b in bins], weight, density, False)


# ---- segment reductions ------------------------------------------------------------

def _segment_layout(data, lengths, offsets, axis):
    """data as (outer, N, inner); each position's segment (outer, N), S where
    it lies in none; the segment lengths (outer, S)."""
    axis = axis % data.ndim
    outer = 1
    for s in data.shape[:axis]:
        outer *= s
    d = data.reshape(outer, data.shape[axis], -1)
    if lengths is not None:
        n = lengths.reshape(outer, -1).astype(jnp.int64)
        ends = jnp.cumsum(n, 1)
        starts = ends - n
    else:
        off = offsets.reshape(outer, -1).astype(jnp.int64)
        starts, ends = off[:, :-1], off[:, 1:]
    count = starts.shape[1]
    j = jnp.arange(d.shape[1], dtype=jnp.int64)
    seg = jnp.sum(ends[:, None, :] <= j[None, :, None], axis=2)  # segments ended by j
    inside = (seg < count) & (j[None] >= jnp.take_along_axis(starts, jnp.minimum(seg, count - 1), 1))
    return d, jnp.where(inside, seg, count), ends - starts


def _segment_apply(fn, d, seg, count):
    import jax
    return jax.vmap(lambda v, s: fn(v, s, num_segments=count))(d, seg)


@lower(aten.segment_reduce.default)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0,
                   unsafe=False, initial=None):
    import jax
    out_dtype = data.dtype
    d, seg, n = _segment_layout(data, lengths, offsets, axis)
    d = d.astype(_acc(out_dtype))
    count = n.shape[1]
    n = n[:, :, None]
    init = None if initial is None else jnp.asarray(initial).astype(d.dtype)
    if reduce in ("max", "min"):
        fn = jax.ops.segment_max if reduce == "max" else jax.ops.segment_min
        out = _segment_apply(fn, d, seg, count)
        if init is not None:
            out = jnp.maximum(out, init) if reduce == "max" else jnp.minimum(out, init)
        # NaN sticks once met
        nan = _segment_apply(jax.ops.segment_max, jnp.isnan(d), seg, count)
        out = jnp.where(nan, jnp.nan, out)
    elif reduce == "prod":
        out = _segment_apply(jax.ops.segment_prod, d, seg, count)
        out = out if init is None else init * out
    else:
        out = _segment_apply(jax.ops.segment_sum, d, seg, count)
        out = out if init is None else init + out
        if reduce == "mean":
            empty = jnp.nan if init is None else init
            out = jnp.where(n == 0, empty, jnp.where(jnp.isnan(out), out, out / jnp.maximum(n, 1)))
    shape = list(data.shape)
    shape[axis % data.ndim] = count
    return out.reshape(shape).astype(out_dtype)


def _segmented_scan(op, x, seg):
    """Inclusive scan of op along axis 1 restarting at each new segment."""
    def combine(a, b):
        (sa, va), (sb, vb) = a, b
        return sb, jnp.where(sa == sb, op(va, vb), vb)
    return lax.associative_scan(combine, (jnp.broadcast_to(seg[:, :, None], x.shape), x), axis=1)[1]


@lower(aten._segment_reduce_backward.default)
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0,
                            initial=None):
    import jax
    out_dtype = data.dtype
    d, seg, n = _segment_layout(data, lengths, offsets, axis)
    acc = _acc(out_dtype)
    d = d.astype(acc)
    count = n.shape[1]
    g = grad.reshape(d.shape[0], count, -1).astype(acc)
    o = output.reshape(d.shape[0], count, -1).astype(acc)
    inside = (seg < count)[:, :, None]
    at = jnp.minimum(seg, count - 1)[:, :, None]
    gs = jnp.where(inside, jnp.take_along_axis(g, at, 1), 0)
    os_ = jnp.take_along_axis(o, at, 1)
    if reduce == "sum":
        out = gs
    elif reduce == "mean":
        out = gs / jnp.maximum(jnp.take_along_axis(n[:, :, None], at, 1), 1).astype(acc)
    elif reduce in ("max", "min"):
        hit = inside & (jnp.isnan(d) | (d == os_))
        out = jnp.where(hit, gs, 0)
        ties = jnp.take_along_axis(_segment_apply(jax.ops.segment_sum, hit.astype(acc), seg, count), at, 1)
        # CPU shares the gradient among ties only where it is positive.
        out = jnp.where((ties >= 2) & (out > 0), out / ties, out)
    else:  # prod
        one = jnp.ones((), acc)
        start = one if initial is None else jnp.asarray(initial).astype(acc)
        before = _segmented_scan(jnp.multiply, d, seg)
        after = jnp.flip(_segmented_scan(jnp.multiply, jnp.flip(d, 1), jnp.flip(seg, 1)), 1)
        # the product of the segment's other elements: before it times after it
        shift_b = jnp.concatenate([jnp.ones_like(before[:, :1]), before[:, :-1]], 1)
        seg_b = jnp.concatenate([jnp.full_like(seg[:, :1], -1), seg[:, :-1]], 1)[:, :, None]
        shift_a = jnp.concatenate([after[:, 1:], jnp.ones_like(after[:, :1])], 1)
        seg_a = jnp.concatenate([seg[:, 1:], jnp.full_like(seg[:, :1], -1)], 1)[:, :, None]
        segc = seg[:, :, None]
        excl = start * jnp.where(seg_b == segc, shift_b, one) * jnp.where(seg_a == segc, shift_a, one)
        special = jnp.isnan(d) | (d == 0)
        out = jnp.where(inside, jnp.where(special, gs * excl, (gs * os_) / jnp.where(special, one, d)), 0)
    return out.reshape(data.shape).astype(out_dtype)
