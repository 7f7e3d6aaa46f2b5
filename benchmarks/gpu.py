"""torchtpu on JAX's GPU backend beside PyTorch CUDA on the same GPU: one script
sized for a 10-minute run on one GPU (an H200).

It measures the per-op cost (benchmarks/per_op.py, plus PyTorch CUDA eager)
and the AdamW training steps of the MLP and the small GPT of
benchmarks/fused.py: torchtpu strict, fused, replayed (torch.tpu.graph) and
compiled (`torch.compile(step, backend="tpu")`), the MLP as one jax.jit
function, and PyTorch CUDA eager and `torch.compile` (Inductor); and
benchmarks/checkpoint_memory.py's figures: XLA's peak memory for a GPT step
with and without activation checkpointing, fused, replayed and compiled, and
its jax.checkpoint control. Each figure
comes from its own subprocess with a timeout (a failure or a timeout is a
row saying so, the rest still run), the median of several steps after
warm-up; a smoke run's figures all come from one. It prints markdown
tables and, if $OUT is set, writes them and the raw figures to
$OUT/gpu.json (and gpu.md).

    python benchmarks/gpu.py            # on the GPU machine
    python benchmarks/gpu.py --smoke    # tiny sizes, JAX on CPU, no CUDA rows

It needs only torch, JAX (with its CUDA plugin on the GPU machine) and
torchtpu's source tree (found from this file, or on PYTHONPATH).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Each step's sizes: the benchmark tables' (fused.py), and the smoke run's.
SIZES = {
    False: {"mlp": {"sizes": (784, 1024, 1024, 10), "batch": 128},
            "gpt": {"vocab": 512, "d": 256, "heads": 4, "layers": 4, "seq": 128, "batch": 8},
            "per_op": {"n_ops": 1000, "size": 128, "repeats": 9}, "repeats": {"mlp": 20, "gpt": 10},
           "checkpoint": {}},  # (checkpoint_memory.py's own sizes)
    True: {"mlp": {"sizes": (16, 32, 32, 4), "batch": 8},
           "gpt": {"vocab": 32, "d": 16, "heads": 2, "layers": 1, "seq": 8, "batch": 2},
           "per_op": {"n_ops": 20, "size": 8, "repeats": 2}, "repeats": {"mlp": 2, "gpt": 2},
           "checkpoint": {"size": {"vocab": 32, "d": 16, "heads": 2, "layers": 2, "seq": 8},
                          "batch": 2, "warmup": 2, "repeats": 2}},
}
MODELS = {"mlp": "MLP {sizes}, batch {batch}",
          "gpt": "GPT {layers} layers d{d} h{heads}, seq {seq}, batch {batch}, vocab {vocab}"}
# A mode ending in _high runs at torch.set_float32_matmul_precision("high")
# (bf16_3x or TF32 for torchtpu, TF32 for CUDA); the others at "highest".
HIGH = "_high"
TPU_MODES = ("strict", "fused", "replayed", "compiled", "fused" + HIGH)
CUDA_MODES = ("cuda_eager", "inductor", "cuda_eager" + HIGH)
COLUMNS = [("strict", "strict"), ("fused", "fused"), ("replayed", "replayed"),
           ("compiled", "compiled (tpu backend)"), ("jax_jit", "jax.jit step"),
           ("cuda_eager", "PyTorch CUDA eager"), ("inductor", "PyTorch Inductor"),
           ("fused" + HIGH, "fused, matmul \"high\""),
           ("cuda_eager" + HIGH, "CUDA eager, matmul \"high\"")]
# (A smoke run measures the fused path alone.)
CHECKPOINT_PATHS = {False: ("fused", "replayed", "compiled", "jax"), True: ("fused",)}
RATIOS = [("fused", "cuda_eager"), ("replayed", "cuda_eager"), ("compiled", "cuda_eager"),
          ("replayed", "inductor"), ("compiled", "inductor"),
          ("fused" + HIGH, "cuda_eager" + HIGH)]


# ---- in a child process ---------------------------------------------------------

def _makers(model, smoke):
    import functools
    import workloads
    size = SIZES[smoke][model]
    if model == "mlp":
        return (functools.partial(workloads.mlp, size["sizes"]),
                functools.partial(workloads.mlp_batch, size["batch"], size["sizes"][0], size["sizes"][-1]))
    spec = {k: size[k] for k in ("vocab", "d", "heads", "layers", "seq")}
    return (functools.partial(workloads.TinyGPT, **spec),
            functools.partial(workloads.gpt_batch, size["batch"], size["seq"], size["vocab"]))


def _inductor_step_fn(make_model, make_batch, device):
    """benchmarks/compiled.py's compiled step with PyTorch's default
    backend (Inductor): the loss compiled (its backward by AOTAutograd),
    optimizer.step() compiled, Adam's step counts on the device, as run()."""
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = make_model().to(device)
    x, y = (t.to(device) for t in make_batch())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)

    @torch.compile(dynamic=False)
    def loss_of(x, y):
        out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y)

    opt_step = torch.compile(opt.step, dynamic=False)

    def run():
        opt.zero_grad(set_to_none=True)
        loss = loss_of(x, y)
        loss.backward()
        opt_step()
        return loss.item()
    return run


