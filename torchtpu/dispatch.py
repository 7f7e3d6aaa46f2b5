"""__torch_dispatch__: find the lowering, apply view and mutation rules from the
op's schema, hand the kernel to the active executor.

The one place for view and mutation rules:
- an op whose schema returns an alias of an input without writing it is a
  view: its result shares the input's Storage, with shape/stride/offset taken
  from PyTorch's own meta kernel;
- an op whose schema writes arguments (in-place, out=, running stats) runs
  its functional variant, and the kernel writes the results back into the
  written tensors' storages through their views.
"""
import functools
import itertools
import math
import sys
import warnings

import jax.numpy as jnp
import torch
from torch._decomp import decomposition_table

from . import advisor, bounds, cache, errors, metrics, modes, pinned, runtime
from .ops import LOWERINGS, ctx
from .ops import random as rng
from .ops.indexing import is_mask
from .tensor import (Lost, Storage, TpuTensor, _is_contiguous, contiguous_strides, make_view,
                     read_view, view_tensor, whole_tensor, write_view)

aten = torch.ops.aten

_DYNAMIC_SCALAR_TYPES = (int, float, complex)
_TENSORISH = ("Tensor", "Optional[Tensor]", "number", "Optional[number]")
# Index lists (Tensor?[]) may hold CPU tensors, as with CUDA tensors.
_INDICES = "indices"
# Scalar[] elements are dynamic like Scalars (optimizers' per-step lists).
_SCALARS = "scalars"


# ---- per-op plans ----------------------------------------------------------

class Plan:
    """What the dispatcher needs to know about one OpOverload, made once."""
    __slots__ = ("func", "name", "kind", "lowering", "functional", "written",
                 "n_plain", "result_sources", "tensorish", "view_cache", "random",
                 "accepts", "special", "custom_default", "pos_flags", "handler")

    def __init__(self, func):
        self.func = func
        self.name = str(func)
        schema = func._schema
        self.tensorish = {}
        for i, a in enumerate(schema.arguments):
            t = str(a.type)
            flag = (_INDICES if t == "List[Optional[Tensor]]" else _SCALARS if t == "List[number]"
                    else t in _TENSORISH)
            self.tensorish[i] = flag
            self.tensorish[a.name] = flag
        qualified = schema.name + ("." + schema.overload_name if schema.overload_name else "")
        self.written = [a.name for a in schema.arguments
                        if a.alias_info is not None and a.alias_info.is_write]
        returns = [r.alias_info for r in schema.returns]
        self.n_plain = sum(1 for r in returns if r is None)
        # Each result of an op that writes arguments: None (a plain result)
        # or the (position, name) of the argument it returns (self, out=).
        writers = {}
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                for alias in a.alias_info.before_set:
                    writers[alias] = (i, a.name)
        self.result_sources = [None if r is None else writers.get(next(iter(r.before_set)))
                               for r in returns] if self.written else None
        self.functional = None
        self.lowering = LOWERINGS.get(func)
        self.view_cache = {}
        aliased = [r for r in returns if r is not None]
        if self.written:
            self.functional = _functional_variant(func)
            fl = LOWERINGS.get(self.functional) if self.functional else None
            self.kind = "mutate" if fl is not None else "other"
            self.lowering = fl
            if fl is None and self.functional is not None and plan_of(self.functional).kind == "view":
                # transpose_, t_, unsqueeze_, squeeze_, as_strided_: only the
                # tensor's metadata changes.
                self.kind = "view_inplace"
        elif aliased and self.lowering is None and not torch._C._dispatch_has_kernel_for_dispatch_key(
                qualified, "CompositeImplicitAutograd"):
            self.kind = "view"
        elif self.lowering is not None:
            self.kind = "lower"
        else:
            self.kind = "other"
        self.random = getattr(self.lowering, "random", False)
        self.custom_default = (schema.name.split("::")[0] not in ("aten", "prims")
                               and torch._C._dispatch_has_kernel_for_dispatch_key(
                                   qualified, "CompositeExplicitAutograd"))
        # accepts(*args, **kwargs) -> False sends a call the lowering cannot
        # take (a value-dependent shape: boolean-mask indexing) down the
        # decomposition / CPU-fallback path.
        self.accepts = getattr(self.lowering, "accepts", None)
        # Scalars a lowering must branch on (a norm's ord) are static; float
        # arguments it names dynamic (an optimizer's learning rate) are traced.
        for i, a in enumerate(schema.arguments):
            if a.name in getattr(self.lowering, "static_args", ()):
                self.tensorish[i] = self.tensorish[a.name] = False
            elif a.name in getattr(self.lowering, "dynamic_args", ()):
                self.tensorish[i] = self.tensorish[a.name] = True
        self.pos_flags = tuple(self.tensorish[i] for i in range(len(schema.arguments)))


