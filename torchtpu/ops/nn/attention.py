"""Softmax and log-softmax with their backwards, and
scaled_dot_product_attention as one torchtpu::attention op each way."""
import math
import warnings

import jax
import jax.numpy as jnp
import torch

from .. import random as rng
from ..registry import lower
from ..util import ctx_dtype, matmul_precision
from .common import _up, aten


# ---- softmax ----------------------------------------------------------------

# softmax.int / log_softmax.int decompose before dispatch; their lowerings
# serve the out= variants, which reach the dispatcher.
def _axis(x, dim):
    # A 0-d tensor is one element along dim 0 (or -1), as ATen takes it.
    return dim if x.ndim else None


@lower(aten._softmax.default, aten.softmax.int)
def softmax(x, dim, half_to_float=None):
    return jax.nn.softmax(_up(x), axis=_axis(x, dim)).astype(ctx_dtype())


@lower(aten._log_softmax.default, aten.log_softmax.int)
def log_softmax(x, dim, half_to_float=None):
    return jax.nn.log_softmax(_up(x), axis=_axis(x, dim)).astype(ctx_dtype())


@lower(aten._softmax_backward_data.default)
def softmax_backward_data(grad, out, dim, input_dtype):
    g, o = _up(grad), _up(out)
    return (o * (g - jnp.sum(g * o, axis=_axis(out, dim), keepdims=True))).astype(ctx_dtype())


@lower(aten._log_softmax_backward_data.default)
def log_softmax_backward_data(grad, out, dim, input_dtype):
    g, o = _up(grad), _up(out)
    return (g - jnp.exp(o) * jnp.sum(g, axis=_axis(out, dim), keepdims=True)).astype(ctx_dtype())


# ---- attention ----------------------------------------------------------------
# scaled_dot_product_attention is a composite op. On a PrivateUse1 device
# PyTorch runs its math path: about 20 ops forward and 25 backward, ~1.3 ms
# of host time per call, and a fused backend for a device can only be chosen
# from C++. So torchtpu takes the op at its autograd key (device.py) and runs
# the math path's computation as one op each way: torchtpu::attention and
# torchtpu::attention_backward, defined here with their meta kernels. With
# dropout, both take the random state (seed, offset) of the call as dynamic
# scalars: backward draws the forward's mask again instead of keeping it.

_ATTENTION_ARGS = "Tensor? mask, bool is_causal, float scale, float dropout_p, Scalar seed, Scalar offset"
_ATTENTION_LIB = torch.library.Library("torchtpu", "DEF")
_ATTENTION_LIB.define(f"attention(Tensor q, Tensor k, Tensor v, {_ATTENTION_ARGS}) -> Tensor")
# mask_grad: whether to return the mask's gradient (else an empty tensor).
_ATTENTION_LIB.define(f"attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, {_ATTENTION_ARGS}, "
                      "bool mask_grad) -> (Tensor, Tensor, Tensor, Tensor)")
_ATTENTION_LIB.define("attention_dropout_keep(Tensor q, Tensor k, float dropout_p, Scalar seed, "
                      "Scalar offset) -> Tensor")
# Attention over keys and values padded along their length to a bucket, of
# which the first `extent` are real (torchtpu.dispatch.growth's grown
# caches); extent is a Scalar, fed at run time, so a decode step compiles one
# kernel per bucket.
_ATTENTION_LIB.define("attention_grown(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, "
                      "Scalar extent) -> Tensor")
_ATTENTION_LIB.impl("attention_grown", lambda q, k, v, *args: q.new_empty(q.shape[:-1] + v.shape[-1:]),
                    "Meta")
_ATTENTION_LIB.impl("attention", lambda q, k, v, *args: q.new_empty(q.shape[:-1] + v.shape[-1:]), "Meta")
# Contiguous, as the kernels' results are (whatever the inputs' strides): a
# DTensor's strides are its meta result's, and a view of it must fit its shards.
_ATTENTION_LIB.impl("attention_backward", lambda grad, q, k, v, mask, *args: (
    q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
    mask.new_empty(mask.shape) if args[-1] else q.new_empty(0)), "Meta")
_ATTENTION_LIB.impl("attention_dropout_keep", lambda q, k, *args: torch.empty(
    q.shape[:-1] + k.shape[-2:-1], dtype=torch.bool, device=q.device), "Meta")


def _dropout_keep(shape, dropout_p, seed, offset):
    """Which attention weights dropout keeps, keyed by the call's random state."""
    return rng.dropout_keep(rng.key_from(seed, offset), shape, dropout_p)


