"""torchtpu against PyTorch's OpInfo database, forward and backward.

Every OpInfo entry runs a bounded number of its sample inputs on CPU and on
tpu (tests/opinfo_common.py says how), for float32, int64, bool and bfloat16
where CPU supports the dtype, and float32 gradients where the op supports
autograd. Results not a clean pass are listed in tests/opinfo_expected.py;
the list is strict: an entry that starts passing fails, so it only shrinks.
Regenerate it with

    .venv/bin/python scripts/ops_report.py --all --jobs 2 \\
        --write-expected tests/opinfo_expected.py --markdown docs/ops.md

TORCHTPU_OPINFO_SAMPLES sets the samples per op (default 2, as the list was
made with).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from opinfo_common import (OPS, TOLERANCES, UNINITIALIZED_OPS, RANDOM_OPS,  # noqa: E402
                           Result, check, op_id, op_db)
from opinfo_expected import EXPECTED_FAILURES, EXPECTED_FALLBACKS  # noqa: E402
from conftest import judge_expected  # noqa: E402

SAMPLES = int(os.environ.get("TORCHTPU_OPINFO_SAMPLES", "2"))
TIMEOUT = 600  # seconds per (op, dtype, kind); a hang is a failure, not a stuck CI
DTYPES = [torch.float32, torch.int64, torch.bool, torch.bfloat16]


def _dname(dtype):
    return str(dtype).replace("torch.", "")


def _forward_params():
    for op in op_db:
        supported = op.supported_dtypes("cpu")
        for dtype in DTYPES:
            if dtype in supported:
                yield pytest.param(op, dtype, id=f"{op_id(op)}-{_dname(dtype)}")


def _backward_params():
    for op in op_db:
        if op.supports_autograd and torch.float32 in op.supported_backward_dtypes("cpu"):
            yield pytest.param(op, id=op_id(op))


FORWARD = list(_forward_params())
BACKWARD = list(_backward_params())


def judge(result):
    judge_expected((result.op, result.dtype, result.kind), result, EXPECTED_FAILURES, EXPECTED_FALLBACKS,
                   "tests/opinfo_expected.py")


def run_check(op, dtype, kind):
    """check(), in a subprocess for entries known to abort the process (an
    error on an autograd worker thread), so they stay strict without taking
    the test run down."""
    reason = EXPECTED_FAILURES.get((op_id(op), _dname(dtype), kind), "")
    if not reason.startswith("crashes the process"):
        return check(op, dtype, kind, samples=SAMPLES, timeout=TIMEOUT)
    code = ("import json, sys, torch; sys.path.insert(0, sys.argv[1]);"
            "from opinfo_common import OPS, check;"
            "r = check(OPS[sys.argv[2]], getattr(torch, sys.argv[3]), sys.argv[4], "
            "samples=int(sys.argv[5]));"
            "print('RESULT' + json.dumps(r.as_dict()))")
    proc = subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), op_id(op),
         _dname(dtype), kind, str(SAMPLES)], capture_output=True, text=True, timeout=TIMEOUT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    if proc.returncode != 0 or not lines:
        return Result(op_id(op), _dname(dtype), kind, "fail",
                      f"process crashed (exit code {proc.returncode})")
    d = json.loads(lines[-1][len("RESULT"):])
    d["fallbacks"] = tuple(d["fallbacks"])
    return Result(**d)


@pytest.mark.parametrize("op,dtype", FORWARD)
def test_forward(op, dtype):
    judge(run_check(op, dtype, "forward"))


@pytest.mark.parametrize("op", BACKWARD)
def test_backward(op):
    judge(run_check(op, torch.float32, "backward"))


def test_expected_lists_name_real_entries():
    """Every listed (op, dtype, kind) is one the tests above run."""
    real = {(op_id(p.values[0]), _dname(p.values[1]), "forward") for p in FORWARD}
    real |= {(op_id(p.values[0]), "float32", "backward") for p in BACKWARD}
    stale = sorted((set(EXPECTED_FAILURES) | set(EXPECTED_FALLBACKS)) - real)
    assert not stale, f"not an OpInfo entry of this torch: {stale}"
    assert not set(EXPECTED_FAILURES) & set(EXPECTED_FALLBACKS)
    assert all(EXPECTED_FAILURES.values()), "every expected failure needs a reason"


def test_tolerance_table():
    for (oid, kind), (rtol, atol, reason) in TOLERANCES.items():
        assert oid in OPS and kind in ("forward", "backward"), oid
        assert reason and rtol < 1e-2 and atol < 1e-2, oid
    assert RANDOM_OPS.isdisjoint(UNINITIALIZED_OPS)


# ---- semantics the OpInfo samples do not pin down on their own --------------

def tpu(x):
    return x.to("tpu")


@pytest.mark.parametrize("make,dtype", [
    (lambda: tpu(torch.tensor([1, 2], dtype=torch.int64)) + 2.5, torch.float32),
    (lambda: tpu(torch.tensor([2**40 + 1])) + 1, torch.int64),
    (lambda: tpu(torch.tensor([1, 2], dtype=torch.int32)) + tpu(torch.tensor(2**31 + 5)), torch.int32),
    (lambda: tpu(torch.ones(2)) * tpu(torch.tensor(2.0, dtype=torch.float64)), torch.float32),
    (lambda: tpu(torch.ones(2, dtype=torch.float64)) * 3, torch.float64),
    (lambda: tpu(torch.tensor([True, False])) + True, torch.bool),
    (lambda: tpu(torch.tensor([True, False])) * 2, torch.int64),
    (lambda: tpu(torch.tensor([1, 2], dtype=torch.uint8)) + tpu(torch.tensor([1], dtype=torch.int8)), torch.int16),
    (lambda: tpu(torch.ones(2, dtype=torch.bfloat16)) + tpu(torch.ones(2, dtype=torch.float16)), torch.float32),
    (lambda: torch.argmax(tpu(torch.tensor([1.0, 3.0, 2.0]))), torch.int64),
    (lambda: torch.max(tpu(torch.tensor([[1.0, 3.0]])), 1).indices, torch.int64),
    (lambda: tpu(torch.tensor([7, 2])) / 2, torch.float32),
    (lambda: tpu(torch.tensor([7, -7])) // 2, torch.int64),
    (lambda: tpu(torch.ones(2, dtype=torch.float64)).sum(), torch.float64),
    (lambda: tpu(torch.tensor([1, 2])).sum(), torch.int64),
    (lambda: tpu(torch.tensor([True, True])).sum(), torch.int64),
], ids=["int+float", "int64-exact", "int32+0dim-int64", "f32*0dim-f64", "f64*int", "bool+bool",
        "bool*int", "uint8+int8", "bf16+fp16", "argmax", "max-indices", "int/int", "int//int",
        "f64-sum", "int-sum", "bool-sum"])
def test_result_dtypes(make, dtype):
    result = make()
    assert result.device.type == "tpu"
    assert result.dtype == dtype
    cpu_result = eval_on_cpu(make)
    torch.testing.assert_close(result.cpu(), cpu_result)


def eval_on_cpu(make):
    """make() with tpu() as the identity: the same expression on CPU."""
    global tpu
    saved = tpu
    tpu = lambda x: x  # noqa: E731
    try:
        return make()
    finally:
        tpu = saved


def test_zero_dim_and_python_scalars():
    a = torch.tensor([[1.5, -2.0], [3.0, 4.0]])
    s = torch.tensor(2.0)  # a 0-dim CPU tensor mixes with tpu tensors, as with cuda
    for f in [lambda x, y: x * y, lambda x, y: y - x, lambda x, y: torch.maximum(x, y),
              lambda x, y: torch.where(x > 0, x, y), lambda x, y: x ** 2 + y]:
        torch.testing.assert_close(f(tpu(a), s).cpu(), f(a, s))
        torch.testing.assert_close(f(tpu(a), tpu(s)).cpu(), f(a, s))
    z = tpu(torch.tensor(3))
    assert (z + 1).shape == () and (z + 1).dtype == torch.int64
    assert (z * 1.5).dtype == torch.float32
    assert z.item() == 3 and isinstance(z.item(), int)
    torch.testing.assert_close((tpu(a)[0, 1] * 2).cpu(), a[0, 1] * 2)


def test_non_contiguous_inputs():
    a = torch.randn(4, 6)
    b = torch.randn(6, 4)
    ta, tb = tpu(a), tpu(b)
    torch.testing.assert_close((ta.t() @ tb.t()).cpu(), a.t() @ b.t())
    torch.testing.assert_close((ta[:, ::2] + tb[::2].t()).cpu(), a[:, ::2] + b[::2].t())
    torch.testing.assert_close((ta[1:3].expand(2, 2, 6) * ta[0]).cpu(), a[1:3].expand(2, 2, 6) * a[0])
    torch.testing.assert_close(ta.t().contiguous().cpu(), a.t().contiguous())
    torch.testing.assert_close(ta.t().sum(0).cpu(), a.t().sum(0))


@pytest.mark.parametrize("name", ["add_", "mul_", "clamp_", "sub_", "div_", "neg_", "zero_", "fill_"])
def test_inplace_mutates_all_views(name):
    base_cpu = torch.randn(3, 4)
    args = {"add_": (1.5,), "mul_": (2.0,), "clamp_": (-0.5, 0.5), "sub_": (torch.ones(2),),
            "div_": (4.0,), "neg_": (), "zero_": (), "fill_": (7.0,)}[name]
    t = tpu(base_cpu.clone())
    view = t[1:, ::2]          # strided, offset view
    other = t.t()              # another view of the same storage
    targs = tuple(tpu(a) if isinstance(a, torch.Tensor) else a for a in args)
    out = getattr(view, name)(*targs)
    assert out is view
    expected = base_cpu.clone()
    getattr(expected[1:, ::2], name)(*args)
    torch.testing.assert_close(t.cpu(), expected)
    torch.testing.assert_close(view.cpu(), expected[1:, ::2])
    torch.testing.assert_close(other.cpu(), expected.t())


def test_out_variants_write_through_views():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    buf = tpu(torch.zeros(2, 3, 4))
    alias = buf.view(6, 4)
    out = buf[1]
    r = torch.add(tpu(a), tpu(b), alpha=2, out=out)
    assert r is out
    torch.testing.assert_close(alias[3:].cpu(), a + 2 * b)
    torch.testing.assert_close(buf[0].cpu(), torch.zeros(3, 4))
    idx = tpu(torch.zeros(3, dtype=torch.int64))
    vals = buf[0, :, 0]
    torch.max(tpu(a), 1, out=(vals, idx))
    torch.testing.assert_close(buf[0, :, 0].cpu(), a.max(1).values)
    torch.testing.assert_close(idx.cpu(), a.max(1).indices)
    with pytest.raises(RuntimeError):
        torch.mul(tpu(torch.ones(2)), 2.5, out=tpu(torch.zeros(2, dtype=torch.int64)))
