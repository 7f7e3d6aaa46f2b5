"""One XLA computation per aten graph: what the `tpu` torch.compile backend
makes of each graph AOTAutograd hands it (a forward, a backward, an
inference graph, an optimizer step).

The graph runs once, per kind of call, under torchtpu's own dispatcher inside
one traced JAX function: its inputs are tpu tensors over storages that hold
JAX tracers, so each aten op adds its lowering's code to that one function
instead of running. What the function returns is the graph's outputs and the
new arrays of the input storages the graph wrote (an optimizer's in-place
updates, batch norm's running statistics); inputs returned as they came and
values returned twice are not outputs (XLA would copy them), the results
view their arrays. A call then is one kernel given to the current executor:
strict issues it asynchronously and debug waits for it, both donating the
written inputs; fused records it as one node of the pending graph. With
mode="reduce-overhead" a kind of call is captured once (torch.tpu.graph)
and every call replays the capture over its own storages.

A kind of call is the inputs' keys (dtype, storage shape, view, device),
which inputs share a storage, and the values of non-tensor inputs; a new
kind traces again. Index checks stay: the computation takes and returns the
device's running bounds flag, and each call notes the checks it made.
Graphs this cannot serve exactly run op by op through the dispatcher in the
current eager mode, as before, and say why in `graph_fallbacks`: random ops
(a traced function would draw the same numbers on every call), control flow
(torch.cond, while_loop: run eagerly), CPU tensor inputs, inputs over a grown
storage (dispatch/growth.py), symbolic sizes, and NaN/Inf checks being on.
"""
import contextlib
import copy
import functools
import sys
import threading
import typing

import jax
import jax.numpy as jnp
import torch

from . import bounds, cache, errors, modes
from .dispatch.build import Kernel, memory_order
from .dispatch.keys import Const
from .integrations import control_flow
from .modes import checks
from .ops import matmul_setting
from .modes.strict import StrictExecutor
from .tensor import Lost, Pending, Storage, TpuTensor, read_view, view_tensor, whole_tensor

# Why graphs ran op by op, by reason: what a user (or a test) can inspect.
graph_fallbacks = {}


def _fallback_reason(gm):
    if checks.CHECK_NANS:
        return "nan checks"
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator) and node.target.name() in control_flow.NAMES:
            return f"control flow ({node.target.name()})"
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            return f"random op {node.target}"
    return None


class Computed(typing.NamedTuple):
    """An output the kernel computes, in the next of its output arrays:
    a tensor of dtype, contiguous (layout None) or (shape, strides) over
    that array, which holds it in its memory order; requiring grad where it
    is an input's view the kernel copies (laid out otherwise than
    AOTAutograd traced it), as that view does (see ReturnedInput)."""
    dtype: torch.dtype
    layout: object
    requires_grad: bool = False


class ReturnedInput(typing.NamedTuple):
    """An output that is an input returned as it came: a view (shape,
    strides, offset, key) of the call's storage at slot, requiring grad as
    that input does (an input the forward saves for backward reaches the
    backward graph as it came, as with AOTAutograd's eager backends)."""
    slot: int
    shape: tuple
    stride: tuple
    offset: int
    key: tuple
    requires_grad: bool


class SameAs(typing.NamedTuple):
    """An output that is the same tensor as output `index`."""
    index: int


class Constant(typing.NamedTuple):
    """An output that is not a tensor: value itself."""
    value: object


class Made(typing.NamedTuple):
    """In a replay, the storage of the call's `index`-th computed output."""
    index: int


class _Traced:
    """The graph traced for one kind of call: its kernel, the slot of each
    tensor input's storage, and how to rebuild the outputs."""
    __slots__ = ("kernel", "slots", "outputs", "checks", "replay", "donated", "_donating")

    def __init__(self, kernel, slots, outputs, checks, donated=()):
        self.kernel = kernel
        # The slots of the storages it writes with arrays of their own shape
        # and dtype (an optimizer's parameters and state): strict and debug
        # mode donate them, so that XLA writes the new values over the old.
        self.donated = donated
        self._donating = None
        # mode="reduce-overhead": its capture (a _Replay), False where it
        # cannot be replayed, None before the first call.
        self.replay = None
        self.slots = slots
        # The index checks its ops make on device (bounds.unread_checks()
        # entries, each naming its line); the kernel's last input and last
        # output are then the device's running flag.
        self.checks = checks
        # per output: a Computed, ReturnedInput, SameAs or Constant
        self.outputs = outputs

    def donating(self):
        """The kernel with the donated storages' arrays donated."""
        if self._donating is None:
            k = self.kernel
            donating = Kernel(k.name, k.fn, None, k.written_slots, device=k.device, graph=True)
            donating.jitted = cache.jit(k.fn, None, self.donated, k.device)
            donating.avals = k.avals
            self._donating = donating
        return self._donating


