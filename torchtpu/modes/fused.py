"""fused: ops are recorded into a pending graph; a sync point compiles the ops
that live tensors depend on into one jitted function and runs it.

Each recorded op is the same Kernel strict mode would call; its results are
Pending values whose shape and dtype are known at once (from the kernel's
abstract evaluation, itself cached on the kernel), so `t.shape` never forces
execution and shape/dtype errors still raise at the user's line.

A backward pass that starts after a long forward (FORWARD_FLUSH_OPS)
flushes it at the backward's first op: the forward's graph runs on the
device while the host records the backward, as a strict step overlaps its
dispatch with its kernels.

Liveness: a Pending is an output of the flushed graph only while a Storage
still holds it (Pending.owner, a weak reference). Intermediates nobody holds
are never materialized.

The graph key is one small tuple per recorded op (the kernel's identity and
where its inputs come from), joined at the flush: nothing about shapes or
values is hashed per op, and a repeated step hits the same compiled graph.

Tiered compilation: a new graph of at least TORCHTPU_FUSED_BACKGROUND_OPS
ops (100) never makes the program wait for XLA. The first time it is met
it runs op by op, on the per-op kernels strict mode uses (or, if an earlier
process stored its executable, that is loaded); met again at the same
line, it is compiled on the compile thread (torchtpu.background) and runs
op by op until that is done, a flush whose graph becomes ready half-way
running the whole graph instead (its inputs are all still there). A graph
met once (a first step's) is not compiled: that would slow the steps after
it for nothing. Smaller graphs compile at once (XLA compiles them in about the
time their ops' own kernels would take), as every graph does with
TORCHTPU_FUSED_COMPILE=sync.

A graph holding collectives (torchtpu.distributed) must run as the same
program on every rank, at the same point. A value read while one is pending
(on one rank only, as `if rank == 0: print(loss.item())`) is computed, when
what it depends on holds no collective, by a side graph of just those ops
(compiled and cached like any graph, local): the value goes to the read and
the pending graph stays as it was. Its flush drops the ops no live value or
collective needs (what one rank computed for a read it no longer holds), so
the ranks' graphs stay alike.
"""
import collections
import sys
import warnings
import weakref

import jax
import torch

from .. import bounds, cache, config, errors, metrics, profiling, recompiles
from . import checks, graph, segments
from ..tensor import Lost, Pending
from .refs import FIRST_RESULTS, INPUTS, SCALARS, Input, Scalar, first_result, numbered, results
from .strict import StrictExecutor


def max_ops():
    return config.FUSE_MAX_OPS.number()


# Churn: at a flush site where most recent flushes brought a new graph,
# compiling costs more than fusing saves; new graphs there run op by op (with
# the per-op kernels strict mode uses); graphs compiled before, or seen again,
# run fused.
CHURN_WINDOW = 8
CHURN_NEW_KEYS = 6

# A backward pass starting after a forward of at least this many ops flushes
# it first: the forward's graph runs while the host records the backward (a
# smaller one runs in about the time a flush costs).
FORWARD_FLUSH_OPS = 100


class _Stats:
    def __init__(self):
        self.reset()

    def reset(self):
        self.graphs_compiled = 0
        self.graph_cache_hits = 0
        self.flushes = collections.Counter()
        self.fused_ops = collections.Counter()  # ops per graph -> graphs
        self.fused_op_total = 0
        self.fused_fallbacks = 0
        self.donated_inputs = 0
        self.side_reads = 0            # reads served by a side graph
        self.side_graphs_compiled = 0
        self.run_while_compiling = 0    # flushes run op by op while their graph compiled
        self.switched_while_compiling = 0  # of those, flushes whose graph was done half-way
        self.run_first_met = 0          # flushes of a graph met for the first time, run op by op
        self.last_flush = None

    def snapshot(self):
        graphs = sum(self.fused_ops.values())
        return {
            "graphs_compiled": self.graphs_compiled,
            "graph_cache_hits": self.graph_cache_hits,
            "fused_ops_mean": round(self.fused_op_total / graphs, 2) if graphs else 0.0,
            "fused_ops": dict(self.fused_ops),
            "flushes": dict(self.flushes),
            "fused_fallbacks": self.fused_fallbacks,
            "donated_inputs": self.donated_inputs,
            "side_reads": self.side_reads,
            "side_graphs_compiled": self.side_graphs_compiled,
            "run_while_compiling": self.run_while_compiling,
            "switched_while_compiling": self.switched_while_compiling,
            "run_first_met": self.run_first_met,
        }


