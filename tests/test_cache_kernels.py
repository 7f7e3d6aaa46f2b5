"""Per-op kernels' records and compilation (torchtpu/cache_kernels.py), in
fresh processes with their own cache directory: a graph fused mode meets
first compiles its new kernels side by side before running them op by op,
and strict and fused mode serve each other's kernel records."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import json, os, sys, threading
os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:int(os.environ["CORES"])]))
from jax import monitoring
import torch, torchtpu
from torch import nn

threads = []  # the thread each XLA compilation of the program ran on
monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **_: threads.append(threading.current_thread().name)
    if event == "/jax/core/compile/backend_compile_duration" else None)

def run(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 4)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g).to(device)
    y = torch.randint(0, 4, (6,), generator=g).to(device)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().cpu().flatten().tolist() for p in model.parameters()]}

result = {"tpu": run("tpu"), "threads": threads}
result["cpu"] = run("cpu")
result["stats"] = torchtpu.cache.stats()
result["metrics"] = {k: torchtpu.metrics.snapshot().get(k, 0) for k in ("run_first_met", "compile_seconds")}
print("RESULT " + json.dumps(result))
'''


def _run(tmp_path, cache_dir, mode, cores, **extra):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(cache_dir), TORCHTPU_EAGER_MODE=mode, CORES=str(cores),
               **extra)
    env.pop("TORCHTPU_CACHE_READONLY", None)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    import torch
    for got, want in zip([result["tpu"]["losses"], *result["tpu"]["params"]],
                         [result["cpu"]["losses"], *result["cpu"]["params"]]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
    return result


# Every graph tiered: met first, it runs op by op on its ops' kernels.
TIERED = {"TORCHTPU_FUSED_BACKGROUND_OPS": "1"}


def test_a_new_graphs_kernels_compile_side_by_side(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("compiling side by side needs 2 cores; this host gives the tests 1")
    two = _run(tmp_path, tmp_path / "two", "fused", 2, **TIERED)
    one = _run(tmp_path, tmp_path / "one", "fused", 1, **TIERED)
    assert two["metrics"]["run_first_met"] > 0
    ahead = [t for t in two["threads"] if t.startswith("torchtpu-compile-ahead")]
    # The first step's kernels compiled on two threads besides the program's.
    assert len(set(ahead)) == 2 and len(ahead) > len(two["threads"]) // 2, two["threads"]
    # On one core they compile one at a time, as each op runs.
    assert not [t for t in one["threads"] if t.startswith("torchtpu-compile-ahead")]
    assert two["stats"]["compilations"] == one["stats"]["compilations"] > 0
    assert 0 < two["metrics"]["compile_seconds"]
    # The same kernels: the same results, bit for bit.
    assert two["tpu"] == one["tpu"]


@pytest.mark.parametrize("first", ["strict", "fused"])
def test_strict_and_fused_mode_serve_each_others_kernel_records(tmp_path, first):
    """One record per kernel, under the same key in both modes: its trace
    (what fused mode records an op from) and its executable."""
    d = tmp_path / "cache"
    then = "fused" if first == "strict" else "strict"
    cold = _run(tmp_path, d, first, 2, **TIERED)
    warm = _run(tmp_path, d, then, 2, **TIERED)
    s1, s2 = cold["stats"], warm["stats"]
    assert s1["compilations"] > 0 and s2["compilations"] == 0 and s2["disk_misses"] == 0
    assert s2["kernels_loaded"] == s1["compilations"]
    if then == "fused":
        # Fused mode traces none of the kernels strict mode stored.
        assert s2["traces_loaded"] == s1["disk_kernels"]
    assert warm["tpu"] == cold["tpu"]
