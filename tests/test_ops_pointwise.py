"""Pointwise lowerings against PyTorch on CPU: values, dtypes, shapes,
non-contiguous inputs, in-place/out= variants, autograd and _foreach_ ops."""

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from conftest import assert_same, compare, to_cpu

F32, F64, BF16, I64, I32, U8, BOOL = (torch.float32, torch.float64, torch.bfloat16,
                                      torch.int64, torch.int32, torch.uint8, torch.bool)


def make(dtype, shape=(3, 4), low=-3, high=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == BOOL:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=F64) * (high - low) + low).to(dtype)
    return torch.randint(low, high + 1, shape, generator=g, dtype=dtype)


def pos(dtype, shape=(3, 4)):
    return make(dtype, shape, 0.1, 3) if dtype.is_floating_point else make(dtype, shape, 1, 5)


def unit(dtype, shape=(3, 4)):
    return make(dtype, shape, -0.95, 0.95)


def check(fn, *args, **kw):
    """fn on CPU and tpu copies of args: same values, dtypes and shapes."""
    expected = fn(*args)
    got = fn(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args])
    assert_same(got, expected, **kw)


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == BF16 else {}


UNARY_FLOAT = [
    ("exp", torch.exp, make), ("exp2", torch.exp2, make), ("expm1", torch.expm1, make),
    ("log", torch.log, pos), ("log2", torch.log2, pos), ("log10", torch.log10, pos),
    ("log1p", torch.log1p, pos), ("sqrt", torch.sqrt, pos), ("rsqrt", torch.rsqrt, pos),
    ("reciprocal", torch.reciprocal, pos), ("sin", torch.sin, make), ("cos", torch.cos, make),
    ("tan", torch.tan, unit), ("asin", torch.asin, unit), ("acos", torch.acos, unit),
    ("atan", torch.atan, make), ("sinh", torch.sinh, make), ("cosh", torch.cosh, make),
    ("tanh", torch.tanh, make), ("asinh", torch.asinh, make),
    ("acosh", lambda x: torch.acosh(x + 1.5), pos), ("atanh", torch.atanh, unit),
    ("erf", torch.erf, make), ("erfc", torch.erfc, make), ("erfinv", torch.erfinv, unit),
    ("lgamma", torch.lgamma, pos), ("digamma", torch.digamma, pos), ("sigmoid", torch.sigmoid, make),
    ("logit", torch.logit, lambda d: make(d, low=0.05, high=0.95)),
    ("logit_eps", lambda x: torch.logit(x, eps=0.2), lambda d: make(d, low=0.0, high=1.0)),
    ("sinc", torch.sinc, make), ("deg2rad", torch.deg2rad, make), ("rad2deg", torch.rad2deg, make),
    ("i0", torch.i0, make), ("ndtr", torch.special.ndtr, make), ("ndtri", torch.special.ndtri,
                                                                  lambda d: make(d, low=0.05, high=0.95)),
    ("log_ndtr", torch.special.log_ndtr, make), ("erfcx", torch.special.erfcx, make),
    ("i0e", torch.special.i0e, make), ("i1", torch.special.i1, make), ("i1e", torch.special.i1e, make),
    ("entr", torch.special.entr, make), ("polygamma1", lambda x: torch.polygamma(1, x), pos),
    ("mvlgamma", lambda x: torch.mvlgamma(x + 2, 2), pos),
]


@pytest.mark.parametrize("dtype", [F32, BF16, I64], ids=str)
@pytest.mark.parametrize("name,fn,maker", UNARY_FLOAT, ids=[u[0] for u in UNARY_FLOAT])
def test_unary_float(name, fn, maker, dtype):
    if dtype == I64 and name in ("erfinv", "logit", "logit_eps", "ndtri", "atanh", "asin", "acos", "tan"):
        pytest.skip("domain is (-1, 1)")
    if dtype == BF16 and name in ("polygamma1", "mvlgamma", "i1", "i1e", "erfcx", "ndtri", "log_ndtr"):
        pytest.skip("PyTorch has no bf16 kernel")
    x = maker(dtype)
    check(fn, x, **_tol(dtype))


UNARY_SAME = [
    ("neg", torch.neg), ("abs", torch.abs), ("sign", torch.sign), ("sgn", torch.sgn),
    ("floor", torch.floor), ("ceil", torch.ceil), ("trunc", torch.trunc), ("round", torch.round),
    ("frac", torch.frac), ("square", torch.square), ("bitwise_not", torch.bitwise_not),
    ("relu", torch.relu),
]


