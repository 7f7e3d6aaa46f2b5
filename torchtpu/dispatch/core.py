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
import itertools
import math
import sys
import warnings

import jax
import jax.numpy as jnp
import torch
from torch._decomp import decomposition_table

from .. import advisor, bounds, cache, errors, metrics, modes, recompiles, runtime
from ..modes import checks
from ..ops import matmul_setting
from ..ops import random as rng
from ..tensor import (DtypeView, GrownStorage, Lost, Storage, TpuTensor, check_in_storage, contiguous_strides,
                      make_view, storage_dtype, view_tensor, whole_tensor)
from .host import download, host_values, to_tpu
from .build import KernelEntry, build_kernel, drop_out_args, physical_order
from .keys import (PLAIN_TYPES, Call, arg_spec, device_mismatch, first_device, grown_readable,
                   hashable, kernel_device, named, offsets_fed, plain_spec, view_args_key,
                   whole_shape)
from .meta import flatten, meta_like, meta_outcome, run_meta, unflatten, written_checked
from .plans import _INDICES, SPECIAL, Plan

from ..compat import aten


# ---- per-op plans ----------------------------------------------------------

_plans = {}
# The same plans by id(func): OpOverload hashes in Python, id() does not (the
# plan keeps func alive, so its id stays unique).
_plans_by_id = {}


def plan_of(func):
    p = _plans_by_id.get(id(func)) or _plans.get(func)
    if p is None:
        p = _plans[func] = Plan(func)
        p.special = SPECIAL.get(func)
        p.handler = _handler(p)
        _plans_by_id[id(func)] = p
    return p


_READ = aten.clone.default  # the op that reads a grown storage's view
_CONTIGUOUS = {"memory_format": torch.contiguous_format}


def _handler(plan):
    """The function dispatch() hands this op's calls to: chosen once per op."""
    if plan.special is not None:
        return lambda plan, args, kwargs: plan.special(*args, **kwargs)
    if plan.kind == "lower" or plan.kind == "mutate":
        return _run_lowered if plan.accepts is None else _run_accepted
    if plan.kind == "view":
        return _run_view
    if plan.kind == "view_inplace":
        return _run_view_inplace
    return _run_other


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
    """Whether func writes all of a lost tensor (load_state_dict's copy_ into parameters lost in a
    failed step) and reads no other lost value: then it gets zeros to write over, to run again."""
    if func not in _OVERWRITES or type(args[0]) is not TpuTensor or args[0]._view is not None:
        return False
    old = args[0]._storage.array
    if type(old) is not Lost or _lost_argument(args[1:], {}) is not None:
        return False
    args[0]._storage.assign(jnp.zeros(old.shape, old.dtype))
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
        meta = run_meta(func, args, kwargs)
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
    device = first_device(args, kwargs)
    return unflatten(template, [
        TpuTensor(Storage(Lost(error, tuple(m.shape), runtime.jax_dtype(m.dtype)), device),
                  tuple(m.shape), m.dtype) for m in leaves])


def _run_accepted(plan, args, kwargs):
    """The lowering, unless it declines this call (plan.accepts)."""
    if plan.accepts is None or plan.accepts(*args, **kwargs):
        return _run_lowered(plan, args, kwargs)
    return _run_other(plan, args, kwargs)


