"""Kernel keys and kernels: each argument's static spec (its storage slot
and view, or a static value; dynamic scalars are fed, not keyed), the
traceable function that materializes the views, runs the lowering, casts to
the meta kernel's dtypes and writes written arguments back, and PyTorch's
meta kernels run for shapes and dtypes."""
import itertools
import warnings

import jax.numpy as jnp
import torch

from .. import bounds, cache, properties, runtime
from ..ops import ctx
from ..ops import random as rng
from ..tensor import (DEVICES, GrownStorage, TpuTensor, View, Window, _is_contiguous, contiguous_strides,
                      grown_view, read_view, read_view_at, write_view, write_view_at)
from .host import to_tpu
from .plans import _DYNAMIC_SCALAR_TYPES, _INDICES, _SCALARS


class Kernel:
    """One compiled op: fn (traceable, reused by fused mode), jitted, and how
    to rebuild its outputs."""
    __slots__ = ("fn", "jitted", "name", "out_dtypes", "out_tree", "written_slots", "avals",
                 "stable_key", "bound", "device", "specs")

    def __init__(self, name, fn, out_dtypes, written_slots, stable_key=None, bound=None, device=0):
        self.name = name
        # The index of the device it runs on, and its results live on.
        self.device = device
        # The bounds.Bound whose flag fn returns as its last output (torchtpu.bounds).
        self.bound = bound
        # The kernel described the same way in every process (fused mode's
        # stored programs), or None.
        self.stable_key = stable_key
        self.fn = fn
        self.out_dtypes = out_dtypes
        self.out_tree = None
        # The storages an in-place op writes, in the order fn returns them.
        self.written_slots = written_slots
        self.avals = None  # output avals, filled by fused mode on first use
        self.specs = None  # (positional, keyword) argument specs: its key (torchtpu.recompiles)
        # Loaded from its record or compiled, at its first call.
        self.jitted = cache.jit_kernel(self, fn, _kernel_name(name), device)


def _kernel_name(name):
    return "tpu_" + "".join(c if c.isalnum() else "_" for c in name)


def _flatten(tree, leaves):
    """Leaves (arrays/tensors) in order; returns a template to rebuild."""
    if isinstance(tree, (tuple, list)):
        return (type(tree), [_flatten(t, leaves) for t in tree])
    if tree is None:
        return None
    leaves.append(tree)
    return ...


def _unflatten(template, leaves):
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


class _Call:
    """One op call split into what keys its kernel and what feeds it: the
    storages (and their arrays, in slot order) and the dynamic scalars."""
    __slots__ = ("storages", "arrays", "slots", "dynamic", "args", "reads_grown")

    def __init__(self, storages, arrays, slots, args, reads_grown=False):
        self.storages = storages
        self.arrays = arrays
        self.slots = slots  # storage -> slot (Storage hashes by identity)
        self.dynamic = []
        self.args = args  # (args, kwargs) of the op
        # Whether views of grown storages may be read from their padded
        # arrays (not for an op that writes: it writes the exact array).
        self.reads_grown = reads_grown

    def device(self):
        """Where a CPU scalar argument goes (see first_device)."""
        return first_device(*self.args)


def first_device(args, kwargs):
    """The device index of an op's first tpu tensor argument, else the
    current device's."""
    for a in itertools.chain(args, kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if type(t) is TpuTensor:
                return t._storage.device
    return properties.current_index()


def _tensor_spec(call, t):
    """A tpu tensor's spec: its storage's slot in this call, then its key."""
    storage = t._storage
    if type(storage) is GrownStorage and t._view is not None and call.reads_grown:
        spec = _grown_spec(call, t)
        if spec is not None:
            return spec
    slot = call.slots.get(storage)
    if slot is None:
        slot = call.slots[storage] = len(call.storages)
        call.storages.append(storage)
        call.arrays.append(storage.array)
    return ("t", slot) + t._key


def grown_readable(t):
    """Whether a view t of a grown storage can be read from the padded array
    at a run-time offset."""
    return t._storage.grown is not None and grown_view(t) is not None


def _grown_spec(call, t):
    """A view of a grown storage, read from its padded array at an offset
    fed at run time: ("d", slot, dtype, padded shape, Window, device), so
    each step of the growth reuses one kernel."""
    storage = t._storage
    grown = storage.grown
    if grown is None:
        return None
    found = grown_view(t)
    if found is None:
        return None
    view, offset = found
    padded = grown._storage
    slot = call.slots.get(padded)
    if slot is None:
        slot = call.slots[padded] = len(call.storages)
        call.storages.append(padded)
        call.arrays.append(padded.array)
    call.dynamic.append(offset)
    return ("d", slot, t._key[0], tuple(grown.shape), view, t._key[3])


def _spec(call, value, tensorish):
    """The static description of one argument (part of the kernel key)."""
    if isinstance(value, TpuTensor):
        return _tensor_spec(call, value)
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and (value.dim() == 0 or tensorish is _INDICES):
            return _spec(call, to_tpu(value, device=call.device()), tensorish)
        raise _device_mismatch(call.device(), value.device)
    if isinstance(value, (list, tuple)):
        if value and type(value[0]) is TpuTensor and all(type(v) is TpuTensor for v in value):
            # A foreach op's tensor lists.
            return ("l", tuple([_tensor_spec(call, v) for v in value]))
        if value and any(isinstance(v, torch.Tensor) for v in value):
            inner = _INDICES if tensorish is _INDICES else True
            return ("l", tuple(_spec(call, v, inner) for v in value))
        if tensorish is _SCALARS:
            return ("l", tuple(_spec(call, v, True) for v in value))
        return ("c", tuple(value))
    if tensorish and type(value) in _DYNAMIC_SCALAR_TYPES:
        call.dynamic.append(value)
        return ("s", type(value))
    if type(value) in _DYNAMIC_SCALAR_TYPES or type(value) is bool:
        # 4, 4.0 and True are equal keys; a static scalar's type matters
        # (arange(4) is int64, arange(4.0) float32).
        return ("c", value, type(value))
    if type(value) is torch.device and value.type == "tpu":
        if value.index is None:
            # "tpu": the current device, which the key must name.
            return ("c", DEVICES[properties.current_index()])
        properties.check_index(value.index)
    return ("c", value)


def _device_mismatch(index, other):
    """CUDA's error for an op given tensors of two devices."""
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two "
        f"devices, {DEVICES[index]} and {other}!")