@pytest.mark.parametrize("dtype", [F32, F64, BF16, I64, I32, U8, BOOL], ids=str)
@pytest.mark.parametrize("name,fn", UNARY_SAME, ids=[u[0] for u in UNARY_SAME])
def test_unary_same_dtype(name, fn, dtype):
    x = make(dtype, low=0 if dtype == U8 else -3)
    try:
        expected = fn(x)
    except RuntimeError:  # NotImplementedError (no CPU kernel for the dtype) included
        with pytest.raises(RuntimeError):
            fn(x.to("tpu"))
        return
    assert_same(fn(x.to("tpu")), expected)


def test_round_half_even_and_decimals():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 1.2345, 123.456, -0.0])
    check(torch.round, x)
    check(lambda t: torch.round(t, decimals=2), x)
    check(lambda t: torch.round(t, decimals=-1), x)
    check(lambda t: torch.round(t, decimals=1), x.to(BF16), **_tol(BF16))


def test_special_values():
    x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, -2.0, 1.0])
    for fn in (torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.sigmoid, torch.tanh,
               torch.digamma, torch.lgamma, torch.erfinv, torch.sign, torch.abs, torch.frac,
               torch.sinc, torch.angle, torch.reciprocal):
        check(fn, x, equal_nan=True)
    for fn in (torch.isnan, torch.isinf, torch.isfinite, torch.isposinf, torch.isneginf, torch.signbit):
        check(fn, x)
        check(fn, torch.tensor([-3, 0, 5]))
    check(torch.nan_to_num, x)
    check(lambda t: torch.nan_to_num(t, nan=1.0, posinf=2.0, neginf=-2.0), x)
    check(torch.nan_to_num, x.to(BF16))
    check(torch.nan_to_num, torch.tensor([1, 2]))


def _binary_inputs(dtype_a, dtype_b, op):
    a = make(dtype_a, seed=1, low=0 if dtype_a == U8 else -3)
    b = make(dtype_b, seed=2, low=0 if dtype_b == U8 else -3)
    if op in ("div", "remainder", "fmod", "floor_divide", "div_floor", "div_trunc"):
        b = torch.where(b == 0, torch.ones_like(b), b)
    return a, b


BINARY = [
    ("add", torch.add), ("add_alpha", lambda a, b: torch.add(a, b, alpha=2)),
    ("sub", torch.sub), ("sub_alpha", lambda a, b: torch.sub(a, b, alpha=3)),
    ("mul", torch.mul), ("div", torch.div),
    ("div_floor", lambda a, b: torch.div(a, b, rounding_mode="floor")),
    ("div_trunc", lambda a, b: torch.div(a, b, rounding_mode="trunc")),
    ("floor_divide", torch.floor_divide), ("remainder", torch.remainder), ("fmod", torch.fmod),
    ("maximum", torch.maximum), ("minimum", torch.minimum), ("fmax", torch.fmax), ("fmin", torch.fmin),
    ("atan2", torch.atan2), ("hypot", torch.hypot), ("copysign", torch.copysign),
    ("nextafter", torch.nextafter), ("xlogy", torch.xlogy), ("logaddexp", torch.logaddexp),
    ("logaddexp2", torch.logaddexp2), ("eq", torch.eq), ("ne", torch.ne), ("lt", torch.lt),
    ("le", torch.le), ("gt", torch.gt), ("ge", torch.ge), ("logical_and", torch.logical_and),
    ("logical_or", torch.logical_or), ("logical_xor", torch.logical_xor),
    ("bitwise_and", torch.bitwise_and), ("bitwise_or", torch.bitwise_or),
    ("bitwise_xor", torch.bitwise_xor), ("heaviside", torch.heaviside), ("rsub", torch.rsub),
    ("pow", lambda a, b: torch.pow(a, b.abs() if not b.is_floating_point() else b)),
]

DTYPE_PAIRS = [(F32, F32), (I64, I64), (BOOL, BOOL), (BF16, BF16), (I64, F32), (BF16, F32),
               (I32, I64), (U8, BOOL)]


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("name,fn", BINARY, ids=[b[0] for b in BINARY])
def test_binary(name, fn, dtypes):
    a, b = _binary_inputs(*dtypes, name)
    if name == "pow" and a.dtype.is_floating_point:
        a = a.abs() + 0.1
    try:
        expected = fn(a, b)
    except RuntimeError:  # NotImplementedError (no CPU kernel for the dtype) included
        with pytest.raises(RuntimeError):
            fn(a.to("tpu"), b.to("tpu"))
        return
    got = fn(a.to("tpu"), b.to("tpu"))
    assert_same(got, expected, equal_nan=True, **_tol(expected.dtype))


