#!/usr/bin/env python
"""Draw docs/images/device-trace.svg: a real device trace of MLP training
steps (AdamW, reading the loss), written by torchtpu.profiler.trace(logdir)
and read back from the .xplane.pb that JAX writes there, drawn as a timeline
in plain SVG. One panel per mode: fused (the steps' ops as one XLA
computation each) and strict (one computation per op).

  .venv/bin/python scripts/trace_picture.py                  # docs/images/device-trace.svg
  .venv/bin/python scripts/trace_picture.py --modes fused --steps 3 --out /tmp/t.svg \\
      --logdir /tmp/trace                                    # keep the trace too

Rows, top to bottom: the step function (from JAX's Python tracer), torchtpu's
ranges (sync, flush, graph run, compile, upload) nested as they ran, the
dispatch of each XLA computation (jax.jit's PjitFunction), each computation's
execution (from its first HLO op to its last, named by its module), and the
HLO ops on each XLA thread, coloured by computation.
"""
import argparse
import collections
import glob
import hashlib
import html
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# Normalized paths: torchtpu tells its own frames from the user's by path.
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import jax  # noqa: E402
import torch  # noqa: E402

import torchtpu  # noqa: E402
from workloads import loss_step, mlp, mlp_batch  # noqa: E402

WIDTH, LABEL_W, RIGHT = 900, 150, 14
ROW_H, GAP = 17, 3
FONT = 11
CHAR_W = 6.1  # a generous mean glyph width of an 11px sans-serif font

COLOURS = {"step": "#9e9e9e", "sync": "#e57373", "flush": "#ffb74d",
           "graph run": "#64b5f6", "compile": "#ba68c8", "upload": "#81c784",
           "dispatch": "#4db6ac"}
# Computations: fused graphs in blues and greens, per-op kernels in warm
# tones, so that the two kinds read apart at a glance.
FUSED_PALETTE = ["#1e88e5", "#43a047", "#00897b", "#3949ab", "#7cb342"]
OP_PALETTE = ["#fb8c00", "#f4511e", "#c0ca33", "#8e24aa", "#d81b60", "#6d4c41",
              "#fdd835", "#00acc1"]


def run_steps(mode, steps, logdir):
    """Warm steps of an MLP in mode, then `steps` more traced into logdir;
    returns the .xplane.pb written."""
    torch.manual_seed(0)
    x, y = mlp_batch()
    with torchtpu.eager_mode(mode):
        model = mlp().to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = x.to("tpu"), y.to("tpu")

        def step():
            return loss_step(model, opt, x, y).item()
        for _ in range(3):
            step()
        # Fused graphs compile in the background: trace the compiled ones.
        torchtpu.wait_for_compiles()
        step()
        with torchtpu.profiler.trace(logdir):
            for _ in range(steps):
                step()
    (path,) = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    return path


Event = collections.namedtuple("Event", "start end name kind module")


def _short(name):
    """torchtpu's range name without its prefix, file path or key's hash."""
    name = name.removeprefix("torchtpu ")
    if " at " in name:
        head, _, where = name.rpartition(" at ")
        name = f"{head} at {os.path.basename(where)}"
    return _unhash(name)


def _unhash(name):
    """tpu_fused_28ops_e5d5b968848a80d1 -> tpu_fused_28ops: the key's hash
    says nothing in a picture."""
    head, _, tail = name.rpartition("_")
    if head and len(tail) == 16 and all(c in "0123456789abcdef" for c in tail):
        return head
    return name


