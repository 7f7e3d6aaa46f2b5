"""Normalization: batch norm (training, no stats, inference), layer norm and
group norm, with their backwards; weight norm's backward."""
import math

import jax.numpy as jnp
import torch
from jax import lax

from ..registry import lower
from .common import _up, aten


def _bcast_channel(v, ndim):
    """A per-channel vector shaped to broadcast over (N, C, *spatial)."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _batch_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - _bcast_channel(mean, x.ndim)), axis=axes)
    return mean, var, math.prod(x.shape[a] for a in axes)


def _bn_apply(x, mean, invstd, weight, bias):
    out = (x - _bcast_channel(mean, x.ndim)) * _bcast_channel(invstd, x.ndim)
    if weight is not None:
        out = out * _bcast_channel(_up(weight), x.ndim)
    if bias is not None:
        out = out + _bcast_channel(_up(bias), x.ndim)
    return out


def _bn_train(x, weight, bias, running_mean, running_var, momentum, eps):
    xs = _up(x)
    mean, var, n = _batch_stats(xs)
    invstd = lax.rsqrt(var + eps)
    out = _bn_apply(xs, mean, invstd, weight, bias).astype(x.dtype)
    new_rm = new_rv = None
    if running_mean is not None:
        new_rm = ((1 - momentum) * _up(running_mean) + momentum * mean).astype(running_mean.dtype)
    if running_var is not None:
        unbiased = var * (n / max(n - 1, 1))
        new_rv = ((1 - momentum) * _up(running_var) + momentum * unbiased).astype(running_var.dtype)
    return out, mean, invstd, new_rm, new_rv


@lower(aten._native_batch_norm_legit_functional.default)
def batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        out, mean, invstd, rm, rv = _bn_train(x, weight, bias, running_mean, running_var,
                                              momentum, eps)
        return out, mean, invstd, rm, rv
    out, mean, invstd = batch_norm_no_training(x, weight, bias, running_mean, running_var,
                                               momentum, eps)
    return out, mean, invstd, running_mean, running_var


@lower(aten._native_batch_norm_legit.no_stats)
def batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    out, mean, invstd, _, _ = _bn_train(x, weight, bias, None, None, momentum, eps)
    return out, mean, invstd


@lower(aten._native_batch_norm_legit_no_training.default)
def batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    xs = _up(x)
    invstd = lax.rsqrt(_up(running_var) + eps)
    out = _bn_apply(xs, _up(running_mean), invstd, weight, bias).astype(x.dtype)
    return out, jnp.zeros((0,), xs.dtype), jnp.zeros((0,), xs.dtype)


def _stats_dtypes(meta_dtypes, x, *params, **kwargs):
    # CPU keeps the saved mean/invstd in the input's dtype unless a parameter
    # has another dtype (then float32); the meta kernels always say float32.
    tensors = [p for p in params if isinstance(p, torch.Tensor)]
    if all(p.dtype == x.dtype for p in tensors):
        return [meta_dtypes[0], x.dtype, x.dtype, *meta_dtypes[3:]]
    return meta_dtypes


for _fn in (batch_norm_functional, batch_norm_no_stats, batch_norm_no_training):
    _fn.result_dtypes = _stats_dtypes


@lower(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean,
                               save_invstd, train, eps, output_mask):
    xs, g = _up(x), _up(grad)
    axes = (0,) + tuple(range(2, x.ndim))
    if train:
        mean, invstd = _up(save_mean), _up(save_invstd)
    else:
        mean, invstd = _up(running_mean), lax.rsqrt(_up(running_var) + eps)
    xhat = (xs - _bcast_channel(mean, x.ndim)) * _bcast_channel(invstd, x.ndim)
    gb = jnp.sum(g, axis=axes)
    gw = jnp.sum(g * xhat, axis=axes)
    w = _up(weight) if weight is not None else jnp.ones_like(mean)
    scale = _bcast_channel(w * invstd, x.ndim)
    if train:
        n = math.prod(x.shape[a] for a in axes)
        gi = scale * (g - _bcast_channel(gb / n, x.ndim) - xhat * _bcast_channel(gw / n, x.ndim))
    else:
        gi = g * scale
    wdt = weight.dtype if weight is not None else x.dtype
    return (gi.astype(x.dtype) if output_mask[0] else None,
            gw.astype(wdt) if output_mask[1] else None,
            gb.astype(wdt) if output_mask[2] else None)


def _layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * _up(weight)
    if bias is not None:
        out = out + _up(bias)
    return out, mean, rstd


@lower(aten.native_layer_norm.default)
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    out, mean, rstd = _layer_norm(_up(x), normalized_shape, weight, bias, eps)
    return out.astype(x.dtype), mean, rstd


native_layer_norm.result_dtypes = _stats_dtypes


def _norm_input_grad(gxhat, xhat, rstd, axes):
    """d(loss)/dx of xhat = (x - mean) * rstd with the statistics over axes."""
    m = math.prod(gxhat.shape[a] for a in axes)
    s1 = jnp.sum(gxhat, axis=axes, keepdims=True)
    s2 = jnp.sum(gxhat * xhat, axis=axes, keepdims=True)
    return rstd * (gxhat - s1 / m - xhat * (s2 / m))


@lower(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias,
                               output_mask):
    g = _up(grad)
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    lead = tuple(range(x.ndim - len(normalized_shape)))
    xhat = (_up(x) - _up(mean)) * _up(rstd)
    gxhat = g * _up(weight) if weight is not None else g
    gx = _norm_input_grad(gxhat, xhat, _up(rstd), axes) if output_mask[0] else None
    gw = jnp.sum(g * xhat, axis=lead) if output_mask[1] and weight is not None else None
    gb = jnp.sum(g, axis=lead) if output_mask[2] and bias is not None else None
    return (gx.astype(x.dtype) if gx is not None else None,
            gw.astype(weight.dtype) if gw is not None else None,
            gb.astype(bias.dtype) if gb is not None else None)


def _group_norm(x, weight, bias, N, C, HxW, group, eps):
    xs = x.reshape(N, group, C // group * HxW)  # (not -1: N may be 0)
    mean = jnp.mean(xs, axis=-1)
    var = jnp.mean(jnp.square(xs - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    out = ((xs - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    if weight is not None:
        out = out * _bcast_channel(weight, x.ndim)
    if bias is not None:
        out = out + _bcast_channel(bias, x.ndim)
    return out, mean, rstd


@lower(aten.native_group_norm.default)
def native_group_norm(x, weight, bias, N, C, HxW, group, eps):
    w = _up(weight) if weight is not None else None
    b = _up(bias) if bias is not None else None
    out, mean, rstd = _group_norm(_up(x), w, b, N, C, HxW, group, eps)
    return out.astype(x.dtype), mean, rstd


@lower(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad, x, mean, rstd, weight, N, C, HxW, group, output_mask):
    g = _up(grad)
    xg = _up(x).reshape(N, group, C // group * HxW)
    m, r = _up(mean)[..., None], _up(rstd)[..., None]
    xhat = (xg - m) * r
    gxhat = g * _bcast_channel(_up(weight), x.ndim) if weight is not None else g
    gx = _norm_input_grad(gxhat.reshape(xg.shape), xhat, r, (2,)).reshape(x.shape)
    axes = (0,) + tuple(range(2, x.ndim))
    gw = jnp.sum(g * xhat.reshape(x.shape), axis=axes)
    gb = jnp.sum(g, axis=axes)
    wdt = weight.dtype if weight is not None else x.dtype
    return (gx.astype(x.dtype) if output_mask[0] else None,
            gw.astype(wdt) if output_mask[1] else None,
            gb.astype(wdt) if output_mask[2] else None)


@lower(aten._weight_norm_interface_backward.default)
def weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    # ATen's, with the sums over every dim but dim: grad_g = sum(grad_w * v) / norm,
    # grad_v = g / norm * (grad_w - v * sum(grad_w * v) / norm^2).
    axes = tuple(i for i in range(saved_v.ndim) if i != dim)
    gw, v, norms = _up(grad_w), _up(saved_v), _up(saved_norms)
    sums = jnp.sum(gw * v, axis=axes, keepdims=True)
    grad_v = (_up(saved_g) / norms) * (gw - v * (sums / (norms * norms)))
    return grad_v.astype(saved_v.dtype), (sums / norms).astype(saved_g.dtype)
