"""Randomized leaky relu, the _trilinear product, and the fused LSTM cell
with its backward."""
import jax
import jax.numpy as jnp

from ..registry import lower
from ..util import ctx_dtype
from .common import HIGHEST, _up, aten


# ---- activations and products ----------------------------------------------

@lower(aten.rrelu_with_noise_functional.default, random=True)
def rrelu_with_noise_functional(x, noise, lower=0.125, upper=1.0 / 3, training=False,
                                generator=None, *, key):
    """Training: each x <= 0 is scaled by r ~ U(lower, upper), the noise keeps
    r (1 elsewhere); otherwise a leaky relu of slope (lower + upper) / 2 that
    leaves the noise alone. rrelu_with_noise (which writes noise) runs
    through this."""
    xs = _up(x)
    if not training:
        return jnp.where(xs >= 0, xs, xs * ((lower + upper) / 2)).astype(x.dtype), noise
    r = jax.random.uniform(key, x.shape, xs.dtype) * (upper - lower) + lower
    r = jnp.where(xs <= 0, r, 1)
    return (xs * r).astype(x.dtype), r.astype(noise.dtype)


@lower(aten._trilinear.default)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """sum over sumdim of i1 * i2 * i3, each with size-1 dims inserted at its
    expand positions."""
    ndim = i1.ndim + len(expand1)
    ins = [(_up(t), set(e)) for t, e in ((i1, expand1), (i2, expand2), (i3, expand3))]
    sizes = [1] * ndim
    for t, e in ins:
        kept = [d for d in range(ndim) if d not in e]
        for d, n in zip(kept, t.shape):
            if n != 1:
                sizes[d] = n
    letters = "abcdefghijklmnopqrstuvwxyz"
    operands, subs = [], []
    for t, e in ins:
        kept = [d for d in range(ndim) if d not in e]
        operands.append(jnp.broadcast_to(t, tuple(sizes[d] for d in kept)))
        subs.append("".join(letters[d] for d in kept))
    out = "".join(letters[d] for d in range(ndim) if d not in set(sumdim))
    res = jnp.einsum(",".join(subs) + "->" + out, *operands, precision=HIGHEST)
    # A dim no input has stays size 1 (unless summed).
    res = res.reshape(tuple(sizes[d] for d in range(ndim) if d not in set(sumdim)))
    return res.astype(ctx_dtype())


# ---- recurrent cells --------------------------------------------------------

@lower(aten._thnn_fused_lstm_cell.default)
def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = _up(input_gates) + _up(hidden_gates)
    if input_bias is not None:
        gates = gates + _up(input_bias)
    if hidden_bias is not None:
        gates = gates + _up(hidden_bias)
    i, f, g, o = jnp.split(gates, 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * _up(cx) + i * g
    hy = o * jnp.tanh(cy)
    # The workspace keeps the activated gates for the backward, as CUDA's does.
    workspace = jnp.concatenate([i, f, g, o], axis=-1)
    dt = cx.dtype
    return hy.astype(dt), cy.astype(dt), workspace.astype(dt)


@lower(aten._thnn_fused_lstm_cell_backward_impl.default)
def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = jnp.split(_up(workspace), 4, axis=-1)
    c = _up(cy)
    gh = _up(grad_hy) if grad_hy is not None else jnp.zeros_like(c)
    gc = _up(grad_cy) if grad_cy is not None else jnp.zeros_like(c)
    tanh_c = jnp.tanh(c)
    gcy = gh * o * (1 - tanh_c * tanh_c) + gc
    go = gh * tanh_c * o * (1 - o)
    gi = gcy * g * i * (1 - i)
    gg = gcy * i * (1 - g * g)
    gf = gcy * _up(cx) * f * (1 - f)
    grad_gates = jnp.concatenate([gi, gf, gg, go], axis=-1)
    grad_cx = gcy * f
    grad_bias = jnp.sum(grad_gates, axis=0).astype(cx.dtype) if has_bias else None
    return grad_gates.astype(cx.dtype), grad_cx.astype(cx.dtype), grad_bias