_plans = {}
# The same plans by id(func): OpOverload hashes in Python, id() does not (the
# plan keeps func alive, so its id stays unique).
_plans_by_id = {}


def plan_of(func):
    p = _plans.get(func)
    if p is None:
        p = _plans[func] = Plan(func)
        p.special = SPECIAL.get(func)
        p.handler = _handler(p)
        _plans_by_id[id(func)] = p
    return p


def _handler(plan):
    """The function dispatch() hands this op's calls to: chosen once per op."""
    if plan.special is not None:
        special = plan.special
        return lambda plan, args, kwargs: special(*args, **kwargs)
    if plan.kind == "lower" or plan.kind == "mutate":
        return _run_lowered if plan.accepts is None else _run_accepted
    if plan.kind == "view":
        return _run_view
    if plan.kind == "view_inplace":
        return _run_view_inplace
    return _run_other


def _functional_variant(func):
    """The functional op whose outputs are func's plain outputs followed by the
    new values of the arguments func writes (functionalization's convention)."""
    schema = func._schema
    name = schema.name.split("::")[1]
    inputs = [(a.name, str(a.type).replace("(a!)", ""))
              for a in schema.arguments if not a.is_out]
    base = name[:-1] if name.endswith("_") else name
    candidates = [base, base + "_functional", name]
    # Exact argument match first; then a functional op that only adds
    # defaulted keyword arguments (randperm.generator_out -> randperm.generator).
    for exact in (True, False):
        for cand in candidates:
            packet = getattr(aten, cand, None)
            if packet is None:
                continue
            for ov in packet.overloads():
                op = getattr(packet, ov)
                s = op._schema
                if any(a.alias_info is not None and a.alias_info.is_write for a in s.arguments):
                    continue
                args = [(a.name, str(a.type)) for a in s.arguments]
                if args == inputs:
                    return op
                if (not exact and args[:len(inputs)] == inputs
                        and all(a.kwarg_only and a.has_default_value()
                                for a in s.arguments[len(inputs):])):
                    return op
    return None


# ---- kernels ---------------------------------------------------------------

class Kernel:
    """One compiled op: fn (traceable, reused by fused mode), jitted, and how
    to rebuild its outputs."""
    __slots__ = ("fn", "jitted", "name", "out_dtypes", "out_tree", "written_slots", "avals",
                 "stable_key", "bound")

    def __init__(self, name, fn, out_dtypes, written_slots, stable_key=None, bound=None):
        self.name = name
        # The errors.Bound whose flag fn returns as its last output (torchtpu.bounds).
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
        self.jitted = cache.jit(fn, name=_kernel_name(name))


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
    __slots__ = ("storages", "arrays", "slots", "dynamic")

    def __init__(self, storages, arrays, slots):
        self.storages = storages
        self.arrays = arrays
        self.slots = slots  # storage -> slot (Storage hashes by identity)
        self.dynamic = []


def _tensor_spec(call, t):
    """A tpu tensor's spec: its storage's slot in this call, then its key."""
    storage = t._storage
    slot = call.slots.get(storage)
    if slot is None:
        slot = call.slots[storage] = len(call.storages)
        call.storages.append(storage)
        call.arrays.append(storage.array)
    return ("t", slot) + t._key


def _spec(call, value, tensorish):
    """The static description of one argument (part of the kernel key)."""
    if isinstance(value, TpuTensor):
        return _tensor_spec(call, value)
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and (value.dim() == 0 or tensorish is _INDICES):
            return _spec(call, to_tpu(value), tensorish)
        raise _device_mismatch(value)
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
    return ("c", value)


def _device_mismatch(value):
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two "
        f"devices, tpu:0 and {value.device}!")


def _materialize(spec, arrays, scalars):
    kind = spec[0]
    if kind == "t":
        return read_view(arrays[spec[1]], spec[4])
    if kind == "s":
        return next(scalars)
    if kind == "l":
        return [_materialize(s, arrays, scalars) for s in spec[1]]
    value = spec[1]
    return list(value) if isinstance(value, tuple) else value


def _spec_contiguous(spec):
    """Whether a positional tensor argument is contiguous in PyTorch's sense
    (part of the kernel key, so a lowering may depend on it)."""
    if spec[0] != "t":
        return None
    view = spec[4]
    return view is None or _is_contiguous(view[0], view[1])


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


