"""Recurrent cells: the fused LSTM and GRU cells with their backwards.

PyTorch's RNN modules (nn.LSTM, nn.GRU and their cells) pick these ops for
any tensor off the CPU; they are CUDA kernels with no CPU kernel to fall
back to. The gate matmuls come in already done (input_gates = x @ W_ih^T,
hidden_gates = h @ W_hh^T); a cell adds the biases, applies the gates and
keeps in a workspace what its backward needs, laid out as CUDA's kernels
lay it out (aten/src/ATen/native/cuda/RNN.cu). Gate order: i, f, g, o for
the LSTM, r, z, n for the GRU.
"""
import jax
import jax.numpy as jnp

from ..registry import lower
from .common import _up, aten


def _sum(*terms):
    """The sum of the terms that are given (a bias may be None), computed
    in float32 for bf16/f16 as CUDA's kernels do."""
    total = None
    for t in terms:
        if t is not None:
            total = _up(t) if total is None else total + _up(t)
    return total


# ---- LSTM -------------------------------------------------------------------

@lower(aten._thnn_fused_lstm_cell.default)
def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = _sum(input_gates, hidden_gates, input_bias, hidden_bias)
    i, f, g, o = jnp.split(gates, 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * _up(cx) + i * g
    hy = o * jnp.tanh(cy)
    # The workspace keeps the activated gates for the backward.
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


# ---- GRU --------------------------------------------------------------------

@lower(aten._thnn_fused_gru_cell.default)
def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """hy = n + z * (hx - n), with r = sigmoid(i_r + h_r), z = sigmoid(i_z + h_z)
    and n = tanh(i_n + r * h_n), each gate with its biases."""
    ir, iz, in_ = jnp.split(_sum(input_gates, input_bias), 3, axis=-1)
    hr, hz, hn = jnp.split(_sum(hidden_gates, hidden_bias), 3, axis=-1)
    h = _up(hx)
    r = jax.nn.sigmoid(ir + hr)
    z = jax.nn.sigmoid(iz + hz)
    n = jnp.tanh(in_ + r * hn)
    hy = n + z * (h - n)
    # The workspace (batch, 5 * hidden): r, z, n, hx and h_n (with its bias),
    # what the backward needs.
    workspace = jnp.concatenate([r, z, n, h, hn], axis=-1)
    return hy.astype(hx.dtype), workspace.astype(hx.dtype)


@lower(aten._thnn_fused_gru_cell_backward.default)
def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, hn = jnp.split(_up(workspace), 5, axis=-1)
    g = _up(grad_hy)
    gz = g * (hx - n) * (1 - z) * z
    ghx = g * z
    gn = g * (1 - z) * (1 - n * n)
    ghn = gn * r
    gr = gn * hn * (1 - r) * r
    # The r and z gates get the same gradient through both matmuls; only the
    # n gate's differs (r scales the hidden part).
    grad_input_gates = jnp.concatenate([gr, gz, gn], axis=-1)
    grad_hidden_gates = jnp.concatenate([gr, gz, ghn], axis=-1)
    dt = grad_hy.dtype
    grad_input_bias = grad_hidden_bias = None
    if has_bias:
        grad_input_bias = jnp.sum(grad_input_gates, axis=0).astype(dt)
        grad_hidden_bias = jnp.sum(grad_hidden_gates, axis=0).astype(dt)
    return (grad_input_gates.astype(dt), grad_hidden_gates.astype(dt), ghx.astype(dt),
            grad_input_bias, grad_hidden_bias)
