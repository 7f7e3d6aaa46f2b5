"""A fused graph: the ops recorded since the last flush (modes/fused.py
records them), and what a flush makes of them: the values still live, the
sub-graph they need (recomputed ops read through fences), the inputs to
donate, and the run(inputs, scalars) it becomes, compiled (in the
background, or loaded from the disk) or op by op on the per-op kernels."""
import collections
import sys
import time
import typing

import jax
import numpy as np

from .. import cache, cache_kernels, config, metrics, runtime
from .refs import Fenced, Input, Result, Scalar, arguments, results


class Graph:
    """The ops recorded since the last flush."""

    def __init__(self):
        self.nodes = []       # (kernel, refs)
        self.outputs = []     # every Pending the nodes produce
        self.inputs = []      # concrete arrays fed to the graph
        self.input_owners = []  # weak reference to the storage each input came from
        self.input_refs = {}  # id(array) -> its Input
        self.scalars = []     # dynamic scalars fed to the graph
        self.device = 0       # the index of the device all its ops run on
        self.side_values = {}  # ref -> the value a side graph computed for a read
        self.collectives = 0   # collective nodes among them
        self.mesh = None       # the devices its collectives span
        self.recomputed = set()  # nodes recorded while a backward pass recomputes a forward
        self.anchor = None     # the last node a backward pass recorded (its first output)


def op_names(g, most=6):
    names = [str(k.name) for k, _ in g.nodes[:most]]
    return ", ".join(names) + (", ..." if len(g.nodes) > most else "")


class GraphEntry(typing.NamedTuple):
    """What the graph cache holds for a graph's key: how it runs, and its
    kernels (held, so that their ids in the key stay theirs)."""
    run: object         # run(inputs, scalars) -> the live values
    kernels: list


class GraphKey:
    """A graph's key with its hash computed once: the cache lookup, its
    recency update and the churn check each hash it, and hashing a step's
    key (a tuple per op) costs about 0.15 us per op."""
    __slots__ = ("parts", "hash")

    def __init__(self, parts):
        self.parts = parts
        self.hash = hash(parts)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return type(other) is GraphKey and self.hash == other.hash and self.parts == other.parts


def live_values(g):
    """(pending value, its storage) for each of g's outputs a storage still
    holds: what running g must materialize."""
    live = []
    for p in g.outputs:
        owner = p.owner() if p.owner is not None else None
        if owner is not None and owner.array is p:
            live.append((p, owner))
    return live


def fenced(g, refs, ni):
    """refs of node ni, an op recomputed in a backward pass, with those from
    outside the recomputation (the graph's inputs, the forward's results)
    read through a fence."""
    g.recomputed.add(ni)
    recomputed = g.recomputed
    anchor = None if g.anchor is None else Result(g.anchor, 0)
    return [Fenced(r, anchor) if type(r) is Input or (type(r) is Result and r.node not in recomputed)
            else r for r in refs]


def _refs_read(refs):
    """The Results and Inputs refs read, Fenced ones' anchors included."""
    for r in refs:
        if type(r) is Fenced:
            yield r.ref
            if r.anchor is not None:
                yield r.anchor
        else:
            yield r


def needed_nodes(g, refs, keep=()):
    """The indices of g's nodes that computing refs (pending refs of g) and
    the nodes in keep takes, in order."""
    nodes = g.nodes
    needed = set(keep)
    stack = [r.node for r in refs] + list(keep)
    while stack:
        ni = stack.pop()
        needed.add(ni)
        for r in _refs_read(nodes[ni][1]):
            if type(r) is Result and r.node not in needed:
                needed.add(r.node)
                stack.append(r.node)
    return sorted(needed)


def subgraph(g, needed):
    """The graph of g's nodes at the indices in needed (in order, each taking
    what it takes from the earlier ones), with its own inputs and scalars:
    (that Graph, {g's pending ref: the sub-graph's})."""
    sub = Graph()
    sub.device = g.device
    at = {}          # g's node index -> the sub-graph's
    mine = {Input: {}, Scalar: {}}  # g's Input or Scalar -> the sub-graph's
    renamed = {}
    for ni in needed:
        kernel, refs = g.nodes[ni]
        new = tuple([_moved_ref(r, g, sub, at, mine) for r in refs])
        at[ni] = len(sub.nodes)
        sub.nodes.append((kernel, new))
        if ni in g.recomputed:
            sub.recomputed.add(at[ni])
    for p in g.outputs:
        ni = p.ref.node
        if ni in at:
            renamed[p.ref] = Result(at[ni], p.ref.index)
    return sub, renamed


