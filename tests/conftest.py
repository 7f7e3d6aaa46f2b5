"""Shared fixtures: the eager modes to run under, and tpu-vs-CPU comparison."""
import json
import os

import pytest
import torch

# Tests never write the user's persistent cache unless asked to.
os.environ.setdefault("TORCHTPU_CACHE_DIR", "off")
# A child process that aborts or crashes prints every thread's Python stack
# (in the log a failing test shows), not only the C++ runtime's last line.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# Two devices, as a TPU host has several chips (on CPU, XLA's host devices):
# tests that name no device run on tpu:0; tests/test_devices.py uses tpu:1.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        filter(None, [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=2"]))

import torchtpu  # noqa: E402
import jax  # noqa: E402

# On a TPU machine one process holds the chip: this one. The children tests
# start (crash paths, fresh processes, ranks of a launch) run on JAX's CPU
# platform, as they do on a machine without a TPU.
ON_TPU = jax.default_backend() == "tpu"
if ON_TPU:
    os.environ["JAX_PLATFORMS"] = "cpu"

# The chip's float32 accuracy per op family, measured on it against float64
# by scripts/tpu_accuracy.py (tests/tpu_accuracy.json; docs/tpu.md's table):
# the largest error relative to |exact| + 1e-5, the form a test's atol and
# rtol take. A TPU evaluates exp, log, tanh and the rest with fewer
# correct bits than CPU's libm (90 to 2000 ulps against under 1).
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_accuracy.json")) as _f:
    TPU_ACCURACY = {row["op"]: row["device_rel"] for row in json.load(_f)["rows"]}
# The families a training step or a loss of the tests goes through.
STEP_FAMILIES = ("exp", "log", "tanh", "sigmoid", "softmax", "logsumexp", "cross_entropy",
                 "layer_norm", "matmul")


def platform_error(*families):
    """The largest measured error of these op families on the platform the
    tests run on: the chip's on a TPU, 0 on the CPU platform (CPU's math)."""
    return max((TPU_ACCURACY[f] for f in families), default=0.0) if ON_TPU else 0.0


def platform_tol(rtol, atol, families=STEP_FAMILIES):
    """A whole computation's tolerance (a training step's parameters, a
    loss) on this platform: on a TPU, the largest error of the families it
    goes through is added to both, as a value computed through them carries
    it; unchanged on the CPU platform. A wrong value is still far outside."""
    e = platform_error(*families)
    return {"rtol": rtol + e, "atol": atol + e}


# The modes every mode-parametrized test runs in.
MODES = ["debug", "strict", "fused"]


# The files that take longest, longest first (measured with --durations=0):
# `make test` runs each file on one worker (--dist loadfile) in this order,
# so the long ones start first and the two workers finish together.
SLOWEST_FIRST = [
    "test_opinfo.py", "test_module_db.py", "test_cache.py", "test_ops_nn.py",
    "test_benchmarks_gpu_script.py", "test_ops_reduction.py", "test_ops_pointwise.py",
    "test_compile.py", "test_training.py", "test_hf.py", "test_graphs.py", "test_recurrent.py",
    "test_ops_linalg.py", "test_generate.py", "test_fsdp_tp.py", "test_ops_indexing.py",
    "test_distributed_xla.py", "test_distributed_hosts.py", "test_flex_attention.py",
    "test_buckets.py", "test_buckets_hf.py",
]


TPU_TIER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_tier.txt")


def tpu_tier_entries():
    """The node ids tests/tpu_tier.txt lists (a file, a test, or one case)."""
    with open(TPU_TIER) as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]


def pytest_addoption(parser):
    parser.addoption("--tpu-tier", action="store_true",
                     help="run only the TPU tier listed in tests/tpu_tier.txt")


def _in_tier(nodeid, entry):
    return nodeid == entry or nodeid.startswith(entry + ("::" if entry.endswith(".py") else "["))


def pytest_collection_modifyitems(config, items):
    if config.getoption("--tpu-tier"):
        entries = tpu_tier_entries()
        kept = [item for item in items if any(_in_tier(item.nodeid, e) for e in entries)]
        unmatched = [e for e in entries if not any(_in_tier(item.nodeid, e) for item in kept)]
        if unmatched:
            raise pytest.UsageError(f"tests/tpu_tier.txt names tests that do not exist: {unmatched}")
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
        return
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep their order


