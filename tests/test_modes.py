"""Choosing the eager mode: env var, set_eager_mode, the context manager; sync;
debug mode's NaN check."""
import os
import subprocess
import sys

import pytest
import torch

import torchtpu
from torchtpu import metrics


def _python(code, **env):
    full = dict(os.environ, TORCHTPU_CACHE_DIR="off", **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=300)


def test_env_var_selects_mode():
    code = ("import torch, torchtpu; x = torch.ones(3).to('tpu') * 2; "
            "print(torchtpu.get_eager_mode(), x.sum().item())")
    r = _python(code, TORCHTPU_EAGER_MODE="debug")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["debug", "6.0"]


def test_env_var_bad_name():
    r = _python("import torchtpu", TORCHTPU_EAGER_MODE="turbo")
    assert r.returncode != 0
    assert "ValueError" in r.stderr and "debug" in r.stderr and "strict" in r.stderr


def test_default_is_strict():
    env = {k: v for k, v in os.environ.items() if k != "TORCHTPU_EAGER_MODE"}
    env["TORCHTPU_CACHE_DIR"] = "off"
    r = subprocess.run([sys.executable, "-c", "import torchtpu; print(torchtpu.get_eager_mode())"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "strict"


def test_set_eager_mode():
    before = torchtpu.get_eager_mode()
    try:
        torchtpu.set_eager_mode("debug")
        assert torchtpu.get_eager_mode() == "debug"
        torchtpu.set_eager_mode("strict")
        assert torchtpu.get_eager_mode() == "strict"
    finally:
        torchtpu.set_eager_mode(before)


def test_context_manager_restores():
    before = torchtpu.get_eager_mode()
    x = torch.arange(4.0).to("tpu")
    with torchtpu.eager_mode("debug"):
        assert torchtpu.get_eager_mode() == "debug"
        y = x * 3
        with torchtpu.eager_mode("strict"):
            assert torchtpu.get_eager_mode() == "strict"
            z = y + 1
        assert torchtpu.get_eager_mode() == "debug"
    assert torchtpu.get_eager_mode() == before
    torch.testing.assert_close(z.cpu(), torch.arange(4.0) * 3 + 1)


def test_context_manager_restores_on_error():
    before = torchtpu.get_eager_mode()
    with pytest.raises(RuntimeError):
        with torchtpu.eager_mode("debug"):
            torch.ones(2).to("tpu") + torch.ones(3).to("tpu")
    assert torchtpu.get_eager_mode() == before


def test_values_survive_mode_switch():
    with torchtpu.eager_mode("strict"):
        a = torch.ones(3).to("tpu")
        for _ in range(5):
            a = a * 2
    with torchtpu.eager_mode("debug"):
        b = a + 1
    torch.testing.assert_close(b.cpu(), torch.full((3,), 33.0))


def test_sync(mode):
    metrics.reset()
    c = torch.zeros(16, 16).to("tpu")
    y = torch.ones(16, 16).to("tpu")
    for _ in range(10):
        c = c + y
    torchtpu.sync()
    torch.tpu.synchronize()
    assert metrics.snapshot()["syncs"] >= 1
    torch.testing.assert_close(c.cpu(), torch.full((16, 16), 10.0))


def test_metrics(mode):
    metrics.reset()
    x = torch.randn(8, 8).to("tpu")
    for _ in range(3):
        x = x * 1.5
    x.sum().item()
    snap = metrics.snapshot()
    for key in ("ops_dispatched", "compilations", "memory_cache_hits", "disk_cache_hits",
                "syncs", "cpu_fallbacks", "compile_seconds"):
        assert key in snap, key
    assert snap["ops_dispatched"] >= 4
    assert isinstance(snap["cpu_fallbacks"], dict)
    text = metrics.report()
    assert "ops_dispatched" in text and "\n" in text
    metrics.reset()
    assert metrics.snapshot()["ops_dispatched"] == 0


def test_repeated_op_does_not_recompile(mode):
    def step(x):
        for _ in range(5):
            x = x * 0.5
        torchtpu.sync()
        return x
    x = torch.randn(5, 7).to("tpu")
    torchtpu.sync()
    # The first step compiles the op (debug, strict) or the 5-op graph (fused).
    x = step(x)
    metrics.reset()
    x = step(x)
    assert metrics.snapshot()["compilations"] == 0
    assert metrics.snapshot()["memory_cache_hits"] >= 1
    torch.testing.assert_close(x.cpu().abs().max() > 0, torch.tensor(True))


def test_check_nans(monkeypatch, debug_mode):
    monkeypatch.setenv("TORCHTPU_CHECK_NANS", "1")
    x = torch.tensor([1.0, 0.0]).to("tpu")
    with pytest.raises(RuntimeError, match="div"):
        x / 0.0
    y = x + 1  # a finite result passes
    torch.testing.assert_close(y.cpu(), torch.tensor([2.0, 1.0]))


def test_changing_python_scalar_does_not_recompile(mode):
    """A learning rate that changes every step is a kernel input, not a constant."""
    x = torch.ones(4).to("tpu")
    torchtpu.sync()
    x = x * 0.5 + 0.25
    torchtpu.sync()
    metrics.reset()
    ref = torch.ones(4) * 0.5 + 0.25
    for step in range(1, 4):
        lr = 0.1 / step
        x = x * lr + 0.25
        ref = ref * lr + 0.25
        torchtpu.sync()
    assert metrics.snapshot()["compilations"] == 0
    torch.testing.assert_close(x.cpu(), ref)