def _build_kernel(plan, pos_specs, kw_specs, n_storages, out_meta, orders=None):
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
        args = [_materialize(s, arrays, scalars) for s in pos_specs]
        kwargs = {k: _materialize(s, arrays, scalars) for k, s in kw_specs}
        if plan.kind == "mutate":
            _drop_out_args(plan, args, kwargs)
        if plan.random:
            kwargs["key"] = rng.key_from(next(scalars), next(scalars))
        ctx.out = out_meta[0] if out_meta is not None else None
        ctx.contiguous = [_spec_contiguous(s) for s in pos_specs]
        flag = bounds.device_flag(bound, args, kwargs, flat[n_storages]) if bound is not None else None
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
                    value = runtime.fit_to(value.astype(arrays[slot].dtype), dtype)
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
    kernel = Kernel(plan.name, fn, out_dtypes, written_slots, None if " at 0x" in stable else stable,
                    bound)
    return kernel


def _flat_written(written):
    out = []
    for spec in written:
        if spec[0] == "l":
            out.extend(spec[1])
        elif spec[0] == "t":
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


# ---- the dispatcher --------------------------------------------------------

def dispatch(func, args, kwargs):
    try:
        plan = _plans_by_id.get(id(func)) or plan_of(func)
        return plan.handler(plan, args, kwargs)
    except Exception as e:
        lost = _lost_argument(args, kwargs)
        if lost is not None and _overwrite_lost(func, args):
            return dispatch(func, args, kwargs)
        if lost is not None and lost.error is not e:
            # An input's op failed earlier: that error, not this op's.
            e = lost.exception()
        # PyTorch's exception type, at the user's line (torchtpu.errors).
        err = errors.user_error(e, func, args, kwargs)
        if errors.in_backward():
            # Raising here would abort the process (errors.raise_after_backward):
            # the pass goes on with lost values and raises err when it ends.
            results = _lost_results(func, args, kwargs, lost.error if lost is not None else err)
            if results is not None:
                errors.raise_after_backward(err)
                return results
            errors.report_unrecoverable(err, func)
        raise err


# Ops whose result does not depend on the old value of the tensor they write.
_OVERWRITES = (aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default)


def _overwrite_lost(func, args):
    """Whether func writes all of a lost tensor (load_state_dict's copy_ into
    parameters lost in a failed step) and reads no other lost value: then
    the storage is given zeros to write over, and the call is run again."""
    if func not in _OVERWRITES or type(args[0]) is not TpuTensor or args[0]._view is not None:
        return False
    storage = args[0]._storage
    old = storage.array
    if type(old) is not Lost or _lost_argument(args[1:], {}) is not None:
        return False
    storage.assign(jnp.zeros(old.shape, old.dtype))
    return True


def _lost_argument(args, kwargs):
    """The Lost value of a tensor argument, if any (an earlier op failed)."""
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, (list, tuple)):
            lost = _lost_argument(a, {})
            if lost is not None:
                return lost
        elif type(a) is TpuTensor and type(a._storage.array) is Lost:
            return a._storage.array
    return None


def _lost_results(func, args, kwargs, error):
    """What a failed op returns in a backward pass: results of its shapes and
    dtypes whose values are Lost(error), with the arguments it writes lost
    too; None when PyTorch's meta kernel cannot give the shapes."""
    try:
        plan = plan_of(func)
        meta = _run_meta(func, args, kwargs)
    except Exception:
        return None
    if meta is None:
        return None
    if plan.written:
        if plan.n_plain:
            return None  # only the written arguments can stand in for results
        for i, a in enumerate(func._schema.arguments):
            if a.name in plan.written:
                for t in _as_list(args[i] if i < len(args) else kwargs.get(a.name)):
                    if type(t) is TpuTensor:
                        old = t._storage.array
                        t._storage.assign(Lost(error, old.shape, old.dtype))
        return _mutation_result(plan, args, kwargs, [])
    leaves, template = meta
    return _unflatten(template, [
        TpuTensor(Storage(Lost(error, tuple(m.shape), runtime.jax_dtype(m.dtype))),
                  tuple(m.shape), m.dtype) for m in leaves])


def _run_accepted(plan, args, kwargs):
    """The lowering, unless it declines this call (plan.accepts)."""
    if plan.accepts is None or plan.accepts(*args, **kwargs):
        return _run_lowered(plan, args, kwargs)
    return _run_other(plan, args, kwargs)