def _tpu_step(mode, make_model, make_batch):
    """(run, warm-up steps, extra figures) of a torchtpu row."""
    # Imported only here, not for PyTorch's own rows: with torchtpu
    # registered, a CUDA backward fails in PyTorch's autograd (pytorch#161129).
    import fused
    if mode in ("strict", "fused"):
        return fused.step_fn(make_model, make_batch, mode), 3, {}
    if mode == "replayed":
        run = fused.replayed_step_fn(make_model, make_batch)
        return run, 3, {"in_place": "%d of %d" % fused.in_place(run)}
    if mode == "compiled":
        import compiled
        return compiled.compiled_step_fn(make_model, make_batch), 6, {}
    if mode == "jax_jit":
        return fused.jax_mlp_step_fn(make_model, make_batch), 3, {}
    raise ValueError(f"unknown mode {mode!r}")


def _measure_step(model, mode, smoke):
    import torch
    from common import timings
    make_model, make_batch = _makers(model, smoke)
    repeats = SIZES[smoke]["repeats"][model]
    extra = {}
    if mode.endswith(HIGH):  # (this child process's setting alone)
        torch.set_float32_matmul_precision("high")
        mode = mode[:-len(HIGH)]
    if mode == "cuda_eager":
        import workloads
        run, warmup = workloads.torch_step_fn(make_model, make_batch, "cuda"), 3
    elif mode == "inductor":
        run, warmup = _inductor_step_fn(make_model, make_batch, "cuda"), 6
    else:
        run, warmup, extra = _tpu_step(mode, make_model, make_batch)
    start = time.perf_counter()
    for _ in range(warmup):
        run()
    warm_s = time.perf_counter() - start
    median, best = timings(run, repeats, warmup=0)
    if mode in CUDA_MODES:
        torch.cuda.synchronize()
    return dict(extra, ms=median * 1e3, best_ms=best * 1e3, warmup_s=warm_s, repeats=repeats)


def _measure_per_op(smoke):
    import torch
    import per_op
    from common import timings
    size = SIZES[smoke]["per_op"]
    rows = per_op.per_op(**size)
    if not smoke and torch.cuda.is_available():
        y = torch.randn(size["size"], size["size"], device="cuda")

        def run():
            c = torch.zeros_like(y)
            for _ in range(size["n_ops"]):
                c = c + y
            torch.cuda.synchronize()
        median, best = timings(run, size["repeats"])
        rows.insert(1, {"mode": "PyTorch CUDA eager", "median": median / size["n_ops"] * 1e6,
                        "best": best / size["n_ops"] * 1e6})
    return {"rows": rows}


def _environment():
    import jax
    import torch
    import torchtpu
    env = {"torch": torch.__version__, "jax": jax.__version__,
           "platform": torchtpu.runtime.PLATFORM,
           "devices": [str(d) for d in torchtpu.runtime.DEVICES],
           "device_kind": torchtpu.runtime.DEVICES[0].device_kind,
           "cuda": torch.cuda.is_available(), "host_cores": os.cpu_count()}
    if env["cuda"]:
        env["cuda_device"] = torch.cuda.get_device_name(0)
    return env


