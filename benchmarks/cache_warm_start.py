"""Time to the first finished training step, cold vs warm compilation cache.

From process start (before the interpreter starts) to the first `loss.item()`
of the small GPT of the fused-mode benchmark (`fused.TinyGPT`: 4 layers,
d=256, 4 heads, seq 128, batch 8, vocab 512, AdamW), each run in its own
subprocess: cold with an empty TORCHTPU_CACHE_DIR, warm with a directory an
earlier process filled. Median of `repeats` runs per mode.

The figure that counts is what torchtpu itself does (its own import, building
the model's kernels, compiling or loading them, running the step), warm over
cold. It is timed from the end of `import torch, jax` and of the two modules
PyTorch imports lazily on the way, whatever the device: `torch._dynamo` (an
optimizer's constructor imports it, on CPU too) and `torch.distributed.tensor`
(PyTorch's C++ imports it at the first dispatch to any `__torch_dispatch__`
subclass, to ask whether it is a DTensor). Those two are timed as their own
column; "after import torch, jax" includes them, as the earlier tables did.
torchtpu's bytecode is compiled first, as an install leaves it. The time
Python's garbage collector takes in that window is counted too (a full
collection walks every object the imports left, about 0.2 s here).

    python benchmarks/cache_warm_start.py [--repeats 3] [--modes strict fused]
    python benchmarks/cache_warm_start.py --gc-freeze  # gc.freeze() after the imports
    python benchmarks/cache_warm_start.py --profile fused   # where a warm start goes

`cache_warm_start()` returns rows for benchmarks/run.py (title and columns
attached like its other benchmarks).
"""
import argparse
import collections
import gc
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


def _gc_timer():
    """Seconds spent in Python's garbage collector from now on, and the
    number of full collections, as a callable returning both."""
    spent = {"seconds": 0.0, "full": 0, "started": None}

    def callback(phase, info):
        if phase == "start":
            spent["started"] = time.perf_counter()
        elif spent["started"] is not None:
            spent["seconds"] += time.perf_counter() - spent["started"]
            spent["full"] += info["generation"] == 2
    gc.callbacks.append(callback)
    return lambda: (spent["seconds"], spent["full"])