def _run_lowered(plan, args, kwargs):
    storages, arrays, slots = [], [], {}
    call = None  # made for the first argument that is not a tpu tensor
    # _spec, with its common case (a tpu tensor) inline: this loop runs for
    # every argument of every op.
    pos_specs = []
    for a, f in zip(args, plan.pos_flags):
        if type(a) is TpuTensor:
            storage = a._storage
            slot = slots.get(storage)
            if slot is None:
                slot = slots[storage] = len(storages)
                storages.append(storage)
                arrays.append(storage.array)
            pos_specs.append(("t", slot) + a._key)
        else:
            if call is None:
                call = _Call(storages, arrays, slots)
            pos_specs.append(_spec(call, a, f))
    pos_specs = tuple(pos_specs)
    if kwargs:
        if call is None:
            call = _Call(storages, arrays, slots)
        kw_specs = tuple([(k, _spec(call, v, plan.tensorish.get(k, False)))
                          for k, v in kwargs.items()])
    else:
        kw_specs = ()
    # The plan stands for its op in the key: it hashes by identity, in C.
    key = (plan, pos_specs, kw_specs)
    entry = cache.lookup(key)
    if entry is None:
        if plan.kind == "mutate":
            if _check_written(plan, args, kwargs):
                # An out= tensor was resized: its key part changed.
                return _run_lowered(plan, args, kwargs)
            # The functional variant's outputs decide the dtypes to cast to.
            out_meta = _run_meta(plan.functional, *_functional_args(plan, args, kwargs))
        else:
            out_meta = _run_meta(plan.func, args, kwargs,
                                 getattr(plan.lowering, "meta_contiguous", False))
        fix = getattr(plan.lowering, "result_dtypes", None)
        if fix is not None and out_meta is not None:
            # Where CPU's kernel and PyTorch's meta kernel disagree on dtypes.
            fargs, fkwargs = (_functional_args(plan, args, kwargs) if plan.kind == "mutate"
                              else (args, kwargs))
            dtypes = fix([m.dtype for m in out_meta[0]], *fargs, **fkwargs)
            out_meta = ([m.to(d) for m, d in zip(out_meta[0], dtypes)], out_meta[1])
        out_tdtypes = tuple(m.dtype for m in out_meta[0]) if out_meta is not None else None
        orders = None
        if out_meta is not None and getattr(plan.lowering, "keeps_strides", False):
            orders = [_physical_order(m) for m in out_meta[0]]
            orders = orders if any(orders) else None
        entry = cache.store(key, (_build_kernel(plan, pos_specs, kw_specs, len(storages), out_meta, orders),
                                  out_meta, out_tdtypes, orders))
        advisor.note_new_kernel(plan.name)
    kernel, out_meta, out_tdtypes, orders = entry
    metrics.M.ops_dispatched += 1
    flat = arrays
    ex = modes._current
    if kernel.bound is not None:
        flag = bounds.flag_input(ex.name == "debug")
        storages.append(flag)
        arrays.append(flag.array)
    if call is not None and call.dynamic:
        flat.extend(call.dynamic)
    if plan.random:
        flat.extend(rng.next_key())
    if ex.name == "debug" or errors.CHECK_NANS:
        # Index bounds and NaN/Inf checks (torchtpu.errors).
        outs, new_storages = errors.checked_run(ex, plan, kernel, flat, storages, args, kwargs)
    else:
        outs, new_storages = ex.run(kernel, flat, storages)
    if kernel.bound is not None or bounds.tainted:
        return _run_watched(plan, entry, ex, outs, new_storages, storages, args, kwargs)
    if plan.kind != "mutate" and kernel.out_tree is ... and orders is None and out_tdtypes is not None:
        # The common case, one plain result, without the general wrapping.
        o = outs[0]
        return whole_tensor(Storage(o), o.shape, out_tdtypes[0])
    return _results(plan, entry, outs, new_storages, storages, args, kwargs)


def _run_watched(plan, entry, ex, outs, new_storages, storages, args, kwargs):
    """The rest of _run_lowered for an op with an index-bounds flag, or while
    flags are unread (torchtpu.bounds tracks what depends on them)."""
    kernel = entry[0]
    flag = None
    if kernel.bound is not None:
        flag, outs = outs[-1], outs[:-1]
    result = _results(plan, entry, outs, new_storages, storages, args, kwargs)
    if type(result) is TpuTensor and not kernel.written_slots:
        produced = (result._storage,)
    else:
        leaves = []
        _flatten(result, leaves)
        produced = [storages[slot] for slot in kernel.written_slots]
        produced += [t._storage for t in leaves if type(t) is TpuTensor]
    if flag is None:
        bounds.propagate(storages, produced)
    elif ex.name != "debug":  # debug mode checked on the host before the op ran
        bounds.note(kernel.bound, plan.func, flag, storages, produced, sys._getframe(1))
    return result