@pytest.mark.parametrize("scalar", [2, -1.5, True], ids=["int", "float", "bool"])
@pytest.mark.parametrize("dtype", [F32, I64, BF16, BOOL], ids=str)
@pytest.mark.parametrize("name,fn", [
    ("add", torch.add), ("mul", torch.mul), ("div", torch.div), ("sub", torch.sub),
    ("remainder", torch.remainder), ("fmod", torch.fmod), ("pow", torch.pow),
    ("floor_divide", torch.floor_divide), ("eq", torch.eq), ("lt", torch.lt),
    ("maximum_scalar_tensor", lambda x, s: torch.clamp(x, min=s)),
    ("rpow", lambda x, s: torch.pow(s, x)), ("rsub", lambda x, s: s - x),
    ("rdiv", lambda x, s: s / (x.abs() + 1)), ("bitwise_and", torch.bitwise_and),
    ("lshift", lambda x, s: x << s), ("rshift", lambda x, s: x >> s),
], ids=lambda v: v if isinstance(v, str) else "")
def test_tensor_scalar(name, fn, dtype, scalar):
    x = make(dtype)
    if name in ("remainder", "fmod", "floor_divide") and scalar is True:
        pytest.skip("division by True")
    if dtype == BOOL and name in ("pow", "lshift", "rshift"):
        pytest.skip("PyTorch's meta kernels disagree with its CPU kernels on bool here")
    try:
        expected = fn(x, scalar)
    except (RuntimeError, TypeError) as e:
        with pytest.raises(RuntimeError if isinstance(e, RuntimeError) else TypeError):
            fn(x.to("tpu"), scalar)
        return
    assert_same(fn(x.to("tpu"), scalar), expected, equal_nan=True, **_tol(expected.dtype))


