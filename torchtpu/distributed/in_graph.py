"""Collectives in fused mode: nodes of the pending graph, not sync points.

`run(gloo, kind, device_ids, t, **params)` gives collective `kind` of tpu
tensor t as a new tpu tensor (of the shape xla.run gives). In strict and
debug mode it runs at once (xla.run). In fused mode it is recorded like any
op: its result is pending, and the graph that holds it compiles as one
program over the group's mesh (`mesh_jit`): a jitted shard_map whose body
is the whole recorded graph, each rank running it on its own values, with
the collectives meeting inside. So XLA sees the collectives beside the
compute, and a training step stays one graph.

Every rank must record the same graph, so the collectives recorded are
those where every rank gives and takes alike: all_reduce, all_gather,
reduce_scatter, all_to_all, and broadcast and reduce, where every rank
writes the result (broadcast's root gets its own bits back, reduce's
others their own values; process_group.py). A broadcast also issues the
pending graph once it has written its tensors (`settle("broadcast")`):
what it hands out, DDP's parameters in its constructor above all, is
then no pending collective's result, and one rank may read what depends
on it (the first step's loss) on its own. So do a reduce, whose root
reads its result alone, and a one-element all_reduce (a loss summed for
logging, read on rank 0). gather, scatter and send/recv
run at once, their inputs computed first, and what they write is issued
(`settle`): only some ranks hold their lists or take part, so the ranks'
graphs around them would differ. Before each run of a graph holding
collectives the ranks swap its digest through gloo (agreement.py) and raise
on every rank when their collectives differ, rather than hang; graphs
with the same collectives amid different local ops (each rank's own
offsets) run op by op on every rank instead, as programs that differ do
not meet. One graph holds
collectives over one set of devices: a collective over another set issues
the pending graph first.

An optimizer's step ends a training step on every rank alike, so once a
collective was recorded the pending graph is issued there (no waiting):
the next step's values,
and a value read then on one rank only (`if rank == 0: print(loss.item())`),
depend on no pending collective. A read before the step (after backward) is
served by fused mode's side graph of the ops it depends on.
"""
import collections
import hashlib

import jax
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import metrics, modes
from ..modes import fused
from ..dispatch.host import device_array
from ..tensor import wrap
from . import agreement, xla

AXIS = xla.AXIS


class _Stats:
    def __init__(self):
        self.reset()

    def reset(self):
        self.recorded = collections.Counter()  # kind -> collectives put in fused graphs
        self.issued = collections.Counter()    # kind -> collectives run on their own
        self.mesh_graphs = 0                   # fused graphs compiled over a mesh
        self.graphs_differ = 0                 # runs of them op by op (GraphsDiffer)

    def snapshot(self):
        return {"collectives_in_graphs": sum(self.recorded.values()),
                "collectives_issued": sum(self.issued.values()),
                "mesh_graphs_compiled": self.mesh_graphs,
                "mesh_graphs_run_op_by_op": self.graphs_differ}


STATS = _Stats()
metrics.register_provider(STATS.snapshot, STATS.reset)