def _results(plan, entry, outs, new_storages, storages, args, kwargs):
    """An op's results as tensors, its written arguments updated."""
    kernel, out_meta, out_tdtypes, orders = entry
    if plan.kind == "mutate":
        for slot, arr in zip(kernel.written_slots, new_storages):
            storages[slot].assign(arr)
    elif kernel.out_tree is ... and orders is None and out_tdtypes is not None:
        o = outs[0]
        return whole_tensor(Storage(o), o.shape, out_tdtypes[0])
    if orders is not None:
        wrapped = [TpuTensor(Storage(o), m.shape, d, None if p is None else m.stride())
                   for o, m, d, p in zip(outs, out_meta[0], out_tdtypes, orders)]
    elif out_tdtypes is not None:
        wrapped = [TpuTensor(Storage(o), o.shape, d) for o, d in zip(outs, out_tdtypes)]
    else:
        wrapped = [TpuTensor(Storage(o), o.shape, runtime.torch_dtype(o.dtype)) for o in outs]
    if plan.kind == "mutate":
        return _mutation_result(plan, args, kwargs, wrapped)
    return _unflatten(kernel.out_tree, wrapped)


def _functional_args(plan, args, kwargs):
    args = list(args)
    kwargs = dict(kwargs)
    _drop_out_args(plan, args, kwargs)
    # Defaults the mutating op has and its functional variant lacks
    # (bernoulli_.float's p=0.5; bernoulli.p requires p).
    mine = {a.name: a for a in plan.func._schema.arguments}
    for i, a in enumerate(plan.functional._schema.arguments):
        if i >= len(args) and a.name not in kwargs and not a.has_default_value():
            m = mine.get(a.name)
            if m is not None and m.has_default_value():
                kwargs[a.name] = m.default_value
    return args, kwargs


def _check_written(plan, args, kwargs):
    """Run PyTorch's checks for the mutating op itself (in-place broadcast,
    result casting) on meta tensors, and resize out= tensors whose shape is
    not the result's, as CPU does (its warning for a non-empty one comes
    from the meta kernel). Returns whether any tensor was resized."""
    margs = [_meta(a) for a in args]
    mkwargs = {k: _meta(v) for k, v in kwargs.items()}
    try:
        plan.func(*margs, **mkwargs)
    except NotImplementedError:
        return False
    except RuntimeError as e:
        if "meta" in str(e).lower() and "not implemented" in str(e).lower():
            return False
        raise
    resized = False
    schema = plan.func._schema
    for i, a in enumerate(schema.arguments):
        if a.is_out:
            before = args[i] if i < len(args) else kwargs.get(a.name)
            after = margs[i] if i < len(margs) else mkwargs.get(a.name)
            for b, m in zip(_as_list(before), _as_list(after)):
                if isinstance(b, TpuTensor) and tuple(b.shape) != tuple(m.shape):
                    resize(b, m.shape)
                    resized = True
    return resized


def resize(t, shape):
    """Resize t in place as CPU's resize_ does: contiguous strides from its
    storage offset over the same storage (so other views still alias it)
    when the elements fit; otherwise a grown copy of the storage, whose new
    elements are zeros (CPU leaves them uninitialized)."""
    shape = tuple(int(s) for s in shape)
    if tuple(t.shape) == shape:
        return t
    if any(s < 0 for s in shape):
        raise RuntimeError(f"Trying to create tensor with negative dimension {min(shape)}: {list(shape)}")
    storage, offset = t._storage, t.storage_offset()
    have = math.prod(storage.array.shape)
    need = offset + math.prod(shape)
    if need > have:
        whole = TpuTensor(storage, storage.array.shape, t.dtype)
        flat = dispatch(aten.reshape.default, (whole, [-1]), {})
        grown = dispatch(aten.constant_pad_nd.default, (flat, [0, need - have]), {})
        storage = grown._storage
    new = TpuTensor(storage, shape, t.dtype, contiguous_strides(shape), offset)
    torch._C.TensorBase.data.__set__(t, new)
    t._storage, t._view, t._key = new._storage, new._view, new._key
    return t


def _resize_(t, size, memory_format=None):
    if memory_format not in (None, torch.contiguous_format):
        raise RuntimeError(f"resize_: memory format {memory_format} is not supported on tpu")
    return resize(t, size)


