"""How one OpInfo entry is run on CPU and on tpu and compared.

Shared by tests/test_opinfo.py and scripts/ops_report.py so the survey and
the test suite judge an op the same way.

check(op, dtype, kind, samples) -> Result with status
  "pass"      every sample matched and nothing ran on the CPU fallback,
  "fallback"  every sample matched but some aten op ran on the CPU fallback,
  "fail"      a sample raised on tpu or differed from CPU (error: one line),
  "skip"      nothing to check (no samples, dtype unsupported, CPU raised).
kind is "forward" (values, dtype, device; also a non-contiguous variant of
each sample, the in-place variant through a view and the out= variant) or
"backward" (gradients from torch.autograd.grad).
"""
import contextlib
import dataclasses
import itertools
import re
import signal
import warnings
import zlib

import torch
from torch.utils._pytree import tree_flatten, tree_map

import torchtpu
from torchtpu import metrics

from conftest import TPU_ACCURACY, platform_error

from torch.testing._internal import common_utils
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.testing._internal.opinfo import core as opinfo_core

# Each op.sample_inputs() call asks torch (twice) which unittest.TestCase
# method is running, by inspect.stack(): that reads the source line of every
# frame, about 0.2 s a call under pytest's deep stack, and finds none, as
# neither pytest nor scripts/ops_report.py runs a TestCase. Answer none at once.
for _module in (common_utils, opinfo_core):
    if hasattr(_module, "extract_test_fn"):
        _module.extract_test_fn = lambda: None

TPU = torch.device("tpu", 0)
DTYPES = {"float32": torch.float32, "int64": torch.int64, "bool": torch.bool,
          "bfloat16": torch.bfloat16, "float64": torch.float64,
          "float16": torch.float16, "int32": torch.int32}

# Ops whose values are random: checked for shape, dtype, range and
# reproducibility under torch.manual_seed, not values.
RANDOM_OPS = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal",
    "uniform", "multinomial", "randn", "randn_like", "rand_like", "randint",
    "randint_like", "randperm", "rand",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
    "nn.functional.rrelu", "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d", "svd_lowrank", "pca_lowrank",
}


def is_random(op, sample):
    """Whether this sample's values depend on the random stream: a random op,
    or multi-head attention with dropout while training (its training=False
    samples are compared by value)."""
    if op.name in RANDOM_OPS:
        return True
    if op.name == "nn.functional.multi_head_attention_forward":
        return bool(sample.kwargs.get("training")) and sample.args[9] > 0  # dropout_p
    return False


# Ops whose values are unspecified (uninitialized memory): shape and dtype only.
UNINITIALIZED_OPS = {"empty", "empty_like", "new_empty", "new_empty_strided",
                     "empty_strided", "empty_permuted"}

# Per-op tolerances for float32 where the math is ill-conditioned, so a
# different (correct) summation order or algorithm moves the result beyond
# the defaults. (op id, kind) -> (rtol, atol, reason). Keep this short.
TOLERANCES = {
    ("erfinv", "backward"): (1e-5, 1e-5,
                             "d/dx erfinv(x) = sqrt(pi)/2 exp(erfinv(x)**2) amplifies the forward's "
                             "last-bit error by 2*erfinv(x) near x = +-1 (samples reach |x| = 0.9987)"),
}

# bf16 has 8 mantissa bits: one rounding of a value is up to 2**-8 relative.
# A tpu kernel may round intermediates differently from CPU (which computes
# many bf16 ops in float32 and rounds once), so allow a couple of ulps.
BF16_TOL = dict(rtol=1.6e-2, atol=1e-2)
FP16_TOL = dict(rtol=2e-3, atol=1e-3)