def _child(profile_to=None, freeze_gc=False):
    """One process: import, build, one training step, report."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import jax  # noqa: F401
    import torch
    libs_imported = time.time()
    import torch._dynamo  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    lazy_imported = time.time()
    if freeze_gc:  # the recipe: what the imports left is not walked again
        gc.freeze()
    gc_spent = _gc_timer()
    profiler = None
    if profile_to:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
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
    gc_seconds, gc_full = gc_spent()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile_to)
    snap = torchtpu.metrics.snapshot()
    print("RESULT " + json.dumps({
        "libs_imported": libs_imported, "lazy_imported": lazy_imported, "imported": imported, "done": done, "loss": value,
        "gc_seconds": gc_seconds, "gc_full": gc_full,
        "stats": torchtpu.cache.stats(),
        "fallbacks": snap["cpu_fallbacks"],
        "graphs_compiled": snap.get("graphs_compiled", 0),
    }), flush=True)


def _run_once(mode, cache_dir, profile_to=None, freeze_gc=False):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=cache_dir, TORCHTPU_EAGER_MODE=mode)
    env.pop("TORCHTPU_CACHE_READONLY", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child"]
    if freeze_gc:
        cmd.append("--gc-freeze")
    if profile_to:
        cmd += ["--profile-to", profile_to]
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    r = json.loads(line[len("RESULT "):])
    r["total"] = r["done"] - start
    r["libs"] = r["libs_imported"] - start            # interpreter + import torch, jax
    r["after_libs"] = r["done"] - r["libs_imported"]
    r["lazy"] = r["lazy_imported"] - r["libs_imported"]  # PyTorch's lazy imports
    r["after"] = r["done"] - r["lazy_imported"]       # what torchtpu does
    r["torchtpu_import"] = r["imported"] - r["lazy_imported"]
    return r


def _compile_bytecode():
    """torchtpu's and the benchmark's .pyc files, as an install leaves them
    (with PYTHONDONTWRITEBYTECODE set, every start would compile the sources
    again, in cold and warm runs alike)."""
    import compileall
    for d in (os.path.join(ROOT, "torchtpu"), HERE):
        compileall.compile_dir(d, quiet=1)


def cache_warm_start(repeats=3, modes=("strict", "fused"), freeze_gc=False):
    """Rows: per mode and cache state, median seconds from process start to
    the first finished step, of it importing torch and JAX, PyTorch's lazy
    imports, and what torchtpu does after them (warm over cold on this), with
    the compilations and disk hits of the last run. Cold and warm runs
    alternate, so both see the same load. freeze_gc: each run calls
    gc.freeze() once its imports are done."""
    _compile_bytecode()
    rows = []
    for mode in modes:
        work = tempfile.mkdtemp(prefix="torchtpu-bench-cache-")
        try:
            filled = os.path.join(work, "filled")
            _run_once(mode, filled, freeze_gc=freeze_gc)  # the warm runs read this cache
            cold, warm = [], []
            for i in range(repeats):
                cold.append(_run_once(mode, os.path.join(work, f"cold{i}"), freeze_gc=freeze_gc))
                warm.append(_run_once(mode, filled, freeze_gc=freeze_gc))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        cold_after = statistics.median(r["after"] for r in cold)
        cold_after_libs = statistics.median(r["after_libs"] for r in cold)
        cold_total = statistics.median(r["total"] for r in cold)
        for state, runs in (("cold", cold), ("warm", warm)):
            last = runs[-1]
            after = statistics.median(r["after"] for r in runs)
            total = statistics.median(r["total"] for r in runs)
            rows.append({
                "mode": mode, "cache": state,
                "total": total,
                "libs": statistics.median(r["libs"] for r in runs),
                "lazy": statistics.median(r["lazy"] for r in runs),
                "after_libs": statistics.median(r["after_libs"] for r in runs),
                "after_libs_of_cold": (statistics.median(r["after_libs"] for r in runs)
                                       / cold_after_libs),
                "after": after,
                "torchtpu_import": statistics.median(r["torchtpu_import"] for r in runs),
                "after_of_cold": after / cold_after,
                "total_of_cold": total / cold_total,
                "compile": statistics.median(r["stats"]["compile_seconds"] for r in runs),
                "gc": statistics.median(r["gc_seconds"] for r in runs),
                "gc_full": last["gc_full"],
                "compilations": last["stats"]["compilations"],
                "disk_hits": last["stats"]["disk_hits"],
                "fallbacks": sum(last["fallbacks"].values()),
                "fallback_ops": ", ".join(sorted(last["fallbacks"])) or "-",
                "loss": last["loss"],
            })
    return rows


cache_warm_start.title = ("Time to the first training step (process start to the first "
                          "`loss.item()`), small GPT 4x256 h4 seq128 b8 AdamW, cold vs warm "
                          "compilation cache, median over separate processes; \"torchtpu\" starts "
                          "once `import torch, jax` and PyTorch's lazy imports (torch._dynamo, "
                          "torch.distributed.tensor) are done")
cache_warm_start.columns = [
    ("mode", "mode", "{}"), ("cache", "cache", "{}"),
    ("total", "s to first step", "{:.2f}"), ("total_of_cold", "vs cold", "{:.0%}"),
    ("libs", "s importing torch, jax", "{:.2f}"),
    ("after_libs", "s after import torch, jax", "{:.2f}"),
    ("after_libs_of_cold", "vs cold", "{:.0%}"),
    ("lazy", "of it PyTorch's lazy imports", "{:.2f}"),
    ("after", "s torchtpu", "{:.2f}"), ("after_of_cold", "torchtpu, vs cold", "{:.0%}"),
    ("torchtpu_import", "of it import torchtpu", "{:.2f}"),
    ("compile", "s compiling", "{:.2f}"),
    ("gc", "s in Python's gc", "{:.2f}"), ("gc_full", "full collections", "{}"),
    ("compilations", "compilations", "{}"),
    ("disk_hits", "disk hits", "{}"), ("fallbacks", "CPU fallbacks", "{}"),
]


# ---- where a warm start goes ---------------------------------------------------

# What a warm start does, as the functions that do it (file suffix, function
# name); each line's time is the cumulative time of its outermost calls.
ACTIVITIES = [
    ("import torchtpu", "torchtpu/__init__.py", "<module>"),
    ("all imports during the run (torchtpu's, and torch's and JAX's lazy ones)",
     "<frozen importlib._bootstrap>", "_find_and_load"),
    ("dispatching ops (torchtpu, from __torch_dispatch__ on)", "torchtpu/tensor.py",
     "__torch_dispatch__"),
    ("  of it: meta kernels for output shapes (dispatch)", "torchtpu/dispatch/meta.py",
     "run_meta"),
    ("  of it: abstract traces of per-op kernels (fused, jax.eval_shape)",
     "torchtpu/modes/fused.py", "_abstract"),
    ("tracing kernels to jaxprs (JAX; strict: each per-op kernel)", "jax/_src/pjit.py",
     "_infer_params"),
    ("lowering jaxprs to StableHLO (JAX)", "jax/_src/interpreters/pxla.py",
     "lower_sharding_computation"),
    ("compiling or loading executables through JAX's cache", "jax/_src/compiler.py",
     "compile_or_get_cached"),
    ("reading checked files (torchtpu's disk cache: records and JAX's entries)",
     "torchtpu/cache_files.py", "get"),
    ("loading stored executables (torchtpu: per-op kernels, fused graphs)", "torchtpu/cache.py",
     "_load_executable"),
    ("waiting for the device's results", "jax/_src/array.py", "_value"),
]


def _group(filename):
    """torchtpu's modules by name; everything else by package."""
    if "/torchtpu/" in filename:
        return "torchtpu/" + filename.rsplit("/torchtpu/", 1)[1]
    for pkg in ("torch", "jax", "jaxlib", "numpy"):
        if f"/site-packages/{pkg}/" in filename:
            return pkg
    if filename.startswith("<frozen"):
        return "Python import system"
    if filename == "~":
        return "C functions (XLA, torch's C++, builtins)"
    return "other Python"