def _resize_as_(t, template, memory_format=None):
    return _resize_(t, template.shape, memory_format)


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _mutation_result(plan, args, kwargs, plain):
    results = []
    it = iter(plain)
    for source in plan.result_sources:
        if source is None:
            results.append(next(it))
        else:
            i, name = source
            results.append(args[i] if i < len(args) else kwargs.get(name))
    if not results:
        return None
    return results[0] if len(results) == 1 else tuple(results)


def _run_view_inplace(plan, args, kwargs):
    """A view op applied to the tensor itself: same storage, new shape,
    strides and offset (set on the wrapper by PyTorch's own as_strided_)."""
    src = args[0]
    if not isinstance(src, TpuTensor):
        return _run_other(plan, args, kwargs)
    view = _run_view(plan_of(plan.functional), args, kwargs)
    with torch._C._DisableTorchDispatch():
        aten.as_strided_.default(src, view.shape, view.stride(), view.storage_offset())
    src._view, src._key = view._view, view._key
    return src


def _run_view(plan, args, kwargs):
    src = args[0]
    if not isinstance(src, TpuTensor):
        return _run_other(plan, args, kwargs)
    # src._key fixes src's shape, strides and offset (a whole-storage tensor
    # is contiguous at offset 0).
    key = (src._key, _hashable(args[1:]) if len(args) > 1 else (),
           _hashable(tuple(kwargs.items())) if kwargs else ())
    specs = plan.view_cache.get(key)
    if specs is None:
        numel = math.prod(src._storage.array.shape)
        base = torch.empty(numel, dtype=src.dtype, device="meta").as_strided(
            src.shape, src.stride(), src.storage_offset())
        out = plan.func(base, *args[1:], **kwargs)
        leaves = []
        template = _flatten(out, leaves)
        if any(m.dtype != src.dtype for m in leaves):
            raise NotImplementedError(f"{plan.name}: dtype-changing views")
        storage_shape = src._key[1]
        specs = (template, [(tuple(m.shape), m.stride(), m.storage_offset(),
                             (src.dtype, storage_shape, make_view(storage_shape, m.shape, m.stride(),
                                                                  m.storage_offset())))
                            for m in leaves])
        plan.view_cache[key] = specs
    template, leaves = specs
    metrics.M.ops_dispatched += 1
    storage = src._storage
    if template is ...:
        return view_tensor(storage, *leaves[0])
    return _unflatten(template, [view_tensor(storage, *leaf) for leaf in leaves])


def _hashable(x):
    if isinstance(x, (list, tuple)):
        # Sizes and dims are ints: only containers and tensors need a look.
        return tuple([_hashable(v) if isinstance(v, (list, tuple, torch.Tensor)) else v for v in x])
    if isinstance(x, torch.Tensor):
        raise TypeError("tensor in a view op's static arguments")
    return x


_warned_fallback = set()


def _run_other(plan, args, kwargs):
    func = plan.func
    decomp = decomposition_table.get(func)
    if decomp is not None:
        metrics.M.decompositions[plan.name] += 1
        out = decomp(*args, **kwargs)
        if out is not NotImplemented:
            return out
    out = func.decompose(*args, **kwargs)
    if out is not NotImplemented:
        metrics.M.decompositions[plan.name] += 1
        return out
    if plan.custom_default:
        # A library's custom op with a device-independent (Python) kernel:
        # run it here; its own ops come back through this dispatcher.
        metrics.M.decompositions[plan.name] += 1
        return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
    return cpu_fallback(plan, args, kwargs)


def _cpu_kernels_in_full():
    """Inside __torch_dispatch__ PyTorch excludes the Conjugate, Negative and
    ZeroTensor keys; a CPU kernel run from here must have them back, or it
    ignores the lazy conjugation of the views it makes itself."""
    C = torch._C
    lazy = (C.DispatchKeySet(C.DispatchKey.Conjugate) | C.DispatchKeySet(C.DispatchKey.Negative)
            | C.DispatchKeySet(C.DispatchKey.ZeroTensor))
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(),
                                    C._dispatch_tls_local_exclude_set() - lazy)


