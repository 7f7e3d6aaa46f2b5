"""Float32 matmul precision: torch.set_float32_matmul_precision() decides the
precision XLA multiplies float matrices at (matmuls, convolutions,
attention), in every mode and under torch.compile, read per call. Results on
the CPU platform do not differ, so the tests read the programs XLA compiled."""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import torchtpu
from torchtpu import metrics

from conftest import assert_same

# Each (way of running, setting) runs a matmul, a convolution and attention,
# at shapes of its own (so each compiles afresh), with JAX dumping the
# StableHLO of every program it compiles into its own folder.
_CHILD = textwrap.dedent("""
    import sys
    import jax
    import torch
    import torch.nn.functional as F
    import torchtpu

    def work(n):
        a = torch.randn(n, n, device="tpu")
        x, w = torch.randn(1, 2, n, n, device="tpu"), torch.randn(3, 2, 3, 3, device="tpu")
        q = torch.randn(1, 2, n, 8, device="tpu")
        return ((a @ a).sum() + F.conv2d(x, w).sum()
                + F.scaled_dot_product_attention(q, q, q).sum())

    n = 8
    for way in ("debug", "strict", "fused", "compile"):
        for setting in ("highest", "high", "medium"):
            jax.config.update("jax_dump_ir_to", f"{sys.argv[1]}/{way}-{setting}")
            torch.set_float32_matmul_precision(setting)
            torchtpu.set_eager_mode("strict" if way == "compile" else way)
            run = torch.compile(work, backend="tpu") if way == "compile" else work
            run(n).item()
            n += 1
""")

_EXPECTED = {"highest": "HIGHEST", "high": "HIGH", "medium": "DEFAULT"}


def _precisions(folder):
    """{"dot_general": [...], "convolution": [...]}: the precision of each
    float matrix product in the programs dumped into folder (DEFAULT where
    the program names none)."""
    found = {"dot_general": [], "convolution": []}
    for name in os.listdir(folder):
        for line in open(os.path.join(folder, name)):
            for op in found:
                if f"stablehlo.{op}" in line and "f32" in line:
                    m = re.search(r"precision = \[(\w+), \w+\]|precision_config = "
                                  r"\[#stablehlo<precision (\w+)>", line)
                    found[op].append((m.group(1) or m.group(2)) if m else "DEFAULT")
    return found


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ir")
    env = dict(os.environ, TORCHTPU_CACHE_DIR="off", TORCHTPU_FUSED_COMPILE="sync")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(folder)], env=env, timeout=600,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return folder


@pytest.mark.parametrize("setting", ["highest", "high", "medium"])
@pytest.mark.parametrize("way", ["debug", "strict", "fused", "compile"])
def test_compiled_programs_multiply_at_the_set_precision(dumped, way, setting):
    found = _precisions(dumped / f"{way}-{setting}")
    # A matmul and attention's two products; the convolution.
    assert len(found["dot_general"]) >= 3 and found["convolution"], found
    assert set(found["dot_general"]) == set(found["convolution"]) == {_EXPECTED[setting]}, found


@pytest.fixture
def precision():
    """Sets the float32 matmul precision for the test, then restores it."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def test_a_new_setting_compiles_new_kernels_and_the_old_one_reuses_its_own(mode, precision):
    n = {"debug": 5, "strict": 6, "fused": 7}[mode]  # (modes share kernels)
    a, b = torch.randn(n, 7), torch.randn(7, 3)
    ta, tb = a.to("tpu"), b.to("tpu")
    for _ in range(2):  # (fused mode compiles a graph the second time it meets it)
        assert_same(ta @ tb, a @ b)
    metrics.reset()
    precision("high")
    assert_same(ta @ tb, a @ b)
    assert metrics.snapshot()["compilations"] >= 1
    metrics.reset()
    precision("highest")
    assert_same(ta @ tb, a @ b)
    assert metrics.snapshot()["compilations"] == 0


def test_ops_other_than_products_do_not_key_on_the_setting(mode, precision):
    x = torch.randn(6).to("tpu")
    for _ in range(2):
        (x.exp() + 1).cpu()
    metrics.reset()
    precision("medium")
    torch.testing.assert_close((x.exp() + 1).cpu(), x.cpu().exp() + 1)
    assert metrics.snapshot()["compilations"] == 0


def test_the_default_is_full_float32_and_matches_cpu(mode):
    assert torch.get_float32_matmul_precision() == "highest"
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    assert_same(layer.to("tpu")(x.to("tpu")), layer.to("cpu")(x))
    assert torchtpu.ops.precision_setting().name == "HIGHEST"


def test_a_compile_for_a_new_setting_says_so(precision):
    a = torch.randn(3, 9).to("tpu")
    with torchtpu.eager_mode("strict"):
        (a @ a.T).cpu()
        precision("medium")
        with pytest.raises(torchtpu.RecompileError, match="float32 matmul precision 'highest' -> 'medium'"):
            with torchtpu.no_recompiles():
                (a @ a.T).cpu()


_NEWER_SPELLING = textwrap.dedent("""
    import torch, torchtpu
    from torchtpu.ops import precision_setting
    a = torch.randn(4, 4)
    t = a.to("tpu")
    seen = []
    for spell in ("torch.backends.cuda.matmul.fp32_precision = 'tf32'",
                  "torch.backends.cuda.matmul.fp32_precision = 'ieee'",
                  "torch.backends.cuda.matmul.allow_tf32 = True",
                  "torch.backends.fp32_precision = 'tf32'"):
        exec(spell)
        torch.testing.assert_close((t @ t).cpu(), a @ a)  # no error, CPU's values
        seen.append(precision_setting().name)
    print(seen)
""")


def test_pytorchs_newer_spelling_is_read_too():
    """torch.backends.*.fp32_precision (after which PyTorch's legacy getter
    raises) sets the precision as well, and matmuls keep working."""
    out = subprocess.run([sys.executable, "-c", _NEWER_SPELLING], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, TORCHTPU_CACHE_DIR="off"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['HIGH', 'HIGHEST', 'HIGH', 'HIGH']"