def _run_lowered(plan, args, kwargs):
    storages, arrays, slots, dynamic = [], [], {}, []
    call = None  # made for the first argument that needs arg_spec's general case
    # arg_spec, with its common cases (a tpu tensor, a plain value) inline:
    # this loop runs for every argument of every op.
    pos_specs = []
    for a, f in zip(args, plan.pos_flags):
        kind = type(a)
        if kind is TpuTensor:
            storage = a._storage
            if type(storage) is GrownStorage and plan.padded is not None and storage.grown is not None:
                out = plan.padded(plan.func, args, kwargs)  # on the padded arrays (dispatch.lengths)
                if out is not NotImplemented:
                    return out
            if type(storage) is GrownStorage and a._view is not None:
                if (plan.func is not _READ and plan.kind != "mutate"
                        and not modes.current().fuses and grown_readable(a)):
                    # A view of a grown storage (`ids[:, -1:]`): read by one kernel per
                    # bucket, so the op compiles once for the view (not fused mode's).
                    a = _run_lowered(plan_of(_READ), (a,), _CONTIGUOUS)
                    i = len(pos_specs)  # a's position (one spec per argument so far)
                    args = (*args[:i], a, *args[i + 1:])  # (its meta run too)
                    storage = a._storage
                else:
                    # The read itself: from the padded array at a run-time offset (or the exact one).
                    if call is None:
                        call = Call(storages, arrays, slots, dynamic, (args, kwargs), plan.kind != "mutate")
                    pos_specs.append(arg_spec(call, a, f))
                    continue
            slot = slots.get(storage)
            if slot is None:
                slot = slots[storage] = len(storages)
                storages.append(storage)
                arrays.append(storage.array if type(storage) is not GrownStorage
                              else storage.read_by(plan.name))
            pos_specs.append((slot,) + a._key)  # a TensorArg's fields (see named)
        elif kind in PLAIN_TYPES:
            pos_specs.append(plain_spec(a, kind, f, dynamic))
        else:
            if call is None:
                call = Call(storages, arrays, slots, dynamic, (args, kwargs), plan.kind != "mutate")
            pos_specs.append(arg_spec(call, a, f))
    pos_specs = tuple(pos_specs)
    if kwargs:
        kw_specs = []
        for k, v in kwargs.items():
            kind, f = type(v), plan.tensorish.get(k, False)
            if k == "generator":  # drawn from at run time (below), not a key part
                v, kind = None, type(None)
            if kind not in PLAIN_TYPES and call is None:
                call = Call(storages, arrays, slots, dynamic, (args, kwargs), plan.kind != "mutate")
            kw_specs.append((k, plain_spec(v, kind, f, dynamic) if kind in PLAIN_TYPES
                                else arg_spec(call, v, f)))
        kw_specs = tuple(kw_specs)
    else:
        kw_specs = ()
    # The plan stands for its op in the key: it hashes by identity, in C. A
    # float matrix product's precision is the user's setting at this call.
    precision = matmul_setting() if plan.matmul else None
    key = (plan, pos_specs, kw_specs, precision)
    entry = cache.lookup(key)
    if entry is None:
        pos_specs = tuple([named(s) for s in pos_specs])
        kw_specs = tuple([(k, named(s)) for k, s in kw_specs])
        key = (plan, pos_specs, kw_specs, precision)
        # Offsets are data: an op met again with its views at new offsets
        # (data[i:i + n] at a moving i) runs one kernel taking them at run time.
        fed = offsets_fed(pos_specs, kw_specs, dynamic)
        if fed is not None:
            general = (plan, fed[0], fed[1], precision)
            if cache.served_generally(general, key):
                pos_specs, kw_specs, dynamic, key = fed[0], fed[1], fed[2], general
                entry = cache.lookup(key)
    if entry is None and plan.padded is not None:
        out = plan.padded(plan.func, args, kwargs)  # slices of a varying row count, padded
        if out is not NotImplemented:
            return out
    if entry is None:
        device = kernel_device(pos_specs, kw_specs)  # (raises CUDA's error for two devices)
        if not modes.current().records:
            recompiles.note_kernel(plan.name, pos_specs, kw_specs, precision)  # (fused mode: per graph)
        if plan.kind == "mutate":
            if written_checked(plan, pos_specs, kw_specs,
                               lambda: _check_written(plan, args, kwargs)):
                # An out= tensor was resized: its key part changed.
                return _run_lowered(plan, args, kwargs)
            # The functional variant's outputs decide the dtypes to cast to.
            out_meta = meta_outcome(plan, pos_specs, kw_specs, lambda: run_meta(
                plan.functional, *_functional_args(plan, args, kwargs)))
        else:
            out_meta = meta_outcome(plan, pos_specs, kw_specs, lambda: run_meta(
                plan.func, args, kwargs, getattr(plan.lowering, "meta_contiguous", False),
                getattr(plan.lowering, "meta_args", None)))
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
            orders = [physical_order(m) for m in out_meta[0]]
            orders = orders if any(orders) else None
        entry = cache.store(key, KernelEntry(build_kernel(plan, pos_specs, kw_specs, len(storages),
                                                          out_meta, orders, device, precision),
                                             out_meta, out_tdtypes, orders))
        advisor.note_new_kernel(plan.name, whole_shape(pos_specs))
    kernel, _, out_dtypes, orders = entry
    metrics.M.ops_dispatched += 1
    flat = arrays  # (then the scalars)
    ex = modes.current()
    if kernel.bound is not None:
        flag = bounds.flag_input(ex.waits_each_op, kernel.device)
        storages.append(flag)
        arrays.append(flag.array)
    if dynamic:
        flat.extend(dynamic)
    if plan.random:
        key = rng.next_key(kwargs.get("generator") if kwargs else None, plan.name, ex.replays)
        if key[0] is None:
            raise RuntimeError(f"{plan.name} draws random numbers: inside a function traced by "
                               "JAX (torchtpu.jax.functionalize) pass it rng_key=, a jax.random key")
        flat.extend(key)
    if ex.waits_each_op or checks.CHECK_NANS:
        # The executor's checks around it: debug's index bounds, NaN/Inf (modes.checks).
        outs, new_storages = ex.run_checked(kernel, flat, storages, plan, args, kwargs, host_values)
    else:
        outs, new_storages = ex.run(kernel, flat, storages)
    plain = plan.kind != "mutate" and kernel.out_tree is ... and orders is None and out_dtypes is not None
    if kernel.bound is not None or (bounds.unread and not plain):
        return _run_watched(plan, entry, ex, outs, new_storages, storages, args, kwargs)
    if plain:  # The common case, one plain result, without the general wrapping.
        out = Storage(outs[0], kernel.device)
        if bounds.unread:  # (what it holds depends on what its inputs depend on)
            bounds.propagate(storages, (out,))
        return whole_tensor(out, outs[0].shape, out_dtypes[0])
    return _results(plan, entry, outs, new_storages, storages, args, kwargs)


