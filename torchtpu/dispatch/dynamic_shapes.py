"""Ops whose result size depends on values: nonzero, boolean-mask indexing,
masked_select, unique, bincount and pack_padded_sequence. Each reads that
size back (one scalar, as CUDA does), then runs fixed-shape kernels."""
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
    """unique_consecutive of a 1-D tensor: (run values, each element's run
    index, run lengths); the run count is read back."""
    n = values.numel()
    new = torch.ones(n, dtype=torch.bool, device=values.device)
    if n > 1:
        new[1:] = values[1:] != values[:-1]
    starts = _nonzero(new)[:, 0]
    inverse = torch.cumsum(new, 0) - 1 if return_inverse else None
    counts = None
    if return_counts:
        ends = torch.cat([starts[1:], torch.full((1,), n, dtype=torch.long, device=values.device)])
        counts = ends - starts
    return values[starts], inverse, counts


def _no_index(x):
    return torch.empty(0, dtype=torch.long, device=x.device)


def _unique2(x, sorted=True, return_inverse=False, return_counts=False):
    flat = x.reshape(-1)
    values, perm = torch.sort(flat, stable=True)
    out, inverse, counts = _runs(values, return_inverse, True)
    if return_inverse:
        inverse = torch.empty_like(inverse).scatter_(0, perm, inverse).reshape(x.shape)
    return (out, inverse if return_inverse else _no_index(x),
            counts if return_counts else _no_index(x))


def _unique_consecutive(x, return_inverse=False, return_counts=False, dim=None):
    if dim is not None:
        return cpu_fallback(plan_of(aten.unique_consecutive.default), (x, return_inverse, return_counts),
                            {"dim": dim})
    out, inverse, counts = _runs(x.reshape(-1), return_inverse, return_counts)
    return (out, inverse.reshape(x.shape) if return_inverse else _no_index(x),
            counts if return_counts else _no_index(x))


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
SPECIAL[aten.nonzero.default] = _nonzero
SPECIAL[aten.nonzero.out] = _into(_nonzero)
SPECIAL[aten.masked_select.out] = _into(_masked_select)
SPECIAL[aten.index.Tensor] = _index
SPECIAL[aten.masked_select.default] = _masked_select
SPECIAL[aten.index_put.default] = _index_put