def _attention(q, k, v, mask, is_causal, scale, dropout_p, seed, offset):
    """scaled_dot_product_attention's computation. float32 and float64 as
    PyTorch's math path: q and k each scaled by sqrt(|scale|) before their
    product, at the float32 matmul precision. bfloat16 and float16 as
    CUDA's flash kernel and jax.nn.dot_product_attention compute them: the
    products of the inputs themselves accumulated in float32 (on a TPU, the
    matrix unit's native products; upcast first, they would cost six passes
    each), the scale applied to those float32 scores, exp(s - max) in float32
    rounded to the inputs' dtype for the product with v, divided by its
    float32 sum, the result rounded once. In every dtype: the mask added (a
    bool mask as 0/-inf), -inf above the diagonal if is_causal; weights of 0
    on fully masked rows; dropout. k and v with fewer heads than q
    (enable_gqa): each of their heads serves that many consecutive heads of q."""
    dtype = q.dtype
    low = dtype in (jnp.bfloat16, jnp.float16)
    if not low:
        q, k, v = _up(q), _up(k), _up(v)
    if k.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = jnp.repeat(k, group, axis=-3), jnp.repeat(v, group, axis=-3)
    if low:
        s = jnp.matmul(q, jnp.swapaxes(k, -1, -2), preferred_element_type=jnp.float32) * scale
    else:
        root = math.sqrt(abs(scale))
        s = jnp.matmul(q * (-root if scale < 0 else root), jnp.swapaxes(k * root, -1, -2),
                       precision=matmul_precision())
    if mask is not None:
        s = s + (jnp.where(mask, 0, -jnp.inf).astype(s.dtype) if mask.dtype == jnp.bool_
                 else mask.astype(s.dtype))
    if is_causal:
        # With a mask as well, both apply (as on CPU; the math path refuses).
        s = jnp.where(jnp.tril(jnp.ones((q.shape[-2], k.shape[-2]), jnp.bool_)), s, -jnp.inf)
    if low:
        # The flash kernels' order: exp(s - max) rounded for the product with
        # v, the division by its float32 sum last. A fully masked row's
        # weights are all exp(-inf) = 0, and so is its result.
        top = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        masked = top == -jnp.inf
        e = jnp.exp(s - jnp.where(masked, 0, top))
        total = jnp.where(masked, 1, jnp.sum(e, axis=-1, keepdims=True))
        e = _dropped(e, dropout_p, seed, offset)
        return (jnp.matmul(e.astype(dtype), v, preferred_element_type=jnp.float32) / total).astype(dtype)
    # Softmax of a finite stand-in on fully masked rows: their gradient is 0,
    # not the NaN a softmax of -inf alone would give.
    masked = jnp.all(s == -jnp.inf, axis=-1, keepdims=True)
    p = jnp.where(masked, 0, jax.nn.softmax(jnp.where(masked, 0, s), axis=-1))
    p = _dropped(p, dropout_p, seed, offset)
    return jnp.matmul(p, v, precision=matmul_precision()).astype(dtype)


def _dropped(p, dropout_p, seed, offset):
    """Attention weights p after dropout."""
    if dropout_p >= 1:
        return jnp.zeros_like(p)
    if dropout_p > 0:
        return jnp.where(_dropout_keep(p.shape, dropout_p, seed, offset), p * (1 / (1 - dropout_p)), 0)
    return p


@lower(torch.ops.torchtpu.attention.default, matmul=True)
def attention(q, k, v, mask, is_causal, scale, dropout_p, seed, offset):
    return _attention(q, k, v, mask, is_causal, scale, dropout_p, seed, offset)


@lower(torch.ops.torchtpu.attention_grown.default, matmul=True)
def attention_grown(q, k, v, mask, scale, extent):
    # A masked key's weight is exactly 0: the result is attention over the
    # first `extent` keys alone.
    valid = jnp.arange(k.shape[-2]) < extent
    if mask is None:
        mask = valid
    elif mask.dtype == jnp.bool_:
        mask = mask & valid
    else:
        mask = jnp.where(valid, mask, -jnp.inf)
    return _attention(q, k, v, mask, False, scale, 0.0, 0, 0)


