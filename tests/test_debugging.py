"""Debugging as on CUDA: errors raised as PyTorch raises them, at the user's
line, in every eager mode; debug-mode checks (NaN/Inf, index bounds); the
debug advisor (TORCHTPU_DEBUG=1)."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
import torch

import torchtpu
from torchtpu import advisor, errors, metrics
from torchtpu.ops import LOWERINGS

from conftest import assert_at_line

ALL_MODES = ["debug", "strict", "fused"]


@pytest.fixture(params=ALL_MODES)
def any_mode(request):
    with torchtpu.eager_mode(request.param):
        yield request.param


# ---- test-only ops whose lowerings fail in known ways ----------------------

torch.library.define("ttpu_test::bad_trace", "(Tensor x) -> Tensor")
torch.library.define("ttpu_test::value_branch", "(Tensor x) -> Tensor")
torch.library.define("ttpu_test::host_fail", "(Tensor x) -> Tensor")
for _name in ("bad_trace", "value_branch", "host_fail"):
    torch.library.register_fake(f"ttpu_test::{_name}")(lambda x: torch.empty_like(x))


def _bad_trace(x):
    return jnp.reshape(x, (x.size + 1,))  # a lowering bug: JAX raises TypeError


def _value_branch(x):
    if x.sum() > 0:  # branches on a traced value
        return x
    return -x


def _host_fail(x):
    def fail(v):
        raise ValueError("host check failed")
    jax.debug.callback(fail, x)
    return x * 2


LOWERINGS[torch.ops.ttpu_test.bad_trace.default] = _bad_trace
LOWERINGS[torch.ops.ttpu_test.value_branch.default] = _value_branch
LOWERINGS[torch.ops.ttpu_test.host_fail.default] = _host_fail


# ---- helpers ---------------------------------------------------------------

# ---- errors at the user's line, in every mode ------------------------------

def test_shape_error(any_mode):
    x, y = torch.ones(2, 3, device="tpu"), torch.ones(3, 2, device="tpu")
    with pytest.raises(RuntimeError) as err:
        x + y
    # PyTorch's meta kernel's own message (its wording differs from CPU's).
    assert "broadcast" in str(err.value) or "must match" in str(err.value)
    assert_at_line(err, "x + y", __file__)


def test_matmul_shape_error(any_mode):
    a = torch.ones(2, 3, device="tpu")
    with pytest.raises(RuntimeError, match=r"cannot be multiplied|same reduction dim") as err:
        a @ a
    assert_at_line(err, "a @ a", __file__)


def test_dtype_error(any_mode):
    i = torch.ones(3, dtype=torch.long, device="tpu")
    f = torch.ones(3, device="tpu")
    with pytest.raises(RuntimeError, match="can't be cast|not possible") as err:
        i.add_(f)
    assert_at_line(err, "i.add_(f)", __file__)


def test_error_inside_nn_module(any_mode):
    model = torch.nn.Linear(4, 2).to("tpu")
    with pytest.raises(RuntimeError, match=r"cannot be multiplied|same reduction dim") as err:
        model(torch.ones(3, 5, device="tpu"))
    # torch.nn frames sit between the test and the op: hidden as well.
    assert_at_line(err, "model(torch.ones(3, 5", __file__)


def test_lowering_trace_error(any_mode):
    x = torch.ones(3, device="tpu")
    with pytest.raises(TypeError) as err:
        torch.ops.ttpu_test.bad_trace(x)
    msg = str(err.value)
    assert "ttpu_test.bad_trace.default(float32[3])" in msg
    assert "reshape" in msg and "torchtpu bug" in msg
    assert "\n" not in msg
    assert_at_line(err, "torch.ops.ttpu_test.bad_trace(x)", __file__)


def test_lowering_depends_on_values(any_mode):
    x = torch.ones(2, 2, dtype=torch.float64, device="tpu")
    with pytest.raises(RuntimeError, match="depends on tensor values") as err:
        torch.ops.ttpu_test.value_branch(x)
    assert "ttpu_test.value_branch.default(float64[2, 2])" in str(err.value)
    assert_at_line(err, "torch.ops.ttpu_test.value_branch(x)", __file__)


def test_device_runtime_error(any_mode):
    x = torch.ones(3, device="tpu")
    with pytest.raises(RuntimeError) as err:
        y = torch.ops.ttpu_test.host_fail(x)
        y.cpu()  # fused mode runs the op here
    msg = str(err.value)
    assert "ttpu_test.host_fail.default" in msg
    assert "ValueError: host check failed" in msg
    if any_mode == "fused":
        assert "a fused graph of 2 ops (aten.ones.default, ttpu_test.host_fail.default)" in msg
        assert_at_line(err, "y.cpu()", __file__)
    else:
        assert "failed on the device" in msg
        assert_at_line(err, "y = torch.ops.ttpu_test.host_fail(x)", __file__)


def test_full_traceback_keeps_frames(monkeypatch):
    monkeypatch.setenv("TORCHTPU_FULL_TRACEBACK", "1")
    x = torch.ones(3, device="tpu")
    with pytest.raises(TypeError) as err:
        torch.ops.ttpu_test.bad_trace(x)
    paths = [str(e.path) for e in err.traceback]
    assert any(os.path.join("torchtpu", "dispatch", "") in p for p in paths)
    assert any(os.sep + "jax" + os.sep in p for p in paths)


def test_uncaught_error_prints_at_user_line(tmp_path):
    """What a script's user sees: the traceback ends at their line."""
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent("""\
        import torch, torchtpu
        x = torch.ones(3, device="tpu")
        y = torch.ones(4, device="tpu")
        z = x * y
    """))
    env = dict(os.environ, TORCHTPU_CACHE_DIR="off", TORCHTPU_DEBUG="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 1
    tb = proc.stderr[proc.stderr.index("Traceback"):]
    frames = [line for line in tb.splitlines() if line.strip().startswith("File ")]
    assert frames == [f'  File "{script}", line 4, in <module>'], tb
    assert "RuntimeError: The size of tensor a (3) must match the size of tensor b (4)" in tb \
        or "RuntimeError: Attempting to broadcast" in tb
    # TORCHTPU_DEBUG=1: the advisor speaks at exit.
    assert "torchtpu debug advisor" in proc.stderr


# ---- debug-mode checks -----------------------------------------------------

def test_nan_check_debug(monkeypatch, debug_mode):
    monkeypatch.setenv("TORCHTPU_CHECK_NANS", "1")
    x = torch.tensor([1.0, -1.0], device="tpu")
    y = x * 2  # finite: no error
    with pytest.raises(RuntimeError) as err:
        z = torch.log(y)
    msg = str(err.value)
    assert "aten.log.default produced NaN or Inf" in msg
    assert f"{__file__}:" in msg
    assert_at_line(err, "z = torch.log(y)", __file__)


@pytest.mark.parametrize("mode_name", ["strict", "fused"])
def test_nan_check_names_issuing_line(mode_name):
    torchtpu.set_check_nans(True)
    try:
        with torchtpu.eager_mode(mode_name):
            x = torch.tensor([4.0, -1.0], device="tpu")
            y = x * 2
            line = sys._getframe().f_lineno + 1
            z = torch.sqrt(y)
            w = z + 1
            with pytest.raises(RuntimeError) as err:
                w.cpu()  # fused mode finds the NaN here, at the flush
                raise AssertionError("no NaN check")  # strict raised above
    except RuntimeError as e:  # strict mode: raised at the sqrt itself
        assert mode_name == "strict"
        err = None
        msg = str(e)
    finally:
        torchtpu.set_check_nans(False)
    if err is not None:
        assert mode_name == "fused"
        msg = str(err.value)
    assert "aten.sqrt.default produced NaN or Inf" in msg
    assert f"{__file__}:{line}" in msg


@pytest.mark.parametrize("mode_name", ["debug", "strict", "fused"])
def test_nan_check_in_a_backward_pass_raises_from_backward(mode_name):
    """A NaN found in a backward op raises from backward() at the user's
    line (fused mode: at the flush), naming the op, and the process goes on."""
    torchtpu.set_check_nans(True)
    try:
        with torchtpu.eager_mode(mode_name):
            x = torch.tensor([0.0, 4.0], device="tpu", requires_grad=True)
            y = torch.sqrt(x)  # its gradient at 0 is inf
            with pytest.raises(RuntimeError, match="aten.div.Tensor produced NaN or Inf") as err:
                y.sum().backward()
                x.grad.cpu()  # fused mode checks here, at the flush
                raise AssertionError("no NaN check")
            line = "x.grad.cpu()" if mode_name == "fused" else "y.sum().backward()"
            assert_at_line(err, line, __file__)
    finally:
        torchtpu.set_check_nans(False)
    x.grad = None
    torch.sqrt(x).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), torch.tensor([float("inf"), 0.25]))


