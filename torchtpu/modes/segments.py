"""A long fused graph split where its op stream repeats: an unrolled RNN's
time steps, a deep stack of identical layers. XLA's compile time grows
faster than the graph (docs/performance.md, "Compile time against graph
length"), and it compiles a repeated stretch as often as it occurs. Cut
into pieces of about PIECE_OPS ops, at whole periods of the repeat, the
graph runs as a sequence of programs, and pieces alike (the same kernels
reading the same things in the same places) share one: a 35-step LSTM
compiles a few pieces, not 35 copies of its cell.

A piece's inputs are the graph's inputs and the results of earlier pieces
it reads; its outputs, its results read after it. Graphs shorter than
TORCHTPU_FUSED_SPLIT_OPS (default 256; 0: never split), graphs holding a
collective (one program over the group's devices) or recomputed ops (their
fences order the whole graph), and graphs run with NaN checks (which name
the graph's lines) compile whole."""
import bisect
import collections

import jax

from .. import background, cache, config, metrics, runtime
from . import checks, graph
from .refs import Input, Result, Scalar

PIECE_OPS = 48     # about the ops a piece holds
MAX_PERIOD = 160   # the longest repeat looked for, in ops

STATS = {"graphs_split": 0, "graph_pieces": 0, "piece_programs": 0}
metrics.register_provider(lambda: dict(STATS), lambda: STATS.update(dict.fromkeys(STATS, 0)))


def split_ops():
    """The fewest ops a graph must have to be split (0: never)."""
    return config.FUSED_SPLIT_OPS.number()


def repeats(kernels):
    """[(start, period, count)]: where the kernel sequence repeats a
    period-long stretch count times in a row (count >= 3, at least
    2 * PIECE_OPS ops in all), earliest first, not overlapping."""
    ids = [id(k) for k in kernels]
    n = len(ids)
    where = {}
    for i, k in enumerate(ids):
        where.setdefault(k, []).append(i)
    found = []
    i = 0
    while i < n:
        occurrences = where[ids[i]]
        at = bisect.bisect_right(occurrences, i)
        region = None
        for nxt in occurrences[at:at + 8]:
            period = nxt - i
            if period > MAX_PERIOD or i + 3 * period > n:
                break
            stretch = ids[i:nxt]
            count, end = 1, nxt + period
            while end <= n and ids[end - period:end] == stretch:
                count, end = count + 1, end + period
            if count >= 3 and count * period >= 2 * PIECE_OPS:
                region = (i, period, count)
                break
        if region is None:
            i += 1
        else:
            found.append(region)
            i += region[1] * region[2]
    return found


def cuts(n, regions):
    """The piece boundaries [(lo, hi)] of n ops with these repeats: whole
    periods of a repeat per piece, what lies between repeats in one piece."""
    pieces = []
    at = 0
    for start, period, count in regions:
        if start > at:
            pieces.append((at, start))
        per = max(1, round(PIECE_OPS / period))
        full, rest = divmod(count, per)
        lo = start
        for _ in range(full):
            pieces.append((lo, lo + per * period))
            lo += per * period
        if rest:
            pieces.append((lo, lo + rest * period))
        at = start + period * count
    if at < n:
        pieces.append((at, n))
    # A short piece (a repeat's remainder, a few ops between repeats) joins
    # the one before it: a program and a launch fewer, and no more programs
    # (the piece it joins is its own program from then on).
    joined = []
    for lo, hi in pieces:
        if joined and (hi - lo < PIECE_OPS // 2 or joined[-1][1] - joined[-1][0] < PIECE_OPS // 2):
            joined[-1] = (joined[-1][0], hi)
        else:
            joined.append((lo, hi))
    return joined


class _Piece:
    """Nodes [lo, hi) of a graph as a graph of their own."""
    __slots__ = ("sources", "scalar_sources", "outputs", "dropped", "run")

    def __init__(self, sources, scalar_sources, outputs, dropped, run):
        self.sources = sources                # the graph's refs (Input or Result) it reads, in order
        self.scalar_sources = scalar_sources  # the graph's Scalars it reads, in order
        self.outputs = outputs                # the graph's Results it gives, in order
        self.dropped = dropped                # earlier pieces' Results no later piece reads
        self.run = run


def _spec(g, r):
    """What compiling needs of the graph's ref r (an Input or a Result)."""
    if type(r) is Input:
        return g.inputs[r.index]
    kernel = g.nodes[r.node][0]
    outs, written = kernel.avals
    aval = (*outs, *written)[r.index]
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=runtime.SHARDINGS[g.device],
                                weak_type=aval.weak_type)


def _kind(spec):
    """(shape, dtype) of an array or its _spec."""
    return tuple(spec.shape), spec.dtype


