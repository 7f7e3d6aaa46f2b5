"""benchmarks/tpu.py, the TPU figures' script, runs here with --smoke (tiny
sizes, JAX on CPU): each path's row is measured, its losses are the plain-JAX
step's and CPU's, its generated tokens are CPU eager's (the plain-JAX decode's
too), and the JSON it writes to $OUT holds the same figures."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "tpu.py")
# Generation: both plain-JAX decodes and one torchtpu path, at batch 2 (the
# others' first generations compile for seconds each; the smoke run makes
# them all outside CI).
ROWS = ("per_op,mlp:jax,mlp:fused,mlp:replayed,gpt:jax,gpt:fused,gpt:cpu,"
        "gpt2:jax,gpt2:fused_static,llama:jax")
DECODE = {"gpt2": ("cpu", "jax", "fused_static"), "llama": ("cpu", "jax")}


def test_tpu_script_smoke_run_fills_its_tables(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--rows", ROWS, "--batches", "2",
                           "--timeout", "200"],
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
    # Generation: every row (CPU's added, as the tokens' reference) with
    # CPU eager's tokens, in the table; plain JAX is the ratios' base.
    decode = results["decode"]
    assert {m: tuple(rows) for m, rows in decode.items()} == DECODE
    for model, modes in DECODE.items():
        for mode in modes:
            row = decode[model][mode]["batches"]["2"]
            assert "error" not in row, (model, mode, row)
            assert row["ms"] > 0 and row["first_generation_s"] > 0
            assert [len(t) for t in row["tokens"]] == [8 + 8] * 2  # prompt and new tokens
            assert mode == "cpu" or row["tokens_equal"] is True, (model, mode)
            line = next(x for x in proc.stdout.splitlines() if x.startswith(f"| {model} | 2 | {mode} |"))
            ratio = row["ms"] / decode[model]["jax"]["batches"]["2"]["ms"]
            assert f"| {row['ms']:.2f} | {ratio:.2f}x |" in line
            assert ("(reference)" if mode == "cpu" else "| yes |") in line
    fused = decode["gpt2"]["fused_static"]["batches"]["2"]
    assert fused["ops_per_token"] > 0 and fused["graphs_per_token"] >= 1
    assert fused["steady_compilations"] == 0 and fused["metrics"]["compilations"] > 0


def test_tokens_check_names_the_first_new_token_that_differs():
    spec = importlib.util.spec_from_file_location(
        "torchtpu_benchmark_tpu_decode", os.path.join(ROOT, "benchmarks", "tpu_decode.py"))
    decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decode)
    prompt = [1] * decode.SIZES[True]["prompt"]
    want = [prompt + [5, 6, 7], prompt + [8, 9, 10]]
    rows = {"cpu": {"batches": {"2": {"tokens": want}}},
            "jax": {"batches": {"2": {"tokens": [want[0], prompt + [8, 9, 11]]}}},
            "strict": {"batches": {"2": {"tokens": want}, "1": {"tokens": want}}}}
    decode.check_tokens({"gpt2": rows}, True)
    assert rows["jax"]["batches"]["2"]["tokens_equal"] == 2
    assert rows["strict"]["batches"]["2"]["tokens_equal"] is True
    assert rows["strict"]["batches"]["1"]["tokens_equal"] is None  # (no CPU tokens for it)