@pytest.fixture(params=MODES)
def mode(request):
    """Run the test in each eager mode; yields the mode's name."""
    with torchtpu.eager_mode(request.param):
        yield request.param
    torchtpu.sync()


@pytest.fixture
def fresh_kernels():
    """The in-memory kernels dropped, as in a fresh process, for a test that
    counts the fused graphs compiled: fused mode tiers a small graph whose
    ops' kernels are all compiled (another test's, say) rather than
    compiling it at once."""
    torchtpu.cache.clear()


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate's per-process state reset before and after the test."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def debug_mode():
    with torchtpu.eager_mode("debug"):
        yield "debug"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fresh_flush_sites():
    """Each test starts fused mode's churn guard afresh: it counts new graphs
    per flush line, and lines shared by tests (a helper's) would otherwise
    carry earlier tests' graphs into this one's count."""
    torchtpu.modes.forget_flush_sites()
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


def make(dtype, shape=(3, 4), seed=0, low=-5, high=6):
    """A reproducible CPU tensor: normal floats/complex, ints in [low, high)
    (from 0 for unsigned), random bools."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(0 if dtype == torch.uint8 else low, high, shape, generator=g, dtype=dtype)


def compare(fn, *args, grad=True, atol=None, rtol=None, fallback_ok=False, allowed_fallbacks=(),
            families=()):
    """fn on CPU and tpu: outputs, and the gradients of every float input
    through a fixed random weighting of the outputs; unless fallback_ok,
    nothing but allowed_fallbacks may run on the CPU fallback. Where tpu and
    CPU differ beyond the tolerance, tpu passes only if it is as close to the
    exact (float64) result as CPU is (assert_as_accurate; families: the op
    families fn goes through, whose measured error a TPU may add)."""
    before = dict(torchtpu.metrics.M.cpu_fallbacks)
    cpu = [a.detach().clone().requires_grad_(grad and a.is_floating_point())
           if isinstance(a, torch.Tensor) else a for a in args]
    dev = [a.detach().to("tpu").requires_grad_(grad and a.is_floating_point())
           if isinstance(a, torch.Tensor) else a for a in args]
    exact = [a.detach().double().requires_grad_(grad) if isinstance(a, torch.Tensor) and a.is_floating_point()
             else a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
    out_c, out_d = fn(*cpu), fn(*dev)
    tol = {} if atol is None else {"atol": atol, "rtol": rtol}
    assert_as_accurate(out_d, out_c, lambda: fn(*exact), families, **tol)
    outs_c = out_c if isinstance(out_c, (tuple, list)) else [out_c]
    outs_d = out_d if isinstance(out_d, (tuple, list)) else [out_d]
    pairs = [(c, d) for c, d in zip(outs_c, outs_d)
             if isinstance(c, torch.Tensor) and c.requires_grad]
    if pairs:
        ws = [torch.randn(c.shape, dtype=c.dtype) for c, _ in pairs]
        sum((c * w).sum() for (c, _), w in zip(pairs, ws)).backward()
        sum((d * w.to("tpu")).sum() for (_, d), w in zip(pairs, ws)).backward()
        exact_grads = []

        def exact_grad(i):
            if not exact_grads:
                out = fn(*exact)
                outs = out if isinstance(out, (tuple, list)) else [out]
                exact_grads.append(torch.autograd.grad(
                    sum((o * w.double()).sum() for o, w in zip(
                        [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad], ws)),
                    [e for e in exact if isinstance(e, torch.Tensor) and e.requires_grad],
                    allow_unused=True))
            return exact_grads[0][i]
        float_inputs = [(c, d) for c, d in zip(cpu, dev) if isinstance(c, torch.Tensor) and c.requires_grad]
        for i, (c, d) in enumerate(float_inputs):
            assert_as_accurate(d.grad, c.grad, lambda i=i: exact_grad(i), families, **tol)
    if not fallback_ok:
        after = dict(torchtpu.metrics.M.cpu_fallbacks)
        for name in allowed_fallbacks:
            after.pop(name, None)
            before.pop(name, None)
        assert after == before, "ran on the CPU fallback"
    return out_d


def _is_float32(x):
    return isinstance(x, torch.Tensor) and x.dtype == torch.float32


def assert_as_accurate(tpu_value, cpu_value, exact, families=(), **kw):
    """assert_same(tpu_value, cpu_value), or else tpu_value is no farther
    from the exact result (exact(): the same computation in float64, or None)
    than cpu_value is, within the same tolerance: CPU's kernels round
    differently from machine to machine (their summation order), so where
    CPU itself is off by more than the tolerance (a cancellation), CPU's
    own error is the yardstick; on a TPU, the chip's measured error for the
    op families named (platform_error) is allowed beside it. Shapes and
    dtypes are always CPU's."""
    try:
        assert_same(tpu_value, cpu_value, **kw)
    except AssertionError:
        ref = exact() if all(_is_float32(c) for c in _leaves(cpu_value)) else None
        if ref is None:
            raise
        gots, wants, refs = _leaves(to_cpu(tpu_value)), _leaves(cpu_value), _leaves(ref)
        if not len(gots) == len(wants) == len(refs):
            raise  # (a missing tpu value, a None gradient, is never as accurate)
        for got, want, r in zip(gots, wants, refs):
            r = r.detach()
            rtol, atol = kw.get("rtol", 1.3e-6), kw.get("atol", 1e-5)
            cpu_error = (want.double() - r).abs()
            finite = cpu_error[cpu_error.isfinite()]
            band = ((finite.max() if finite.numel() else 0) + atol + rtol * r.abs()
                    + platform_error(*families) * (r.abs() + 1e-5))
            if got.shape != want.shape or got.dtype != want.dtype or not (
                    (got.double() - r).abs() <= band).all():
                raise


