"""One XLA computation per aten graph: what the `tpu` torch.compile backend
makes of each graph AOTAutograd hands it (a forward, a backward, an
inference graph, an optimizer step).

The graph runs once, per kind of call, under torchtpu's own dispatcher inside
one traced JAX function: its inputs are tpu tensors over storages that hold
JAX tracers, so each aten op adds its lowering's code to that one function
instead of running. What the function returns is the graph's outputs and the
new arrays of the input storages the graph wrote (an optimizer's in-place
updates, batch norm's running statistics). A call then is one kernel given
to the current executor: strict issues it asynchronously, debug waits for
it, fused records it as one node of the pending graph.

A kind of call is the inputs' keys (dtype, storage shape, view, device),
which inputs share a storage, and the values of non-tensor inputs; a new
kind traces again. Graphs this cannot serve exactly run op by op through the
dispatcher in the current eager mode, as before, and say why in
`graph_fallbacks`: random ops (a traced function would draw the same numbers
on every call), ops with device-side index checks, CPU tensor inputs, and
NaN/Inf checks being on.
"""
import jax
import torch

from . import bounds, errors, modes
from .dispatch.kernels import Kernel
from .tensor import Storage, TpuTensor, read_view, view_tensor, whole_tensor

# Why graphs ran op by op, by reason: what a user (or a test) can inspect.
graph_fallbacks = {}


def _fallback_reason(gm):
    if errors.CHECK_NANS:
        return "nan checks"
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            return f"random op {node.target}"
        if node.target in errors.BOUNDS:
            return f"index-checked op {node.target}"
    return None


class _Traced:
    """The graph traced for one kind of call: its kernel, the slot of each
    tensor input's storage, and how to rebuild the outputs."""
    __slots__ = ("kernel", "slots", "outputs")

    def __init__(self, kernel, slots, outputs):
        self.kernel = kernel
        self.slots = slots
        self.outputs = outputs  # per output: ("t", dtype) or ("c", value)


def _call_key(args):
    """The kind of call, and each tensor argument's storage slot."""
    storages, slots, parts = {}, [], []
    for a in args:
        if type(a) is TpuTensor:
            slot = storages.setdefault(a._storage, len(storages))
            slots.append(slot)
            parts.append((slot, a._key, a.requires_grad))
        else:
            slots.append(None)
            parts.append(("c", type(a), a))
    return tuple(parts), list(storages), slots


def _trace(gm, args, slots, n_storages, device, name):
    """Build the kernel that runs gm over the storages' arrays."""
    outputs = []
    written = []

    def fn(*arrays):
        storages = [Storage(a, device) for a in arrays]
        inputs = []
        for a, slot in zip(args, slots):
            if slot is None:
                inputs.append(a)
            else:
                inputs.append(view_tensor(storages[slot], a.shape, a.stride(), a.storage_offset(),
                                          a._key))
        previous = modes._current
        modes._current = modes._executor("strict")  # ops add code to this trace, one by one
        try:
            with torch.no_grad():
                results = gm(*inputs)
        finally:
            modes._current = previous
        outs = []
        outputs.clear()
        for r in (results if isinstance(results, (list, tuple)) else (results,)):
            if type(r) is TpuTensor:
                outs.append(read_view(r._storage.array, r._view))
                outputs.append(("t", r.dtype))
            elif isinstance(r, torch.Tensor):
                raise _Unservable(f"a {r.device} tensor output")
            else:
                outputs.append(("c", r))
        written.clear()
        new = []
        for slot, (st, array) in enumerate(zip(storages, arrays)):
            if st.array is not array:
                written.append(slot)
                new.append(st.array)
        return tuple(outs), tuple(new)

    specs = []
    for slot in range(n_storages):
        a = next(x for x, s in zip(args, slots) if s == slot)
        arr = a._storage.array
        specs.append(jax.ShapeDtypeStruct(arr.shape, arr.dtype))
    avals = jax.eval_shape(fn, *specs)  # traces once: outputs and written slots known
    kernel = Kernel(name, fn, None, tuple(written), device=device)
    kernel.avals = avals
    return _Traced(kernel, slots, list(outputs))


class _Unservable(Exception):
    """A graph this module cannot compile exactly (it runs op by op)."""


class CompiledGraph:
    """A callable for AOTAutograd: gm as one XLA computation per kind of call."""

    def __init__(self, gm, name):
        self.gm = gm
        self.name = name
        self.traced = {}
        self.eager_reason = _fallback_reason(gm)
        if self.eager_reason is not None:
            graph_fallbacks[self.eager_reason] = graph_fallbacks.get(self.eager_reason, 0) + 1

    def _eager(self, args, reason):
        if self.eager_reason is None:
            self.eager_reason = reason
            graph_fallbacks[reason] = graph_fallbacks.get(reason, 0) + 1
        return self.gm(*args)

    def __call__(self, *args):
        if self.eager_reason is not None:
            return self.gm(*args)
        key, storages, slots = _call_key(args)
        traced = self.traced.get(key)
        if traced is None:
            for a in args:
                if isinstance(a, torch.Tensor) and type(a) is not TpuTensor:
                    return self._eager(args, f"a {a.device} tensor input")
            devices = {st.device for st in storages}
            if len(devices) > 1:
                return self._eager(args, "tensors on several devices")
            bounds.check()  # earlier ops' index checks are read before tracing
            try:
                traced = _trace(self.gm, args, slots, len(storages),
                                devices.pop() if devices else 0, self.name)
            except (_Unservable, jax.errors.ConcretizationTypeError,
                    jax.errors.TracerArrayConversionError) as e:
                return self._eager(args, str(e).split("\n")[0][:80])
            self.traced[key] = traced
        return _run(traced, storages)


def _run(traced, storages):
    kernel = traced.kernel
    outs, written = modes._current.run(kernel, [st.array for st in storages], storages)
    for slot, array in zip(kernel.written_slots, written):
        storages[slot].assign(array)
    results, it = [], iter(outs)
    for kind, value in traced.outputs:
        if kind == "t":
            o = next(it)
            results.append(whole_tensor(Storage(o, kernel.device), tuple(o.shape), value))
        else:
            results.append(value)
    return results


_counter = [0]


def compile_graph(gm, example_inputs):
    """AOTAutograd's compiler for one aten graph (forward, backward or
    inference): a boxed callable running it as one XLA computation."""
    _counter[0] += 1
    compiled = CompiledGraph(gm, f"compiled_graph_{_counter[0]}")

    def run(args):
        values = list(args)
        args.clear()  # boxed: AOTAutograd's inputs are freed as soon as read
        return compiled(*values)

    run._boxed_call = True
    run.compiled = compiled
    return run