def profile_warm(mode, top=12):
    """Fill a cache, then profile a warm run after `import torch, jax`:
    returns (lines of activities with seconds, self time by module)."""
    import pstats
    work = tempfile.mkdtemp(prefix="torchtpu-bench-profile-")
    try:
        filled = os.path.join(work, "cache")
        _run_once(mode, filled)
        out = os.path.join(work, "warm.prof")
        r = _run_once(mode, filled, profile_to=out)
        stats = pstats.Stats(out).stats
    finally:
        shutil.rmtree(work, ignore_errors=True)
    activities = []
    for label, file_suffix, name in ACTIVITIES:
        seconds = sum(ct for (f, _, fn), (_, _, _, ct, _) in stats.items()
                      if fn == name and f.endswith(file_suffix))
        activities.append((label, seconds))
    by_group = collections.Counter()
    for (f, _, _), (_, _, tt, _, _) in stats.items():
        by_group[_group(f)] += tt
    return r, activities, by_group.most_common(top)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile-to", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["strict", "fused"])
    p.add_argument("--profile", metavar="MODE", help="profile a warm run in MODE instead")
    p.add_argument("--gc-freeze", action="store_true",
                   help="each run calls gc.freeze() once its imports are done")
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = p.parse_args(argv)
    if args.child:
        _child(args.profile_to, args.gc_freeze)
        return
    from common import table
    if args.profile:
        _compile_bytecode()
        r, activities, by_group = profile_warm(args.profile)
        print(f"\nWarm {args.profile} start, {r['after']:.2f} s after `import torch, jax` "
              "and PyTorch's lazy imports "
              f"({r['stats']['compilations']} compilations, {r['stats']['disk_hits']} disk "
              "hits), under cProfile (which slows Python code down):\n")
        for label, seconds in activities:
            print(f"  {seconds:6.2f} s  {label}")
        print("\nSelf time by module:\n")
        for group, seconds in by_group:
            print(f"  {seconds:6.2f} s  {group}")
        return
    rows = cache_warm_start(args.repeats, tuple(args.modes), args.gc_freeze)
    print(f"\n{cache_warm_start.title}\n\n{table(cache_warm_start, rows)}\n")
    for r in rows:
        if r["fallbacks"]:
            print(f"{r['mode']} {r['cache']}: CPU fallbacks: {r['fallback_ops']}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
