"""Soak: do long training runs stay flat?

Each workload trains for `steps` steps (5,000 by default) in strict and in
fused mode, each run in a fresh process of its own (with a timeout and an
empty compilation cache): a small MLP and a small transformer (TinyGPT's
shape, scaled down so that 20,000 steps take minutes on a CPU host), AdamW
under a cosine learning-rate schedule with warm-up (a new learning rate
every step), `loss.item()` every step and a `torch.save` checkpoint of the
model and optimizer every 1,000 steps. After `warmup` steps (1,000) it
samples, every 500 steps:

- host RSS (/proc/self/statm): the table gives its growth per 1,000 steps,
  the least-squares slope over the samples, and its whole rise after
  warm-up;
- `torch.tpu.memory_allocated()`: its drift, the last sample less the
  first (a sync point, so pending work is counted);
- the in-memory cache's size (its entries: compiled kernels and graphs);
- the live storages: torchtpu's tensor storages alive in the process (the
  garbage collector's count of them, after a collection), and the live
  device arrays (`torch.tpu.memory_snapshot()`).

Targets: no growth of device memory, cache or storages after warm-up, and
host RSS growth below 1 MB per 1,000 steps.

    python benchmarks/soak.py [--steps 5000] [--workloads mlp gpt] [--modes strict fused]
"""
import argparse
import json
import os
import sys
import time

from common import print_rows, worker_rows

SAMPLE_EVERY = 500
WARMUP_STEPS = 1000


def _models():
    import torch
    from workloads import TinyGPT, mlp

    def mlp_workload():
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        return mlp((64, 128, 128, 10)), x, y

    def gpt_workload():
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 64, (4, 17), generator=g)
        model = TinyGPT(vocab=64, d=32, heads=2, layers=2, seq=16)
        return model, tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous()

    return {"mlp": mlp_workload, "gpt": gpt_workload}


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sample(step):
    import gc
    import torch
    import torchtpu
    from torchtpu import cache, tensor
    allocated = torch.tpu.memory_allocated()  # a sync point: pending work done
    gc.collect()
    storages = sum(1 for o in gc.get_objects() if issubclass(type(o), tensor.Storage))
    return {"step": step, "rss": _rss_bytes(), "allocated": allocated,
            "cache_entries": len(cache._memory), "storages": storages,
            "arrays": len(torch.tpu.memory_snapshot()),
            "compilations": torchtpu.metrics.snapshot()["compilations"]}


def _worker(workload, steps, warmup, checkpoint_dir):
    import math
    import torch
    import torch.nn.functional as F
    import torchtpu  # noqa: F401 (the mode comes from TORCHTPU_EAGER_MODE)

    torch.manual_seed(0)
    model, x, y = _models()[workload]()
    model, x, y = model.to("tpu"), x.to("tpu"), y.to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ramp = 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / ramp if s < ramp
        else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - ramp) / steps)))
    checkpoint_every = max(steps // 5, 1)
    samples, losses = [], []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % checkpoint_every == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "step": step},
                       os.path.join(checkpoint_dir, "checkpoint.pt"))
        if step >= warmup and (step - warmup) % SAMPLE_EVERY == 0:
            samples.append(_sample(step))
    seconds = time.perf_counter() - start
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError("a loss is not finite")
    back = torch.load(os.path.join(checkpoint_dir, "checkpoint.pt"))
    if back["step"] != steps - steps % checkpoint_every:
        raise RuntimeError(f"the checkpoint holds step {back['step']}")
    print_rows([{"samples": samples, "seconds": seconds, "first_loss": losses[0],
                 "last_loss": losses[-1]}])


def _slope(points):
    """Least-squares slope of (x, y) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def summarize(workload, mode, steps, report):
    s = report["samples"]
    first, last = s[0], s[-1]
    return {"workload": workload, "mode": mode, "steps": steps,
            "step_ms": 1e3 * report["seconds"] / steps,
            "rss_per_1000": _slope([(p["step"], p["rss"]) for p in s]) * 1000 / 2**20,
            "rss_rise": (last["rss"] - first["rss"]) / 2**20,
            "allocated_drift": last["allocated"] - first["allocated"],
            "allocated": last["allocated"] / 2**20,
            "cache": f"{first['cache_entries']} → {last['cache_entries']}",
            "storages": f"{first['storages']} → {last['storages']}",
            "arrays": f"{first['arrays']} → {last['arrays']}",
            "compilations": last["compilations"] - first["compilations"],
            "loss": f"{report['first_loss']:.2f} → {report['last_loss']:.2f}"}


def soak(steps=5000, workloads=("mlp", "gpt"), modes=("strict", "fused"), warmup=WARMUP_STEPS,
         timeout=900):
    rows = []
    for workload in workloads:
        for mode in modes:
            os.environ["TORCHTPU_EAGER_MODE"] = mode
            try:
                report, = worker_rows(__file__, [workload, str(steps), str(warmup)], timeout)
            finally:
                os.environ.pop("TORCHTPU_EAGER_MODE", None)
            rows.append(summarize(workload, mode, steps, report))
    return rows


soak.title = ("Soak: host and device memory over a long run, after "
              f"{WARMUP_STEPS} steps of warm-up (sampled every {SAMPLE_EVERY} steps)")
soak.columns = [("workload", "workload", "{}"), ("mode", "mode", "{}"),
                ("steps", "steps", "{}"), ("step_ms", "ms/step", "{:.1f}"),
                ("rss_per_1000", "host RSS growth per 1,000 steps (MB)", "{:+.2f}"),
                ("rss_rise", "host RSS rise after warm-up (MB)", "{:+.2f}"),
                ("allocated_drift", "memory_allocated drift (bytes)", "{:+d}"),
                ("allocated", "memory_allocated (MiB)", "{:.2f}"),
                ("cache", "in-memory cache entries", "{}"),
                ("storages", "live storages", "{}"), ("arrays", "live device arrays", "{}"),
                ("compilations", "compilations after warm-up", "{}"),
                ("loss", "loss, first → last", "{}")]


def main():
    if sys.argv[1:2] == ["--worker"]:
        import tempfile
        workload, steps, warmup = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        with tempfile.TemporaryDirectory() as d:
            _worker(workload, steps, warmup, d)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--warmup", type=int, default=WARMUP_STEPS)
    p.add_argument("--workloads", nargs="+", default=["mlp", "gpt"])
    p.add_argument("--modes", nargs="+", default=["strict", "fused"])
    args = p.parse_args()
    from common import table
    rows = soak(args.steps, args.workloads, args.modes, args.warmup)
    print(json.dumps(rows, indent=1))
    print(table(soak, rows))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    main()
