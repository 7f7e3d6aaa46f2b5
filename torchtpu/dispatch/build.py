"""Kernels: the traceable function around a lowering, which materializes
its arguments' views, runs it, casts to the meta kernel's dtypes and writes
written arguments back through their views."""
import typing

import jax.numpy as jnp
import torch

from .. import bounds, cache_kernels, runtime
from ..ops import ctx
from ..ops import random as rng
from ..tensor import _is_contiguous, contiguous_strides, read_view, read_view_at, write_view, write_view_at
from .keys import FedArg, ListArg, ScalarArg, TensorArg
from .meta import flatten


class Kernel:
    """One compiled op: fn (traceable, reused by fused mode), jitted, and how
    to rebuild its outputs."""
    __slots__ = ("fn", "jitted", "name", "out_dtypes", "out_tree", "written_slots", "avals",
                 "stable_key", "bound", "device", "specs", "nested", "traced", "trace_args")

    def __init__(self, name, fn, out_dtypes, written_slots, stable_key=None, bound=None, device=0,
                 graph=False):
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
        # (positional, keyword) argument specs and matmul precision: its key
        # (torchtpu.recompiles)
        self.specs = None
        # jax.jit(fn), called inside a fused graph's trace (modes/graph.py)
        self.nested = None
        # fn's trace from fused mode's abstract evaluation (for the argument
        # specs trace_args), lowered by its compile (if one comes) rather
        # than tracing fn again (cache_kernels.py).
        self.traced = self.trace_args = None
        # Loaded from its record or compiled, at its first call. graph: fn is
        # a whole graph of ops (torch.compile's), compiled as fused graphs are.
        self.jitted = cache_kernels.jit_kernel(self, fn, cache_kernels.module_name(name), device, graph)

    @property
    def compiled(self):
        """Whether its executable is there (compiled or loaded at its first
        call): running it costs no compilation."""
        return not getattr(self.jitted, "pending", False)


class KernelEntry(typing.NamedTuple):
    """What the kernel cache holds for an op call's key."""
    kernel: Kernel
    out_meta: object    # PyTorch's meta results: (leaves, tree), or None
    out_dtypes: tuple   # the results' torch dtypes, or None
    orders: list        # each result's memory order (physical_order), or None


def _materialize(spec, arrays, scalars, offsets):
    """An argument's value in the kernel; offsets: id(spec) -> the offset fed
    for each FedArg (an op writing such a view writes it there)."""
    kind = type(spec)
    if kind is TensorArg:
        return read_view(arrays[spec.slot], spec.view)
    if kind is FedArg:
        offset = offsets[id(spec)] = next(scalars)
        return read_view_at(arrays[spec.slot], spec.window, offset)
    if kind is ScalarArg:
        return next(scalars)
    if kind is ListArg:
        return [_materialize(s, arrays, scalars, offsets) for s in spec.items]
    value = spec.value
    return list(value) if isinstance(value, tuple) else value


def _spec_contiguous(spec):
    """Whether a positional tensor argument is contiguous in PyTorch's sense
    (part of the kernel key, so a lowering may depend on it)."""
    kind = type(spec)
    if kind is TensorArg:
        view = spec.view
        return view is None or _is_contiguous(view.shape, view.stride)
    if kind is FedArg:
        return _is_contiguous(spec.window.shape, spec.window.stride)
    return None


def physical_order(meta):
    """The dim order in which a dense, non-overlapping but permuted result
    (a clone of a transposed tensor) lies in memory; None when contiguous."""
    return memory_order(tuple(meta.shape), meta.stride())


def memory_order(shape, stride):
    """physical_order of a tensor of this shape and these strides."""
    if _is_contiguous(shape, stride):
        return None
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    compact = contiguous_strides([shape[d] for d in order])
    if any(shape[d] > 1 and stride[d] != c for d, c in zip(order, compact)):
        return None
    return tuple(order)


def build_kernel(plan, pos_specs, kw_specs, n_storages, out_meta, orders=None, device=0, precision=None):
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
    written_slots = sorted({s.slot for s in _flat_written(written)})

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
            drop_out_args(plan, args, kwargs)
        if plan.random:
            kwargs["key"] = rng.key_from(next(scalars), next(scalars))
        flag = bounds.device_flag(bound, args, kwargs, flat[n_storages]) if bound is not None else None
        with ctx.tracing(out_meta[0] if out_meta is not None else None,
                         [_spec_contiguous(s) for s in pos_specs], precision):
            result = lowering(*args, **kwargs)
        leaves = []
        template = flatten(result, leaves)
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
                slot, dtype = spec.slot, spec.dtype
                if dtype == torch.complex32:
                    value = runtime.fit_to(value.astype(jnp.complex64), dtype)
                if type(spec) is FedArg:
                    arrays[slot] = write_view_at(arrays[slot], spec.window, offsets[id(spec)], value)
                else:
                    arrays[slot] = write_view(arrays[slot], spec.view, value)
            kernel.out_tree = template
            if flag is not None:
                leaves.append(flag)
            return tuple(leaves), tuple(arrays[s] for s in written_slots)
        kernel.out_tree = template
        if flag is not None:
            leaves.append(flag)
        return tuple(leaves), ()

    stable = repr((plan.name, pos_specs, kw_specs, out_dtypes)) + (" checked" if bound else "")
    if precision is not None:
        stable += f" precision {precision}"
    if " at 0x" in stable or getattr(lowering, "process_local", False):
        # Not describable across processes (a user's kernel: its code is not
        # in torchtpu's source digest).
        stable = None
    kernel = Kernel(plan.name, fn, out_dtypes, written_slots, stable,
                    bound, device)
    kernel.specs = (pos_specs, kw_specs, precision)
    return kernel


def _flat_written(written):
    out = []
    for spec in written:
        if type(spec) is ListArg:
            out.extend(spec.items)
        elif type(spec) is TensorArg or type(spec) is FedArg:
            # Not an empty list (a fused Adam's max_exp_avg_sqs without amsgrad).
            out.append(spec)
    return out


def drop_out_args(plan, args, kwargs):
    """The functional variant takes no out= arguments."""
    for i, a in enumerate(plan.func._schema.arguments):
        if a.is_out:
            kwargs.pop(a.name, None)
            if i < len(args):
                del args[i:]
                break


