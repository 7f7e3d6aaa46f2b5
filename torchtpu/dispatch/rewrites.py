"""Ops the dispatcher rewrites into others before lowering: views that may
be copies, as_strided_scatter, in-place ops whose functional variant takes
other arguments, legacy batch-norm ops, questions answered with one value
read back (equal, allclose, linalg's error checks) or from sizes alone
(_has_same_storage_numel), x.new_* factories (the factory, with x's
dtype and device), composite out= kernels
that would not write out=, and the refusal of sparse layouts."""
import math

import torch

from .core import _run_lowered, dispatch, plan_of
from .host import download, no_sparse
from .plans import SPECIAL
from .transfers import _copy_, _into, _local_scalar_dense

from ..compat import aten


def _unsafe_view(x, size):
    # A view (composites reshape an out= tensor with it and write through),
    # or a copy where the strides allow no view, as reshape would.
    try:
        return dispatch(aten.view.default, (x, size), {})
    except RuntimeError:
        return _run_lowered(plan_of(aten._unsafe_view.default), (x, size), {})


SPECIAL[aten._unsafe_view.default] = _unsafe_view


def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    # As CPU (clone_preserve_strides): the absolute offset and strides address
    # a copy of x's whole storage, which the result views as x views its own.
    if torch._debug_has_internal_overlap(x) == 1:
        out = x.clone()
    else:
        full = x.as_strided((math.prod(x._storage.array.shape),), (1,), 0).clone()
        out = full.as_strided(x.shape, x.stride(), x.storage_offset())
    out.as_strided(size, stride, storage_offset or 0).copy_(src)
    return out


SPECIAL[aten.as_strided_scatter.default] = _as_strided_scatter


def _polygamma_(x, n):
    # The functional variant takes (n, self), an order _functional_variant
    # does not match.
    return _copy_(x, dispatch(aten.polygamma.default, (n, x), {}))


SPECIAL[aten.polygamma_.default] = _polygamma_


# Ops that answer a Python bool: computed on tpu, one value read back.
def _all_true(t):
    return bool(_local_scalar_dense(dispatch(aten.all.default, (t,), {})))


def _equal(a, b):
    if a.shape != b.shape:
        return False
    return _all_true(dispatch(aten.eq.Tensor, (a, b), {}))


def _allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    return _all_true(dispatch(aten.isclose.default, (a, b, rtol, atol, equal_nan), {}))


SPECIAL[aten.equal.default] = _equal
SPECIAL[aten.allclose.default] = _allclose



# Composite out= kernels that, for a tensor subclass, return a new tensor
# instead of writing out= (matrix_rank's isTensorSubclassLike branch):
# device.py routes them here, past the composite, to write out= themselves.
OUT_VIA_FUNCTIONAL = {
    aten.linalg_matrix_rank.atol_rtol_tensor_out: aten.linalg_matrix_rank.atol_rtol_tensor,
    aten.linalg_matrix_rank.atol_rtol_float_out: aten.linalg_matrix_rank.atol_rtol_float,
    aten.linalg_matrix_rank.out: aten.linalg_matrix_rank.default,
    aten.linalg_matrix_rank.out_tol_tensor: aten.linalg_matrix_rank.tol_tensor,
}
SPECIAL.update({op: _into(functional) for op, functional in OUT_VIA_FUNCTIONAL.items()})


def _linalg_check_errors(info, api_name, *, is_matrix):
    # LAPACK's info decides whether linalg.inv & co. raise: read it back, as
    # CUDA does, and let PyTorch's own check word the error.
    aten._linalg_check_errors.default(download(info, "linalg_check"), api_name, is_matrix=is_matrix)


SPECIAL[aten._linalg_check_errors.default] = _linalg_check_errors


def _has_same_storage_numel(base, other):
    # Forward-mode AD's check on a tangent's storage (torch.func.jvp): a
    # question of sizes, answered as ATen does, with no device work.
    return base.untyped_storage().nbytes() // base.element_size() == other.numel()


SPECIAL[aten._has_same_storage_numel.default] = _has_same_storage_numel