def _call_key(args):
    """The kind of call (its arguments, and the float32 matmul precision its
    products are traced at), and each tensor argument's storage slot."""
    storages, slots, parts = {}, [], []
    for a in args:
        if type(a) is TpuTensor:
            slot = storages.setdefault(a._storage, len(storages))
            slots.append(slot)
            parts.append((slot, a._key, a.requires_grad))
        else:
            slots.append(None)
            parts.append(Const(a, type(a)))
    parts.append(matmul_setting())
    return tuple(parts), list(storages), slots


def _as_values(gm):
    """gm with each view op a reshape. Inside one computation a view is only
    a value (the graph is functional), and AOTAutograd chose its views for
    the strides fake tensors had, which a value computed another way need
    not have."""
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    return torch.fx.GraphModule(gm, graph)


class _Layout(typing.NamedTuple):
    """An output's shape, strides and storage offset as AOTAutograd traced
    it, in this call's sizes."""
    shape: tuple
    stride: tuple
    offset: int


def _layouts(gm, args):
    """The _Layout of each of gm's tensor outputs at the call of args (None
    for another output, or one whose size this call's inputs do not give).

    A graph Dynamo traced with dynamic shapes has symbolic sizes in its
    fake tensors: each is evaluated at the values the call's inputs give the
    symbols (ShapeEnv.bind_symbols), never compared with a size as a SymInt,
    which would evaluate it at its hint (the size the graph was traced at)
    and, worse, add a guard to Dynamo's ShapeEnv fixing the symbol to this
    call's size (its replacements: every later call's layout would read
    as that size's)."""
    (returned,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    metas = [r.meta.get("val") if isinstance(r, torch.fx.Node) else None
             for r in (returned if isinstance(returned, (list, tuple)) else (returned,))]
    placeholders = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    symbolic = [x for m in metas + placeholders if isinstance(m, torch.Tensor)
                for x in (*m.shape, *m.stride(), m.storage_offset())
                if isinstance(x, torch.SymInt)]
    symbolic += [m for m in placeholders if isinstance(m, torch.SymInt)]
    values = {}
    if symbolic:
        pairs = [(m, a) for m, a in zip(placeholders, args)
                 if isinstance(m, torch.SymInt) and type(a) is int
                 or isinstance(m, torch.Tensor) and isinstance(a, torch.Tensor)]
        bound = symbolic[0].node.shape_env.bind_symbols(*zip(*pairs)) if pairs else {}
        import sympy  # (here, not at torchtpu's import: only symbolic sizes need it)
        values = {symbol: sympy.Integer(v) for symbol, v in bound.items()}

    def concrete(x):
        if not isinstance(x, torch.SymInt):
            return x
        value = sympy.sympify(x.node.expr).xreplace(values)
        if not value.is_Integer:
            raise LookupError(x.node.expr)
        return int(value)

    layouts = []
    for m in metas:
        try:
            layouts.append(_Layout(tuple(map(concrete, m.shape)), tuple(map(concrete, m.stride())),
                                   concrete(m.storage_offset())) if isinstance(m, torch.Tensor) else None)
        except LookupError:  # (an unbacked size, say)
            layouts.append(None)
    return layouts


def _trace(gm, args, slots, n_storages, device, name):
    """Build the kernel that runs gm over the storages' arrays."""
    # Each output gets the strides AOTAutograd traced it with (a saved
    # activation that is a transpose stays one: backward's views rely on it).
    layouts = _layouts(gm, args)
    outputs = []
    written = []
    checks = []
    flag = bounds.flag_input(False, device)

    def fn(*arrays):
        arrays, flag_in = arrays[:-1], arrays[-1]
        storages = [Storage(a, device) for a in arrays]
        inputs = []
        for a, slot in zip(args, slots):
            if slot is None:
                inputs.append(a)
            else:
                # requires_grad as the call's tensor has it (part of the
                # call's key): an op may decide on it, as flex_attention's
                # backward returns the gradient of a tensor its score_mod
                # reads only when that tensor requires grad.
                inputs.append(view_tensor(storages[slot], a.shape, a.stride(), a.storage_offset(),
                                          a._key, requires_grad=a.requires_grad))
        with traced_ops(device, flag_in) as (flag, first):
            results = gm(*inputs)
            flag_out = flag.array
            # The user's line that called the compiled function (its first
            # call, which traces it): what an index check names.
            where = errors.user_site()
            checks[:] = [bounds._Check(c.bound, c.func, where)
                         for c in bounds.unread_checks()[first:]]
        outs = []
        outputs.clear()
        slot_of = {id(st): slot for slot, st in enumerate(storages)}
        returned_at = {}  # id(an output's value) -> its place in outputs
        for r, layout in zip(results if isinstance(results, (list, tuple)) else (results,), layouts):
            slot = slot_of.get(id(r._storage)) if type(r) is TpuTensor else None
            if slot is not None and r._storage.array is arrays[slot] and _same_layout(r, layout):
                # An input returned as it came (a parameter or the batch saved
                # for backward): the result views the input's array, which
                # the computation need not copy into a new buffer.
                outputs.append(ReturnedInput(slot, tuple(r.shape), tuple(r.stride()),
                                             r.storage_offset(), r._key, r.requires_grad))
            elif type(r) is TpuTensor:
                value = read_view(r._storage.array, r._view)
                # An input's view copied keeps the view's requires_grad: a
                # tensor score_mod reads gets its gradient only if it does.
                requires_grad = slot is not None and r.requires_grad
                order = memory_order(layout.shape, layout.stride) if layout is not None else None
                if order is None:
                    outputs.append(Computed(r.dtype, None, requires_grad))
                else:
                    value = jnp.transpose(value, order)
                    outputs.append(Computed(r.dtype, (tuple(r.shape), layout.stride), requires_grad))
                earlier = returned_at.get(id(value))
                if earlier is not None and outputs[earlier] == outputs[-1]:
                    # The same value returned twice (an activation and its
                    # alias): one output, which XLA need not copy.
                    outputs[-1] = SameAs(earlier)
                else:
                    returned_at[id(value)] = len(outputs) - 1
                    outs.append(value)
            elif isinstance(r, torch.Tensor):
                raise _Unservable(f"a {r.device} tensor output")
            else:
                outputs.append(Constant(r))
        written.clear()
        new = []
        for slot, (st, array) in enumerate(zip(storages, arrays)):
            if st.array is not array:
                written.append(slot)
                new.append(st.array)
        if checks:
            outs.append(flag_out)
        return tuple(outs), tuple(new)

    specs = []
    for slot in range(n_storages):
        a = next(x for x, s in zip(args, slots) if s == slot)
        arr = a._storage.array
        specs.append(jax.ShapeDtypeStruct(arr.shape, arr.dtype))
    specs.append(jax.ShapeDtypeStruct(flag.array.shape, flag.array.dtype))
    avals = jax.eval_shape(fn, *specs)  # traces once: outputs and written slots known
    kernel = Kernel(name, fn, None, tuple(written), device=device, graph=True)
    kernel.avals = avals
    donated = tuple(slot for slot, new in zip(written, avals[1])
                    if (new.shape, new.dtype) == (specs[slot].shape, specs[slot].dtype))
    return _Traced(kernel, slots, list(outputs), tuple(checks), donated)


def _same_layout(t, layout):
    """Whether t has the shape, strides and offset AOTAutograd traced its
    output with (layout, a _Layout or None)."""
    return (layout is not None and layout.shape == tuple(t.shape)
            and layout.stride == tuple(t.stride()) and layout.offset == t.storage_offset())


class _TracingExecutor(StrictExecutor):
    """The executor while a graph is traced: each op's kernel function is
    inlined into the one function being traced (as fused mode's graphs do),
    not called as its own executable."""

    def run(self, kernel, flat, storages):
        return kernel.fn(*flat)


_TRACING = _TracingExecutor()


@functools.cache
def _new_thread_dispatch_keys():
    """The dispatcher's thread-local (include, exclude) key sets as a new
    thread starts with them: the same in every process, read once."""
    keys = []
    t = threading.Thread(target=lambda: keys.append(
        (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())))
    t.start()
    t.join()
    return keys[0]


def _as_in_a_new_thread():
    """A graph is traced wherever its kernel is first needed: from the user's
    call, in a background compile, or at a fused flush, which can come from
    inside another op's __torch_dispatch__, where PyTorch excludes every key
    above Python (functorch's too: flex_attention's vmap then fails with
    "querying is_contiguous inside of vmap"). With a new thread's keys, the
    trace is the same wherever it runs."""
    return torch._C._ForceDispatchKeyGuard(*_new_thread_dispatch_keys())


@contextlib.contextmanager
def traced_ops(device, flag_in):
    """Inside the block, each op on tpu tensors over traced arrays adds its
    code to the JAX function being traced instead of running. Index checks
    merge into flag_in; the block gets (the device's flag, whose array is
    then what they merged into, the index of the first check it made)."""
    flag = bounds.flag_input(False, device)
    flag_before = flag.array
    first = len(bounds.unread_checks())
    flag.assign(flag_in)
    try:
        with _as_in_a_new_thread(), modes.using(_TRACING), torch.no_grad():
            yield flag, first
    finally:
        _forget_checks(first, device)
        flag.assign(flag_before)


def _forget_checks(first, device):
    """Drop the index checks the trace noted (bounds keeps them per call of
    the kernel instead, through note_replayed): they ran on tracers."""
    del bounds.unread[first:]
    f = bounds._flags_of(device)
    f.positions = [p for p in f.positions if p < first]


class _Unservable(Exception):
    """A graph this module cannot compile exactly (it runs op by op)."""


class CompiledGraph:
    """A callable for AOTAutograd: gm as one XLA computation per kind of call;
    with replay (mode="reduce-overhead"), each kind captured once into a
    TPUGraph and replayed."""

    def __init__(self, gm, name, replay=False):
        self.gm = _as_values(gm)
        self.name = name
        self.run = _replayed if replay else _run
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
        if any(isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) for a in args):
            # Called while something traces it (symbolic sizes): as eager code.
            return self.gm(*args)
        key, storages, slots = _call_key(args)
        try:
            traced = self.traced.get(key)
        except TypeError:  # a symbolic size among the values (dynamic shapes)
            return self._eager(args, "symbolic sizes")
        if traced is None:
            for a in args:
                if isinstance(a, torch.Tensor) and type(a) is not TpuTensor:
                    return self._eager(args, f"a {a.device} tensor input")
            if any(type(st) is not Storage for st in storages):
                return self._eager(args, "an input over a grown storage")
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
        return self.run(traced, storages)