STATS = _Stats()
metrics.register_provider(STATS.snapshot, STATS.reset)


# Called before a graph runs while torch.tpu.set_per_process_memory_fraction's
# limit is set (None costs a flush one check); see check_memory_with.
_memory_check = None


def check_memory_with(check):
    """Have check(device index, the live (Pending, owner) pairs, describe(),
    the graph's GraphEntry or None) called before each graph runs; None: no
    check. It raises to keep the graph's ops pending."""
    global _memory_check
    _memory_check = check


class FusedExecutor(StrictExecutor):
    name = "fused"
    records = True
    fuses = True

    def __init__(self):
        super().__init__()
        self._graph = graph.Graph()
        self._regions = {}  # flush site -> recent (new graph?) flags
        self._debug = config.FUSE_DEBUG.on()
        self._limit = max_ops()
        self._cut = False       # the pending graph follows a cut at the limit
        self._backward_hooked = False  # the backward pass under way flushes at its end
        self._step_hook = None  # flushing at the optimizer's step after such a cut
        self._forward_ops = 0   # of the pending graph's ops, those recorded outside a backward pass
        # A program that runs collectives keeps its step in one graph: a
        # read on one rank must not run a graph that holds them, so only the
        # step's whole graph can serve it (a side graph) with its index checks.
        self._collectives_seen = False

    # -- recording ---------------------------------------------------------
    def run(self, kernel, flat, storages):
        g = self._graph
        ni = len(g.nodes)
        if not ni:
            self._limit = max_ops()  # (read as each graph starts: a change applies from there)
        backward = _graph_task_id() != -1
        if ni >= self._limit or kernel.device != g.device or (
                backward and self.fuses and self._forward_ops >= FORWARD_FLUSH_OPS
                and not self._collectives_seen and not torch.compiler.is_compiling()):
            if ni:
                # Flush before recording (a graph runs on one device; a
                # backward pass runs its long forward first): every earlier
                # result is owned by now.
                if ni >= self._limit:
                    self._cut_at_limit()
                    reason = "limit"
                else:
                    reason = "device" if kernel.device != g.device else "backward"
                self.flush(reason)
                flat = [self._concrete_value(x) for x in flat]
                g = self._graph
                ni = 0
            g.device = kernel.device
        input_refs = g.input_refs
        refs = []
        # flat: the arrays of storages, in the same order, then scalars.
        for x, storage in zip(flat, storages):
            if type(x) is Pending:
                refs.append(x.ref)
                continue
            ref = input_refs.get(id(x))
            if ref is None:
                if type(x) is Lost:
                    x.fail()
                n = len(g.inputs)
                ref = input_refs[id(x)] = INPUTS[n] if n < len(INPUTS) else numbered(INPUTS, Input, n)
                g.inputs.append(x)
                g.input_owners.append(weakref.ref(storage))
            refs.append(ref)
        if len(flat) > len(storages):
            for x in flat[len(storages):]:
                n = len(g.scalars)
                refs.append(SCALARS[n] if n < len(SCALARS) else numbered(SCALARS, Scalar, n))
                g.scalars.append(x)
        outs_aval, written_aval = kernel.avals or graph.abstract(kernel, flat)
        if not backward:
            self._forward_ops += 1
        else:
            if self._cut and not self._backward_hooked:
                self._backward_hooked = True
                _engine.queue_callback(self._after_backward)
            # In a backward pass: a forward op that checkpointing recomputes
            # (grad mode is on only then) reads its inputs through a fence.
            if torch.is_grad_enabled():
                refs = graph.fenced(g, refs, ni)
            elif outs_aval or written_aval:
                g.anchor = ni
        g.nodes.append((kernel, tuple(refs)))
        if len(outs_aval) == 1 and not written_aval:
            # Most ops: one result.
            a = outs_aval[0]
            out = Pending(a.shape, a.dtype, FIRST_RESULTS[ni] if ni < len(FIRST_RESULTS) else first_result(ni))
            g.outputs.append(out)
            return (out,), ()
        row = results(ni, len(outs_aval) + len(written_aval))
        outs = [Pending(a.shape, a.dtype, row[j]) for j, a in enumerate(outs_aval)]
        g.outputs += outs
        if not written_aval:
            return outs, ()
        k = len(outs)
        written = [Pending(a.shape, a.dtype, row[k + j]) for j, a in enumerate(written_aval)]
        g.outputs += written
        return outs, written

    def record_collective(self, kernel, storage, mesh):
        """Record a collective over mesh (device ids) reading storage; its
        result. A graph's collectives span one mesh: one over another mesh
        starts a new graph."""
        if self._graph.nodes and self._graph.mesh not in (None, mesh):
            self.flush("collective")
        (out,), _ = self.run(kernel, [storage.array], [storage])
        g = self._graph  # the graph that took it (run may flush first)
        g.collectives += 1
        self._collectives_seen = True
        g.mesh = mesh
        return out

    def _cut_at_limit(self):
        """A step longer than the limit is cut there; its next flush is at
        the end of the backward pass or at the optimizer's step, whichever
        comes first, so that the cuts fall at the same ops every step (else
        they drift, and each step makes new graphs). A loop that updates its
        parameters by hand has no optimizer step."""
        self._cut = True
        if self._step_hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            self._step_hook = register_optimizer_step_post_hook(self._after_optimizer_step)

    def _after_optimizer_step(self, optimizer, args, kwargs):
        self._at_step_boundary()

    def _after_backward(self):
        self._backward_hooked = False
        self._at_step_boundary()

    def _at_step_boundary(self):
        if self._cut and self._graph.nodes and not torch.compiler.is_compiling():
            self._cut = False
            self.flush("step_boundary")

    def replaced(self, storage):
        # The empty buffer an upload replaces is dead: unless dropped, its op
        # stays in the graph's key (with the batch's shape, when that varies).
        g = self._graph
        p = storage.array
        if type(p) is Pending and g.outputs and g.outputs[-1] is p:
            kernel, refs = g.nodes[-1]
            outs, written = kernel.avals
            lines = checks.FUSED_LINES  # (NaN checks' record of lines follows the nodes)
            if len(outs) + len(written) == 1 and not refs and (not lines or lines[-1][0] is kernel):
                g.nodes.pop()
                g.outputs.pop()
                if lines:
                    lines.pop()

    # -- reading -----------------------------------------------------------
    def _concrete_value(self, x):
        """x, or the array it became once flushed (x is held by a storage)."""
        if type(x) is Pending:
            owner = x.owner()
            self.flush("dependency")
            return owner.array
        return x

    def concrete(self, storage, reason="read", to_host=False):
        own_checks = False  # its index checks can be read from its own graph's flag
        if type(storage.array) is Pending:
            value = self._side_value(storage)
            if value is not None:
                return value
            self.flush(reason)
        elif bounds.unread and not self._graph.collectives and bounds.flag_pending() \
                and bounds.depends_on_unread(storage):
            # Its value is known (its graph ran when a backward pass began),
            # but the flag of an index check it depends on is pending: run
            # the graph. (Not when the graph holds a collective: one rank's
            # read may not run it.) The value's own checks are read from the
            # flag its graph returned: a loss read after the optimizer step
            # waits for its forward only, and the host records the next step
            # while the device runs this one's backward; the later checks are
            # read at the next sync, their values marked lost if out of range.
            self.flush(reason)
            own_checks = True
        if to_host:
            self._start_copy(storage)
        if own_checks and bounds.checked_for(storage):
            return storage.array
        bounds.check()  # a read is a sync point: out-of-range indices raise here
        return storage.array

    def _side_value(self, storage):
        """The value of storage's pending array computed by a side graph of
        the ops it depends on, leaving the pending graph as it was; None
        (flush instead) unless the graph holds a collective and those ops
        do not. So a read on some ranks only does not flush a graph that
        every rank must run alike. An out-of-range index the value depends
        on raises here, as at a flush."""
        g = self._graph
        ref = storage.array.ref
        value = g.side_values.get(ref)
        if value is not None:
            STATS.side_reads += 1
            return value
        if not g.collectives:
            return None
        wanted = [ref]
        flag = bounds.flag_input(False, g.device)
        checked = type(flag.array) is Pending and bounds.depends_on_unread(storage)
        if checked:
            wanted.append(flag.array.ref)
        needed = graph.needed_nodes(g, wanted)
        if graph.collective_jit([g.nodes[i] for i in needed]) is not None:
            return None  # it needs a collective: every rank must run the graph
        sub, renamed = graph.subgraph(g, needed)
        live_refs = tuple(renamed[r] for r in wanted)
        key = graph.GraphKey(("side", tuple(sub.nodes), live_refs))
        entry = cache.lookup(key)
        try:
            if entry is None:
                entry = cache.store(key, graph.GraphEntry(graph.build(sub, live_refs), [k for k, _ in sub.nodes]))
                STATS.side_graphs_compiled += 1
            values = entry.run(sub.inputs, sub.scalars)
        except Exception:
            return None  # the flush runs it, and its op-by-op recovery names the failing op
        STATS.side_reads += 1
        if checked and int(values[1][1]):
            # An index out of range: raise it at this read (what depends on
            # it is marked lost, as at a flush).
            flag.assign(values[1])
            bounds.check()
        g.side_values[ref] = values[0]
        return values[0]

    def sync(self, reason="sync"):
        self.flush(reason)
        super().sync(reason)

    # -- flushing ----------------------------------------------------------
    def flush(self, reason):
        g = self._graph
        if not g.nodes:
            return
        self._graph = graph.Graph()
        self._forward_ops = 0
        self._cut = reason == "limit"  # (a sync sets the boundary, not the limit)
        live = graph.live_values(g)
        if not live and not g.collectives and not checks.nan_checks_on():
            # Nothing recorded is held any more (the empty buffer of each
            # upload, replaced by its data): there is nothing to run.
            return
        renamed = None
        if g.collectives and not checks.FUSED_LINES and not checks.nan_checks_on():
            # Every rank must run the same program: drop what one rank alone
            # computed and no longer holds (a value it read). (Not with NaN
            # checks on: their record of lines follows the recorded nodes.)
            g, renamed = graph.without_dead_nodes(g, live)
        try:
            with profiling.span(lambda: f"torchtpu flush ({reason}): {len(g.nodes)} ops at {errors.user_line()}"):
                self._issue(g, live, renamed, reason)
            bounds.note_flushed(g.device)
        except Exception as e:
            errors.note_fused_graph(e, g, reason, checks.graph_lines(g))  # its message names the graph's ops
            raise

    def _issue(self, g, live, renamed, reason):
        """Compile (or find) and run graph g, giving each live value's owner its array."""
        self._last = None  # the last graph's results: maybe this one's inputs, to donate
        donate = None if checks.nan_checks_on() else graph.donatable(g, live)
        if donate is not None:
            live = graph.donation_order(g, live, donate)
        live_refs = tuple(p.ref if renamed is None else renamed[p.ref] for p, _ in live)
        # Kernels stand for their ops: they compare and hash by identity, so
        # the nodes themselves are the key (the entry holds them).
        key = graph.GraphKey((tuple(g.nodes), live_refs, donate))
        entry = cache.lookup(key)
        site = errors.user_line()
        refused = None
        if entry is None:
            try:
                recompiles.note_graph(site, [k for k, _ in g.nodes])
            except recompiles.RecompileError as e:
                if renamed is None:
                    self._graph = g  # kept pending: nothing is lost
                    raise
                # (Not kept: dead ops were dropped, and its collectives must
                # run on every rank. It runs, then the error is raised.)
                refused = e
        if _memory_check is not None and renamed is None:
            try:
                _memory_check(g.device, live, lambda: (
                    f"a fused graph of {len(g.nodes)} ops ({graph.op_names(g)}) run at {site} ({reason})"), entry)
            except Exception:
                self._graph = g  # kept pending: nothing is lost
                raise
        churning, met = self._note_churn(site, key, entry is not None)
        run, state = self._runner(g, key, entry, live_refs, donate, site, churning, met)
        STATS.flushes[reason] += 1
        STATS.fused_ops[len(g.nodes)] += 1
        STATS.fused_op_total += len(g.nodes)
        STATS.last_flush = {"reason": reason, "site": site, "ops": len(g.nodes),
                            "outputs": len(live), "cache_hit": state == "hit"}
        if self._debug:
            print(f"[torchtpu fused] flush reason={reason} at {site} ops={len(g.nodes)} "
                  f"outputs={len(live)} cache={state}", file=sys.stderr)
        results = None
        if state == "compiling":
            # Tiered: op by op, on strict's kernels (an op's error raised as
            # strict mode raises it), until the graph is compiled; if it is
            # done half-way, the graph runs instead (from the same inputs).
            STATS.run_while_compiling += 1
            results = self._op_by_op(g, live, live_refs, run.job)
            if results is None:
                STATS.switched_while_compiling += 1
        if results is None:
            if donate is not None and state != "op-by-op":
                STATS.donated_inputs += sum(donate)
            try:
                with profiling.span(lambda: f"torchtpu graph run ({state}): {len(g.nodes)} ops at {site}"):
                    results = run(g.inputs, g.scalars)
                    if profiling.recording():
                        jax.block_until_ready(results)  # the range spans the device's work
            except Exception as e:
                results = self._recover(g, live, live_refs, site, e)
        self._last = results
        if entry is None:
            graph.drop_traces(g)
        for (p, owner), value in zip(live, results):
            owner.array = value
        checks.after_flush(g, results)  # NaN/Inf checks name the op and line
        if refused is not None:
            raise refused

    def _recover(self, g, live, live_refs, site, error):
        """A fused graph failed to compile or run: run its ops one by one.
        If an op fails there too, the tensors it feeds are marked lost (using
        one raises that error) and the error goes to the user; everything
        else keeps its value."""
        STATS.fused_fallbacks += 1
        warnings.warn(f"torchtpu: a fused graph of {len(g.nodes)} ops flushed at {site} failed "
                      f"({type(error).__name__}: {str(error)[:200]}); running its ops one by one",
                      stacklevel=4)
        return self._op_by_op(g, live, live_refs)

    def _op_by_op(self, g, live, live_refs, job=None):
        """g's live values, its ops run one by one with their own kernels;
        None if job (the graph's compilation) succeeds before they are done."""
        values = {}
        try:
            return graph.replay(g.nodes, live_refs, g.inputs, g.scalars, graph.call_jitted, values, job)
        except Exception as e:
            for (p, owner), ref in zip(live, live_refs):
                value = values.get(ref)
                owner.array = value if value is not None else Lost(e, p.shape, p.dtype)
            raise

    def _runner(self, g, key, entry, live_refs, donate, site, churning, met):
        """How this flush runs g: (run(inputs, scalars), the state the debug
        output names). "compiling": run's graph compiles in the background
        (run.job); meanwhile its ops run one by one. met: whether g was
        flushed at site before."""
        if entry is not None:
            STATS.graph_cache_hits += 1
            run = entry.run
            job = getattr(run, "job", None)
            if job is None or (job.done and job.error is None):
                return run, "hit"
            if not job.done:
                return run, "compiling"
            # Its compilation failed: warn once, and run its ops one by one
            # from now on.
            STATS.fused_fallbacks += 1
            warnings.warn(f"torchtpu: a fused graph of {len(g.nodes)} ops flushed at {site} failed "
                          f"to compile ({type(job.error).__name__}: {str(job.error)[:200]}); its ops "
                          "run one by one", stacklevel=5)
            return cache.store(key, graph.GraphEntry(graph.op_by_op_run(g.nodes, live_refs), entry.kernels)).run, "op-by-op"
        collective = graph.collective_jit(g.nodes) is not None
        if churning and not collective:
            # This site's graphs keep changing: run its ops one by one with
            # their own (cached) kernels instead of compiling another graph.
            STATS.fused_fallbacks += 1
            if STATS.fused_fallbacks == 1:
                warnings.warn("torchtpu: fused graphs keep changing at "
                              f"{site} (new shapes every step?); running them op by op "
                              "instead of recompiling (counted in metrics fused_fallbacks)",
                              stacklevel=5)
            return graph.op_by_op_run(g.nodes, live_refs), "op-by-op"
        kernels = [k for k, _ in g.nodes]
        if (collective or not graph.compile_in_background()
                or (len(g.nodes) < graph.background_min_ops() and not all(k.compiled for k in kernels))):
            # A small graph compiles faster than its ops' own kernels would
            # for an op-by-op run (one whose kernels are all there is tiered:
            # run op by op, it waits for no compilation); a graph holding a
            # collective is compiled and run by every rank.
            STATS.graphs_compiled += 1
            return cache.store(key, graph.GraphEntry(segments.build(g, live_refs, donate), kernels)).run, "miss"
        if not met:
            # Met for the first time: op by op, unless an earlier process
            # stored its executable. Only a graph that recurs is worth
            # compiling: a first step's often does not, and compiling it
            # would slow the steps after it.
            run = segments.build(g, live_refs, donate, "stored")
            if run is not None:
                return cache.store(key, graph.GraphEntry(run, kernels)).run, "hit"
            STATS.run_first_met += 1
            return graph.op_by_op_run(g.nodes, live_refs), "first met"
        STATS.graphs_compiled += 1
        return cache.store(key, graph.GraphEntry(segments.build(g, live_refs, donate, "background"),
                                           kernels)).run, "compiling"

    def forget_sites(self):
        """Forget which graphs earlier flushes brought at each line (the
        churn guard's history), as a new process would."""
        self._regions.clear()

    def _note_churn(self, site, key, hit):
        """(whether to run this flush op by op, whether its graph was
        flushed at this site before). Op by op: its graph is new to this
        site and most of the last CHURN_WINDOW flushes there brought a new
        graph. A graph seen before at the site is compiled: it recurs."""
        region = self._regions.get(site)
        if region is None:
            region = self._regions[site] = (collections.deque(maxlen=CHURN_WINDOW),
                                            collections.deque(maxlen=2 * CHURN_WINDOW))
        flags, seen = region
        h = key.hash
        met = hit or h in seen
        seen.append(h)
        flags.append(not met)
        return not met and len(flags) == CHURN_WINDOW and sum(flags) >= CHURN_NEW_KEYS, met


_graph_task_id = torch._C._current_graph_task_id
_engine = torch.autograd.Variable._execution_engine