def read_trace(path):
    """The rows to draw, as [(label, [Event])], from a .xplane.pb."""
    data = jax.profiler.ProfileData.from_file(path)
    step_events, ranges, dispatches = [], [], []
    ops_by_thread = collections.defaultdict(list)
    for plane in data.planes:
        if not plane.name.startswith("/host:CPU") and not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for ev in line.events:
                name, start, end = ev.name, ev.start_ns / 1e6, (ev.start_ns + ev.duration_ns) / 1e6
                if name.startswith("$trace_picture.py:") and name.endswith(" step"):
                    step_events.append(Event(start, end, "step", "step", None))
                elif name.startswith("torchtpu "):
                    kind = next((k for k in ("sync", "flush", "graph run", "compile", "upload")
                                 if name.startswith("torchtpu " + k)), "sync")
                    ranges.append(Event(start, end, _short(name), kind, None))
                elif name.startswith("PjitFunction(jit(tpu_"):
                    module = name[len("PjitFunction(jit("):-2]
                    dispatches.append(Event(start, end, _unhash(module), "dispatch", module))
                elif not name.startswith("end: "):
                    stats = dict(ev.stats)
                    module = stats.get("hlo_module")
                    if module and module.startswith("jit_tpu_"):
                        module = module[len("jit_"):]
                        ops_by_thread[(plane.name, line.name)].append(
                            Event(start, end, stats.get("hlo_op", name), "op",
                                  (module, stats.get("run_id"))))
    # jax.jit's dispatch shows twice, nested: keep the outer one.
    outer = []
    for d in sorted(dispatches, key=lambda e: (e.start, -e.end)):
        if not outer or d.start >= outer[-1].end:
            outer.append(d)
    dispatches = outer
    # A computation's execution: its first HLO op's start to its last's end.
    runs = {}
    for ops in ops_by_thread.values():
        for op in ops:
            start, end = runs.get(op.module, (op.start, op.end))
            runs[op.module] = (min(start, op.start), max(end, op.end))
    executions = [Event(s, e, _unhash(module), "run", module)
                  for (module, _), (s, e) in runs.items()]
    rows = [("your step()", sorted(step_events))]
    for depth, events in enumerate(_nest(sorted(ranges, key=lambda e: (e.start, -e.end)))):
        rows.append(("torchtpu ranges" if depth == 0 else "", events))
    rows.append(("XLA dispatch", dispatches))
    rows.append(("XLA computation", sorted(executions)))
    for n, key in enumerate(sorted(ops_by_thread, key=lambda k: min(ops_by_thread[k]).start)):
        rows.append((f"HLO ops, thread {n + 1}", sorted(ops_by_thread[key])))
    return rows


def _nest(events):
    """Events split into levels: each inside the last open one goes a level
    below it (the ranges nest as the calls did)."""
    levels, open_ = [], []
    for ev in events:
        while open_ and open_[-1].end <= ev.start:
            open_.pop()
        depth = len(open_)
        if depth == len(levels):
            levels.append([])
        levels[depth].append(ev)
        open_.append(ev)
    return levels


def _colour(ev, modules):
    if ev.kind in COLOURS:
        return COLOURS[ev.kind]
    module = ev.module[0] if ev.kind == "op" else ev.module
    fused = "tpu_fused_" in module
    palette = FUSED_PALETTE if fused else OP_PALETTE
    names = sorted(m for m in modules if ("tpu_fused_" in m) == fused)
    index = names.index(module) if module in names else int(
        hashlib.md5(module.encode()).hexdigest(), 16)
    return palette[index % len(palette)]


def _ticks(span):
    """A round tick step giving 5-10 ticks over span ms."""
    step = 10 ** len(str(int(span))) / 100
    for mult in (1, 2, 5, 10):
        if span / (step * mult) <= 10:
            return step * mult
    return step * 10


