"""benchmarks/tpu.py, the TPU figures' script, runs here with --smoke (tiny
sizes, JAX on CPU): each path's row is measured, its losses are the plain-JAX
step's and CPU's, its generated tokens are CPU eager's (the plain-JAX decode's
too), and the JSON it writes to $OUT holds the same figures."""
import importlib.util
import json
import os
import subprocess
import sys
import time

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


def _tpu_script():
    bench = os.path.join(ROOT, "benchmarks")
    sys.path.insert(0, bench)  # (its `import tpu_decode`)
    try:
        spec = importlib.util.spec_from_file_location("torchtpu_benchmark_tpu", SCRIPT)
        tpu = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tpu)
    finally:
        sys.path.remove(bench)
    return tpu


def test_warm_start_rows_time_a_second_process_on_the_first_ones_cache(monkeypatch):
    # (The rows' processes are faked here: a smoke run of them takes a minute.)
    tpu = _tpu_script()
    assert [(s["what"], s["mode"]) for s in tpu.plan(["gpt:warm"])] == [
        ("warm", m + "_warm") for m in tpu.WARM_MODES]
    with pytest.raises(SystemExit, match="gpt:replayed_warm"):
        tpu.plan(["gpt:replayed_warm"])
    # Steady: the first step within 1.2x of the median of the later steps.
    assert tpu.first_steady([5.0, 0.03, 0.0115, 0.01, 0.011, 0.009], 4) == (2, pytest.approx(0.0105))
    calls = []

    def child(spec, timeout, cache_dir):
        calls.append((spec, cache_dir))
        cold = len(calls) == 1
        now = time.time()
        return {"imported": now + 0.5, "opened": now + 1.0, "torchtpu_imported": now + 1.2,
                "built": now + 1.5, "uploaded": now + 2.0, "optimizer_made": now + 2.1,
                "done": [now + 4.0, now + 4.1, now + 4.2],
                "step_s": [3.0, 0.1, 0.1], "steady_step": 1, "ms": 100.0, "losses": [2.0, 1.9, 1.8],
                "compilations": 5 if cold else 0, "background_compiles": 2 if cold else 0,
                "disk_hits": 0 if cold else 7}
    monkeypatch.setattr(tpu, "run_child", child)
    row = tpu._warm_start({"what": "warm", "model": "gpt", "mode": "fused_warm", "smoke": True}, 60)
    assert [(s["what"], s["mode"]) for s, _ in calls] == [("start", "fused")] * 2
    assert calls[0][1] == calls[1][1] and not os.path.exists(calls[0][1])  # one directory, removed
    cold, warm = row["cold"], row["warm"]
    assert cold["compiled"] == 7 and warm["compiled"] == 0 and warm["disk_hits"] == 7
    assert warm["to_device_s"] == pytest.approx(1.0, abs=0.5)
    assert (warm["first_step_s"], warm["steady_s"]) == pytest.approx((3.0, 3.1), abs=1e-3)
    text = tpu.tables({"steps": {"gpt": {"fused_warm": row}}})
    line = next(x for x in text.splitlines() if x.startswith("| gpt | fused_warm |"))
    assert "| 3.1 | 7 |" in line and "| 3.00 | 0.20 / 0.30 / 0.50 / 0.10 | 3.10 | 0 | 7 | 100.00 |" in line
    calls.clear()

    def warm_one_times_out(spec, timeout, cache_dir):
        return {"error": "timed out after 60 s"} if calls else child(spec, timeout, cache_dir)
    monkeypatch.setattr(tpu, "run_child", warm_one_times_out)
    row = tpu._warm_start({"what": "warm", "model": "gpt", "mode": "strict_warm", "smoke": True}, 60)
    assert row["error"] == "warm process: timed out after 60 s" and "cold" in row