def _leaves(x):
    if isinstance(x, (tuple, list)):
        return [leaf for v in x for leaf in _leaves(v)]
    return [x] if isinstance(x, torch.Tensor) else []


def visible(excinfo):
    """The frames pytest (and IPython) show: those not marked hidden."""
    return [e for e in excinfo.traceback if not e.ishidden(excinfo)]


def assert_at_line(excinfo, source, path):
    """The last shown frame is the line of file `path` holding `source`, and
    what is left after trimming (the uncaught-exception hook) ends there too;
    no JAX or lowering frames are kept below the dispatcher."""
    from torchtpu import errors
    last = visible(excinfo)[-1]
    assert str(last.path) == path, [str(e.path) for e in visible(excinfo)]
    assert source in str(last.statement)
    tb = errors.trim(excinfo.value.__traceback__)
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_filename == path
    names = [e.path for e in excinfo.traceback]
    assert not any("/jax/" in str(n) or "/torchtpu/ops/" in str(n) for n in names)


def judge_expected(key, result, failures, fallbacks, table):
    """Pass, xfail or fail one result of a database suite (OpInfo, ModuleInfo)
    against its expected lists in `table` (strict: an expected failure that
    passes fails, so the lists only shrink). result has status, error and
    fallbacks."""
    known = failures.get(key)
    if result.status == "skip":
        if known:
            pytest.fail(f"{key} is an expected failure but has nothing to check now "
                        f"({result.error}): remove it from {table}")
        pytest.skip(result.error)
    if result.status == "fail":
        if known:
            pytest.xfail(known)
        pytest.fail(f"{key}: {result.error}", pytrace=False)
    if known:
        pytest.fail(f"{key} passes now: remove it from EXPECTED_FAILURES in {table}", pytrace=False)
    listed = fallbacks.get(key)
    listed = set(listed.split(", ")) if listed else set()
    actual = set(result.fallbacks)
    if actual != listed:
        pytest.fail(f"{key} runs {sorted(actual) or 'nothing'} on the CPU fallback, "
                    f"{table} lists {sorted(listed) or 'nothing'}: "
                    "update EXPECTED_FALLBACKS (it may only shrink)", pytrace=False)