def cpu_fallback(plan, args, kwargs):
    """Run the op on CPU: copy in, run, copy results (and written args) back."""
    name = plan.name
    metrics.M.cpu_fallbacks[name] += 1
    advisor.note_fallback(name)
    if name not in _warned_fallback:
        _warned_fallback.add(name)
        warnings.warn(f"torchtpu: {name} has no tpu lowering; running it on CPU "
                      "(counted in torchtpu.metrics cpu_fallbacks)", stacklevel=4)
    modes.note_sync("cpu_fallback")
    moved = {}

    def to_cpu(x, cpu_ok=False):
        if isinstance(x, TpuTensor):
            if id(x) not in moved:
                moved[id(x)] = (x, download(x))
            return moved[id(x)][1]
        if isinstance(x, torch.Tensor) and x.dim() > 0 and not cpu_ok:
            # The CPU op would accept it; a tpu op must not (as with CUDA).
            raise _device_mismatch(x)
        if isinstance(x, (list, tuple)):
            return type(x)(to_cpu(v, cpu_ok) for v in x)
        return x

    tensorish = plan.tensorish
    cargs = [to_cpu(a, tensorish.get(i) is _INDICES) for i, a in enumerate(args)]
    ckwargs = {k: to_cpu(v, tensorish.get(k) is _INDICES) for k, v in kwargs.items()}
    errors.check_bounds(plan.func, cargs, ckwargs, plan.functional)  # CPU's check, naming the op
    with _cpu_kernels_in_full():
        out = plan.func(*cargs, **ckwargs)
    written = set(plan.written)
    schema = plan.func._schema
    for i, a in enumerate(schema.arguments):
        if a.name in written:
            orig = args[i] if i < len(args) else kwargs.get(a.name)
            for t in _as_list(orig):
                if isinstance(t, TpuTensor):
                    copy_into(t, moved[id(t)][1])

    def back(x):
        if isinstance(x, torch.Tensor):
            for orig, cpu in moved.values():
                if x is cpu:
                    return orig
            return to_tpu(x)
        if isinstance(x, (list, tuple)):
            return type(x)(back(v) for v in x)
        return x
    return back(out)


# ---- host <-> device -------------------------------------------------------

def to_tpu(t, non_blocking=False):
    """A CPU tensor -> a new TpuTensor holding a copy; non_blocking (from a
    pinned tensor) starts the transfer and returns (runtime.to_device)."""
    arr = runtime.to_device(t, non_blocking=non_blocking)
    return TpuTensor(Storage(arr), tuple(t.shape), t.dtype)


@functools.lru_cache(maxsize=None)
def _reader(view):
    return cache.jit(lambda arr: read_view(arr, view), name="tpu_read_view")


def device_array(t):
    """The concrete JAX array of t's values (in t's shape), syncing if needed."""
    arr = modes.current().concrete(t._storage)
    if type(arr) is Lost:
        arr.fail()
    if t._view is None:
        return arr
    return _reader(t._view)(arr)


def download(t):
    """A TpuTensor -> a new CPU tensor with its values."""
    metrics.M.syncs += 1
    runtime.wait_transfers()  # a sync point: pinned sources are free again after it
    if advisor.ON:
        return advisor.sync_point(lambda: runtime.to_host(device_array(t), t.dtype))
    return runtime.to_host(device_array(t), t.dtype)


def copy_into(dst, src_cpu):
    """Write a CPU tensor's values into a TpuTensor (through its view)."""
    src_cpu = src_cpu.to(dst.dtype).expand(dst.shape).contiguous()
    src = to_tpu(src_cpu)
    return dispatch(aten.copy_.default, (dst, src), {})


# ---- ops the dispatcher handles itself ------------------------------------

def _copy_(dst, src, non_blocking=False):
    if isinstance(dst, TpuTensor) and not isinstance(src, TpuTensor):
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"copy_(): argument 'src' must be Tensor, not {type(src).__name__}")
        torch.empty(dst.shape, dtype=dst.dtype, device="meta").copy_(src.to("meta"))
        # From pinned memory, non_blocking starts the transfer and returns.
        non_blocking = non_blocking and pinned.is_pinned(src)
        src = to_tpu(src.to(dst.dtype).expand(dst.shape).contiguous(), non_blocking)
        if dst._view is None and type(dst._storage.array) is not Lost:
            # dst is its whole storage (as .to("tpu") makes it): the upload
            # becomes the storage's array, with no copy kernel.
            dst._storage.assign(src._storage.array)
            if modes.current().name == "debug":
                runtime.wait_transfers()  # debug mode waits for each op
            return dst
    elif not isinstance(dst, TpuTensor):
        # dst on CPU, src on tpu
        dst.copy_(download(src))
        return dst
    return _run_lowered(plan_of(aten.copy_.default), (dst, src), {})


def _local_scalar_dense(x):
    modes.note_sync("item")
    return download(x).item()


def _copy_from(src, dst, non_blocking=False):
    return _copy_(dst, src, non_blocking)


def _pin_memory(x, device=None):
    raise RuntimeError(f"cannot pin '{x.type()}' only dense CPU tensors can be pinned")