def _factory_of(factory):
    """x.new_ones(size) and the other new_* ops: the factory itself, with
    x's dtype and device where none is given. x gives nothing else, so its
    values are not read (a grown attention mask, `mask.new_ones((b, 1))` in
    generate's loop, is not cut to its length each step) and its shape keys
    no kernel (the factory compiles once for its size, not once per x)."""
    def run(x, *args, dtype=None, layout=None, device=None, pin_memory=None):
        return factory(*args, dtype=x.dtype if dtype is None else dtype, layout=layout,
                       device=x.device if device is None else device, pin_memory=pin_memory)
    return run


for _new, _factory in ((aten.new_empty.default, aten.empty.memory_format),
                       (aten.new_empty_strided.default, aten.empty_strided.default),
                       (aten.new_zeros.default, aten.zeros.default),
                       (aten.new_ones.default, aten.ones.default),
                       (aten.new_full.default, aten.full.default)):
    SPECIAL[_new] = _factory_of(_factory)


def _native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    # A legacy op that updates the running stats without saying so in its
    # schema; _native_batch_norm_legit is the same op, annotated.
    if running_mean is None and running_var is None:
        return dispatch(aten._native_batch_norm_legit.no_stats,
                        (input, weight, bias, training, momentum, eps), {})
    return dispatch(aten._native_batch_norm_legit.default,
                    (input, weight, bias, running_mean, running_var, training, momentum, eps), {})


SPECIAL[aten.native_batch_norm.default] = _native_batch_norm


def _batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    # Training-mode batch norm plus CPU's empty reserve buffer.
    out = dispatch(aten._native_batch_norm_legit.default,
                   (input, weight, bias, running_mean, running_var, True, momentum, eps), {})
    return (*out, torch.empty(0, dtype=torch.uint8, device=input.device))


SPECIAL[aten._batch_norm_with_update.default] = _batch_norm_with_update


def _view_then_copy(view):
    """An X_copy op: view X's result, copied out contiguous (as its CPU kernel)."""
    def run(*args, **kwargs):
        out = dispatch(view, args, kwargs)
        if isinstance(out, (list, tuple)):
            return [dispatch(aten.clone.default, (t,), _CONTIGUOUS) for t in out]
        return dispatch(aten.clone.default, (out,), _CONTIGUOUS)
    return run


_CONTIGUOUS = {"memory_format": torch.contiguous_format}
# The view-copy ops torch._decomp has no entry for (functionalized programs
# and torch.func's map emit them).
for _name, _overload in (("select_copy", "int"), ("slice_copy", "Tensor"), ("split_copy", "Tensor"),
                         ("detach_copy", "default"), ("view_as_real_copy", "default"),
                         ("view_as_complex_copy", "default"), ("_conj_copy", "default"),
                         ("_neg_view_copy", "default")):
    SPECIAL[getattr(getattr(aten, _name), _overload)] = _view_then_copy(
        getattr(getattr(aten, _name[:-len("_copy")]), _overload))


# Conversions to sparse, and sparse tensors built on tpu (a sparse CPU
# tensor's .to("tpu")).
for _name in ("_to_sparse", "_to_sparse_csr", "_to_sparse_csc", "_to_sparse_bsr", "_to_sparse_bsc",
              "_sparse_coo_tensor_with_dims_and_tensors", "_sparse_coo_tensor_with_dims",
              "_sparse_compressed_tensor_unsafe", "sparse_compressed_tensor"):
    for _overload in getattr(aten, _name).overloads():
        SPECIAL[getattr(getattr(aten, _name), _overload)] = no_sparse


# x |= m and friends: PyTorch's decomposition calls the out-of-place
# overload packet, whose overload matching formats (prints, so syncs) the
# tensors of every overload it rejects. Their bitwise_*_ ops are the same.
def _alias_of(target):
    return lambda *args, **kwargs: dispatch(target, args, kwargs)


for _dunder, _bitwise in (("and", "and"), ("or", "or"), ("xor", "xor"),
                          ("lshift", "left_shift"), ("rshift", "right_shift")):
    _packet = getattr(aten, f"bitwise_{_bitwise}_")
    SPECIAL[getattr(aten, f"__i{_dunder}__").Tensor] = _alias_of(_packet.Tensor)
    SPECIAL[getattr(aten, f"__i{_dunder}__").Scalar] = _alias_of(
        _packet.Scalar if "Scalar" in _packet.overloads() else _packet.Tensor_Scalar)