def draw_panel(out, top, title, rows):
    """SVG elements of one panel at y=top; returns its bottom y."""
    plot_w = WIDTH - LABEL_W - RIGHT
    starts = [e.start for _, evs in rows for e in evs]
    ends = [e.end for _, evs in rows for e in evs]
    t0, t1 = min(starts), max(ends)
    pad = (t1 - t0) * 0.01
    t0, t1 = t0 - pad, t1 + pad

    def x(t):
        return LABEL_W + (t - t0) / (t1 - t0) * plot_w

    modules = {e.module for _, evs in rows for e in evs if e.kind in ("run", "dispatch")}
    out.append(f'<text x="8" y="{top + 14}" font-weight="bold">{html.escape(title)}</text>')
    y = top + 24
    rows = [(label, evs) for label, evs in rows if evs]
    for label, events in rows:
        out.append(f'<text x="8" y="{y + ROW_H - 5}" fill="#333">{html.escape(label)}</text>')
        out.append(f'<line x1="{LABEL_W}" y1="{y + ROW_H + 1}" x2="{WIDTH - RIGHT}" '
                   f'y2="{y + ROW_H + 1}" stroke="#eee"/>')
        for ev in events:
            x0, x1 = x(ev.start), x(ev.end)
            w = max(x1 - x0, 0.6)
            tip = f"{ev.name}: {(ev.end - ev.start) * 1e3:.0f} µs"
            # A white edge parts touching bars, where they are wide enough.
            edge = ' stroke="#fff" stroke-width="0.6"' if w > 3 else ""
            out.append(f'<rect x="{x0:.2f}" y="{y}" width="{w:.2f}" height="{ROW_H}" '
                       f'fill="{_colour(ev, modules)}"{edge}><title>{html.escape(tip)}</title></rect>')
            fits = int((w - 6) / CHAR_W)
            if fits >= 4:
                text = ev.name if len(ev.name) <= fits else ev.name[:fits - 1] + "…"
                colour = "#fff" if ev.kind in ("run", "op") else "#000"
                out.append(f'<text x="{x0 + 3:.2f}" y="{y + ROW_H - 5}" fill="{colour}">'
                           f'{html.escape(text)}</text>')
        y += ROW_H + GAP
    # The time axis, in ms from the panel's first event.
    step = _ticks(t1 - t0)
    out.append(f'<line x1="{LABEL_W}" y1="{y + 2}" x2="{WIDTH - RIGHT}" y2="{y + 2}" stroke="#666"/>')
    tick = 0.0
    while t0 + pad + tick <= t1:
        tx = x(t0 + pad + tick)
        out.append(f'<line x1="{tx:.2f}" y1="{y + 2}" x2="{tx:.2f}" y2="{y + 6}" stroke="#666"/>')
        out.append(f'<text x="{tx:.2f}" y="{y + 18}" text-anchor="middle" fill="#555">'
                   f'{tick:g}{" ms" if tick == 0 else ""}</text>')
        tick += step
    return y + 28


def render(panels, title, legend):
    out, y = [], 0
    y = 30
    for panel_title, rows in panels:
        y = draw_panel(out, y, panel_title, rows) + 6
    x = 8
    for name, colour in legend:
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 16}" y="{y + 10}" fill="#333">{html.escape(name)}</text>')
        x += 16 + len(name) * CHAR_W + 16
    height = y + 22
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="Helvetica, Arial, sans-serif" '
            f'font-size="{FONT}">\n<rect width="100%" height="100%" fill="#fff"/>\n'
            f'<text x="8" y="19" font-size="14" font-weight="bold">{html.escape(title)}</text>')
    return "\n".join([head] + out + ["</svg>\n"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="fused,strict")
    parser.add_argument("--steps", type=int, default=2, help="traced steps per mode")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "images", "device-trace.svg"))
    parser.add_argument("--logdir", help="where the traces go (kept); a temporary folder if not")
    args = parser.parse_args()
    panels = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            logdir = os.path.join(args.logdir or tmp, mode)
            rows = read_trace(run_steps(mode, args.steps, logdir))
            what = "one fused graph per step" if mode == "fused" else "one computation per op"
            panels.append((f"{mode} mode: {args.steps} steps, {what}", rows))
    platform = jax.devices()[0].platform.upper()
    title = (f"torchtpu.profiler.trace: MLP training steps (AdamW, reading the loss) "
             f"on JAX's {platform} platform")
    shown = {e.kind for _, rows in panels for _, evs in rows for e in evs}
    legend = [(k, COLOURS[k]) for k in COLOURS if k in shown]
    legend += [("fused graph", FUSED_PALETTE[0]), ("per-op kernels", OP_PALETTE[0])]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(render(panels, title, legend))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
