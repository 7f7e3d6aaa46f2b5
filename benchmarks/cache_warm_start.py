"""Time to the first finished training step, cold vs warm compilation cache.

From process start (before the interpreter starts) to the first `loss.item()`
of the small GPT of the fused-mode benchmark (`fused.TinyGPT`: 4 layers,
d=256, 4 heads, seq 128, batch 8, vocab 512, AdamW), each run in its own
subprocess: cold with an empty TORCHTPU_CACHE_DIR, warm with a directory an
earlier process filled. Median of `repeats` runs per mode.

    python benchmarks/cache_warm_start.py [--repeats 3] [--modes strict fused]

`cache_warm_start()` returns rows for benchmarks/run.py (title and columns
attached like its other benchmarks).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _child():
    """One process: import, build, one training step, report."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import torch
    import torch.nn.functional as F

    import torchtpu
    imported = time.time()
    from fused import TinyGPT, gpt_batch

    torch.manual_seed(0)
    model = TinyGPT().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = gpt_batch()
    x, y = x.to("tpu"), y.to("tpu")
    out = model(x)
    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y)
    loss.backward()
    opt.step()
    value = loss.item()
    done = time.time()
    snap = torchtpu.metrics.snapshot()
    print("RESULT " + json.dumps({
        "imported": imported, "done": done, "loss": value,
        "stats": torchtpu.cache.stats(),
        "fallbacks": snap["cpu_fallbacks"],
        "graphs_compiled": snap.get("graphs_compiled", 0),
    }), flush=True)


def _run_once(mode, cache_dir):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=cache_dir, TORCHTPU_EAGER_MODE=mode)
    env.pop("TORCHTPU_CACHE_READONLY", None)
    start = time.time()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    r = json.loads(line[len("RESULT "):])
    r["total"] = r["done"] - start
    r["import"] = r["imported"] - start
    return r


def cache_warm_start(repeats=3, modes=("strict", "fused")):
    """Rows: per mode and cache state, median seconds from process start to
    the first finished step (and to the end of `import torchtpu`), with the
    compilations and disk hits of the last run."""
    rows = []
    for mode in modes:
        work = tempfile.mkdtemp(prefix="torchtpu-bench-cache-")
        try:
            cold = []
            for i in range(repeats):
                d = os.path.join(work, f"cold{i}")
                cold.append(_run_once(mode, d))
            filled = os.path.join(work, "cold0")  # the warm runs read the first cold run's cache
            warm = [_run_once(mode, filled) for _ in range(repeats)]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        cold_total = statistics.median(r["total"] for r in cold)
        for state, runs in (("cold", cold), ("warm", warm)):
            last = runs[-1]
            total = statistics.median(r["total"] for r in runs)
            rows.append({
                "mode": mode, "cache": state,
                "total": total,
                "import": statistics.median(r["import"] for r in runs),
                "step": statistics.median(r["total"] - r["import"] for r in runs),
                "of_cold": total / cold_total,
                "compile": statistics.median(r["stats"]["compile_seconds"] for r in runs),
                "compilations": last["stats"]["compilations"],
                "disk_hits": last["stats"]["disk_hits"],
                "fallbacks": sum(last["fallbacks"].values()),
                "fallback_ops": ", ".join(sorted(last["fallbacks"])) or "-",
                "loss": last["loss"],
            })
    return rows


cache_warm_start.title = ("Time to the first training step (process start to the first "
                          "`loss.item()`), small GPT 4x256 h4 seq128 b8 AdamW, cold vs warm "
                          "compilation cache, median over separate processes")
cache_warm_start.columns = [
    ("mode", "mode", "{}"), ("cache", "cache", "{}"),
    ("total", "s to first step", "{:.2f}"), ("import", "s of it importing", "{:.2f}"),
    ("step", "s after import", "{:.2f}"), ("of_cold", "vs cold", "{:.0%}"),
    ("compile", "s compiling", "{:.2f}"), ("compilations", "compilations", "{}"),
    ("disk_hits", "disk hits", "{}"), ("fallbacks", "CPU fallbacks", "{}"),
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["strict", "fused"])
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = p.parse_args(argv)
    if args.child:
        _child()
        return
    from run import table
    rows = cache_warm_start(args.repeats, tuple(args.modes))
    print(f"\n{cache_warm_start.title}\n\n{table(cache_warm_start, rows)}\n")
    for r in rows:
        if r["fallbacks"]:
            print(f"{r['mode']} {r['cache']}: CPU fallbacks: {r['fallback_ops']}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