def _run(traced, storages):
    kernel = traced.kernel
    ex = modes.current()
    flag = bounds.flag_input(False, kernel.device)
    arrays = [st.array for st in storages]
    # An executor that runs the kernel at once donates here (fused mode and
    # capture record it: their graph's flush or replay donates what it may).
    if traced.donated and not ex.records:
        kernel = traced.donating()
        for i in traced.donated:
            # Another holder (a second storage, the executor's last results)
            # would see a donated buffer vanish: donate a copy instead.
            if sys.getrefcount(arrays[i]) > 3:
                arrays[i] = jnp.copy(arrays[i])
    arrays.append(flag.array)
    outs, written = ex.run(kernel, arrays, storages + [flag])
    del arrays
    for slot, array in zip(kernel.written_slots, written):
        storages[slot].assign(array)
    if traced.checks:
        outs = list(outs)
        new_flag = outs.pop()
        produced = [storages[slot] for slot in kernel.written_slots]
    results = _results(traced, [Storage(o, kernel.device) for o in outs], storages)
    if traced.checks:
        produced += [r._storage for r in results if type(r) is TpuTensor]
        bounds.note_replayed(traced.checks, new_flag, storages, produced, kernel.device)
        if ex.waits_each_op:
            bounds.check()  # debug mode raises at the call that went out of range
    return results


