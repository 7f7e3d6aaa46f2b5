"""PyTorch's meta kernels, run for an op call's result shapes, dtypes and
errors (and stored on disk for the next process), and the trees of leaves
both they and the lowerings return."""
import warnings

import torch

from .. import cache
from ..tensor import TpuTensor


def flatten(tree, leaves):
    """Leaves (arrays/tensors) in order; returns a template to rebuild."""
    if isinstance(tree, (tuple, list)):
        return (type(tree), [flatten(t, leaves) for t in tree])
    if tree is None:
        return None
    leaves.append(tree)
    return ...


def unflatten(template, leaves):
    if template is ...:
        return leaves[0]
    return _build(template, iter(leaves))


def _build(template, it):
    # Not a closure: a self-referencing closure would keep the results alive
    # in a reference cycle until the next garbage collection.
    if template is ...:
        return next(it)
    if template is None:
        return None
    kind, items = template
    return kind(_build(x, it) for x in items)


def meta_like(value, contiguous=False):
    if isinstance(value, TpuTensor):
        if contiguous:
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() == 0:
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(meta_like(v, contiguous) for v in value)
    if isinstance(value, torch.device) and value.type == "tpu":
        return _META
    return value


_META = torch.device("meta")


# Ops whose meta kernels are torch's or torchtpu's code (so the versions
# in a record's key name them): their outcomes may be stored on disk.
_STORED_META_NAMESPACES = frozenset({"aten", "prims", "torchtpu"})


def _stored_meta_key(plan, pos_specs, kw_specs, what):
    """The text a meta kernel's outcome for this call is stored under, or
    None when it is not stored (a meta kernel of code not in the key)."""
    if getattr(plan.func, "namespace", None) not in _STORED_META_NAMESPACES \
            or getattr(plan.lowering, "process_local", False):
        return None
    text = repr((what, plan.name, plan.kind, pos_specs, kw_specs))
    return None if " at 0x" in text else text  # (not describable across processes)


def meta_outcome(plan, pos_specs, kw_specs, run):
    """run() (run_meta for this call), or the outcome an earlier process
    stored for a call of the same specs: a meta kernel is a function of what
    the specs describe, as the in-memory kernel cache already assumes, and a
    call that raised stored nothing (so its error is raised again)."""
    text = _stored_meta_key(plan, pos_specs, kw_specs, "meta")
    if text is None:
        return run()
    return _stored(text, run, _encode_meta, _decode_meta)


def written_checked(plan, pos_specs, kw_specs, run):
    """run() (core._check_written: PyTorch's checks of a mutating op, and
    whether an out= tensor was resized), or False when an earlier process's
    call of the same specs passed them and resized nothing."""
    text = _stored_meta_key(plan, pos_specs, kw_specs, "written")
    if text is None:
        return run()
    return _stored(text, run, lambda resized: None if resized else False, _decode_false)


def _stored(text, run, encode, decode):
    """cache.stored_value for a meta kernel's outcome; one that warned is not
    stored (a later process would not warn), and its warnings are issued as
    they came, under the program's filters."""
    warned = []

    def compute():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return run()
            finally:
                warned.extend(caught)  # issued below, under the program's own filters

    try:
        return cache.stored_value(text, compute, lambda v: None if warned else encode(v), decode)
    finally:
        for w in warned:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _decode_false(data):
    if data is not False:
        raise ValueError(f"{data!r} is not a stored check")
    return False


def _encode_meta(out_meta):
    """A run_meta outcome as JSON data, or None when it does not round-trip."""
    if out_meta is None:
        return {"none": True}
    leaves, template = out_meta
    parts = []
    for m in leaves:
        if m.layout != torch.strided or m.storage_offset() or m.is_conj() or m.is_neg():
            return None
        parts.append([list(m.shape), list(m.stride()), str(m.dtype).removeprefix("torch.")])
    try:
        return {"leaves": parts, "tree": cache.encode_tree(template)}
    except TypeError:
        return None


def _decode_meta(data):
    if data.get("none"):
        return None
    leaves = []
    for shape, stride, name in data["leaves"]:
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name} is not a dtype")
        leaves.append(torch.empty_strided([int(n) for n in shape], [int(n) for n in stride],
                                          dtype=dtype, device="meta"))
    return leaves, cache.decode_tree(data["tree"])


def _all_empty(args, kwargs):
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, TpuTensor)]
    return bool(tensors) and all(t.numel() == 0 for t in tensors)


def _empty_cpu(value):
    if isinstance(value, TpuTensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
    return value


def _on_empty_cpu(out):
    if isinstance(out, torch.Tensor):
        return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
    if isinstance(out, (list, tuple)):
        return type(out)(_on_empty_cpu(v) for v in out)
    return out


def run_meta(func, args, kwargs, contiguous=False, adapt=None):
    """PyTorch's own shape/dtype inference and error checks for this call, or
    None when the op has no meta kernel. contiguous: give it contiguous
    inputs (view_copy's meta kernel rejects strides its CPU kernel takes).
    adapt(args, kwargs) -> (args, kwargs): the meta kernel's arguments where
    its checks are narrower than the op (the lowering's meta_args)."""
    margs = [meta_like(a, contiguous) for a in args]
    mkwargs = {k: meta_like(v, contiguous) for k, v in kwargs.items()}
    if adapt is not None:
        margs, mkwargs = adapt(margs, mkwargs)
    try:
        out = func(*margs, **mkwargs)
    except NotImplementedError:
        return None
    except AttributeError:
        # A meta kernel tripping on a None it should accept (that of
        # _thnn_fused_lstm_cell without biases reads their .device).
        return None
    except RuntimeError as e:
        msg = str(e)
        if "meta" in msg.lower() and ("not implemented" in msg.lower() or "could not run" in msg.lower()):
            return None
        raise
    except TypeError as e:
        # A meta kernel handing torch._check an int for an empty input
        # (upsample_nearest*d of a batch of 0): CPU's kernel on the same
        # empty tensors gives the result's shape, or CPU's error.
        if "cond must be a bool" not in str(e) or not _all_empty(args, kwargs):
            raise
        out = _on_empty_cpu(func(*[_empty_cpu(a) for a in args],
                                 **{k: _empty_cpu(v) for k, v in kwargs.items()}))
    leaves = []
    template = flatten(out, leaves)
    if not all(isinstance(x, torch.Tensor) for x in leaves):
        return None
    return leaves, template
