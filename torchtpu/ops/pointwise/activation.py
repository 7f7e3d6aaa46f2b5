"""Activations and their backward ops, computed in PyTorch's opmath dtype
(float32 for bf16/fp16)."""
import math

import jax
import jax.numpy as jnp
from jax import lax

from ..registry import lower
from ..util import cast, promote
from .binary import add
from .common import _is_complex, guard
from .logic import clamp

from ...compat import aten


def _opmath(*xs):
    """xs in their computation dtype, and the dtype of the result."""
    return promote(*xs)


@lower(aten.relu.default)
@guard("relu", "b", RuntimeError, "Boolean inputs not supported for relu")
def relu(x):
    return jnp.maximum(x, jnp.zeros((), x.dtype)) if x.dtype != jnp.bool_ else x


@lower(aten._add_relu.Tensor, aten._add_relu.Scalar)
def add_relu(a, b, alpha=1):
    # relu(a + alpha * b), fused by the JIT's and quantization's passes.
    if a.dtype == jnp.bool_:
        raise RuntimeError("Unsupported datatype for add_relu:bool")
    return relu(add(a, b, alpha))


@lower(aten.threshold.default)
def threshold(x, threshold, value):
    t = cast(threshold, x.dtype)
    return jnp.where(x <= t, cast(value, x.dtype), x)


@lower(aten.threshold_backward.default)
def threshold_backward(grad, x, threshold):
    (grad, x), res = _opmath(grad, x)
    return jnp.where(x <= cast(threshold, x.dtype), 0, grad).astype(res)


_SQRT1_2 = 1 / math.sqrt(2)
_GELU_BETA = math.sqrt(2) * (2 / math.sqrt(math.pi)) * 0.5  # sqrt(2/pi)
_GELU_KAPPA = 0.044715


@lower(aten.gelu.default)
def gelu(x, *, approximate="none"):
    (x,), res = _opmath(x)
    if approximate == "tanh":
        inner = _GELU_BETA * (x + _GELU_KAPPA * x * x * x)
        out = 0.5 * x * (1 + jnp.tanh(inner))
    else:
        out = x * 0.5 * (1 + lax.erf(x * _SQRT1_2))
    return out.astype(res)


@lower(aten.gelu_backward.default)
def gelu_backward(grad, x, *, approximate="none"):
    (grad, x), res = _opmath(grad, x)
    if approximate == "tanh":
        x_sq = x * x
        inner = _GELU_BETA * (x + _GELU_KAPPA * x_sq * x)
        t = jnp.tanh(inner)
        left_d = 0.5 * (1 + t)
        right_d = 0.5 * x * (1 - t * t) * _GELU_BETA * (1 + 3 * _GELU_KAPPA * x_sq)
        out = grad * (left_d + right_d)
    else:
        cdf = 0.5 * (1 + lax.erf(x * _SQRT1_2))
        pdf = jnp.exp(-0.5 * x * x) * (2 / math.sqrt(math.pi) * _SQRT1_2 * 0.5)
        out = grad * (cdf + x * pdf)
    return out.astype(res)


@lower(aten.silu.default)
def silu(x):
    (x,), res = _opmath(x)
    return (x * jax.nn.sigmoid(x)).astype(res)


@lower(aten.silu_backward.default)
def silu_backward(grad, x):
    (grad, x), res = _opmath(grad, x)
    s = jax.nn.sigmoid(x)
    return (grad * s * (1 + x * (1 - s))).astype(res)


@lower(aten.hardtanh.default)
def hardtanh(x, min_val=-1, max_val=1):
    return clamp(x, min_val, max_val)


@lower(aten.hardtanh_backward.default)
def hardtanh_backward(grad, x, min_val, max_val):
    (grad, x), res = _opmath(grad, x)
    out = jnp.where((x <= cast(min_val, x.dtype)) | (x >= cast(max_val, x.dtype)), 0, grad)
    return out.astype(res)


@lower(aten.leaky_relu.default)
def leaky_relu(x, negative_slope=0.01):
    (x,), res = _opmath(x)
    return jnp.where(x > 0, x, x * cast(negative_slope, x.dtype)).astype(res)


@lower(aten.leaky_relu_backward.default)
def leaky_relu_backward(grad, x, negative_slope, self_is_result):
    (grad, x), res = _opmath(grad, x)
    return jnp.where(x > 0, grad, grad * cast(negative_slope, grad.dtype)).astype(res)


@lower(aten.elu.default)
def elu(x, alpha=1, scale=1, input_scale=1):
    (x,), res = _opmath(x)
    alpha, scale, input_scale = (cast(v, x.dtype) for v in (alpha, scale, input_scale))
    out = jnp.where(x > 0, x * scale, jnp.expm1(x * input_scale) * alpha * scale)
    return out.astype(res)