def _measure_checkpoint(path, checkpointed, smoke):
    import checkpoint_memory
    if path == "jax" and smoke:
        return checkpoint_memory.measure(path, checkpointed, repeats=2)
    return checkpoint_memory.measure(path, checkpointed, **SIZES[smoke]["checkpoint"])


def child(spec):
    sys.path[:0] = [ROOT, HERE]
    if isinstance(spec, list):
        return _children_in_one(spec)
    if spec["what"] == "env":
        return _environment()
    if spec["what"] == "checkpoint":
        return _measure_checkpoint(spec["path"], spec["checkpointed"], spec["smoke"])
    if spec["what"] == "per_op":
        return _measure_per_op(spec["smoke"])
    return _measure_step(spec["model"], spec["mode"], spec["smoke"])


def _children_in_one(specs):
    """A smoke run's figures, measured one after another in this process."""
    import torch
    from common import in_one_process
    # (a "_high" mode's setting undone after each)
    return in_one_process(child, specs, lambda: torch.set_float32_matmul_precision("highest"))


# ---- the parent: one subprocess per figure ----------------------------------------

def _child_env(smoke):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # Several processes take turns on one GPU: none keeps 75% of it.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if smoke:
        env["TORCHTPU_PLATFORM"] = "cpu"
        env["JAX_PLATFORMS"] = "cpu"
    return env


