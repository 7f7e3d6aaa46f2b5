"""Ops whose result size depends on values: nonzero, boolean-mask indexing,
masked_select, unique, repeat_interleave, bincount, lstsq's residuals and
pack_padded_sequence. Each reads that size back (one scalar, as CUDA
does), then runs fixed-shape kernels."""
import torch

from ..ops.indexing import is_mask
from ..tensor import TpuTensor
from .core import _run_accepted, cpu_fallback, dispatch, plan_of
from .host import download, to_tpu
from .plans import SPECIAL
from .transfers import _into

from ..compat import aten



# Ops whose result size depends on values: read that size back (one scalar,
# as CUDA does), then run fixed-shape kernels. A boolean mask index is the
# long indices of its nonzero elements, as in PyTorch's own indexing.
def _is_mask(t):
    return isinstance(t, torch.Tensor) and is_mask(t) and t.dim() > 0


def _nonzero(x):
    n = download(dispatch(aten.count_nonzero.default, (x,), {}), "nonzero").item()
    return dispatch(aten.nonzero_static.default, (x,), {"size": n})


def _masks_as_indices(indices, device):
    out = []
    for i in indices:
        if _is_mask(i):
            if not isinstance(i, TpuTensor):
                i = to_tpu(i, device=device)
            if i.dtype == torch.uint8:
                i = dispatch(aten.ne.Scalar, (i, 0), {})
            nz = _nonzero(i)
            out.extend(dispatch(aten.select.int, (nz, 1, d), {}) for d in range(i.dim()))
        else:
            out.append(i)
    return out


def _index(x, indices):
    if any(_is_mask(i) for i in indices):
        indices = _masks_as_indices(indices, x._storage.device)
    return _run_accepted(plan_of(aten.index.Tensor), (x, indices), {})


def _index_put(x, indices, values, accumulate=False):
    # A mask whose selected values vary along it needs their positions.
    plan = plan_of(aten.index_put.default)
    if not plan.accepts(x, indices, values, accumulate):
        indices = _masks_as_indices(indices, x._storage.device)
    return _run_accepted(plan, (x, indices, values, accumulate), {})


def _masked_select(x, mask):
    x, mask = dispatch(aten.broadcast_tensors.default, ([x, mask],), {})
    if x.dim() == 0:  # a 0-d mask selects from one element, as on CPU
        x, mask = x.reshape(1), mask.reshape(1)
    return _index(x, [mask])


def _runs(values, return_inverse, return_counts):
    """unique_consecutive along the first dim of values (elements, or rows
    of a 2-D tensor): (each run's first position, each element's run index,
    run lengths); the run count is read back."""
    n = values.shape[0]
    new = torch.ones(n, dtype=torch.bool, device=values.device)
    if n > 1:
        differs = values[1:] != values[:-1]
        new[1:] = differs.any(1) if differs.dim() > 1 else differs
    starts = _nonzero(new)[:, 0]
    inverse = torch.cumsum(new, 0) - 1 if return_inverse else None
    counts = None
    if return_counts:
        ends = torch.cat([starts[1:], torch.full((1,), n, dtype=torch.long, device=values.device)])
        counts = ends - starts
    return starts, inverse, counts


def _no_index(x):
    return torch.empty(0, dtype=torch.long, device=x.device)


def _unique2(x, sorted=True, return_inverse=False, return_counts=False):
    flat = x.reshape(-1)
    values, perm = torch.sort(flat, stable=True)
    starts, inverse, counts = _runs(values, return_inverse, True)
    if return_inverse:
        inverse = torch.empty_like(inverse).scatter_(0, perm, inverse).reshape(x.shape)
    return (values[starts], inverse if return_inverse else _no_index(x),
            counts if return_counts else _no_index(x))


def _unique_rows(x, dim, args, kwargs, func):
    """unique(dim=) (func unique_dim: rows sorted first) or
    unique_consecutive(dim=) of x. CPU returns the inverse and the counts
    whatever the flags say."""
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        return cpu_fallback(plan_of(func), args, kwargs)  # its error
    if x.numel() == 0:
        if sum(size == 0 for size in x.shape) > 1:
            raise RuntimeError("Number of zero sized dimensions is more than one, so unique cannot be applied ")
        if x.shape[dim] != 0:
            raise RuntimeError("There are 0 sized dimensions, and they aren't selected, so unique cannot be applied")
        return torch.empty_like(x), _no_index(x), _no_index(x)
    rows = x.movedim(dim, 0).reshape(x.shape[dim], -1)
    if func is aten.unique_consecutive.default:
        starts, inverse, counts = _runs(rows, True, True)
        return x.index_select(dim, starts), inverse, counts
    perm = torch.ops.torchtpu.sort_rows(rows)
    starts, inverse, counts = _runs(rows[perm], True, True)
    inverse = torch.empty_like(inverse).scatter_(0, perm, inverse)
    return x.index_select(dim, perm[starts]), inverse, counts