def _run_watched(plan, entry, ex, outs, new_storages, storages, args, kwargs):
    """The rest of _run_lowered for an op with an index-bounds flag, or while
    flags are unread (torchtpu.bounds tracks what depends on them)."""
    kernel = entry.kernel
    flag = None
    if kernel.bound is not None:
        flag, outs = outs[-1], outs[:-1]
    result = _results(plan, entry, outs, new_storages, storages, args, kwargs)
    if type(result) is TpuTensor and not kernel.written_slots:
        produced = (result._storage,)
    else:
        leaves = []
        flatten(result, leaves)
        produced = [storages[slot] for slot in kernel.written_slots]
        produced += [t._storage for t in leaves if type(t) is TpuTensor]
    if flag is None:
        bounds.propagate(storages, produced)
    elif not ex.waits_each_op:  # debug mode checked on the host before the op ran
        if bounds.note(kernel.bound, plan.func, flag, storages, produced, sys._getframe(1), kernel.device):
            ex.sync("index checks")  # (fused mode: the flags of a loop that never reads)
    return result


def _results(plan, entry, outs, new_storages, storages, args, kwargs):
    """An op's results as tensors, its written arguments updated."""
    kernel, out_meta, out_tdtypes, orders = entry
    if plan.kind == "mutate":
        for slot, arr in zip(kernel.written_slots, new_storages):
            storages[slot].assign(arr)
    elif kernel.out_tree is ... and orders is None and out_tdtypes is not None:
        o = outs[0]
        return whole_tensor(Storage(o, kernel.device), o.shape, out_tdtypes[0])
    device = kernel.device
    if orders is not None:
        wrapped = [TpuTensor(Storage(o, device), m.shape, d, None if p is None else m.stride())
                   for o, m, d, p in zip(outs, out_meta[0], out_tdtypes, orders)]
    elif out_tdtypes is not None:  # (whole_tensor: array and pending shapes are tuples)
        wrapped = [whole_tensor(Storage(o, device), o.shape, d) for o, d in zip(outs, out_tdtypes)]
    else:
        wrapped = [whole_tensor(Storage(o, device), o.shape, runtime.torch_dtype(o.dtype)) for o in outs]
    if plan.kind == "mutate":
        return _mutation_result(plan, args, kwargs, wrapped)
    return unflatten(kernel.out_tree, wrapped)


def _functional_args(plan, args, kwargs):
    args = list(args)
    kwargs = dict(kwargs)
    drop_out_args(plan, args, kwargs)
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
    margs = [meta_like(a) for a in args]
    mkwargs = {k: meta_like(v) for k, v in kwargs.items()}
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


_VIEW_CACHE_ENTRIES = 4096