def run_child(spec, timeout):
    """The child's result dict, or {"error": why}; spec a list (a smoke
    run's): the list of their results, or that error."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    smoke = (spec[0] if isinstance(spec, list) else spec)["smoke"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=_child_env(smoke), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            return result if isinstance(result, list) else dict(result, wall_s=wall)
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    # The exception's line (JAX adds lines of its own after it).
    raised = [line for line in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", line)]
    return {"error": ((raised or lines)[-1] if lines else f"exit status {proc.returncode}")[:400]}


def plan(smoke, cuda):
    """The children to run, most telling first."""
    specs = [{"what": "env"}, {"what": "per_op"}]
    for model in ("mlp", "gpt"):
        modes = TPU_MODES + (("jax_jit",) if model == "mlp" else ()) + (CUDA_MODES if cuda else ())
        specs += [{"what": "step", "model": model, "mode": m} for m in modes]
    specs += [{"what": "checkpoint", "path": p, "checkpointed": c}
              for p in CHECKPOINT_PATHS[smoke] for c in (False, True)]
    for s in specs:
        s["smoke"] = smoke
    return specs


def _chosen(specs, rows):
    """The specs that rows name, in the order rows names them."""
    chosen = []
    for row in rows:
        model, _, mode = row.partition(":")
        found = [s for s in specs if s.get("model", s["what"]) == model
                 and (not mode or s.get("mode") == mode)]
        if not found:
            raise SystemExit(f"--rows: no figure {row!r}")
        chosen += [s for s in found if s not in chosen]
    return chosen


def _cell(value, fmt="{:.2f}"):
    if value is None:
        return "—"
    return fmt.format(value) if isinstance(value, float) else str(value)


def tables(results, smoke):
    """The markdown text of the per-op table and the training-step table."""
    env = results.get("env", {})
    lines = [f"torchtpu on JAX {env.get('jax', '?')} {env.get('platform', '?')} "
             f"({env.get('device_kind', '?')}), torch {env.get('torch', '?')}"
             + (f", PyTorch on {env['cuda_device']}" if env.get("cuda_device") else "")
             + (" (smoke run: tiny sizes)" if smoke else "")
             + (f"; the environment's child failed: {env['error']}" if "error" in env else ""), ""]
    per_op = results.get("per_op", {})
    lines += ["Per-op cost, µs per op (`c = c + y`, then one sync)", "",
              "| mode | µs per op (median) | µs per op (best) |", "|---|---|---|"]
    if "error" in per_op:
        lines.append(f"| error: {per_op['error']} | — | — |")
    for r in per_op.get("rows", []):
        lines.append(f"| {r['mode']} | {r['median']:.1f} | {r['best']:.1f} |")
    short = {"cuda_eager": "CUDA eager", "inductor": "Inductor",
             "cuda_eager" + HIGH: "CUDA eager \"high\""}
    head = (["model"] + [t for _, t in COLUMNS] + [f"{a} / {short[b]}" for a, b in RATIOS]
            + ["replay state in place"])
    lines += ["", "AdamW training step, ms per step (median)", "",
              "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    errors = []
    for model in ("mlp", "gpt"):
        steps = results.get("steps", {}).get(model, {})
        ms = {m: r.get("ms") for m, r in steps.items()}
        for m, r in steps.items():
            if "error" in r:
                errors.append(f"- {model} {m}: {r['error']}")
        ratios = [ms[a] / ms[b] if ms.get(a) and ms.get(b) else None for a, b in RATIOS]
        name = MODELS[model].format(**SIZES[smoke][model])
        cells = ([name] + [_cell(ms.get(k)) for k, _ in COLUMNS]
                 + [_cell(r, "{:.2f}x") for r in ratios]
                 + [_cell(steps.get("replayed", {}).get("in_place"))])
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", _checkpoint_table(results.get("checkpoint", {}), smoke, errors)]
    if errors:
        lines += ["", "Not measured:", ""] + errors
    return "\n".join(lines)


def _checkpoint_table(measures, smoke, errors):
    """checkpoint_memory.py's table of the measures ({"PATH:way": figures}),
    the rows of a path that failed left out (its error in errors)."""
    import checkpoint_memory
    from common import table
    size = SIZES[smoke]["checkpoint"].get("size")
    model = (checkpoint_memory.MODEL if not smoke
             else "GPT {layers} layers d{d} h{heads}, seq {seq} (smoke)".format(**size))
    rows = []
    for path in CHECKPOINT_PATHS[smoke]:
        two = [measures.get(f"{path}:{c}", {"error": "not run"}) for c in (False, True)]
        failed = [f"- checkpoint_memory {path} {way}: {m['error']}"
                  for way, m in zip(("not", "checkpointed"), two) if "error" in m]
        if failed:
            errors += failed
            continue
        rows += checkpoint_memory.compare(*two, model=model)
    for row in rows:
        if row["loss_diff"] is None:
            row["loss_diff"] = float("nan")
    bench = checkpoint_memory.checkpoint_memory
    return bench.title + "\n\n" + table(bench, rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, JAX on CPU, no PyTorch CUDA rows (a test of the script)")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for the whole run (default 540: a 10-minute slot)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per child")
    parser.add_argument("--rows", help="only these figures, in this order: comma-separated "
                        "MODEL:MODE (e.g. gpt:fused,mlp:inductor), MODEL, per_op, or checkpoint "
                        "(checkpoint_memory.py's figures)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="torchtpu-gpu-bench-") as cache_dir:
        # One cold compilation cache for the run, shared by its children: a
        # kernel one measurement compiled, the next loads (the figures are
        # steady steps either way; the budget goes further).
        os.environ["TORCHTPU_CACHE_DIR"] = cache_dir
        _run(args)


def _run(args):
    start = time.perf_counter()
    env = run_child({"what": "env", "smoke": args.smoke}, args.timeout)
    results = {"env": env, "steps": {}}
    specs = plan(args.smoke, bool(env.get("cuda")) and not args.smoke)[1:]
    if args.rows:
        specs = _chosen(specs, args.rows.split(","))
    from common import measured
    for spec, result in measured(specs, run_child, args.smoke, args.budget, args.timeout, start):
        if spec["what"] == "per_op":
            results["per_op"] = result
        elif spec["what"] == "checkpoint":
            results.setdefault("checkpoint", {})[f"{spec['path']}:{spec['checkpointed']}"] = result
        else:
            results["steps"].setdefault(spec["model"], {})[spec["mode"]] = result
        print(f"[gpu.py {time.perf_counter() - start:.0f} s] {spec.get('model', spec['what'])} "
              f"{spec.get('mode', spec.get('path', ''))}: {result.get('ms', result.get('error', 'done'))}",
              file=sys.stderr, flush=True)
    text = tables(results, args.smoke)
    print(text)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        results["markdown"] = text
        with open(os.path.join(out, "gpu.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(out, "gpu.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
