"""Counters of what torchtpu did: ops, compilations, cache hits, syncs, fallbacks."""
import collections
import html
import os
import time

_COUNTERS = ("ops_dispatched", "compilations", "memory_cache_hits",
             "disk_cache_hits", "disk_cache_misses", "syncs")


class _Metrics:
    def __init__(self):
        self.reset()

    def reset(self):
        for name in _COUNTERS:
            setattr(self, name, 0)
        self.compile_seconds = 0.0
        self.steps = 0  # optimizer.step() calls
        # Per (user line, reason): [syncs there, seconds they waited].
        self.sync_sites = collections.defaultdict(lambda: [0, 0.0])
        self.sync_seconds = 0.0
        self.since = time.perf_counter()
        self.cpu_fallbacks = collections.Counter()
        self.decompositions = collections.Counter()
        self.extra = {}  # counters owned by other layers (fused mode, cache)


M = _Metrics()


def note_sync(line, reason, seconds):
    """A sync at the user's line, for reason, that waited seconds."""
    M.syncs += 1
    site = M.sync_sites[(line, reason)]
    site[0] += 1
    site[1] += seconds
    M.sync_seconds += seconds


def _count_step(optimizer, args, kwargs):
    M.steps += 1


def short_line(line):
    """'dir/file.py:12' -> 'file.py:12' (still unambiguous enough in a report)."""
    path, _, lineno = line.rpartition(":")
    return f"{os.path.basename(path) or path}:{lineno}" if path else line


def sync_report(most=8):
    """Where the program waits for the device: each sync site (the user's
    line and why) with its count, per training step (optimizer.step()
    calls), and the time it waited; then the waiting against the wall time
    since metrics were reset. Little waiting means the host is the
    bottleneck (Python, dispatch, recording); much means the device is."""
    wall = time.perf_counter() - M.since
    steps = M.steps
    per = (lambda n: f" ({n / steps:.1f} per step)") if steps else (lambda n: "")
    head = f"torchtpu syncs: {M.syncs}" + (f" in {steps} training steps" + per(M.syncs) if steps else "")
    lines = [head, f"  waiting for the device: {M.sync_seconds:.3f} s of {wall:.3f} s "
                   f"({100 * M.sync_seconds / wall if wall else 0:.0f}%; the rest is the host's)"]
    sites = sorted(M.sync_sites.items(), key=lambda kv: -kv[1][0])
    for (line, reason), (n, seconds) in sites[:most]:
        lines.append(f"  {short_line(line)}: {reason} x{n}{per(n)}, waited {seconds:.3f} s")
    if len(sites) > most:
        lines.append(f"  ... and {len(sites) - most} more sites")
    return "\n".join(lines)
_providers = []
_footers = []


def register_footer(text):
    """Let a layer add text under report() (the debug advisor): text() -> str."""
    _footers.append(text)


def _footer_text():
    return "\n".join(t for t in (fn() for fn in _footers) if t)


def register_provider(snapshot, reset=None):
    """Let a layer report its own figures: snapshot() -> dict merged into
    snapshot(); reset() called by reset()."""
    _providers.append((snapshot, reset))


def reset():
    M.reset()
    for _, fn in _providers:
        if fn is not None:
            fn()


def snapshot():
    snap = {name: getattr(M, name) for name in _COUNTERS}
    snap["compile_seconds"] = round(M.compile_seconds, 6)
    snap["cpu_fallbacks"] = dict(M.cpu_fallbacks)
    snap["decompositions"] = dict(M.decompositions)
    snap.update(M.extra)
    for fn, _ in _providers:
        snap.update(fn())
    return snap


def _rows():
    rows = []
    for key, value in snapshot().items():
        if isinstance(value, dict):
            if not value:
                rows.append((key, "-"))
            for sub, count in sorted(value.items(), key=lambda kv: -kv[1] if isinstance(kv[1], (int, float)) else 0):
                rows.append((f"{key}[{sub}]", count))
        else:
            rows.append((key, value))
    return rows


class Report(str):
    """The metrics table as text; renders as an HTML table in notebooks."""

    def _repr_html_(self):
        cells = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in _rows())
        footer = _footer_text()
        footer = f"<pre>{html.escape(footer)}</pre>" if footer else ""
        return f"<table><tr><th>metric</th><th>value</th></tr>{cells}</table>{footer}"


def report():
    rows = _rows()
    width = max(len(k) for k, _ in rows)
    lines = ["torchtpu metrics", "-" * (width + 16)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    footer = _footer_text()
    if footer:
        lines += ["", footer]
    return Report("\n".join(lines))


def summary():
    """Five lines of the figures a newcomer looks at first (report() has
    them all): ops, compilations and the time they took, cache hits, syncs,
    and the ops that ran on the CPU."""
    snap = snapshot()
    fallbacks = snap["cpu_fallbacks"]
    fell_back = (", ".join(f"{op} x{n}" for op, n in sorted(fallbacks.items(), key=lambda kv: -kv[1]))
                 if fallbacks else "none")
    return "\n".join([
        f"torchtpu: {snap['ops_dispatched']} ops dispatched",
        f"  compilations: {snap['compilations']} ({snap['compile_seconds']:.1f} s compiling)",
        f"  cache hits: {snap['memory_cache_hits']} in memory, {snap['disk_cache_hits']} from disk",
        f"  syncs (host reads of device values): {snap['syncs']}",
        f"  CPU fallbacks: {fell_back}",
    ])


def _install_step_counter():
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(_count_step)


_install_step_counter()