def _cpu_error(fn, *args):
    with pytest.raises(Exception) as err:
        fn(*args)
    return err


INDEXING = [
    ("index", lambda x, i: x[i]),
    ("index_put", lambda x, i: x.index_put_((i,), torch.tensor(1.0, device=x.device))),
    ("setitem", lambda x, i: (x.__setitem__(i, 0.0), x)[1]),
    ("gather", lambda x, i: torch.gather(x, 0, i)),
    ("scatter", lambda x, i: x.scatter(0, i, 1.0)),
    ("scatter_add", lambda x, i: x.scatter_add(0, i, torch.ones(i.shape, device=x.device))),
    ("index_select", lambda x, i: x.index_select(0, i)),
    ("index_add", lambda x, i: x.index_add(0, i, torch.ones(i.shape, device=x.device))),
    ("embedding", lambda x, i: torch.nn.functional.embedding(i, x.reshape(5, 1))),
    ("take", lambda x, i: torch.take(x, i)),
]


@pytest.mark.parametrize("name,fn", INDEXING, ids=[n for n, _ in INDEXING])
def test_index_bounds_debug(debug_mode, name, fn):
    cpu_x, cpu_i = torch.arange(5.0), torch.tensor([1, 10, 12])
    cpu = _cpu_error(fn, cpu_x, cpu_i)
    x, i = cpu_x.to("tpu"), cpu_i.to("tpu")
    with pytest.raises(cpu.type) as err:
        fn(x, i)
    assert "10" in str(err.value) and "out of" in str(err.value)
    if name in ("index", "gather", "scatter", "index_select", "embedding"):
        assert "index 10 is out of bounds for dimension 0 with size 5" in str(err.value)
    assert_at_line(err, f"(\"{name}\", lambda x, i:", __file__)  # the lambda is the user code
    # In range: no error, same values as CPU.
    ok = torch.tensor([4, 0, 2])
    torch.testing.assert_close(fn(torch.arange(5.0).to("tpu"), ok.to("tpu")).cpu(),
                               fn(torch.arange(5.0), ok))