def _moved_ref(r, g, sub, at, mine):
    """g's ref r as the sub-graph's (subgraph). Not a closure: one that
    calls itself is a reference cycle, which would keep the sub-graph's
    inputs alive (and so not donatable) until the next garbage collection."""
    kind = type(r)
    if kind is Result:
        return Result(at[r.node], r.index)
    if kind is Fenced:
        return Fenced(_moved_ref(r.ref, g, sub, at, mine),
                      None if r.anchor is None else _moved_ref(r.anchor, g, sub, at, mine))
    ref = mine[kind].get(r)
    if ref is None:
        if kind is Input:
            ref = Input(len(sub.inputs))
            sub.inputs.append(g.inputs[r.index])
            sub.input_owners.append(g.input_owners[r.index])
        else:
            ref = Scalar(len(sub.scalars))
            sub.scalars.append(g.scalars[r.index])
        mine[kind][r] = ref
    return ref


def without_dead_nodes(g, live):
    """g without the nodes that neither a live value nor a collective needs:
    (g or that sub-graph, None or its renaming of g's refs)."""
    collectives = [i for i, node in enumerate(g.nodes) if collective_jit([node]) is not None]
    needed = needed_nodes(g, [p.ref for p, _ in live], collectives)
    if len(needed) == len(g.nodes):
        return g, None
    return subgraph(g, needed)


def abstract(kernel, flat):
    """Output avals of kernel for these inputs (cached on the kernel: its key
    fixes the input avals). Tracing a new kernel here, once, also raises a
    lowering's errors at the user's line rather than at the next flush."""
    avals = kernel.avals
    if avals is None:
        placed = runtime.SHARDINGS[kernel.device]  # (a kept trace is compiled for its device)
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed) if hasattr(x, "shape") else x
                 for x in flat]
        avals = kernel.avals = cache_kernels.eval_shape_kernel(kernel, specs)  # (through its record)
    return avals


def drop_traces(g):
    """Forget the traces abstract() left on g's new kernels (cache.py): what
    g's run did not compile op by op is compiled within graphs, if at all."""
    for kernel, _ in g.nodes:
        if getattr(kernel, "traced", None) is not None:
            kernel.traced = kernel.trace_args = None


def call_traced(kernel, args):
    """kernel's op inside a graph being traced, as a call of jax.jit(fn):
    JAX traces it once per kernel and argument types, however often the
    graph (or the next one) repeats it, a model's layers say, and lowers it
    once per graph; XLA inlines the calls. Tracing each op's fn anew made a
    600-op graph's trace take 0.6 s, the program's thread held up meanwhile."""
    nested = kernel.nested
    if nested is None:
        nested = kernel.nested = jax.jit(kernel.fn)
    return nested(*args)


def call_inlined(kernel, args):
    """kernel's op traced straight into the graph: how a graph holding a
    collective (one program over the group's devices) traces its ops, a
    collective's kernel (distributed/in_graph.py) having no nested jit."""
    return kernel.fn(*args)


def call_jitted(kernel, args):
    return kernel.jitted(*args)


def replay(nodes, live_refs, inputs, scalars, call, values=None, until=None):
    """Run the recorded nodes (call(kernel, args) runs one) and return the
    values of live_refs. values: where Result -> value is kept.
    until: a background.Job; once it has succeeded, stop and return None.
    Fences are optimization barriers where the nodes are traced into one
    computation (call is call_traced or call_inlined); op by op, XLA merges
    nothing."""
    values = {} if values is None else values
    fence = call is call_traced or call is call_inlined
    if call is call_jitted:
        cache_kernels.compile_ahead(kernel for kernel, _ in nodes)
    for ni, (kernel, refs) in enumerate(nodes):
        if until is not None and until.done and until.error is None:
            return None
        outs, written = call(kernel, arguments(refs, values, inputs, scalars, fence))
        produced = (*outs, *written)
        for r, v in zip(results(ni, len(produced)), produced):
            values[r] = v
    return [values[r] for r in live_refs]


