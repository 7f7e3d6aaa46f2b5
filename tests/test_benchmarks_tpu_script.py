"""benchmarks/tpu.py, the TPU figures' script, runs here with --smoke (tiny
sizes, JAX on CPU): each path's row is measured, its losses are the plain-JAX
step's and CPU's, and the JSON it writes to $OUT holds the same figures."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "tpu.py")
ROWS = "per_op,mlp:jax,mlp:fused,mlp:replayed,gpt:jax,gpt:fused,gpt:cpu"


def test_tpu_script_smoke_run_fills_its_tables(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--rows", ROWS, "--timeout", "200"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "tpu.json").read_text())
    assert results["env"]["platform"] == "cpu"
    assert results["markdown"] == proc.stdout.strip()
    per_op = results["per_op"]
    for key in ("jax_call", "jax_in_jit", "strict", "fused", "debug"):
        assert per_op[key] > 0, per_op
    steps = results["steps"]
    for model, modes in (("mlp", ("jax", "fused", "replayed")),
                         ("gpt", ("jax", "fused"))):
        reference = steps[model]["jax"]["losses"]
        for mode in modes:
            row = steps[model][mode]
            assert "error" not in row, (model, mode, row)
            assert row["ms"] > 0 and len(row["first_steps_s"]) == len(row["losses"]) == 3
            # The same model, data and AdamW: the same losses as plain JAX's
            # (float32 for the MLP; the GPT under bf16 autocast).
            tol = 1e-5 if model == "mlp" else 2e-3
            assert row["losses"] == pytest.approx(reference, rel=tol), (model, mode)
            line = next(x for x in proc.stdout.splitlines() if x.startswith(f"| {model} | {mode} |"))
            assert f"{row['ms']:.2f}" in line
    # The GPT's torchtpu losses are CPU eager's under CPU autocast.
    assert steps["gpt"]["fused"]["losses"] == pytest.approx(steps["gpt"]["cpu"]["losses"], rel=2e-3)
