"""benchmarks/gpu.py, the GPU figures' script, runs here with --smoke (tiny
sizes, JAX on CPU, no PyTorch CUDA rows): every torchtpu row of its tables is
measured, and the JSON it writes to $OUT holds the same figures."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu.py")


def _row(text, first_cell):
    rows = [line for line in text.splitlines() if line.startswith(f"| {first_cell}")]
    assert len(rows) == 1, (first_cell, text)
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def test_gpu_script_smoke_run_fills_its_tables(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--timeout", "240"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "Not measured" not in text, text
    for mode in ("PyTorch CPU eager", "torchtpu fused", "torchtpu strict", "torchtpu debug"):
        cells = _row(text, mode)
        assert float(cells[1]) > 0 and float(cells[2]) > 0, cells
    # No CUDA rows in a smoke run.
    assert not [line for line in text.splitlines() if line.startswith("| PyTorch CUDA")]
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert results["env"]["platform"] == "cpu"
    assert results["markdown"] == text.strip()
    for model, first_cell in (("mlp", "MLP"), ("gpt", "GPT")):
        cells = _row(text, first_cell)
        steps = results["steps"][model]
        # strict, fused, replayed, compiled (and the MLP's jax.jit step) measured.
        for i, mode in enumerate(("strict", "fused", "replayed", "compiled", "jax_jit"), 1):
            if mode == "jax_jit" and model == "gpt":
                assert cells[i] == "—"
                continue
            assert steps[mode]["ms"] > 0, (model, mode, steps[mode])
            assert abs(float(cells[i]) - steps[mode]["ms"]) <= 0.0051
        assert cells[6] == cells[7] == "—"  # PyTorch CUDA eager and Inductor
        # fused at float32 matmul precision "high", beside "highest"'s fused.
        assert steps["fused_high"]["ms"] > 0
        assert abs(float(cells[8]) - steps["fused_high"]["ms"]) <= 0.0051
        assert cells[9] == "—"  # CUDA eager at "high"
        # Every parameter and optimizer-state tensor updated in its own buffer.
        kept, total = steps["replayed"]["in_place"].split(" of ")
        assert kept == total and int(total) > 0
        assert cells[-1] == steps["replayed"]["in_place"]
    # checkpoint_memory's rows for fused mode, both ways, with equal losses.
    fused = [line for line in text.splitlines() if line.startswith("| fused | GPT")]
    assert len(fused) == 2 and all(int(r.split("|")[4]) > 0 for r in fused), text
    assert fused[0].split("|")[10] == fused[1].split("|")[10], fused


def test_pytorch_rows_run_without_torchtpu():
    """PyTorch's own rows (CUDA eager, Inductor) train the same models in a
    process that never imports torchtpu: with a PrivateUse1 backend
    registered, PyTorch's autograd fails any CUDA backward (pytorch#161129).
    Here on CPU: the models' step trains, and torchtpu stays unimported."""
    code = ("import sys; sys.path[:0] = [sys.argv[1]]\n"
            "import functools, workloads\n"
            "make = functools.partial(workloads.mlp, (8, 16, 16, 3))\n"
            "batch = functools.partial(workloads.mlp_batch, 4, 8, 3)\n"
            "run = workloads.torch_step_fn(make, batch, 'cpu')\n"
            "losses = [run() for _ in range(3)]\n"
            "assert losses[2] < losses[0], losses\n"
            "assert 'torchtpu' not in sys.modules and 'jax' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "benchmarks")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_rows_pick_figures_in_order():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    specs = gpu.plan(smoke=False, cuda=True)
    chosen = gpu._chosen(specs, ["gpt:inductor", "mlp", "per_op"])
    assert [(s.get("model"), s.get("mode")) for s in chosen] == (
        [("gpt", "inductor")] + [("mlp", m) for m in gpu.TPU_MODES + ("jax_jit",) + gpu.CUDA_MODES]
        + [(None, None)])
    try:
        gpu._chosen(specs, ["gpt:nonesuch"])
    except SystemExit as e:
        assert "gpt:nonesuch" in str(e)
    else:
        raise AssertionError("an unknown figure was accepted")