def op_by_op_run(nodes, live_refs):
    """A graph's run(inputs, scalars) that calls its ops' own kernels."""
    return lambda inputs, scalars: replay(nodes, live_refs, inputs, scalars, call_jitted)


def donatable(g, live):
    """Which inputs to donate (XLA then updates them in place, as an
    optimizer step overwrites parameters and state): those no tensor holds
    any more (the graph overwrote them), as many of each shape and dtype as
    results of that shape and dtype need; None if none."""
    wanted = collections.Counter([(p.shape, p.dtype) for p, _ in live])
    mask = []
    for a in g.inputs:
        # Held only by g.inputs (plus this loop and getrefcount's argument).
        if sys.getrefcount(a) <= 3:
            kind = (a.shape, a.dtype)  # (read only here: an array's are properties)
            if wanted[kind] > 0:
                wanted[kind] -= 1
                mask.append(True)
                continue
        mask.append(False)
    return tuple(mask) if True in mask else None


def donation_order(g, live, donate):
    """live reordered so that each donated input's buffer goes to the value
    that replaced it in its storage (a parameter's buffer to the updated
    parameter). JAX gives the k-th donated input of a shape and dtype to the
    k-th output of that shape and dtype; given another (the gradient, say),
    XLA must copy the input to keep reading it while the output is written."""
    at = {id(p): j for j, (p, _) in enumerate(live)}
    pairs = []  # (donated input, the live value that replaced it, or None)
    for i, d in enumerate(donate):
        if d:
            storage = g.input_owners[i]()
            p = storage.array if storage is not None else None
            j = at.get(id(p))
            same_kind = j is not None and (p.shape, p.dtype) == (g.inputs[i].shape, g.inputs[i].dtype)
            pairs.append((i, j if same_kind else None))
    claimed = {j for _, j in pairs if j is not None}
    unclaimed = collections.defaultdict(collections.deque)  # kind -> live indices, in order
    for j, (p, _) in enumerate(live):
        if j not in claimed:
            unclaimed[(p.shape, p.dtype)].append(j)
    first, taken = [], set()
    for i, j in pairs:
        if j is None or j in taken:
            # No successor: the first live value of its kind that no input
            # claims (donatable donates no more of a kind than there are).
            free = unclaimed.get((g.inputs[i].shape, g.inputs[i].dtype))
            if not free:
                continue
            j = free.popleft()
        taken.add(j)
        first.append(live[j])
    return first + [x for j, x in enumerate(live) if j not in taken]


def background_min_ops():
    """The fewest ops a new graph has to compile in the background (below,
    XLA compiles it in about the time its ops' own kernels would take)."""
    return config.FUSED_BACKGROUND_OPS.number()


def compile_in_background():
    """Whether a new graph compiles on the compile thread while its flushes
    run op by op (tiered compilation; TORCHTPU_FUSED_COMPILE=sync: not)."""
    return config.FUSED_COMPILE.text().lower() != "sync"


def build(g, live_refs, donate=None, when="first call", piece=False):
    """The compiled graph as run(inputs, scalars); inputs marked in donate
    are passed as a donated argument. when (cache.jit_stored's): compiled
    at its first call, or in the "background" on the compile thread (not a
    graph holding a collective), run.job saying when it is done; or only
    loaded if "stored" (else None). piece: g is a piece of a longer graph
    (segments.py), compiled with XLA's defaults whatever its length."""
    nodes = list(g.nodes)
    start = time.perf_counter()
    donate = donate or (False,) * len(g.inputs)
    given = [i for i, d in enumerate(donate) if d]
    kept = [i for i, d in enumerate(donate) if not d]

    mesh_jit = collective_jit(nodes)
    call = call_traced if mesh_jit is None else call_inlined
    scalars_in = ScalarPacking(g.scalars)

    def graph(donated, rest, packed):
        inputs = [None] * len(donate)
        for i, x in zip(given, donated):
            inputs[i] = x
        for i, x in zip(kept, rest):
            inputs[i] = x
        return replay(nodes, live_refs, inputs, scalars_in.unpack(packed), call)

    graph.__name__ = graph.__qualname__ = f"tpu_fused_{len(nodes)}ops"
    args = ([g.inputs[i] for i in given], [g.inputs[i] for i in kept], scalars_in.pack(g.scalars))
    if mesh_jit is not None:
        # It holds a collective: one program over the group's devices.
        jitted = mesh_jit(graph, args, (0,) if given else (), nodes, live_refs)
    else:
        key_text = _stable_key(nodes, live_refs, g)
        if key_text is not None:
            key_text += f"\ndonated {given}\nscalars packed {scalars_in.layout}"
        jitted = cache.jit_stored(graph, args, key_text, donate_argnums=(0,) if given else (),
                                  device=g.device, when=when,
                                  options=None if piece else runtime.graph_options([k.name for k, _ in nodes]))
    metrics.M.extra["graph_build_seconds"] = metrics.M.extra.get("graph_build_seconds", 0.0) + time.perf_counter() - start

    if jitted is None:
        return None
    pack = scalars_in.pack
    if mesh_jit is None and when != "first call":
        def run(inputs, scalars):
            return jitted.value([inputs[i] for i in given], [inputs[i] for i in kept], pack(scalars))
        run.job = jitted
    else:
        def run(inputs, scalars):
            return jitted([inputs[i] for i in given], [inputs[i] for i in kept], pack(scalars))
    specs = cache.shape_specs(args)
    run.executable = lambda: cache.compiled_of(jitted, specs)
    return run


