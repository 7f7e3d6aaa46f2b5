"""Shared fixtures: the eager modes to run under, and tpu-vs-CPU comparison."""
import os

import pytest
import torch

# Tests never write the user's persistent cache unless asked to.
os.environ.setdefault("TORCHTPU_CACHE_DIR", "off")

import torchtpu  # noqa: E402

# The modes every mode-parametrized test runs in.
MODES = ["debug", "strict", "fused"]


@pytest.fixture(params=MODES)
def mode(request):
    """Run the test in each eager mode; yields the mode's name."""
    with torchtpu.eager_mode(request.param):
        yield request.param
    torchtpu.sync()


@pytest.fixture
def debug_mode():
    with torchtpu.eager_mode("debug"):
        yield "debug"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def to_cpu(x):
    """tpu tensors (in any structure) -> CPU tensors; everything else as is."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu() if x.device.type == "tpu" else x.detach()
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    return x


def assert_same(tpu_value, cpu_value, **kw):
    """tpu_value (moved to CPU) equals cpu_value: values, shapes and dtypes."""
    got = to_cpu(tpu_value)
    if isinstance(cpu_value, torch.Tensor):
        assert isinstance(tpu_value, torch.Tensor) and tpu_value.device.type == "tpu", \
            f"expected a tpu tensor, got {type(tpu_value).__name__} on " \
            f"{getattr(tpu_value, 'device', None)}"
    torch.testing.assert_close(got, cpu_value, **kw)


def run_both(fn, *cpu_args):
    """fn(*args) on CPU and on tpu (args copied to tpu); returns (tpu, cpu) results."""
    tpu_args = [a.to("tpu") if isinstance(a, torch.Tensor) else a for a in cpu_args]
    cpu_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in cpu_args]
    return fn(*tpu_args), fn(*cpu_args), tpu_args, cpu_args