def _unique_dim(x, dim, sorted=True, return_inverse=False, return_counts=False):
    return _unique_rows(x, dim, (x, dim, sorted, return_inverse, return_counts), {}, aten.unique_dim.default)


def _unique_consecutive(x, return_inverse=False, return_counts=False, dim=None):
    if dim is not None:
        return _unique_rows(x, dim, (x, return_inverse, return_counts), {"dim": dim},
                            aten.unique_consecutive.default)
    starts, inverse, counts = _runs(x.reshape(-1), return_inverse, return_counts)
    return (x.reshape(-1)[starts], inverse.reshape(x.shape) if return_inverse else _no_index(x),
            counts if return_counts else _no_index(x))


def _repeat_interleave(repeats, output_size=None):
    """The indices repeat_interleave repeats: i, repeats[i] times. The total
    and the smallest count are read back (one transfer), as on CPU, which
    checks both even when given output_size."""
    if repeats.dim() != 1 or repeats.dtype not in (torch.int32, torch.int64):
        return cpu_fallback(plan_of(aten.repeat_interleave.Tensor), (repeats,), {"output_size": output_size})
    if repeats.numel() == 0:
        return torch.empty(0, dtype=repeats.dtype, device=repeats.device)
    ends = torch.cumsum(repeats, 0)
    total, low = download(torch.stack([ends[-1], repeats.min().to(ends.dtype)]), "repeat_interleave").tolist()
    if low < 0:
        raise RuntimeError("repeats can not be negative")
    if output_size is not None and output_size != total:
        raise RuntimeError("allocated size does not match required size")
    positions = torch.arange(total, dtype=ends.dtype, device=repeats.device)
    return torch.searchsorted(ends, positions, right=True).to(repeats.dtype)


def _unique(x, sorted=True, return_inverse=False):
    return _unique2(x, sorted, return_inverse)[:2]


def _bincount(x, weights=None, minlength=0):
    if x.dim() != 1 or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        return cpu_fallback(plan_of(aten.bincount.default), (x, weights, minlength), {})  # its error
    size = minlength
    if x.numel():
        low, high = download(torch.stack(torch.aminmax(x)), "bincount").tolist()
        if low < 0:
            raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
        size = max(size, high + 1)
    if weights is None:
        dtype, weights = torch.long, torch.ones_like(x, dtype=torch.long)
    else:
        dtype = weights.dtype if weights.dtype in (torch.float32, torch.float64) else torch.float64
    return torch.zeros(size, dtype=dtype, device=x.device).index_add_(0, x, weights.to(dtype))


def _lstsq(a, b, rcond=None, *, driver=None):
    """gelsd and gelss return residuals (m > n) only when every matrix has
    full rank: the ranks are read back to say which."""
    out = _run_accepted(plan_of(aten.linalg_lstsq.default), (a, b, rcond), {"driver": driver})
    m, n = a.shape[-2:]
    if driver in ("gelsd", "gelss") and m > n and n > 0:
        solution, residuals, rank, values = out
        if not download((rank == n).all(), "linalg_lstsq").item():
            return solution, residuals.new_empty(0), rank, values
    return out


def _pack_padded_sequence(input, lengths, batch_first):
    """PyTorch's own composite kernel, as for a CUDA input: `lengths` and the
    `batch_sizes` it returns live on the host (where the RNN ops and
    pad_packed_sequence read them), and it slices the input with ops that
    come back here."""
    return aten._pack_padded_sequence.default._op_dk(
        torch._C.DispatchKey.CompositeExplicitAutograd, input, lengths, batch_first)


SPECIAL[aten._pack_padded_sequence.default] = _pack_padded_sequence
SPECIAL[aten._unique2.default] = _unique2
SPECIAL[aten._unique.default] = _unique
SPECIAL[aten.bincount.default] = _bincount
SPECIAL[aten.unique_consecutive.default] = _unique_consecutive
SPECIAL[aten.unique_dim.default] = _unique_dim
SPECIAL[aten.repeat_interleave.Tensor] = _repeat_interleave
SPECIAL[aten.linalg_lstsq.default] = _lstsq
SPECIAL[aten.nonzero.default] = _nonzero
SPECIAL[aten.nonzero.out] = _into(_nonzero)
SPECIAL[aten.masked_select.out] = _into(_masked_select)
SPECIAL[aten.index.Tensor] = _index
SPECIAL[aten.masked_select.default] = _masked_select
SPECIAL[aten.index_put.default] = _index_put
