"""torch.distributed on tpu tensors, 2 processes on this host: all_reduce's
bus bandwidth on XLA's collectives against the host-and-gloo path
(TORCHTPU_DISTRIBUTED=0), and a DDP training step in strict and fused mode.
Each figure comes from its own pair of processes started as torchrun starts
them."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap

SIZES_MIB = (1, 4, 16, 64, 256)

WORKER = textwrap.dedent("""\
    import datetime, json, statistics, sys, time
    import torch, torch.distributed as dist, torchtpu
    out, what = sys.argv[1], sys.argv[2]
    device = torch.device("tpu", torch.tpu.current_device())
    dist.init_process_group(dist.get_default_backend_for_device(device), device_id=device,
                            timeout=datetime.timedelta(seconds=120))
    result = {}

    def median_s(fn, repeats):
        fn()
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    if what == "all_reduce":
        for mib in SIZES:
            t = torch.ones(mib << 18, device="tpu")  # float32
            def reduce():
                dist.all_reduce(t)
                torchtpu.sync()
            result[str(mib)] = median_s(reduce, 9 if mib < 64 else 5)
    else:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10)).to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        x = torch.randn(64, 784, device=device)
        y = torch.randint(0, 10, (64,), device=device)
        for mode in ("strict", "fused"):
            with torchtpu.eager_mode(mode):
                def step():
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(ddp(x), y).backward()
                    opt.step()
                    torchtpu.sync()
                median_s(step, 1)  # compiles
                result[mode] = median_s(step, 7)
    dist.destroy_process_group()
    json.dump(result, open(out, "w"))
""")


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(what, **env):
    """Rank 0's report of WORKER(what) run as 2 ranks (env added to theirs)."""
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "worker.py")
        with open(script, "w") as f:
            f.write(f"SIZES = {SIZES_MIB!r}\n" + WORKER)
        base = dict(os.environ, TORCHTPU_CACHE_DIR="off", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(_port()), TORCHTPU_COORDINATOR_PORT=str(_port()),
                    WORLD_SIZE="2", **env)
        outs = [os.path.join(d, f"rank{r}.json") for r in range(2)]
        procs = [subprocess.Popen([sys.executable, script, outs[r], what],
                                  env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
        try:
            logs = [p.communicate(timeout=1200)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        for p, log in zip(procs, logs):
            if p.returncode:
                raise RuntimeError(f"{what} worker failed:\n{log[-3000:]}")
        with open(outs[0]) as f:
            return json.load(f)


def _bus_gbps(mib, seconds, n=2):
    """NCCL's bus bandwidth of an all_reduce: bytes * 2(n-1)/n per second."""
    return (mib << 20) * 2 * (n - 1) / n / seconds / 1e9


def all_reduce_bandwidth():
    xla = _two_processes("all_reduce")
    host = _two_processes("all_reduce", TORCHTPU_DISTRIBUTED="0")
    rows = []
    for mib in SIZES_MIB:
        x, h = xla[str(mib)], host[str(mib)]
        rows.append({"size": f"{mib} MiB", "xla_ms": x * 1e3, "host_ms": h * 1e3,
                     "xla_bw": _bus_gbps(mib, x), "host_bw": _bus_gbps(mib, h), "ratio": h / x})
    return rows


all_reduce_bandwidth.title = ("all_reduce of float32 tpu tensors, 2 processes: XLA's collectives "
                              "against copies through the host and gloo (TORCHTPU_DISTRIBUTED=0), "
                              "median time and bus bandwidth")
all_reduce_bandwidth.columns = [
    ("size", "size", "{}"), ("xla_ms", "XLA ms", "{:.2f}"), ("host_ms", "host+gloo ms", "{:.2f}"),
    ("xla_bw", "XLA GB/s", "{:.2f}"), ("host_bw", "host+gloo GB/s", "{:.2f}"),
    ("ratio", "XLA speed-up", "{:.2f}x")]


def ddp_step():
    xla = _two_processes("ddp")
    host = _two_processes("ddp", TORCHTPU_DISTRIBUTED="0")
    return [{"mode": mode, "xla": xla[mode] * 1e3, "host": host[mode] * 1e3,
             "ratio": host[mode] / xla[mode]} for mode in ("strict", "fused")]


ddp_step.title = ("DistributedDataParallel AdamW step, MLP 784-1024-1024-10, batch 64 per rank, "
                  "2 processes: gradients all-reduced on XLA against through the host and gloo")
ddp_step.columns = [("mode", "mode", "{}"), ("xla", "XLA ms", "{:.1f}"),
                    ("host", "host+gloo ms", "{:.1f}"), ("ratio", "XLA speed-up", "{:.2f}x")]
