"""The debug advisor: what makes this program slow, and where.

With TORCHTPU_DEBUG=1, a short summary is printed at exit and appended to
torchtpu.metrics.report(): ops that fell back to CPU (count, first user
line), ops and fused graphs compiled for many shapes (shape churn), sync
points per training step (optimizer.step() calls) with their lines, and
compile and execute time.

Everything is recorded when the event happens, never per op: the first
line of each CPU fallback, the line where an op crosses the churn threshold,
the line of each sync point (a sync costs far more than the stack walk).
"""
import atexit
import collections
import sys
import time

from . import config, errors, metrics, recompiles

ON = config.DEBUG.on()
# An op compiled for this many different shapes/arguments is churning.
CHURN_KERNELS = config.CHURN_THRESHOLD.number()
_START = time.perf_counter()


class _State:
    def __init__(self):
        self.reset()

    def reset(self):
        self.fallback_lines = {}                 # op -> first user line
        # Keyed by (after the first optimizer step?, op):
        self.kernels = collections.Counter()     # kernels compiled
        self.churn_lines = {}                    # the line at the threshold
        self.churn_shapes = collections.defaultdict(list)  # the first argument's shapes
        self.grown_cuts = collections.Counter()  # (op, line, dim, bucket) -> count


S = _State()
metrics.register_provider(lambda: {}, S.reset)


def enable(on=True):
    """Turn the advisor on (as TORCHTPU_DEBUG=1 does at start)."""
    global ON
    ON = bool(on)
    if ON:
        _install()


def note_fallback(op):
    """An op ran on CPU (the stack walk only for its first time)."""
    if op not in S.fallback_lines:
        S.fallback_lines[op] = errors.user_line(sys._getframe(1))


def note_new_kernel(op, shape=None):
    """A new kernel was built for op (a cache miss: new shapes/arguments);
    shape: its first whole tensor argument's, which says which dim churns.
    Counted apart before and after the first optimizer step: a program that
    trains makes one kernel per parameter shape while it builds its model
    and optimizer state, once, which is not churn."""
    key = (metrics.M.steps > 0, op)
    n = S.kernels[key] = S.kernels[key] + 1
    if shape is not None and n <= CHURN_KERNELS:
        S.churn_shapes[key].append(shape)
    if n == CHURN_KERNELS:
        S.churn_lines[key] = errors.user_line(sys._getframe(1))


def _bucket_hint(shapes):
    """Which dim of an op's first whole tensor argument varies across its
    kernels, and the bucket (a power of two, at least 128) that would hold
    every length seen: 'dim 1 (17..24), bucket 128', or ''."""
    ranks = {len(s) for s in shapes}
    if len(shapes) < 2 or len(ranks) != 1:
        return ""
    hints = []
    for d in range(ranks.pop()):
        sizes = {s[d] for s in shapes}
        if len(sizes) > 1:
            bucket = 128
            while bucket < max(sizes):
                bucket *= 2
            hints.append(f"dim {d} ({min(sizes)}..{max(sizes)}), bucket {bucket}")
    return "; ".join(hints)


def note_grown_cut(op, line, dim, length, bucket):
    """A padded tensor (grown step by step, torchtpu.dispatch.growth, or of
    a varying length, dispatch.lengths) is read whole by op, which has no
    rule for padded tensors: it compiles for each length."""
    S.grown_cuts[(op, line, dim, bucket)] += 1


_installed = False


def _install():
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(_print_at_exit)
    metrics.register_footer(lambda: summary() if ON else "")


def _print_at_exit():
    if ON:
        print(summary(), file=sys.stderr)


def summary():
    """The advisor's text: at most a few lines per finding."""
    snap = metrics.snapshot()
    out = ["torchtpu debug advisor (TORCHTPU_DEBUG=1)"]
    fallbacks = snap.get("cpu_fallbacks", {})
    if fallbacks:
        out.append("  CPU fallbacks (each copies its inputs to the host and back; "
                   "a lowering would keep them on the device):")
        for op, n in sorted(fallbacks.items(), key=lambda kv: -kv[1])[:8]:
            line = S.fallback_lines.get(op, "<unknown>")
            out.append(f"    {op}: {n} calls, first at {metrics.short_line(line)}")
    # In a program that trains, only what compiles after its first step.
    trains = metrics.M.steps > 0
    churn = [(key, n) for key, n in S.kernels.items() if key[0] == trains and n >= CHURN_KERNELS]
    if churn:
        out.append("  Shape churn (ops compiled again for each new shape"
                   + (" after the first training step" if trains else "")
                   + "; pad or bucket the varying dimension):")
        for key, n in sorted(churn, key=lambda kv: -kv[1])[:8]:
            hint = _bucket_hint(S.churn_shapes.get(key, []))
            out.append(f"    {key[1]}: {n} compilations, churning at "
                       f"{metrics.short_line(S.churn_lines.get(key, '<unknown>'))}"
                       + (f"; varying {hint}" if hint else ""))
    again = [e[:3] for e in recompiles.events() if e[3] > 0 or not trains]
    if again:
        out.append(f"  Compiled again ({len(again)}"
                   + (" after the first training step" if trains else "")
                   + "; torchtpu.explain_compiles() lists them all):")
        for line, what, why in again[-6:]:
            out.append(f"    {metrics.short_line(line)}: {what}: {why}")
    if S.grown_cuts:
        out.append("  Padded tensors read whole (grown by torch.cat in a loop, or of a length that "
                   "varies; the op that reads one compiles for each length, where the ops with "
                   "a rule for padded tensors use its bucket, docs/modes.md):")
        for (op, line, dim, bucket), n in S.grown_cuts.most_common(6):
            out.append(f"    {op} at {metrics.short_line(line)}: dim {dim}, {n} times; its bucket is {bucket}")
    graphs = snap.get("graphs_compiled", 0)
    hits = snap.get("graph_cache_hits", 0)
    if graphs >= CHURN_KERNELS and graphs > hits:
        out.append(f"  Fused graphs: {graphs} compiled, {hits} reused; the graph changes "
                   "between steps (new shapes?)"
                   + (f"; fused mode fell back to op by op {snap.get('fused_fallbacks')} times"
                      if snap.get("fused_fallbacks") else ""))
    syncs = metrics.M.sync_sites
    if syncs:
        total = sum(n for n, _ in syncs.values())
        steps = metrics.M.steps
        if steps:
            out.append(f"  Sync points: {total} in {steps} training steps "
                       f"({total / steps:.1f} per step); each waits for the device:")
        else:
            out.append(f"  Sync points: {total}; each waits for the device:")
        for (line, reason), (n, _) in sorted(syncs.items(), key=lambda kv: -kv[1][0])[:6]:
            per = f" ({n / steps:.1f} per step)" if steps else ""
            out.append(f"    {metrics.short_line(line)}: {reason} x{n}{per}")
    compile_s = snap.get("compile_seconds", 0.0) + snap.get("graph_build_seconds", 0.0)
    out.append(f"  Time: compile {compile_s:.2f} s ({snap.get('compilations', 0)} compilations), "
               f"execute (waiting at sync points) {metrics.M.sync_seconds:.2f} s, "
               f"wall {time.perf_counter() - _START:.2f} s")
    if len(out) == 2:
        out.insert(1, "  nothing to report: no CPU fallbacks, no shape churn, no syncs")
    return "\n".join(out)


if ON:
    _install()
