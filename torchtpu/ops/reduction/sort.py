"""Sorting and selection: sort, argsort, topk, mode, kthvalue, median and
nanmedian, with the replay of CPU's partition steps that gives equal elements
CPU's indices (up to REPLAY_MAX elements)."""
import jax.numpy as jnp
import torch
from jax import lax

from ..registry import lower
from .common import _isnan, _require

from ...compat import aten


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


# torchtpu::sort_rows(x): the permutation that sorts the rows of a 2-D x
# lexicographically, CPU's order for unique(dim=): NaNs equal and last,
# -0.0 equal to 0.0, equal rows in index order.
_SORT_LIB = torch.library.Library("torchtpu", "FRAGMENT")
_SORT_LIB.define("sort_rows(Tensor x) -> Tensor")
_SORT_LIB.impl("sort_rows", lambda x: x.new_empty(x.shape[:1], dtype=torch.long), "Meta")


@lower(torch.ops.torchtpu.sort_rows.default)
def sort_rows(x):
    # Stable sorts by each column, last first: one loop whatever the width.
    def by_column(i, perm):
        col = lax.dynamic_index_in_dim(x, x.shape[1] - 1 - i, axis=1, keepdims=False)[perm]
        if jnp.issubdtype(col.dtype, jnp.floating):
            nan = jnp.isnan(col)
            keys = (nan.astype(jnp.int8), jnp.where(nan | (col == 0), jnp.zeros((), col.dtype), col))
        else:
            keys = (col.astype(jnp.int8) if col.dtype == jnp.bool_ else col,)
        return lax.sort(keys + (perm,), num_keys=len(keys), is_stable=True)[-1]
    return lax.fori_loop(0, x.shape[1], by_column, jnp.arange(x.shape[0], dtype=jnp.int64))


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