def kernel_device(pos_specs, kw_specs):
    """The index of the device a call runs on: its tpu tensors' (which must
    agree, as CUDA requires), else its device= argument's, else the current
    device."""
    found = None
    stack = list(pos_specs) + [s for _, s in kw_specs]
    while stack:
        spec = stack.pop()
        kind = spec[0]
        if kind == "t" or kind == "d":
            if found is None:
                found = spec[5]
            elif spec[5] != found:
                raise _device_mismatch(min(found, spec[5]), DEVICES[max(found, spec[5])])
        elif kind == "l":
            stack.extend(spec[1])
        elif found is None and type(spec[1]) is torch.device and spec[1].type == "tpu":
            found = spec[1].index
    return properties.current_index() if found is None else found


def _materialize(spec, arrays, scalars, offsets):
    """An argument's value in the kernel; offsets: id(spec) -> the offset fed
    for each "d" spec (an op writing such a view writes it there)."""
    kind = spec[0]
    if kind == "t":
        return read_view(arrays[spec[1]], spec[4])
    if kind == "d":
        offset = offsets[id(spec)] = next(scalars)
        return read_view_at(arrays[spec[1]], spec[4], offset)
    if kind == "s":
        return next(scalars)
    if kind == "l":
        return [_materialize(s, arrays, scalars, offsets) for s in spec[1]]
    value = spec[1]
    return list(value) if isinstance(value, tuple) else value


def offsets_fed(pos_specs, kw_specs, dynamic):
    """Offsets as data: the specs with each tensor argument that views its
    storage at some offset read at an offset fed at run time ("d" specs, as
    a grown storage's views are), and the dynamic scalars with those offsets
    in their places; None when no argument is such a view. A kernel of
    these specs serves the op at every position of its views (data[i:i + n]
    at a moving i) with one compilation."""
    old, new = iter(dynamic), []

    def fed(spec):
        kind = spec[0]
        if kind == "t":
            view = spec[4]
            if type(view) is not View:
                return spec  # the whole storage, or a dtype view
            new.append(view.offset)
            return ("d", spec[1], spec[2], spec[3], Window(view.shape, view.stride), spec[5])
        if kind == "d" or kind == "s":
            new.append(next(old))
        elif kind == "l":
            return ("l", tuple([fed(s) for s in spec[1]]))
        return spec

    pos = tuple([fed(s) for s in pos_specs])
    kw = tuple([(k, fed(s)) for k, s in kw_specs])
    if len(new) == len(dynamic):
        return None
    return pos, kw, new


def _spec_contiguous(spec):
    """Whether a positional tensor argument is contiguous in PyTorch's sense
    (part of the kernel key, so a lowering may depend on it)."""
    if spec[0] != "t" and spec[0] != "d":
        return None
    view = spec[4]
    return view is None or _is_contiguous(view.shape, view.stride)


def _physical_order(meta):
    """The dim order in which a dense, non-overlapping but permuted result
    (a clone of a transposed tensor) lies in memory; None when contiguous."""
    shape, stride = tuple(meta.shape), meta.stride()
    if _is_contiguous(shape, stride):
        return None
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    compact = contiguous_strides([shape[d] for d in order])
    if any(shape[d] > 1 and stride[d] != c for d, c in zip(order, compact)):
        return None
    return tuple(order)