def test_index_bounds_negative_and_2d(debug_mode):
    x = torch.zeros(2, 3, device="tpu")
    with pytest.raises(IndexError, match="index -7 is out of bounds for dimension 0 with size 2"):
        x[torch.tensor([-7], device="tpu")]
    with pytest.raises(IndexError, match="index 3 is out of bounds for dimension 1 with size 3"):
        x[:, torch.tensor([0, 3])]
    assert x[torch.tensor([-1])].shape == (1, 3)  # negative in range is fine


# ---- the debug advisor -----------------------------------------------------

def test_advisor_reports_fallback_churn_and_syncs(monkeypatch):
    monkeypatch.setattr(advisor, "ON", True)
    advisor._install()
    metrics.reset()
    with torchtpu.eager_mode("strict"):
        model = torch.nn.Linear(3, 1).to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 3).to("tpu")
        sym = (torch.eye(3) * 2).to(torch.complex64).to("tpu")
        for step in range(4):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            value = loss.item()  # a sync point every step
            item_line = sys._getframe().f_lineno - 1
            ldl = torch.linalg.ldl_factor(sym)  # a CPU fallback (complex)
            fallback_line = sys._getframe().f_lineno - 1
        for n in range(advisor.CHURN_KERNELS + 2):  # a recompilation storm
            torch.ones(7, 1000 + n, device="tpu").tanh()
    assert value == value and ldl.LD.shape == (3, 3)
    text = advisor.summary()
    assert "aten.linalg_ldl_factor_ex.default: 4 calls, first at test_debugging.py:" + str(fallback_line) in text
    assert "aten.tanh.default: 10 compilations" in text
    assert "Sync points:" in text and "in 4 training steps" in text
    assert f"test_debugging.py:{item_line}: item x4 (1.0 per step)" in text
    assert "Time: compile" in text
    # metrics.report() carries the summary, as text and as HTML.
    report = metrics.report()
    assert "torchtpu debug advisor" in report
    assert "aten.tanh.default" in report._repr_html_()
    metrics.reset()
    assert "nothing to report" in advisor.summary()