# ---- mode="reduce-overhead": replay ------------------------------------------
# A kind of call is captured once (torch.tpu.graph's capture of the kernel's
# call) and each call replays that capture over its own storages, as
# torch.compile's CUDA graphs replay over each call's inputs. A replay writes
# the storages the graph updates in place (their buffers donated: an
# optimizer's parameters and state stay in their buffers), where a plain
# call returns their new values in new buffers.

_FLAG = -1  # the device's running bounds flag, in a capture's storages


class _Replay:
    """The capture of one kind of call, and where each storage it reads and
    writes is found in a call: slot k of the call's storages (k >= 0), the
    bounds flag (_FLAG), or the call's j-th tensor result (Made(j))."""
    __slots__ = ("graph", "inputs", "outputs", "n_results")

    def __init__(self, graph, inputs, outputs, n_results):
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self.n_results = n_results


def _capture(traced, storages):
    """The _Replay of traced over these storages, or False if its capture
    reads or writes a storage that is none of the call's."""
    from . import graphs
    g = graphs.TPUGraph()
    g.capture_begin()
    try:
        results = _run(traced, storages)
    except BaseException as e:
        g._abort(e)
        raise
    # Only the computed outputs: a replay makes the others from them.
    tensors = [r for r, out in zip(results, traced.outputs) if type(out) is Computed]
    del results
    g.capture_end()
    slot_of = {id(st): k for k, st in enumerate(storages)}
    slot_of[id(bounds.flag_input(False, traced.kernel.device))] = _FLAG
    result_of = {id(r._storage): Made(j) for j, r in enumerate(tensors)}
    captured = g.captured
    inputs = [slot_of.get(id(st)) for st in captured.inputs]
    outputs = [slot_of.get(id(st), result_of.get(id(st))) for st in captured.outputs]
    made = {o for o in outputs if type(o) is Made}
    if None in inputs or None in outputs or len(made) != len(tensors):
        return False
    return _Replay(g, inputs, outputs, len(tensors))