class CollectiveKernel:
    """A collective as fused mode's recorder sees an op: fn runs it inside
    the graph's shard_map, jitted runs it on its own (fused mode's op-by-op
    replays), mesh_jit compiles a graph that holds it."""
    __slots__ = ("name", "fn", "jitted", "avals", "stable_key", "bound", "device",
                 "written_slots", "out_dtypes", "out_tree", "device_ids", "gloo")

    def __init__(self, gloo, kind, device_ids, params, shape, dtype, device):
        self.name = f"collective.{kind}"
        self.stable_key = None  # its graphs are compiled here, not stored
        self.bound = None
        self.device = device
        self.written_slots = ()
        self.out_dtypes = None
        self.out_tree = None
        self.device_ids = device_ids
        self.gloo = gloo
        one = xla.body(kind, device_ids, params)

        def fn(x):
            return (one(x.reshape(1) if x.ndim == 0 else x),), ()

        def alone(x):
            if _refused[0] is not None:
                # The ranks disagreed on the graph: fused mode's op-by-op
                # rerun of it must not run collectives that would not meet.
                raise _refused[0]
            return (xla.run(kind, device_ids, x, **dict(params)),), ()

        self.fn = fn
        self.jitted = alone
        n = len(device_ids)
        local = (1,) + shape[1:] if not shape else shape
        whole = jax.ShapeDtypeStruct((n * local[0],) + tuple(local[1:]), dtype)
        out = jax.eval_shape(jax.shard_map(one, mesh=xla.mesh(device_ids), in_specs=P(AXIS),
                                           out_specs=P(AXIS)), whole)
        self.avals = ((jax.ShapeDtypeStruct((out.shape[0] // n,) + out.shape[1:], out.dtype),),
                      ())

    def mesh_jit(self, graph, args, donate_argnums, nodes, live_refs):
        """graph(donated, kept, scalars) -> outputs (local arrays) compiled as
        one program over this collective's mesh; the same call signature."""
        return _MeshGraph(self, graph, args, donate_argnums, nodes, live_refs)


def _digests(nodes, live_refs, args):
    """(the graph's collectives in order, the whole graph), each described
    the same way on every rank."""
    collectives = [f"{k.name} {k.device_ids} {k.avals}" for k, _ in nodes
                   if type(k) is CollectiveKernel]
    whole = [f"{k.stable_key or k.name} <- {refs}" for k, refs in nodes]
    whole.append(f"live {live_refs}")
    whole.append(" ".join(f"{x.dtype}{list(x.shape)}" for group in args[:2] for x in group))
    return tuple(hashlib.blake2b("\n".join(p).encode(), digest_size=16).hexdigest()
                 for p in (collectives, whole))


class GraphsDiffer(RuntimeError):
    """The ranks' graphs hold the same collectives amid different local ops
    (an FSDP2 rank slices its own shard): programs that differ do not meet,
    so fused mode runs this graph op by op on every rank, its collectives
    each on its own, in the order all ranks agreed."""


class _MeshGraph:
    """A fused graph holding collectives, run as one program over the mesh."""

    def __init__(self, kernel, graph, args, donate_argnums, nodes, live_refs):
        self.gloo = kernel.gloo
        self.n = len(kernel.device_ids)
        self.sharding = NamedSharding(xla.mesh(kernel.device_ids), P(AXIS))
        self.collectives, self.whole = _digests(nodes, live_refs, args)
        self.scalar_out = []  # which outputs are 0-d (known once traced)
        donated, kept, _ = args
        flags = [[x.ndim == 0 for x in donated], [x.ndim == 0 for x in kept]]
        scalar_out = self.scalar_out

        def body(d, k, s):
            d = [x.reshape(()) if z else x for x, z in zip(d, flags[0])]
            k = [x.reshape(()) if z else x for x, z in zip(k, flags[1])]
            outs = graph(d, k, s)
            scalar_out[:] = [o.ndim == 0 for o in outs]
            return [o.reshape(1) if o.ndim == 0 else o for o in outs]

        mapped = jax.shard_map(body, mesh=self.sharding.mesh,
                               in_specs=(P(AXIS), P(AXIS), P()), out_specs=P(AXIS),
                               check_vma=False)
        self.jitted = jax.jit(mapped, donate_argnums=donate_argnums)
        STATS.mesh_graphs += 1

    def _whole(self, x):
        if x.ndim == 0:
            x = x.reshape(1)
        return jax.make_array_from_single_device_arrays(
            (self.n * x.shape[0],) + x.shape[1:], self.sharding, [x])

    def __call__(self, donated, kept, scalars):
        try:
            found = agreement.exchange(self.gloo, "a fused graph holding collectives", -1,
                                       f"{agreement.FUSED_GRAPH} {self.collectives}",
                                       agreement.graph_extra(self.whole, _flushed_why()))
        except RuntimeError as e:
            _refused[0] = e
            raise
        if len({agreement.graph_whole(extra) for _, extra in found}) > 1:
            STATS.graphs_differ += 1
            raise GraphsDiffer("the ranks' graphs differ in their local ops")
        outs = self.jitted([self._whole(x) for x in donated], [self._whole(x) for x in kept],
                           list(scalars))
        local = [o.addressable_shards[0].data for o in outs]
        return [x.reshape(()) if z else x for x, z in zip(local, self.scalar_out)]


def _flushed_why():
    """Why and where this rank flushes the graph (for the message when the
    ranks' graphs differ), kept short: the message has a fixed size."""
    last = fused.STATS.last_flush or {}
    site = str(last.get("site", "?"))
    return f"{last.get('reason', '?')} at {site if len(site) <= 80 else '...' + site[-77:]}"


RECORDED = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
_kernels = {}
_refused = [None]     # the error of the last graph the ranks disagreed on
_step_hook = []       # the optimizer step hook, once registered


def _after_optimizer_step(optimizer, args, kwargs):
    """Every rank steps its optimizer at the same point of a training step:
    issue the pending graph there (registered once fused mode recorded a
    collective). Also one that holds no collective: a rank that flushed its
    step's collectives early for a read must start the next step where the
    others do."""
    if torch.compiler.is_compiling():
        return
    ex = modes.current()
    if ex.fuses:
        ex.flush("optimizer_step")  # (nothing when no op is pending)


def settle(reason="collective"):
    """In fused mode, after a collective run at once: issue what it wrote, so
    that every rank (root or not, writer or not) goes on from an empty graph
    and the graphs they record next are the same. After a broadcast too
    (reason "broadcast"): it hands out one rank's state (DDP's parameters
    in its constructor, its buffers before a forward), which any rank may
    then read on its own."""
    ex = modes.current()
    if ex.fuses:
        ex.flush(reason)


def run(gloo, kind, device_ids, t, rooted=False, **params):
    """Collective kind of tpu tensor t over device_ids (group-rank order) as a
    new tpu tensor on t's device; rooted: some rank drops the result."""
    index = t.device.index
    ex = modes.current()
    if not ex.fuses or rooted or kind not in RECORDED:
        STATS.issued[kind] += 1
        result = xla.run(kind, device_ids, device_array(t), **params)
        return wrap(result, t.dtype, device=index)
    if t._view is not None:
        t = t.clone()  # the collective reads a whole storage
    storage = t._storage
    array = storage.array
    device_ids = tuple(device_ids)
    key = (id(gloo), kind, device_ids, tuple(sorted(params.items())), tuple(array.shape),
           str(array.dtype), index)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = CollectiveKernel(gloo, kind, device_ids,
                                                  tuple(sorted(params.items())),
                                                  tuple(array.shape), array.dtype, index)
    _refused[0] = None
    if not _step_hook:
        _step_hook.append(register_optimizer_step_post_hook(_after_optimizer_step))
    out = ex.record_collective(kernel, storage, device_ids)
    STATS.recorded[kind] += 1
    return wrap(out, t.dtype, device=index)