@lower(aten.elu_backward.default)
def elu_backward(grad, alpha, scale, input_scale, is_result, self_or_result):
    (grad, y), res = _opmath(grad, self_or_result)
    negcoef = cast(alpha, y.dtype) * cast(scale, y.dtype)
    poscoef = cast(scale, y.dtype)
    negiptcoef = cast(input_scale, y.dtype)
    if is_result:
        neg = grad * negiptcoef * (y + negcoef)
    else:
        neg = grad * negiptcoef * negcoef * jnp.exp(y * negiptcoef)
    return jnp.where(y <= 0, neg, grad * poscoef).astype(res)


@lower(aten.softplus.default)
def softplus(x, beta=1, threshold=20):
    (x,), res = _opmath(x)
    xb = x * cast(beta, x.dtype)
    out = jnp.where(xb > cast(threshold, x.dtype), x, jnp.log1p(jnp.exp(xb)) / cast(beta, x.dtype))
    return out.astype(res)


@lower(aten.softplus_backward.default)
def softplus_backward(grad, x, beta, threshold):
    (grad, x), res = _opmath(grad, x)
    xb = x * cast(beta, x.dtype)
    z = jnp.exp(xb)
    return jnp.where(xb > cast(threshold, x.dtype), grad, grad * z / (z + 1)).astype(res)


@lower(aten.sigmoid_backward.default)
def sigmoid_backward(grad, y):
    (grad, y), res = _opmath(grad, y)
    if _is_complex(y):
        y = jnp.conj(y)
    return (grad * (1 - y) * y).astype(res)


@lower(aten.tanh_backward.default)
def tanh_backward(grad, y):
    (grad, y), res = _opmath(grad, y)
    if _is_complex(y):
        y = jnp.conj(y)
    return (grad * (1 - y * y)).astype(res)


@lower(aten.hardsigmoid.default)
def hardsigmoid(x):
    (x,), res = _opmath(x)
    return (jnp.clip(x + 3, 0, 6) / 6).astype(res)


@lower(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(grad, x):
    (grad, x), res = _opmath(grad, x)
    return jnp.where((x > -3) & (x < 3), grad / 6, 0).astype(res)


@lower(aten.hardswish.default)
def hardswish(x):
    (x,), res = _opmath(x)
    return (x * jnp.clip(x + 3, 0, 6) / 6).astype(res)


@lower(aten.hardswish_backward.default)
def hardswish_backward(grad, x):
    (grad, x), res = _opmath(grad, x)
    out = jnp.where(x <= -3, 0, jnp.where(x < 3, grad * (x / 3 + 0.5), grad))
    return out.astype(res)


def _softplus1(x):
    return jnp.where(x > 20, x, jnp.log1p(jnp.exp(x)))


@lower(aten.mish.default)
def mish(x):
    (x,), res = _opmath(x)
    return (x * jnp.tanh(_softplus1(x))).astype(res)


@lower(aten.mish_backward.default)
def mish_backward(grad, x):
    (grad, x), res = _opmath(grad, x)
    s = jax.nn.sigmoid(x)
    t = jnp.tanh(_softplus1(x))
    return (grad * (t + x * s * (1 - t * t))).astype(res)


@lower(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(x):
    (x,), res = _opmath(x)
    z = jnp.exp(-jnp.abs(x))
    # The buffer is what PyTorch's CPU kernel stores: exp(-|x|).
    return (jnp.minimum(x, 0) - jnp.log1p(z)).astype(res), z.astype(res)


@lower(aten.log_sigmoid_backward.default)
def log_sigmoid_backward(grad, x, buffer):
    (grad, x, z), res = _opmath(grad, x, buffer)
    neg = x < 0
    max_deriv = jnp.where(neg, 1, 0).astype(x.dtype)
    sgn_ = jnp.where(neg, 1, -1).astype(x.dtype)
    return ((max_deriv - sgn_ * (z / (1 + z))) * grad).astype(res)


@lower(aten.hardshrink.default)
def hardshrink(x, lambd=0.5):
    (x,), res = _opmath(x)
    lam = cast(lambd, x.dtype)
    return jnp.where((x >= -lam) & (x <= lam), 0, x).astype(res)


@lower(aten.hardshrink_backward.default, aten.softshrink_backward.default)
def shrink_backward(grad, x, lambd):
    (grad, x), res = _opmath(grad, x)
    lam = cast(lambd, x.dtype)
    return jnp.where((x >= -lam) & (x <= lam), 0, grad).astype(res)


@lower(aten.softshrink.default)
def softshrink(x, lambd=0.5):
    (x,), res = _opmath(x)
    lam = cast(lambd, x.dtype)
    return jnp.where(x > lam, x - lam, jnp.where(x < -lam, x + lam, 0)).astype(res)