SPECIAL = {
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.copy_.default: _copy_,
    aten._copy_from.default: _copy_from,
    aten.resize_.default: _resize_,
    aten.resize_as_.default: _resize_as_,
}


def _to_copy_handler(x, **kwargs):
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        modes.note_sync("cpu")
        out = download(x)
        dtype = kwargs.get("dtype")
        return out.to(dtype) if dtype is not None else out
    kwargs.pop("device", None)
    kwargs.pop("layout", None)
    kwargs.pop("pin_memory", None)
    kwargs.pop("non_blocking", None)
    return _run_lowered(plan_of(aten._to_copy.default), (x,), kwargs)


SPECIAL[aten._to_copy.default] = _to_copy_handler
# Device memory is never pinned host memory.
SPECIAL[aten.is_pinned.default] = lambda x, device=None: False
SPECIAL[aten._pin_memory.default] = _pin_memory


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


# Ops whose result size depends on values: read that size back (one scalar,
# as CUDA does), then run fixed-shape kernels. A boolean mask index is the
# long indices of its nonzero elements, as in PyTorch's own indexing.
def _is_mask(t):
    return isinstance(t, torch.Tensor) and is_mask(t) and t.dim() > 0


def _nonzero(x):
    modes.note_sync("nonzero")
    n = download(dispatch(aten.count_nonzero.default, (x,), {})).item()
    return dispatch(aten.nonzero_static.default, (x,), {"size": n})


def _masks_as_indices(indices):
    out = []
    for i in indices:
        if _is_mask(i):
            if not isinstance(i, TpuTensor):
                i = to_tpu(i)
            if i.dtype == torch.uint8:
                i = dispatch(aten.ne.Scalar, (i, 0), {})
            nz = _nonzero(i)
            out.extend(dispatch(aten.select.int, (nz, 1, d), {}) for d in range(i.dim()))
        else:
            out.append(i)
    return out


def _index(x, indices):
    if any(_is_mask(i) for i in indices):
        indices = _masks_as_indices(indices)
    return _run_accepted(plan_of(aten.index.Tensor), (x, indices), {})


def _index_put(x, indices, values, accumulate=False):
    # A mask whose selected values vary along it needs their positions.
    plan = plan_of(aten.index_put.default)
    if not plan.accepts(x, indices, values, accumulate):
        indices = _masks_as_indices(indices)
    return _run_accepted(plan, (x, indices, values, accumulate), {})


def _masked_select(x, mask):
    x, mask = dispatch(aten.broadcast_tensors.default, ([x, mask],), {})
    return _index(x, [mask])


def _into(fn):
    """The out= form of fn: out is resized to the result and written."""
    def out_variant(*args, out, **kwargs):
        result = fn(*args, **kwargs)
        resize(out, result.shape)
        return _copy_(out, result)
    return out_variant


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
        modes.note_sync("bincount")
        low, high = download(torch.stack(torch.aminmax(x))).tolist()
        if low < 0:
            raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
        size = max(size, high + 1)
    if weights is None:
        dtype, weights = torch.long, torch.ones_like(x, dtype=torch.long)
    else:
        dtype = weights.dtype if weights.dtype in (torch.float32, torch.float64) else torch.float64
    return torch.zeros(size, dtype=dtype, device=x.device).index_add_(0, x, weights.to(dtype))


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


def _linalg_check_errors(info, api_name, *, is_matrix):
    # LAPACK's info decides whether linalg.inv & co. raise: read it back, as
    # CUDA does, and let PyTorch's own check word the error.
    modes.note_sync("linalg_check")
    aten._linalg_check_errors.default(download(info), api_name, is_matrix=is_matrix)


SPECIAL[aten._linalg_check_errors.default] = _linalg_check_errors


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


def _no_sparse(*args, **kwargs):
    raise NotImplementedError("tpu tensors are dense: sparse layouts are not supported on tpu "
                              "(keep sparse tensors on the CPU)")


# Conversions to sparse, and sparse tensors built on tpu (a sparse CPU
# tensor's .to("tpu")).
for _name in ("_to_sparse", "_to_sparse_csr", "_to_sparse_csc", "_to_sparse_bsr", "_to_sparse_bsc",
              "_sparse_coo_tensor_with_dims_and_tensors", "_sparse_coo_tensor_with_dims",
              "_sparse_compressed_tensor_unsafe", "sparse_compressed_tensor"):
    for _overload in getattr(aten, _name).overloads():
        SPECIAL[getattr(getattr(aten, _name), _overload)] = _no_sparse


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