def op_id(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


OPS = {op_id(op): op for op in op_db}


@dataclasses.dataclass
class Result:
    op: str
    dtype: str
    kind: str
    status: str
    error: str = ""
    fallbacks: tuple = ()
    samples: int = 0

    def as_dict(self):
        return dataclasses.asdict(self)


class SampleTimeout(Exception):
    pass


class Failure(Exception):
    """A failure in one of the extra checks; the message says which."""


@contextlib.contextmanager
def time_limit(seconds):
    """Bound one op's check (SIGALRM: main thread only, else no limit)."""
    if not seconds:
        yield
        return
    try:
        old = signal.signal(signal.SIGALRM, _alarm)
    except ValueError:
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _alarm(signum, frame):
    raise SampleTimeout("timed out")


# ---- moving samples --------------------------------------------------------

def _is_cpu_device(v):
    return (isinstance(v, str) and v == "cpu") or (isinstance(v, torch.device) and v.type == "cpu")


def _fix_kwargs(kwargs):
    return {k: ("tpu" if k == "device" and _is_cpu_device(v) else v) for k, v in kwargs.items()}


def _fix_args(args):
    # A target device given positionally (Tensor.to('cpu', ...)) is the test's device.
    return tuple("tpu" if _is_cpu_device(v) else v for v in args)


# Tensor arguments PyTorch requires on the CPU whatever the input's device;
# op name -> positional index in sample.args.
CPU_ARGS = {"tensor_split": 0}


def _copier(to_device, noncontig=False):
    """A tree_map function copying tensors (keeping identity between repeated
    tensors, and leaf-ness and requires_grad for autograd)."""
    memo = {}

    def copy(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) in memo:
            return memo[id(t)]
        x = t.detach()
        if noncontig:
            x = _noncontig(x, TPU if to_device else "cpu")
        else:
            x = x.to(TPU) if to_device else x.clone()
        if t.requires_grad:
            x.requires_grad_(True)
        memo[id(t)] = x
        return x
    return copy


def _noncontig(x, device):
    """x's values as a non-contiguous tensor with a storage offset: a strided
    slice of a bigger buffer, transposed as well for 2+ dims. The same layout
    on CPU and tpu, so layout-dependent ops (as_strided, view) compare too."""
    if x.dim() == 0 or x.numel() == 0:
        return x.to(device) if device == TPU else x.clone()
    src = x.transpose(-1, -2) if x.dim() >= 2 else x
    big = torch.stack([torch.zeros_like(src), src], dim=-1).to(device)
    v = big[..., 1]
    return v.transpose(-1, -2) if x.dim() >= 2 else v


def sample_copies(sample, to_device, noncontig=False, op=None):
    copy = _copier(to_device, noncontig)
    inp = tree_map(copy, sample.input)
    args = tree_map(copy, sample.args)
    kwargs = tree_map(copy, sample.kwargs)
    if to_device:
        args = _fix_args(args)
        kwargs = _fix_kwargs(kwargs)
        keep = CPU_ARGS.get(getattr(op, "name", None))
        if keep is not None and keep < len(args):
            args = args[:keep] + (tree_map(_copier(False), sample.args[keep]),) + args[keep + 1:]
    return inp, args, kwargs


def to_cpu(tree):
    def f(x):
        if isinstance(x, torch.Tensor):
            if x.device.type != "tpu":
                raise AssertionError(f"result on {x.device}, expected tpu")
            return x.detach().cpu()
        return x
    return tree_map(f, tree)


def _cpu_detach(tree):
    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


# ---- comparing -------------------------------------------------------------

def tolerances(oid, dtype, kind):
    if (oid, kind) in TOLERANCES and dtype in (torch.float32, torch.float64):
        rtol, atol, _ = TOLERANCES[(oid, kind)]
        return _on_platform(oid, dtype, dict(rtol=rtol, atol=atol))
    if dtype == torch.float32:
        return _on_platform(oid, dtype, {})
    if dtype == torch.bfloat16:
        return dict(BF16_TOL)
    if dtype == torch.float16:
        return dict(FP16_TOL)
    return {}


def _on_platform(oid, dtype, tol):
    """tol, and on a TPU the chip's measured float32 error for the op's
    family (exp, log, tanh, ...: conftest.platform_error) on top:
    e * (|exact| + 1e-5), as it was measured."""
    e = platform_error(*(part for part in oid.split(".") if part in TPU_ACCURACY))
    if not e or dtype != torch.float32:
        return tol
    return dict(rtol=tol.get("rtol", 1.3e-6) + e, atol=tol.get("atol", 1e-5) + e * 1e-5)


def compare(actual, expected, tol):
    actual = _normalize(actual)
    expected = _normalize(expected)
    torch.testing.assert_close(actual, expected, equal_nan=True, check_device=False,
                               check_layout=False, check_stride=False, **tol)


def compare_as_accurate(actual, expected, tol, exact):
    """compare(), or else every floating result is no farther from the exact
    one (exact(): the op on the same values in float64, or None) than CPU's
    is, within the same tolerance. CPU's kernels round differently from
    machine to machine (their summation order), so where CPU itself is off
    by more than the tolerance (a cancellation), its own error is the
    yardstick; a wrong value is still far outside it."""
    try:
        compare(actual, expected, tol)
    except AssertionError:
        ref = exact()
        if ref is None:
            raise
        got, want, ref = (tree_flatten(_normalize(x))[0] for x in (actual, expected, ref))
        if len(got) != len(want) or len(ref) != len(want):
            raise
        rtol = tol.get("rtol", 1.3e-6)
        atol = tol.get("atol", 1e-5)
        for g, w, r in zip(got, want, ref):
            if not isinstance(w, torch.Tensor) or not w.is_floating_point():
                continue
            if g.shape != w.shape or g.dtype != w.dtype:
                raise
            r = r.detach().double()
            cpu_error = (w.double() - r).abs()
            finite = cpu_error[cpu_error.isfinite()]
            band = (finite.max() if finite.numel() else 0) + atol + rtol * r.abs()
            close = ((g.double() - r).abs() <= band) | (g.isnan() & w.isnan() & r.isnan())
            if not close.all():
                raise


def _exact_call(op, sample, noncontig=False):
    """The op on the sample's values in float64 (None where it cannot run)."""
    def up(x):
        return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    inp, args, kwargs = sample_copies(sample, False, noncontig=noncontig)
    try:
        return sample.output_process_fn_grad(_call(op, tree_map(up, inp), tree_map(up, args),
                                                   tree_map(up, kwargs)))
    except Exception:
        return None


def _normalize(tree):
    # torch.Size and namedtuples compare as plain sequences.
    if isinstance(tree, torch.Size):
        return tuple(tree)
    if isinstance(tree, tuple):
        return tuple(_normalize(x) for x in tree)
    if isinstance(tree, list):
        return [_normalize(x) for x in tree]
    return tree


def short_error(e):
    """One line that says what went wrong."""
    if isinstance(e, Failure):
        return str(e)[:400]
    name = type(e).__name__
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if isinstance(e, AssertionError) and lines:
        # assert_close: "Tensor-likes are not close!" + the useful detail lines
        keep = [ln for ln in lines if not ln.startswith(("Greatest", "The failure"))][:3]
        text = " ".join(keep)
    else:
        text = lines[0] if lines else ""
    text = re.sub(r" at 0x[0-9a-f]+", "", text.replace("|", "/"))  # stable across runs
    return f"{name}: {text}"[:240]


# ---- running ---------------------------------------------------------------

def samples_of(op, dtype, requires_grad, n):
    oid = op_id(op)
    torch.manual_seed(zlib.crc32(oid.encode()) & 0x7FFFFFFF)
    gen = op.sample_inputs("cpu", dtype, requires_grad=requires_grad)
    return list(itertools.islice(gen, n))


def _call(fn, inp, args, kwargs):
    return fn(inp, *args, **kwargs)


def _check_random(op, sample, tol):
    """Shape/dtype against CPU, range, and same values under the same seed."""
    inp, args, kwargs = sample_copies(sample, False)
    torch.manual_seed(0)
    expected = _call(op, inp, args, kwargs)
    outs = []
    for _ in range(2):
        t_inp, t_args, t_kwargs = sample_copies(sample, True, op=op)
        torch.manual_seed(1234)
        outs.append(to_cpu(_call(op, t_inp, t_args, t_kwargs)))
    exp_leaves, _ = tree_flatten(_normalize(expected))
    act_leaves, _ = tree_flatten(_normalize(outs[0]))
    if len(exp_leaves) != len(act_leaves):
        raise AssertionError(f"{len(act_leaves)} outputs, expected {len(exp_leaves)}")
    for a, e in zip(act_leaves, exp_leaves):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise AssertionError(f"output is {type(a).__name__}, expected Tensor")
            if a.shape != e.shape or a.dtype != e.dtype:
                raise AssertionError(f"output {tuple(a.shape)} {a.dtype}, expected {tuple(e.shape)} {e.dtype}")
            if a.is_floating_point() and e.isfinite().all() and not a.isfinite().all():
                raise AssertionError("non-finite values where CPU gives finite ones")
            _check_range(op, sample, a, e)
    compare(outs[1], outs[0], {})  # reproducible under manual_seed


def _check_range(op, sample, a, e):
    name = op.name
    if a.numel() == 0:
        return
    if name == "bernoulli" and not ((a == 0) | (a == 1)).all():
        raise AssertionError("bernoulli values outside {0, 1}")
    # (No [0, 1) check for "rand_like": that OpInfo entry calls randn_like.)
    if name == "multinomial":
        n = sample.input.shape[-1]
        if not ((a >= 0) & (a < n)).all():
            raise AssertionError("multinomial index out of range")
    if name in ("randint", "randint_like") and e.numel():
        lo, hi = e.min(), e.max()
        # CPU's draw bounds the range loosely: tpu values must be integers
        # of the same dtype; the exact bounds come from the sample args.
        args = [x for x in (sample.input, *sample.args) if isinstance(x, int)]
        if len(args) >= 1:
            low, high = (0, args[-1]) if len(args) == 1 else (args[-2], args[-1])
            if not ((a >= low) & (a < high)).all():
                raise AssertionError(f"{name} values outside [{low}, {high})")
        del lo, hi
    if name in ("exponential", "geometric", "log_normal") and (a < 0).any():
        raise AssertionError(f"{name} gave negative values")


def _forward_sample(op, oid, sample, dtype, tol, extras, first):
    if is_random(op, sample):
        return _check_random(op, sample, tol)
    inp, args, kwargs = sample_copies(sample, False)
    try:
        expected = _call(op, inp, args, kwargs)
        expected = sample.output_process_fn_grad(expected)
    except Exception:
        return "cpu-error"
    t_inp, t_args, t_kwargs = sample_copies(sample, True, op=op)
    actual = _call(op, t_inp, t_args, t_kwargs)
    actual = to_cpu(sample.output_process_fn_grad(actual))
    if op.name in UNINITIALIZED_OPS:
        compare(tree_map(_meta_of, actual), tree_map(_meta_of, _cpu_detach(expected)), {})
        return None
    compare_as_accurate(actual, _cpu_detach(expected), tol, lambda: _exact_call(op, sample))
    if not extras:
        return None
    # The same sample with non-contiguous (strided, offset, transposed) inputs.
    try:
        inp, args, kwargs = sample_copies(sample, False, noncontig=True)
        expected_nc = sample.output_process_fn_grad(_call(op, inp, args, kwargs))
    except Exception:
        expected_nc = None  # e.g. view() of a non-contiguous tensor
    if expected_nc is not None:
        try:
            t_inp, t_args, t_kwargs = sample_copies(sample, True, noncontig=True, op=op)
            actual = to_cpu(sample.output_process_fn_grad(_call(op, t_inp, t_args, t_kwargs)))
            compare_as_accurate(actual, _cpu_detach(expected_nc), tol,
                                lambda: _exact_call(op, sample, noncontig=True))
        except Exception as e:
            raise Failure(f"non-contiguous inputs: {short_error(e)}") from e
    if op.inplace_variant is not None and isinstance(sample.input, torch.Tensor):
        _check_inplace(op, sample, tol)
    if first and op.supports_out and isinstance(expected, torch.Tensor):
        _check_out(op, sample, expected, tol)
    return None


def _check_out(op, sample, expected, tol):
    """out= given a view into a bigger buffer writes the result through it."""
    if expected.numel() == 0:
        return
    inp, args, kwargs = sample_copies(sample, False)
    try:
        out = torch.empty_like(expected)
        got = op(inp, *args, **kwargs, out=out)
        if got is not out or not torch.equal(out, expected):
            return
    except Exception:
        return  # CPU takes no out= for this sample
    base = torch.zeros((2, *expected.shape), dtype=expected.dtype).to(TPU)
    view = base[1]
    t_inp, t_args, t_kwargs = sample_copies(sample, True, op=op)
    try:
        got = op(t_inp, *t_args, **t_kwargs, out=view)
        if got is not view:
            raise AssertionError("did not return its out= tensor")
        compare(to_cpu(base), torch.stack([torch.zeros_like(expected), expected.detach()]), tol)
    except Exception as e:
        raise Failure(f"out= variant through a view: {short_error(e)}") from e


def _meta_of(x):
    if isinstance(x, torch.Tensor):
        return torch.zeros(x.shape, dtype=x.dtype)
    return x


# In-place ops whose storage_offset is absolute in the storage: on a view
# into a bigger buffer they address other elements than on a fresh tensor,
# on CPU as on tpu, so the through-a-view comparison does not apply
# (test_aliasing checks as_strided_ on views against CPU).
ABSOLUTE_OFFSET_OPS = {"as_strided"}


def _check_inplace(op, sample, tol):
    """op.inplace_variant on a view (offset into a bigger buffer) mutates the
    view and the base, and returns the view itself."""
    if op.name in ABSOLUTE_OFFSET_OPS:
        return
    inp, args, kwargs = sample_copies(sample, False)
    try:
        expected = op.inplace_variant(inp, *args, **kwargs)
    except Exception:
        return  # e.g. a result type that cannot be cast back in place
    if expected is not inp or inp.shape != sample.input.shape:
        return  # CPU resized the input (addbmm_ on a broadcastable input)
    x = sample.input.detach()
    if x.numel() == 0:
        return
    base = torch.stack([torch.zeros_like(x), x]).to(TPU)
    view = base[1]
    t_inp, t_args, t_kwargs = sample_copies(sample, True, op=op)
    memo_src = t_inp
    # Use the view in place of the input everywhere the input appears.
    t_args = tree_map(lambda v: view if v is memo_src else v, t_args)
    t_kwargs = tree_map(lambda v: view if v is memo_src else v, t_kwargs)
    try:
        out = op.inplace_variant(view, *t_args, **t_kwargs)
    except Exception as e:
        raise Failure(f"in-place variant: {short_error(e)}") from e
    if out is not view:
        raise AssertionError("in-place variant did not return its input")
    try:
        compare(to_cpu(view), inp.detach(), tol)
        compare(to_cpu(base), torch.stack([torch.zeros_like(x), inp.detach()]), tol)
    except Exception as e:
        raise Failure(f"in-place variant through a view: {short_error(e)}") from e


def _backward_sample(op, oid, sample, tol):
    inp, args, kwargs = sample_copies(sample, False)
    leaves = [t for t in tree_flatten((inp, args, kwargs))[0]
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        return "no-grad"
    try:
        out = sample.output_process_fn_grad(_call(op, inp, args, kwargs))
        outs = [t for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs:
            return "no-grad"
        torch.manual_seed(7)
        cots = [torch.randn_like(o) for o in outs]
        expected = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
    except Exception:
        return "cpu-error"
    if is_random(op, sample):
        # Gradients depend on the random draw: same shapes and dtypes as on
        # CPU, and the same values under the same seed.
        runs = [_tpu_grads(op, sample, cots, len(outs), seed=1234) for _ in range(2)]
        compare(tree_map(_meta_of, runs[0]), tree_map(_meta_of, list(expected)), {})
        compare(runs[1], runs[0], {})
        return None
    actual = _tpu_grads(op, sample, cots, len(outs))
    compare(actual, list(expected), tol)
    return None


def _tpu_grads(op, sample, cots, n_outs, seed=None):
    t_inp, t_args, t_kwargs = sample_copies(sample, True, op=op)
    t_leaves = [t for t in tree_flatten((t_inp, t_args, t_kwargs))[0]
                if isinstance(t, torch.Tensor) and t.requires_grad]
    if seed is not None:
        torch.manual_seed(seed)
    t_out = sample.output_process_fn_grad(_call(op, t_inp, t_args, t_kwargs))
    t_outs = [t for t in tree_flatten(t_out)[0]
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if len(t_outs) != n_outs:
        raise AssertionError(f"{len(t_outs)} differentiable outputs, expected {n_outs}")
    actual = torch.autograd.grad(t_outs, t_leaves, [c.to(TPU) for c in cots], allow_unused=True)
    return to_cpu(list(actual))


def check(op, dtype, kind="forward", samples=2, extras=None, timeout=None):
    """Run up to `samples` sample inputs of op; see the module docstring.
    extras (default: float32 only, as layout and aliasing do not depend on the
    dtype) adds the non-contiguous, in-place-through-a-view and out= checks."""
    oid = op_id(op)
    if extras is None:
        extras = dtype == torch.float32
    dname = str(dtype).replace("torch.", "")
    if kind == "backward":
        if not op.supports_autograd or dtype not in op.supported_backward_dtypes("cpu"):
            return Result(oid, dname, kind, "skip", "no autograd for this dtype")
    elif dtype not in op.supported_dtypes("cpu"):
        return Result(oid, dname, kind, "skip", "dtype not supported on CPU")
    tol = tolerances(oid, dtype, kind)
    before = metrics.M.cpu_fallbacks.copy()
    ran = 0
    status, error = "pass", ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with time_limit(timeout):
                for i, sample in enumerate(samples_of(op, dtype, kind == "backward", samples)):
                    if kind == "backward":
                        why = _backward_sample(op, oid, sample, tol)
                    else:
                        why = _forward_sample(op, oid, sample, dtype, tol, extras, i == 0)
                    if why is None:
                        ran += 1
        except Exception as e:  # noqa: BLE001 - any failure is a finding
            status, error = "fail", short_error(e)
    after = metrics.M.cpu_fallbacks
    fallbacks = tuple(sorted(k for k in after if after[k] > before.get(k, 0)))
    if status == "pass":
        if ran == 0:
            status, error = "skip", "no sample ran (none, or all raise on CPU)"
        elif fallbacks:
            status = "fallback"
    return Result(oid, dname, kind, status, error, fallbacks, ran)


def select_ops(names=None, family=None):
    ops = list(op_db)
    if names:
        want = set(names)
        ops = [op for op in ops if op_id(op) in want or op.name in want]
    if family:
        ops = [op for op in ops if family in op_id(op)]
    return ops


__all__ = ["OPS", "RANDOM_OPS", "TOLERANCES", "Result", "check", "is_random", "op_id",
           "select_ops", "DTYPES", "torchtpu"]
