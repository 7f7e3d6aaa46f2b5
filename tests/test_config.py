"""torchtpu.config: how a TORCHTPU_* variable's value reads."""
import os
import subprocess
import sys

import jax
import pytest
import torch

from torchtpu import config, runtime
from torchtpu.modes import fused


@pytest.mark.parametrize("value,on", [
    ("1", True), ("yes", True), ("ON", True), ("true", True), (" 1 ", True),
    ("0", False), ("off", False), ("False", False), ("no", False), ("", False)])
def test_a_switch_is_on_unless_empty_or_off(monkeypatch, value, on):
    monkeypatch.setenv("TORCHTPU_FULL_TRACEBACK", value)
    assert config.FULL_TRACEBACK.on() is on


def test_an_unset_or_empty_variable_reads_as_its_default(monkeypatch):
    monkeypatch.delenv("TORCHTPU_INDEX_CHECKS", raising=False)
    assert config.INDEX_CHECKS.on() is True
    monkeypatch.setenv("TORCHTPU_INDEX_CHECKS", "  ")
    assert config.INDEX_CHECKS.on() is True
    monkeypatch.setenv("TORCHTPU_INDEX_CHECKS", "off")
    assert config.INDEX_CHECKS.on() is False
    assert config.TPU_PROCESS_PORT.number({}) == 8476
    assert config.TPU_PROCESS_PORT.number({"TORCHTPU_TPU_PROCESS_PORT": "9000"}) == 9000


def test_a_variable_read_at_each_use_follows_a_change_at_run_time(monkeypatch):
    monkeypatch.setenv("TORCHTPU_FUSE_MAX_OPS", "7")
    assert fused.max_ops() == 7
    monkeypatch.setenv("TORCHTPU_FUSE_MAX_OPS", "9")
    assert fused.max_ops() == 9
    monkeypatch.setenv("TORCHTPU_FUSE_MAX_OPS", "many")
    with pytest.raises(ValueError):
        fused.max_ops()


def test_one_op_kernels_compile_with_elemental_emitters_unless_xla_flags_say():
    """On the CPU platform a one-op kernel is built with XLA's elemental
    emitters (a third less compile time) and a fused graph, or a kernel of
    many arrays, with XLA's default, on the JAX versions XLA is known to
    take the option on; a user's XLA_FLAGS setting of the option wins."""
    assert runtime.PLATFORM == "cpu"
    checked = jax.__version_info__[:2] == (0, 10)  # the JAX versions the option is known to
    assert runtime.KERNEL_COMPILER_OPTIONS == ({"xla_cpu_use_fusion_emitters": False} if checked else None)
    one = jax.numpy.zeros(3)
    assert runtime.kernel_options((one, one, 2.0)) == runtime.KERNEL_COMPILER_OPTIONS
    # A _foreach op's kernel, an array per tensor, compiles as a graph does.
    assert runtime.kernel_options([[one] * 9, [one] * 9]) is None
    code = ("import torch, torchtpu; from torchtpu import runtime\n"
            "x = torch.arange(6.0, device='tpu')\n"
            "print(runtime.KERNEL_COMPILER_OPTIONS, (x.sin() * 2).sum().item())\n")
    env = dict(os.environ, TORCHTPU_CACHE_DIR="off",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=true")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    options, value = proc.stdout.split()
    assert options == "None"
    assert abs(float(value) - float((torch.arange(6.0).sin() * 2).sum())) < 1e-5