def test_division_sign_semantics():
    a = torch.tensor([5.0, -5.0, 5.0, -5.0, 0.0, -0.0, 7.5, 1.0, -1.0])
    b = torch.tensor([3.0, 3.0, -3.0, -3.0, 2.0, 2.0, 0.0, 0.0, 0.0])
    for mode in (None, "floor", "trunc"):
        check(lambda x, y: torch.div(x, y, rounding_mode=mode), a, b, equal_nan=True)
    check(torch.remainder, a, b, equal_nan=True)
    check(torch.fmod, a, b, equal_nan=True)
    ai = torch.tensor([5, -5, 5, -5, 0, 7])
    bi = torch.tensor([3, 3, -3, -3, 2, -2])
    for fn in (torch.remainder, torch.fmod, torch.floor_divide,
               lambda x, y: torch.div(x, y, rounding_mode="trunc")):
        check(fn, ai, bi)
    # int64 stays exact beyond float precision.
    big = torch.tensor([2 ** 62 + 1, -(2 ** 62) - 3])
    check(lambda x: x // 3, big)
    check(lambda x: x % 7, big)
    check(lambda x: x + 1, big)


def test_integer_pow_exact_and_negative_exponent():
    x = torch.tensor([3, -2, 1, -1, 0, 7])
    check(lambda t: t ** 3, x)
    check(lambda t: t ** 21, torch.tensor([3, -3]))
    check(lambda t, e: torch.pow(t, e), torch.tensor([2, 1, -1, -1, 5]), torch.tensor([-1, -3, -2, -3, 0]))
    check(lambda t: t ** 2, make(F32))
    check(lambda t: t ** 0.5, pos(F32))
    check(lambda t: 2 ** t, make(F32))


def test_shifts():
    x = torch.tensor([1, -8, 3, 2 ** 40, -1])
    s = torch.tensor([1, 2, 0, 10, 63])
    check(torch.bitwise_left_shift, x, s)
    check(torch.bitwise_right_shift, x, s)
    check(lambda a: a << 3, x)
    check(lambda a: a >> 2, x)
    check(lambda a: a >> 1, torch.tensor([200, 3], dtype=U8))


def test_clamp_family():
    x = torch.tensor([-2.0, -0.5, 0.0, 0.7, float("nan"), 3.0])
    check(lambda t: t.clamp(-1, 1), x, equal_nan=True)
    check(lambda t: t.clamp(min=0.5), x, equal_nan=True)
    check(lambda t: t.clamp(max=0.5), x, equal_nan=True)
    check(lambda t: t.clamp(2, 1), x, equal_nan=True)  # min > max -> max
    check(lambda t: t.clamp(min=float("nan")), x, equal_nan=True)
    lo, hi = torch.full((6,), -0.3), torch.tensor([1.0, 0.1, 0.2, 0.3, 0.4, 5.0])
    check(lambda t, a, b: torch.clamp(t, a, b), x, lo, hi, equal_nan=True)
    check(lambda t, a: torch.clamp(t, min=a), x, lo, equal_nan=True)
    check(lambda t, b: torch.clamp(t, max=b), x, hi, equal_nan=True)
    check(lambda t, a: torch.clamp_min(t, a), x, lo, equal_nan=True)
    check(lambda t: torch.clamp_max(t, 0), x, equal_nan=True)
    check(lambda t: t.clamp(-2, 2), torch.tensor([-5, 0, 5]))
    check(lambda t: t.clamp(-2.5, 2.5), torch.tensor([-5, 0, 5]))  # int -> float
    check(lambda t: t.clamp(0, 1), make(BF16))


def test_where_lerp_addc():
    a, b, c = make(F32, seed=1), make(F32, seed=2), make(F32, seed=3)
    cond = a > 0
    check(torch.where, cond, a, b)
    check(lambda m, x: torch.where(m, x, 0.5), cond, a)
    check(lambda m, x: torch.where(m, 2, x), cond, make(I64))
    check(lambda m: torch.where(m, 1.0, 0.0), cond)
    check(torch.where, cond, make(I64), make(F32))
    check(lambda x, y: torch.lerp(x, y, 0.3), a, b)
    check(lambda x, y: torch.lerp(x, y, 0.7), a, b)
    check(torch.lerp, a, b, torch.rand(3, 4))
    check(lambda x, y: torch.lerp(x, y, 0.3), a.to(BF16), b.to(BF16), **_tol(BF16))
    check(lambda x, y, z: torch.addcmul(x, y, z, value=0.5), a, b, c)
    check(lambda x, y, z: torch.addcdiv(x, y, z, value=-2), a, b, c.abs() + 1)
    check(lambda x, y, z: torch.addcmul(x, y, z, value=3), make(I64), make(I64), make(I64))


def test_noncontiguous_and_broadcast():
    a = make(F32, (4, 6))
    b = make(F32, (6, 4), seed=3)
    check(lambda x, y: x.t() * y + 1, a, b)
    check(lambda x: torch.exp(x[:, ::2]), a)
    check(lambda x, y: torch.maximum(x[1:3], y[0]), a, b.t())
    check(lambda x: torch.where(x.t() > 0, x.t(), -1.0), a)
    check(lambda x, y: x.unsqueeze(0) + y.unsqueeze(1), make(F32, (3,)), make(F32, (4,)))
    check(lambda x: x.expand(3, 4) * 2, make(F32, (1, 4)))


@pytest.mark.parametrize("dtype", [F32, I64])
def test_broadcast_of_different_ranks(dtype):
    # Ops lowered to lax's, which do not broadcast (OpInfo's samples of [5, 1] and [5]).
    a, b = make(dtype, (5, 1)), make(dtype, (5,), seed=1, low=1)
    for fn in [torch.fmod, torch.remainder, lambda x, y: torch.div(x, y, rounding_mode="trunc"),
               lambda x, y: torch.div(x, y, rounding_mode="floor")]:
        check(fn, a, b)
        check(fn, b, a.abs() + 1)
    if dtype == I64:
        check(torch.bitwise_left_shift, a, b % 8)
        check(torch.bitwise_right_shift, a, b % 8)
        check(torch.lcm, a, b)


def test_in_place_and_out():
    a, b = make(F32, seed=1), make(F32, seed=2)
    for fn in (lambda x, y: x.add_(y, alpha=2), lambda x, y: x.mul_(y), lambda x, y: x.clamp_(-1, 1),
               lambda x, y: x.sigmoid_(), lambda x, y: x.div_(y.abs() + 1, rounding_mode="floor"),
               lambda x, y: x.lerp_(y, 0.25), lambda x, y: x.addcmul_(y, y, value=2),
               lambda x, y: x.t().neg_(), lambda x, y: x[:, 1].exp_(), lambda x, y: x.masked_fill_(y > 0, 0.0)):
        xc, yc = a.clone(), b.clone()
        xt, yt = a.to("tpu"), b.to("tpu")
        rc, rt = fn(xc, yc), fn(xt, yt)
        assert_same(xt, xc)
        assert_same(rt, rc)
    # out=, including a dtype-changing comparison and a view as out.
    out = torch.empty(3, 4, device="tpu")
    r = torch.add(a.to("tpu"), b.to("tpu"), out=out)
    assert r is out
    assert_same(out, a + b)
    out_b = torch.empty(3, 4, dtype=BOOL, device="tpu")
    torch.gt(a.to("tpu"), 0, out=out_b)
    assert_same(out_b, a > 0)
    base = torch.zeros(4, 3, device="tpu")
    torch.mul(a.to("tpu"), 2, out=base.t())
    assert_same(base, (a * 2).t())
    # int tensor += float errors as in PyTorch.
    with pytest.raises(RuntimeError):
        make(I64).to("tpu").add_(1.5)


ACTIVATIONS = [
    ("relu", F.relu), ("relu6", F.relu6), ("gelu", F.gelu),
    ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")), ("silu", F.silu),
    ("hardtanh", lambda x: F.hardtanh(x, -0.5, 2.0)), ("leaky_relu", lambda x: F.leaky_relu(x, 0.2)),
    ("elu", lambda x: F.elu(x, 0.7)), ("selu", F.selu), ("celu", lambda x: F.celu(x, 1.3)),
    ("softplus", lambda x: F.softplus(x, beta=2, threshold=3)), ("sigmoid", torch.sigmoid),
    ("tanh", torch.tanh), ("hardsigmoid", F.hardsigmoid), ("hardswish", F.hardswish),
    ("mish", F.mish), ("logsigmoid", F.logsigmoid), ("threshold", lambda x: F.threshold(x, 0.3, -2.0)),
    ("hardshrink", lambda x: F.hardshrink(x, 0.6)), ("softshrink", lambda x: F.softshrink(x, 0.6)),
    ("tanhshrink", F.tanhshrink), ("softsign", F.softsign),
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("name,fn", ACTIVATIONS, ids=[a[0] for a in ACTIVATIONS])
def test_activation_forward_backward(name, fn, dtype):
    x = make(dtype, (5, 6), -4, 4)
    x.view(-1)[:3] = torch.tensor([0.0, 3.0, -3.0], dtype=dtype)  # kinks
    xc = x.clone().requires_grad_()
    xt = x.to("tpu").requires_grad_()
    yc, yt = fn(xc), fn(xt)
    assert_same(yt, yc, **_tol(dtype))
    g = make(dtype, (5, 6), seed=5)
    yc.backward(g)
    yt.backward(g.to("tpu"))
    assert_same(xt.grad, xc.grad, **_tol(dtype))
    assert torchtpu.metrics.M.cpu_fallbacks.get(name, 0) == 0


def test_add_relu_on_device(mode):
    # relu(a + alpha * b), the op TorchScript's and quantization's fusion passes emit.
    torchtpu.metrics.reset()
    a, b = make(F32, (5, 6), seed=1), make(F32, (5, 6), seed=2)
    for fn in (lambda a, b: torch._VF._add_relu(a, b, alpha=2), lambda a, b: torch._VF._add_relu(a, 1.5),
               lambda a, b: torch._VF._add_relu_(a.clone(), b)):
        assert_same(fn(a.to("tpu"), b.to("tpu")), fn(a, b))
    ints = make(I64, (4,), -3, 3)
    assert_same(torch._VF._add_relu(ints.to("tpu"), ints.to("tpu")), torch._VF._add_relu(ints, ints))
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == {}
    with pytest.raises(RuntimeError, match="add_relu:bool"):
        torch._VF._add_relu(torch.ones(2, dtype=torch.bool, device="tpu"), torch.ones(2, dtype=torch.bool, device="tpu"))


def test_backward_ops_directly():
    aten = torch.ops.aten
    g, x = make(F32, seed=1), make(F32, seed=2)
    y = torch.sigmoid(x)
    for fn, args in [
        (aten.threshold_backward, (g, x, 0.1)),
        (aten.gelu_backward, (g, x)), (lambda a, b: aten.gelu_backward(a, b, approximate="tanh"), (g, x)),
        (aten.silu_backward, (g, x)), (aten.hardtanh_backward, (g, x, -1.0, 1.0)),
        (aten.leaky_relu_backward, (g, x, 0.1, False)),
        (aten.elu_backward, (g, 1.0, 1.0, 1.0, False, x)), (aten.elu_backward, (g, 1.0, 1.0, 1.0, True, F.elu(x))),
        (aten.softplus_backward, (g, x, 1.0, 20.0)), (aten.sigmoid_backward, (g, y)),
        (aten.tanh_backward, (g, torch.tanh(x))), (aten.hardsigmoid_backward, (g, x)),
        (aten.hardswish_backward, (g, x)), (aten.mish_backward, (g, x)),
        (aten.logit_backward, (g, y)), (lambda a, b: aten.logit_backward(a, b, 0.3), (g, y)),
    ]:
        check(fn, *args)


@pytest.mark.parametrize("name,fn,maker", [
    ("exp", torch.exp, make), ("log", torch.log, pos), ("sqrt", torch.sqrt, pos),
    ("pow", lambda x: x ** 3, make), ("div", lambda x: 1 / (x.abs() + 1), make),
    ("atan2", lambda x: torch.atan2(x, x.flip(0)), make), ("clamp", lambda x: x.clamp(-1, 1), make),
    ("lerp", lambda x: torch.lerp(x, x * 3, 0.4), make), ("xlogy", lambda x: torch.xlogy(x, x.abs() + 1), make),
    ("erf", torch.erf, make), ("lgamma", torch.lgamma, pos), ("where", lambda x: torch.where(x > 0, x * 2, x ** 2), make),
    ("maximum", lambda x: torch.maximum(x, x.flip(1)), make), ("hypot", lambda x: torch.hypot(x, x.flip(1)), make),
], ids=lambda v: v if isinstance(v, str) else "")
def test_autograd(name, fn, maker):
    x = maker(F32)
    xc = x.clone().requires_grad_()
    xt = x.to("tpu").requires_grad_()
    fn(xc).sum().backward()
    fn(xt).sum().backward()
    assert_same(xt.grad, xc.grad)


def test_error_types_match():
    x = make(F32).to("tpu")
    with pytest.raises(RuntimeError):
        x + make(F32, (2, 4)).to("tpu")
    with pytest.raises(RuntimeError):
        torch.bitwise_and(x, x)
    with pytest.raises(RuntimeError):
        -make(BOOL).to("tpu")


# ---- torch.special: polynomials, Bessel functions, polygamma -----------------

def _lowered(fn, *args, **kw):
    """check() with nan == nan, and nothing run on the CPU fallback."""
    before = dict(torchtpu.metrics.M.cpu_fallbacks)
    check(fn, *args, equal_nan=True, **kw)
    assert dict(torchtpu.metrics.M.cpu_fallbacks) == before, "ran on the CPU fallback"


POLYNOMIALS = ["chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
               "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t",
               "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
               "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he",
               "laguerre_polynomial_l", "legendre_polynomial_p"]


@pytest.mark.parametrize("dtype", [F32, torch.float64], ids=str)
@pytest.mark.parametrize("name", POLYNOMIALS)
def test_orthogonal_polynomials(name, dtype):
    # The ends of the interval, 0, |x| > 1, the trigonometric form at high
    # degree, negative, fractional, nan and inf degrees (CPU: 0), and the
    # nan cut-off of the Hermite polynomials above degree 128 / 512.
    fn = getattr(torch.special, name)
    x = torch.tensor([1.0, -1.0, 0.0, 0.5, -0.3, 1.5, -2.0, 0.9, 0.25, 0.7, -0.6, 0.1, 3.0, 2.5],
                     dtype=dtype)
    n = torch.tensor([5, 6, 3, 12, 25, 7, -1, 3.7, float("nan"), float("inf"), 40, 0, 1, 600],
                     dtype=dtype)
    _lowered(fn, x, n)
    _lowered(fn, x, torch.arange(14))
    _lowered(lambda t: fn(t, 9), x)
    _lowered(lambda t: fn(0.4, t), torch.arange(12))


BESSEL = ["bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0",
          "modified_bessel_i1", "modified_bessel_k0", "modified_bessel_k1",
          "scaled_modified_bessel_k0", "scaled_modified_bessel_k1", "spherical_bessel_j0", "airy_ai"]


@pytest.mark.parametrize("name", BESSEL)
def test_bessel_airy(name):
    # Every branch of the Cephes approximations: both sides of 0.5, 2, 2.09,
    # 5, 8, 8.32 and 103.9, negative arguments, 0, infinities and nan.
    fn = getattr(torch.special, name)
    x = torch.cat([torch.linspace(-40, 40, 161), torch.tensor(
        [0.0, 1e-6, -1e-6, 0.49, 2.0, 2.01, 2.09, -2.09, 5.0, 5.01, 8.0, 8.01, 8.33, 104.0, -90.5,
         float("inf"), float("-inf"), float("nan")])])
    for dtype in (F32, torch.float64):
        _lowered(fn, x.to(dtype))
    _lowered(fn, torch.arange(-6, 7))
    with pytest.raises(NotImplementedError):
        fn(x.to(BF16).to("tpu"))


@pytest.mark.parametrize("dtype", [F32, BF16, torch.float64], ids=str)
def test_polygamma_negative_and_large_n(dtype):
    # Negative x sums Hurwitz zeta's series directly, as the CPU kernel does.
    x = torch.tensor([-8.4784, -0.5, -3.25, 0.3, 2.5, 12.0, -9.5, 1e-3], dtype=dtype)
    for n in (2, 3, 4, 5, 7):
        _lowered(lambda t: torch.polygamma(n, t), x, **_tol(dtype))
    if dtype == F32:
        compare(lambda t: torch.polygamma(2, t), x)
    _lowered(torch.special.zeta, torch.tensor([2.0, 3.0, 4.0, 1.5, 0.5, 1.0]),
             torch.tensor([-2.5, -0.5, -7.25, 3.0, 2.0, -1.0]))


def test_gcd_lcm_frexp():
    big = torch.iinfo(I64).min
    a = torch.tensor([0, 6, -4, 7, 0, big, 12, 48, 17, big], dtype=I64)
    b = torch.tensor([0, 4, 6, -21, 5, 6, big, -18, 0, 1], dtype=I64)
    for dtype in (I64, I32, torch.int16, torch.int8):
        lo, hi = max(torch.iinfo(dtype).min, -100), min(torch.iinfo(dtype).max, 100)
        args = (a.clamp(lo, hi).to(dtype), b.clamp(lo, hi).to(dtype)) if dtype != I64 else (a, b)
        _lowered(torch.gcd, *args)
        _lowered(torch.lcm, *args)
    _lowered(torch.lcm, make(U8, (40,), low=0, high=100, seed=3),
             make(U8, (40,), low=0, high=100, seed=4))
    with pytest.raises(NotImplementedError):
        torch.gcd(make(F32).to("tpu"), make(F32).to("tpu"))
    # Subnormals keep their exponent (XLA's CPU code flushes them).
    x = torch.tensor([0.0, -0.0, 1.0, 3.5, -7.0, 1e-40, 1.4e-45, -1e-39, 3e38,
                      float("inf"), float("-inf"), float("nan")])
    for dtype in (F32, torch.float64, BF16, torch.float16):
        _lowered(torch.frexp, x.to(dtype))
    with pytest.raises(RuntimeError):
        torch.frexp(make(I64).to("tpu"))


# ---- _foreach_ ---------------------------------------------------------------

def _lists(n=3, dtype=F32, seed=0):
    shapes = [(3,), (2, 4), ()]
    return [make(dtype, shapes[i % 3], seed=seed + i) for i in range(n)]


@pytest.mark.parametrize("name,fn", [
    ("add_scalar", lambda a, b: torch._foreach_add(a, 1.5)),
    ("add_list", lambda a, b: torch._foreach_add(a, b, alpha=-2)),
    ("add_scalarlist", lambda a, b: torch._foreach_add(a, [1.0, 2, -3.5])),
    ("add_tensor", lambda a, b: torch._foreach_add(a, b[2], alpha=2)),
    ("sub_list", lambda a, b: torch._foreach_sub(a, b)),
    ("mul_scalar", lambda a, b: torch._foreach_mul(a, 0.9)),
    ("mul_tensor", lambda a, b: torch._foreach_mul(a, b[2])),
    ("div_list", lambda a, b: torch._foreach_div(a, [x.abs() + 1 for x in b])),
    ("div_scalarlist", lambda a, b: torch._foreach_div(a, [2.0, 3.0, 4.0])),
    ("maximum", lambda a, b: torch._foreach_maximum(a, b)),
    ("minimum_scalar", lambda a, b: torch._foreach_minimum(a, 0.1)),
    ("clamp_min", lambda a, b: torch._foreach_clamp_min(a, -0.5)),
    ("clamp_max_list", lambda a, b: torch._foreach_clamp_max(a, b)),
    ("pow_scalar", lambda a, b: torch._foreach_pow(a, 2)),
    ("pow_list", lambda a, b: torch._foreach_pow([x.abs() for x in a], b)),
    ("pow_scalar_base", lambda a, b: torch._foreach_pow(0.9, b)),
    ("lerp_scalar", lambda a, b: torch._foreach_lerp(a, b, 0.1)),
    ("lerp_list", lambda a, b: torch._foreach_lerp(a, b, [x.abs() / 4 for x in b])),
    ("addcmul", lambda a, b: torch._foreach_addcmul(a, b, b, value=0.5)),
    ("addcmul_scalarlist", lambda a, b: torch._foreach_addcmul(a, b, a, [1.0, -1.0, 2.0])),
    ("addcdiv", lambda a, b: torch._foreach_addcdiv(a, b, [x.abs() + 1 for x in b], value=-0.1)),
    ("sqrt", lambda a, b: torch._foreach_sqrt([x.abs() for x in a])),
    ("neg", lambda a, b: torch._foreach_neg(a)), ("exp", lambda a, b: torch._foreach_exp(a)),
    ("sign", lambda a, b: torch._foreach_sign(a)), ("abs", lambda a, b: torch._foreach_abs(a)),
    ("reciprocal", lambda a, b: torch._foreach_reciprocal(b)), ("sigmoid", lambda a, b: torch._foreach_sigmoid(a)),
    ("norm", lambda a, b: torch._foreach_norm(a)), ("norm_inf", lambda a, b: torch._foreach_norm(a, float("inf"))),
    ("norm_1", lambda a, b: torch._foreach_norm(a, 1)), ("max", lambda a, b: torch._foreach_max(a)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_foreach(name, fn):
    a, b = _lists(seed=0), _lists(seed=10)
    expected = fn(a, b)
    got = fn([x.to("tpu") for x in a], [x.to("tpu") for x in b])
    assert_same(list(got), list(expected))


def test_foreach_in_place():
    a, b = _lists(seed=0), _lists(seed=10)
    at, bt = [x.to("tpu") for x in a], [x.to("tpu") for x in b]
    for fn in (lambda x, y: torch._foreach_add_(x, y, alpha=0.5), lambda x, y: torch._foreach_mul_(x, 1.1),
               lambda x, y: torch._foreach_addcdiv_(x, y, [v.abs() + 1 for v in y], [0.1, 0.2, 0.3]),
               lambda x, y: torch._foreach_lerp_(x, y, 0.2), lambda x, y: torch._foreach_zero_(x),
               lambda x, y: torch._foreach_copy_(x, y), lambda x, y: torch._foreach_sqrt_([v.abs_() for v in x])):
        fn(a, b)
        fn(at, bt)
        assert_same(at, a)


def test_foreach_scalarlist_does_not_recompile():
    at = [x.to("tpu") for x in _lists()]
    torch._foreach_add_(at, [0.1, 0.2, 0.3])
    torchtpu.sync()
    before = torchtpu.metrics.M.compilations
    for s in range(3):
        torch._foreach_add_(at, [0.5 + s, 1.5 * s, -s - 0.5])
    torchtpu.sync()
    assert torchtpu.metrics.M.compilations == before


@pytest.mark.parametrize("foreach", [True, False])
def test_adamw_matches_cpu(foreach):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    model_t = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    model_t.load_state_dict(model.state_dict())
    model_t.to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    opt_t = torch.optim.AdamW(model_t.parameters(), lr=1e-2, foreach=foreach)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    for _ in range(3):
        for m, o, xx, yy in ((model, opt, x, y), (model_t, opt_t, x.to("tpu"), y.to("tpu"))):
            o.zero_grad()
            F.mse_loss(m(xx), yy).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=foreach)
            o.step()
    for p, pt in zip(model.parameters(), model_t.parameters()):
        assert_same(pt.detach(), p.detach(), atol=1e-5, rtol=1e-4)
    assert_same(to_cpu(opt_t.state[model_t[0].weight]["exp_avg_sq"]).to("tpu"),
                opt.state[model[0].weight]["exp_avg_sq"], atol=1e-6, rtol=1e-4)