def _run_view(plan, args, kwargs):
    src = args[0]
    if not isinstance(src, TpuTensor):
        return _run_other(plan, args, kwargs)
    # src._key fixes src's shape, strides and offset (a whole-storage tensor
    # is contiguous at offset 0).
    key = (src._key, view_args_key(args) if len(args) > 1 else (),
           hashable(tuple(kwargs.items())) if kwargs else ())
    specs = plan.view_cache.get(key)
    if specs is None:
        storage_shape, base_dtype = src._key[1], storage_dtype(src)
        numel = math.prod(storage_shape) * base_dtype.itemsize // src.dtype.itemsize
        base = torch.empty(numel, dtype=src.dtype, device="meta").as_strided(
            src.shape, src.stride(), src.storage_offset())
        out = plan.func(base, *args[1:], **kwargs)
        leaves = []
        template = flatten(out, leaves)
        for m in leaves:
            # (A meta storage does not check that an as_strided view fits.)
            check_in_storage(m.shape, m.stride(), m.storage_offset(), m.element_size(),
                             numel * src.dtype.itemsize)
        specs = (template, [(tuple(m.shape), m.stride(), m.storage_offset(),
                             (m.dtype, storage_shape, _view_of(m, storage_shape, base_dtype),
                              src._key[3]))
                            for m in leaves])
        if len(plan.view_cache) >= _VIEW_CACHE_ENTRIES:
            # Bounded: a slice at a moving offset makes a new key each step.
            del plan.view_cache[next(iter(plan.view_cache))]
        plan.view_cache[key] = specs
    template, leaves = specs
    metrics.M.ops_dispatched += 1
    if torch.is_inference_mode_enabled() and not src.is_inference():
        # A view of a normal tensor is a normal tensor, in inference mode
        # too (autograd gives it its base's version counter, which an
        # inference tensor cannot take).
        with torch.inference_mode(False):
            return _views(src._storage, template, leaves)
    return _views(src._storage, template, leaves)


def _views(storage, template, leaves):
    if template is ...:
        return view_tensor(storage, *leaves[0])
    return unflatten(template, [view_tensor(storage, *leaf) for leaf in leaves])


def _view_of(m, storage_shape, storage_dtype):
    """The view spec of meta result m over a storage of storage_dtype: its
    elements, or (x.view(torch.uint8), view_as_real) the storage's bytes read
    as m's dtype, so that writes through either reach the other."""
    if m.dtype == storage_dtype:
        return make_view(storage_shape, m.shape, m.stride(), m.storage_offset())
    return DtypeView(tuple(m.shape), tuple(m.stride()), m.storage_offset(), m.dtype, storage_dtype)


_warned_fallback = set()


def _run_other(plan, args, kwargs):
    func = plan.func
    # CPU's own composite first (inference mode sends them here): some of
    # torch._decomp's take the Python API's arguments (a reduction's name).
    for decomp in (func.decompose, decomposition_table.get(func)):
        out = NotImplemented if decomp is None else decomp(*args, **kwargs)
        if out is not NotImplemented:
            metrics.M.decompositions[plan.name] += 1
            return out
    if plan.custom_default is not None:
        # A library's custom op with a kernel for tpu or any device (in
        # Python): run it here; its own ops come back through this dispatcher.
        metrics.M.decompositions[plan.name] += 1
        return func._op_dk(plan.custom_default, *args, **kwargs)
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
    moved = {}
    device = first_device(args, kwargs)  # where the results go

    def to_cpu(x, cpu_ok=False):
        if isinstance(x, TpuTensor):
            if x._storage.device != device:
                raise device_mismatch(device, x.device)
            if id(x) not in moved:
                if isinstance(x._storage.array, jax.core.Tracer):
                    raise RuntimeError(
                        f"{name} has no tpu lowering (eager modes run it on the CPU), so it "
                        "cannot be traced into a JAX function")
                moved[id(x)] = (x, download(x, "cpu_fallback"))
            return moved[id(x)][1]
        if isinstance(x, torch.Tensor) and x.dim() > 0 and not cpu_ok:
            # The CPU op would accept it; a tpu op must not (as with CUDA).
            raise device_mismatch(device, x.device)
        if isinstance(x, (list, tuple)):
            return type(x)(to_cpu(v, cpu_ok) for v in x)
        return x

    tensorish = plan.tensorish
    cargs = [to_cpu(a, tensorish.get(i) is _INDICES) for i, a in enumerate(args)]
    ckwargs = {k: to_cpu(v, tensorish.get(k) is _INDICES) for k, v in kwargs.items()}
    bounds.check_on_host(plan.func, cargs, ckwargs, plan.functional)  # CPU's check, naming the op
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
            return to_tpu(x, device=device)
        if isinstance(x, (list, tuple)):
            return type(x)(back(v) for v in x)
        return x
    return back(out)


def copy_into(dst, src_cpu):
    """Write a CPU tensor's values into a TpuTensor (through its view)."""
    src_cpu = src_cpu.to(dst.dtype).expand(dst.shape).contiguous()
    src = to_tpu(src_cpu, device=dst._storage.device)
    return dispatch(aten.copy_.default, (dst, src), {})