def _build_kernel(plan, pos_specs, kw_specs, n_storages, out_meta, orders=None, device=0):
    lowering = plan.lowering
    out_dtypes = out_tdtypes = None
    if out_meta is not None:
        out_tdtypes = [m.dtype for m in out_meta[0]]
        out_dtypes = [runtime.jax_dtype(d) for d in out_tdtypes]
    # Written arguments: (slot, view) of each, in schema order.
    written = []
    if plan.kind == "mutate":
        by_name = dict(kw_specs)
        for i, a in enumerate(plan.func._schema.arguments):
            if a.name in plan.written:
                spec = pos_specs[i] if i < len(pos_specs) else by_name[a.name]
                written.append(spec)
    written_slots = sorted({s[1] for s in _flat_written(written)})

    kernel = None
    bound = bounds.kernel_bound(plan)

    def fn(*flat):
        arrays = list(flat[:n_storages])
        # A checked kernel takes the index-bounds flag so far after the storages.
        scalars = iter(flat[n_storages + (bound is not None):])
        offsets = {}
        args = [_materialize(s, arrays, scalars, offsets) for s in pos_specs]
        kwargs = {k: _materialize(s, arrays, scalars, offsets) for k, s in kw_specs}
        if plan.kind == "mutate":
            _drop_out_args(plan, args, kwargs)
        if plan.random:
            kwargs["key"] = rng.key_from(next(scalars), next(scalars))
        flag = bounds.device_flag(bound, args, kwargs, flat[n_storages]) if bound is not None else None
        with ctx.tracing(out_meta[0] if out_meta is not None else None,
                         [_spec_contiguous(s) for s in pos_specs]):
            result = lowering(*args, **kwargs)
        leaves = []
        template = _flatten(result, leaves)
        if out_dtypes is not None and len(out_dtypes) == len(leaves):
            leaves = [x.astype(d) if x.dtype != d else x for x, d in zip(leaves, out_dtypes)]
            if torch.complex32 in out_tdtypes:
                leaves = [runtime.fit_to(x, d) for x, d in zip(leaves, out_tdtypes)]
        if orders:
            # Results stored in their memory order, viewed with CPU's strides.
            leaves = [x if o is None else jnp.transpose(x, o) for x, o in zip(leaves, orders)]
        if plan.kind == "mutate":
            new = leaves[plan.n_plain:]
            leaves = leaves[:plan.n_plain]
            for spec, value in zip(_flat_written(written), new):
                slot, dtype, view = spec[1], spec[2], spec[4]
                if dtype == torch.complex32:
                    value = runtime.fit_to(value.astype(jnp.complex64), dtype)
                if spec[0] == "d":
                    arrays[slot] = write_view_at(arrays[slot], view, offsets[id(spec)], value)
                else:
                    arrays[slot] = write_view(arrays[slot], view, value)
            kernel.out_tree = template
            if flag is not None:
                leaves.append(flag)
            return tuple(leaves), tuple(arrays[s] for s in written_slots)
        kernel.out_tree = template
        if flag is not None:
            leaves.append(flag)
        return tuple(leaves), ()

    stable = repr((plan.name, pos_specs, kw_specs, out_dtypes)) + (" checked" if bound else "")
    if " at 0x" in stable or getattr(lowering, "process_local", False):
        # Not describable across processes (a user's kernel: its code is not
        # in torchtpu's source digest).
        stable = None
    kernel = Kernel(plan.name, fn, out_dtypes, written_slots, stable,
                    bound, device)
    kernel.specs = (pos_specs, kw_specs)
    return kernel


def _flat_written(written):
    out = []
    for spec in written:
        if spec[0] == "l":
            out.extend(spec[1])
        elif spec[0] == "t" or spec[0] == "d":
            # Not an empty list (a fused Adam's max_exp_avg_sqs without amsgrad).
            out.append(spec)
    return out


def _drop_out_args(plan, args, kwargs):
    """The functional variant takes no out= arguments."""
    for i, a in enumerate(plan.func._schema.arguments):
        if a.is_out:
            kwargs.pop(a.name, None)
            if i < len(args):
                del args[i:]
                break


def _meta(value, contiguous=False):
    if isinstance(value, TpuTensor):
        if contiguous:
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() == 0:
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v, contiguous) for v in value)
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
    """run() (_run_meta for this call), or the outcome an earlier process
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
    """A _run_meta outcome as JSON data, or None when it does not round-trip."""
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


def _run_meta(func, args, kwargs, contiguous=False):
    """PyTorch's own shape/dtype inference and error checks for this call, or
    None when the op has no meta kernel. contiguous: give it contiguous
    inputs (view_copy's meta kernel rejects strides its CPU kernel takes)."""
    margs = [_meta(a, contiguous) for a in args]
    mkwargs = {k: _meta(v, contiguous) for k, v in kwargs.items()}
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
    leaves = []
    template = _flatten(out, leaves)
    if not all(isinstance(x, torch.Tensor) for x in leaves):
        return None
    return leaves, template