class ScalarPacking:
    """How a compiled graph takes its dynamic scalars: the Python floats in
    one float64 host array, the ints in one int64 array, anything else as it
    is. A call then makes one transfer per kind, not one per scalar (an
    AdamW step's graph has a few hundred: its step sizes, a transfer each,
    cost a TPU host more than 20 ms a step). Inside, each is a weakly typed
    scalar of its array's dtype, as JAX makes a Python scalar argument, so
    type promotion is the same."""
    __slots__ = ("layout",)

    _KINDS = {float: 0, int: 1}  # (exact types: a bool is not packed)
    _DTYPES = (np.float64, np.int64)

    def __init__(self, scalars):
        counts = [0, 0]
        layout = []
        for x in scalars:
            kind = self._KINDS.get(type(x)) if _weak is not None else None
            if kind is None:
                layout.append(None)
            else:
                layout.append((kind, counts[kind]))
                counts[kind] += 1
        self.layout = tuple(layout)

    def pack(self, scalars):
        kinds = ([], [])
        others = []
        for x, place in zip(scalars, self.layout):
            if place is None:
                others.append(x)
            else:
                kinds[place[0]].append(x)
        return (*(np.array(values, dtype) for values, dtype in zip(kinds, self._DTYPES)), tuple(others))

    def unpack(self, packed):
        *arrays, others = packed
        others = iter(others)
        return [next(others) if place is None else _weak(arrays[place[0]][place[1]])
                for place in self.layout]


def _weak_scalar():
    """A function making a traced scalar weakly typed (JAX's own, private:
    without it, scalars are not packed)."""
    try:
        from jax._src.lax.lax import _convert_element_type
    except ImportError:
        return None
    return lambda x: _convert_element_type(x, x.dtype, weak_type=True)


_weak = _weak_scalar()


def executable_of(entry):
    """The compiled executable a GraphEntry runs, or None: not compiled yet
    (compiling, or run op by op), or compiled inside a plain jax.jit."""
    executable = getattr(entry.run, "executable", None) if entry is not None else None
    return executable() if executable is not None else None


def collective_jit(nodes):
    """The compiler a collective among nodes brings for its graph (see
    distributed/in_graph.py; a graph holding one is never run op by op for
    churn, as every rank must run the same program), or None."""
    for kernel, _ in nodes:
        mesh_jit = getattr(kernel, "mesh_jit", None)
        if mesh_jit is not None:
            return mesh_jit
    return None


def _stable_key(nodes, live_refs, g):
    """The graph described the same way in every process (kernels by their op
    and argument specs, not their identity), or None if some kernel cannot be."""
    parts = []
    for kernel, refs in nodes:
        if kernel.stable_key is None:
            return None
        parts.append(f"{kernel.stable_key} <- {refs}")
    parts.append(f"live {live_refs}")
    parts.append("inputs " + " ".join(f"{x.dtype}{list(x.shape)}" for x in g.inputs))
    parts.append("scalars " + " ".join(type(x).__name__ for x in g.scalars))
    return "\n".join(parts)