@lower(torch.ops.torchtpu.attention_backward.default, matmul=True)
def attention_backward(grad, q, k, v, mask, is_causal, scale, dropout_p, seed, offset, mask_grad):
    def attend(q_, k_, v_, mask_=mask):
        return _attention(q_, k_, v_, mask_, is_causal, scale, dropout_p, seed, offset)
    grad = grad.astype(q.dtype)
    if mask_grad:
        return jax.vjp(attend, q, k, v, mask)[1](grad)
    return (*jax.vjp(attend, q, k, v)[1](grad), jnp.zeros((0,), q.dtype))


@lower(torch.ops.torchtpu.attention_dropout_keep.default)
def attention_dropout_keep(q, k, dropout_p, seed, offset):
    return _dropout_keep(q.shape[:-1] + k.shape[-2:-1], dropout_p, seed, offset)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, *args):
        ctx.save_for_backward(q, k, v, mask)
        ctx.args = args  # is_causal, scale, dropout_p, seed, offset
        return torch.ops.torchtpu.attention(q, k, v, mask, *args)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask = ctx.saved_tensors
        mask_grad = ctx.needs_input_grad[3]
        if torch.is_grad_enabled():
            # create_graph=True: gradients that are differentiable in turn,
            # through PyTorch's composite.
            wanted = (q, k, v, mask)
            inputs = [t for t, w in zip(wanted, ctx.needs_input_grad) if w]
            grads = iter(torch.autograd.grad(_composite_attention(q, k, v, mask, *ctx.args),
                                             inputs, grad, create_graph=True))
            grads = tuple(next(grads) if w else None for w in ctx.needs_input_grad[:4])
        else:
            grads = torch.ops.torchtpu.attention_backward(grad, q, k, v, mask, *ctx.args, mask_grad)
            grads = grads[:3] + (grads[3] if mask_grad else None,)
        return grads + (None,) * len(ctx.args)


def _composite_attention(q, k, v, mask, is_causal, scale, dropout_p, seed, offset):
    """The same attention through PyTorch's math path, op by op: a bool mask
    as 0/-inf (as scaled_dot_product_attention gives it to the math path), a
    causal mask folded into it (the math path takes one of them), the dropout
    mask the one op draws."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    if is_causal and mask is not None:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = mask.masked_fill(~causal, float("-inf"))
        is_causal = False
    keep = None
    if dropout_p > 0:
        keep = torch.ops.torchtpu.attention_dropout_keep(q, k, dropout_p, seed, offset)
    with warnings.catch_warnings():
        # Its note that an explicit dropout mask is meant for tests.
        warnings.simplefilter("ignore")
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, mask, dropout_p, is_causal, dropout_mask=keep, scale=scale,
            enable_gqa=q.dim() >= 3 and q.shape[-3] != k.shape[-3])[0]


def _attention_applies(q, k, v, mask, dropout_p, is_causal, enable_gqa):
    """Whether one attention op computes this call as the math path would;
    other calls (a batch that broadcasts, invalid input, heads that differ
    without enable_gqa, a mask that needs a gradient with is_causal, which
    the math path refuses) take PyTorch's composite, its checks and errors
    included."""
    if not (0.0 <= dropout_p <= 1.0) or not q.is_floating_point():
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dim() == k.dim() == v.dim() >= 2):
        return False
    same_heads = q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
    if not same_heads and enable_gqa and q.dim() >= 3:
        # Grouped-query attention: k and v have fewer heads.
        same_heads = (q.shape[:-3] == k.shape[:-3] == v.shape[:-3] and k.shape[-3] == v.shape[-3]
                      and k.shape[-3] > 0 and q.shape[-3] % k.shape[-3] == 0)
    if not (same_heads and q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2]):
        return False
    if mask is None:
        return True
    if (mask.requires_grad and is_causal) or mask.device != q.device or mask.dtype not in (
            torch.bool, torch.float32, q.dtype):
        return False
    try:
        return torch.broadcast_shapes(mask.shape, q.shape[:-1] + k.shape[-2:-1]) == q.shape[:-1] + k.shape[-2:-1]
    except RuntimeError:
        return False


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                 scale=None, enable_gqa=False):
    """aten.scaled_dot_product_attention at the tpu autograd key."""
    if not _attention_applies(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa):
        return torch.ops.aten.scaled_dot_product_attention.default.decompose(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    dropout_p = float(dropout_p)
    # The random state this call draws its dropout mask with (none without).
    seed, offset = rng.next_key() if dropout_p > 0 else (0, 0)
    args = (is_causal, scale, dropout_p, seed, offset)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, attn_mask)):
        return _Attention.apply(q, k, v, attn_mask, *args)
    return torch.ops.torchtpu.attention(q, k, v, attn_mask, *args)

