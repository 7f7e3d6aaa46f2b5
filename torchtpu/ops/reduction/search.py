"""Searching sorted sequences (searchsorted, bucketize) and histograms
(histc, histogram, histogramdd), both with CPU's binary search."""
import jax.numpy as jnp
import torch

from ..creation import _linspace
from ..pointwise import _TORCH_NAMES
from ..registry import ctx, lower
from ..util import ctx_dtype, is_weak_scalar, jdt, tdt
from .common import _acc, _require

from ...compat import aten


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


def _histc_range(x, min, max, dtype):
    """histc's range in dtype: (min, max), the data's own when they are
    equal, then widened by 1 each way if still equal."""
    lo, hi = jnp.asarray(min).astype(dtype), jnp.asarray(max).astype(dtype)
    if x.size:
        same = lo == hi
        lo = jnp.where(same, jnp.min(x).astype(dtype), lo)
        hi = jnp.where(same, jnp.max(x).astype(dtype), hi)
    same = lo == hi
    return jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)


def _histc_int(x, bins, min, max):
    """CUDA's histc of an integer tensor (CPU has none; libraries pick it for
    every device but CPU and MPS): integer bins (x - min) * bins // (max -
    min), the top edge in the last bin, counts in the input's dtype."""
    v = x.reshape(-1).astype(jnp.int64)
    lo, hi = _histc_range(v, min, max, jnp.int64)
    keep = (v >= lo) & (v <= hi)
    pos = jnp.minimum((v - lo) * bins // jnp.maximum(hi - lo, 1), bins - 1)
    return jnp.zeros(bins, jnp.int64).at[jnp.where(keep, pos, 0)].add(keep.astype(jnp.int64)).astype(x.dtype)


@lower(aten.histc.default)
def histc(x, bins=100, min=0, max=0):
    if jnp.issubdtype(x.dtype, jnp.integer):
        return _histc_int(x, bins, min, max)
    _require(jnp.issubdtype(x.dtype, jnp.floating), NotImplementedError,
             f'"histogram_cpu" not implemented for \'{_TORCH_NAMES[jnp.dtype(x.dtype).name]}\'')
    lo, hi = _histc_range(x, min, max, jnp.float64)
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