def test_each_sync_is_counted_once_with_its_reason(mode):
    """metrics' sync count and its per-line reasons agree: each host read and
    each wait for all work is one sync, named by its caller."""
    x = torch.arange(6.0).to("tpu") * 2
    metrics.reset()
    assert x.sum().item() == 30.0
    assert "device='tpu:0'" in repr(x)
    torch.testing.assert_close(x.cpu(), torch.arange(6.0) * 2)
    torchtpu.sync()
    reasons = sorted(reason for (_, reason), (n, _) in metrics.M.sync_sites.items() for _ in range(n))
    assert reasons == ["cpu", "item", "print", "sync"]
    assert metrics.snapshot()["syncs"] == 4
    metrics.reset()


def test_advisor_does_not_call_building_a_model_churn(monkeypatch):
    """A model of many parameter shapes and its Adam state compile one
    kernel per shape, once, before and in the first step: not churn."""
    monkeypatch.setattr(advisor, "ON", True)
    metrics.reset()
    with torchtpu.eager_mode("strict"):
        widths = [3 + i for i in range(advisor.CHURN_KERNELS + 2)]
        model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]).to("tpu")
        opt = torch.optim.Adam(model.parameters())
        x = torch.randn(2, widths[0]).to("tpu")
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    assert metrics.M.steps == 3
    assert "Shape churn" not in advisor.summary()
    metrics.reset()


def test_advisor_off_adds_nothing(monkeypatch):
    monkeypatch.setattr(advisor, "ON", False)
    assert "advisor" not in metrics.report()
    assert "<table>" in metrics.report()._repr_html_()


def test_summary_is_five_lines_of_the_first_figures():
    metrics.reset()
    x = torch.arange(6.0, device="tpu").reshape(2, 3)
    y = (x * 2).sum().item()
    assert y == 30.0
    snap = metrics.snapshot()
    lines = metrics.summary().splitlines()
    assert len(lines) == 5
    assert lines[0] == f"torchtpu: {snap['ops_dispatched']} ops dispatched"
    assert lines[1].startswith(f"  compilations: {snap['compilations']} (")
    assert lines[2] == (f"  cache hits: {snap['memory_cache_hits']} in memory, "
                        f"{snap['disk_cache_hits']} from disk")
    assert lines[3] == f"  syncs (host reads of device values): {snap['syncs']}"
    assert lines[4] == "  CPU fallbacks: none"
    metrics.M.cpu_fallbacks["aten.foo.default"] += 3
    assert metrics.summary().splitlines()[4] == "  CPU fallbacks: aten.foo.default x3"
    metrics.reset()