def _piece(g, lo, hi, last_read, live, donate, when):
    """Nodes [lo, hi) of g as a _Piece, its program found or built (None:
    when is "stored" and it is not). It donates the inputs nothing after it
    reads: the graph's that g donates, and earlier pieces' results."""
    sub = graph.Graph()
    sub.device = g.device
    mine, sources, scalar_sources = {}, [], []
    for ni in range(lo, hi):
        kernel, refs = g.nodes[ni]
        new = []
        for r in refs:
            kind = type(r)
            if kind is Result and r.node >= lo:
                new.append(Result(r.node - lo, r.index))
                continue
            ref = mine.get((kind, r))  # (Input(i) == Scalar(i): both are (i,))
            if ref is None:
                if kind is Scalar:
                    ref = Scalar(len(sub.scalars))
                    sub.scalars.append(g.scalars[r.index])
                    scalar_sources.append(r)
                else:
                    ref = Input(len(sub.inputs))
                    sub.inputs.append(_spec(g, r))
                    sources.append(r)
                mine[kind, r] = ref
            new.append(ref)
        sub.nodes.append((kernel, tuple(new)))
    outputs = [r for r in _results(g, lo, hi) if r in live or last_read.get(r, -1) >= hi]
    local = tuple(Result(r.node - lo, r.index) for r in outputs)
    last_here = [last_read[r] < hi and r not in live for r in sources]
    # As many of each shape and dtype as its results of that shape and dtype
    # (XLA writes a result over a donated input; one it cannot use, it warns of).
    wanted = collections.Counter(_kind(_spec(g, r)) for r in outputs)
    given = []
    for r, last, spec in zip(sources, last_here, sub.inputs):
        free = last and (type(r) is Result or (donate is not None and donate[r.index]))
        kind = _kind(spec) if free else None
        given.append(free and wanted[kind] > 0)
        if given[-1]:
            wanted[kind] -= 1
    given = tuple(given) if any(given) else None
    key = graph.GraphKey(("piece", tuple(sub.nodes), local, given))
    entry = cache.lookup(key)
    if entry is not None and when == "stored":
        job = getattr(entry.run, "job", None)
        if job is not None and not (job.done and job.error is None):
            return None  # (another graph's piece, still compiling: not ready to run)
    if entry is None:
        run = graph.build(sub, local, given, when, piece=True)
        if run is None:
            return None  # ("stored": not on the disk)
        entry = cache.store(key, graph.GraphEntry(run, [k for k, _ in sub.nodes]))
        STATS["piece_programs"] += 1
    dropped = [r for r, last in zip(sources, last_here) if last and type(r) is Result]
    return _Piece(sources, scalar_sources, outputs, dropped, entry.run)


def _results(g, lo, hi):
    for ni in range(lo, hi):
        outs, written = g.nodes[ni][0].avals
        for j in range(len(outs) + len(written)):
            yield Result(ni, j)


class _AllJobs:
    """The background compiles of a split graph's pieces, as one job (asked
    whether it is done before each op of a flush run op by op meanwhile,
    and at each flush)."""
    __slots__ = ("jobs", "finished", "_error")

    def __init__(self, jobs):
        self.jobs = jobs
        self.finished = 0  # jobs[:finished] are done
        self._error = None

    @property
    def done(self):
        jobs = self.jobs
        while self.finished < len(jobs) and jobs[self.finished].done:
            if jobs[self.finished].error is not None and self._error is None:
                self._error = jobs[self.finished].error
            self.finished += 1
        return self.finished == len(jobs)

    @property
    def error(self):
        """The first failed piece's error, among those done (once all are,
        kept)."""
        if self.done:
            return self._error
        return next((job.error for job in self.jobs if job.done and job.error is not None), None)


def build(g, live_refs, donate=None, when="first call"):
    """graph.build(g, ...), split into pieces where g's op stream repeats;
    the whole graph where it does not, or cannot be split."""
    n = len(g.nodes)
    least = split_ops()
    if (not least or n < least or g.recomputed or checks.nan_checks_on()
            or graph.collective_jit(g.nodes) is not None):
        return graph.build(g, live_refs, donate, when)
    pieces = cuts(n, repeats([k for k, _ in g.nodes]))
    if len(pieces) < 2:
        return graph.build(g, live_refs, donate, when)
    last_read = {}  # the graph's Input or Result -> the last node reading it
    for ni, (_, refs) in enumerate(g.nodes):
        for r in refs:
            if type(r) is not Scalar:
                last_read[r] = ni
    live = set(live_refs)
    built = []
    for lo, hi in pieces:
        piece = _piece(g, lo, hi, last_read, live, donate, when)
        if piece is None:
            return None
        built.append(piece)

    jobs = [piece.run.job for piece in built if getattr(piece.run, "job", None) is not None]
    all_jobs = _AllJobs(jobs) if jobs else None

    def run(inputs, scalars):
        if all_jobs is not None and not all_jobs.done:
            # Pieces another graph compiles in the background, run by a
            # graph compiled at once: their compiles are waited for.
            background.wait()
        if all_jobs is not None and all_jobs.error is not None:
            raise all_jobs.error
        values = {}
        for piece in built:
            args = [values[r] if type(r) is Result else inputs[r.index] for r in piece.sources]
            outs = piece.run(args, [scalars[s.index] for s in piece.scalar_sources])
            for r in piece.dropped:
                del values[r]  # (as XLA frees what a whole graph no longer needs)
            for r, v in zip(piece.outputs, outs):
                values[r] = v
        return [values[r] for r in live_refs]
    if all_jobs is not None:
        run.job = all_jobs
    STATS["graphs_split"] += 1
    STATS["graph_pieces"] += len(built)
    return run