def _replayed(traced, storages):
    """A call of traced as a replay of its capture (captured at the first
    call); inside a user's capture, the call is recorded there instead."""
    from . import graphs
    rep = traced.replay
    if rep is None:
        if graphs.is_current_stream_capturing():
            return _run(traced, storages)
        rep = traced.replay = _capture(traced, storages)
    if rep is False or graphs.is_current_stream_capturing():
        return _run(traced, storages)
    device = traced.kernel.device
    flag = bounds.flag_input(False, device)
    made = [Storage(None, device) for _ in range(rep.n_results)]

    def storage(place):
        if type(place) is Made:
            return made[place.index]
        return storages[place] if place >= 0 else flag
    rep.graph.replay_over([storage(p) for p in rep.inputs], [storage(p) for p in rep.outputs])
    ex = modes.current()
    if ex.waits_each_op:
        # Waits for the replay's results: debug mode raises at the call
        # that went out of range.
        ex.sync()
    return _results(traced, made, storages)


def _alias(storage, shape, stride, offset, key, requires_grad=False):
    """A tensor viewing storage's array as it is now, in a storage of its
    own (a later write to storage is not seen, as if it were a copy)."""
    array = storage.array
    if type(array) in (Pending, Lost):
        # Not a value yet (fused mode, capture): the recorder's copy of it
        # (a Pending has one owner), one node of its graph.
        (array,), _ = modes.current().run(_copy_kernel(array, storage.device), [array], [storage])
    return view_tensor(Storage(array, storage.device), shape, stride, offset, key, requires_grad)


_copy_kernels = {}


def _copy(array):
    return (array,), ()


def _copy_kernel(array, device):
    """The kernel returning its one input: a recorded copy of a pending value."""
    kind = (array.shape, array.dtype, device)
    kernel = _copy_kernels.get(kind)
    if kernel is None:
        kernel = _copy_kernels[kind] = Kernel("compiled_graph_output", _copy, None, (),
                                              device=device)
        kernel.avals = ((jax.ShapeDtypeStruct(array.shape, array.dtype),), ())
    return kernel


def _results(traced, storages, inputs):
    """The graph's outputs: its constants, inputs it returned as they came
    (views of their arrays, in storages of their own: a later write to the
    input is not seen), and tensors over storages (one per computed tensor
    output, in order, holding the arrays the kernel returned). inputs: the
    call's storages."""
    results, it = [], iter(storages)
    for out in traced.outputs:
        kind = type(out)
        if kind is ReturnedInput:
            results.append(_alias(inputs[out.slot], out.shape, out.stride, out.offset, out.key,
                                  out.requires_grad))
        elif kind is SameAs:
            t = results[out.index]
            results.append(_alias(t._storage, tuple(t.shape), t.stride(), t.storage_offset(),
                                  t._key))
        elif kind is Constant:
            results.append(out.value)
        elif out.layout is None:
            st = next(it)
            results.append(whole_tensor(st, tuple(st.array.shape), out.dtype, out.requires_grad))
        else:
            shape, strides = out.layout
            results.append(TpuTensor(next(it), shape, out.dtype, strides,
                                     requires_grad=out.requires_grad))
    return results


_counter = [0]


def compile_graph(gm, example_inputs, replay=False):
    """AOTAutograd's compiler for one aten graph (forward, backward or
    inference): a boxed callable running it as one XLA computation (with
    replay, a replayed capture of it: mode="reduce-overhead")."""
    _counter[0] += 1
    compiled = CompiledGraph(gm, f"compiled_graph_{_counter[0]}", replay)

    def run(args):
        values = list(args)
        args.clear()  # boxed: AOTAutograd's inputs are freed as soon as read
        return compiled(*values)

    run._boxed_call = True
    run.compiled = compiled
    return run
