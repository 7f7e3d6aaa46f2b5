"""Losses: negative log likelihood, multi-margin, multilabel-margin, and the
CTC loss forward."""
from functools import reduce as functools_reduce

import jax
import jax.numpy as jnp
from jax import lax

from ..registry import ctx, lower
from .common import _up, aten


def _nll_parts(x, target, weight, ignore_index):
    """Per-element weights (0 where ignored) and the picked log-probabilities."""
    cdim = 1 if x.ndim >= 2 else 0
    valid = target != ignore_index
    safe = jnp.where(valid, target, 0)
    w = (_up(weight)[safe] if weight is not None else jnp.ones(safe.shape, _up(x).dtype))
    w = jnp.where(valid, w, 0)
    picked = jnp.take_along_axis(_up(x), jnp.expand_dims(safe, cdim), axis=cdim)
    return w, jnp.squeeze(picked, cdim), safe, cdim


@lower(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    w, picked, _, _ = _nll_parts(x, target, weight, ignore_index)
    losses = -picked * w
    total = jnp.sum(w)
    if reduction == 0:
        return losses.astype(x.dtype), jnp.zeros((), x.dtype)
    s = jnp.sum(losses)
    out = s / total if reduction == 1 else s
    return out.astype(x.dtype), total.astype(x.dtype)


@lower(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    w, _, safe, cdim = _nll_parts(x, target, weight, ignore_index)
    g = _up(grad)
    if reduction == 1:
        g = g / _up(total_weight)
    contrib = -w * g
    onehot = jax.nn.one_hot(safe, x.shape[cdim], axis=cdim, dtype=contrib.dtype)
    return (onehot * jnp.expand_dims(contrib, cdim)).astype(x.dtype)


def _reduce_loss(losses, reduction):
    if reduction == 1:
        return jnp.mean(losses)
    return jnp.sum(losses) if reduction == 2 else losses


def _multi_margin(x, target, p, margin, weight, reduction):
    """sum over i != y of w[y] * max(0, margin - x[y] + x[i])^p, over C."""
    x2 = x.reshape(-1, x.shape[-1] if x.ndim else 1)
    t = target.reshape(-1)
    xy = jnp.take_along_axis(x2, t[:, None], axis=1)
    z = margin - xy + x2
    # Strictly positive margins count (zero gradient at z == 0, as on CPU).
    h = jnp.where(z > 0, z if p == 1 else z * z, 0)
    h = jnp.where(jnp.arange(x2.shape[1]) == t[:, None], 0, h)
    if weight is not None:
        h = h * _up(weight)[t][:, None]
    losses = jnp.sum(h, axis=1) / x2.shape[1]
    return _reduce_loss(losses.reshape(target.shape), reduction)


@lower(aten.multi_margin_loss.default)
def multi_margin_loss(x, target, p=1, margin=1, weight=None, reduction=1):
    return _multi_margin(_up(x), target, p, margin, weight, reduction).astype(x.dtype)


multi_margin_loss.static_args = ("p",)


@lower(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward(grad, x, target, p, margin, weight=None, reduction=1):
    _, vjp = jax.vjp(lambda x_: _multi_margin(x_, target, p, margin, weight, reduction), _up(x))
    return vjp(_up(grad))[0].astype(x.dtype)


multi_margin_loss_backward.static_args = ("p",)


def _multilabel_margin(x, target, reduction):
    """Targets are the class indices before the first -1; the loss sums
    max(0, 1 - (x[target] - x[other])) over target/non-target pairs, over C."""
    C = x.shape[-1] if x.ndim else 1
    x2, t = x.reshape(-1, C), target.reshape(-1, C)
    valid = jnp.cumprod(t >= 0, axis=1).astype(bool)
    safe = jnp.where(valid, t, 0)
    is_target = jnp.any(valid[:, :, None] & (safe[:, :, None] == jnp.arange(C)), axis=1)
    xy = jnp.take_along_axis(x2, safe, axis=1)
    z = 1 - xy[:, :, None] + x2[:, None, :]
    h = jnp.where((z > 0) & valid[:, :, None] & ~is_target[:, None, :], z, 0)
    losses = jnp.sum(h, axis=(1, 2)) / C
    return (_reduce_loss(losses.reshape(target.shape[:-1] if target.ndim else ()), reduction),
            is_target.reshape(target.shape))


@lower(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(x, target, reduction):
    out, is_target = _multilabel_margin(_up(x), target, reduction)
    return out.astype(x.dtype), is_target.astype(x.dtype)


@lower(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad, x, target, reduction, is_target):
    _, vjp = jax.vjp(lambda x_: _multilabel_margin(x_, target, reduction)[0], _up(x))
    return vjp(_up(grad))[0].astype(x.dtype)


# ---- CTC loss ---------------------------------------------------------------
# _ctc_loss_backward is left to PyTorch's CPU kernel: its gradient,
# exp(lp) - exp(lcab + nll - lp), cancels terms of size |nll| (hundreds) in
# float32, so XLA's exp/log (a few ulps off glibc's) move results by ~1e-4
# relative, past OpInfo's tolerance. It reads this forward's nll and
# log_alpha (only t < input length, s < 2*target length + 1).

def _lse(*xs):
    """log(sum(exp(xs))) as CPU's CTC computes it (max shifted, 0 when all are
    -inf), -inf with a zero gradient when every term is -inf."""
    m = functools_reduce(jnp.maximum, xs)
    m = lax.stop_gradient(jnp.where(jnp.isneginf(m), 0, m))
    total = sum(jnp.exp(x - m) for x in xs)
    pos = total > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, total, 1)) + m, -jnp.inf)


def _ctc_labels(targets, tl, blank, max_tl, N):
    """The extended label sequence l' (N, 2*max_tl+1): blanks around each target."""
    if targets.ndim == 1:
        # Concatenated targets: sample n's start at the sum of the earlier lengths.
        starts = jnp.cumsum(tl) - tl
        j = starts[:, None] + jnp.arange(max_tl)
        targets = targets[jnp.clip(j, 0, max(targets.shape[0] - 1, 0))]
    s = jnp.arange(2 * max_tl + 1)
    if not max_tl:
        return jnp.full((N, 1), blank, jnp.int64)
    return jnp.where(s % 2 == 1, targets[:, jnp.clip((s - 1) // 2, 0, max_tl - 1)],
                     blank).astype(jnp.int64)


def _ctc(lp, targets, il, tl, blank, max_tl):
    """(neg log likelihood (N,), log_alpha (N, T, 2*max_tl+1)) of log_probs (T, N, C)."""
    T, N, _ = lp.shape
    il, tl = jnp.asarray(il, jnp.int64), jnp.asarray(tl, jnp.int64)
    lab = _ctc_labels(targets, tl, blank, max_tl, N)
    S = lab.shape[1]
    s = jnp.arange(S)
    prev2 = jnp.concatenate([jnp.full((N, 2), -1, lab.dtype), lab[:, :-2]], axis=1)
    skip = (s % 2 == 1) & (s >= 2) & (lab != prev2)
    inside = s < 2 * tl[:, None] + 1
    lp_lab = jnp.take_along_axis(lp, jnp.broadcast_to(lab, (T, N, S)), axis=2)
    neg = jnp.asarray(-jnp.inf, lp.dtype)
    a0 = jnp.where(inside & ((s == 0) | ((s == 1) & (tl[:, None] > 0))), lp_lab[0], neg)

    def shift(a, k):
        return jnp.concatenate([jnp.full((N, k), neg), a[:, :-k]], axis=1)

    def step(a, xs):
        lpt, t = xs
        new = _lse(a, shift(a, 1), jnp.where(skip, shift(a, 2), neg)) + lpt
        new = jnp.where(inside, new, neg)
        # Past its input length a sample's alphas stay put.
        new = jnp.where((t < il)[:, None], new, a)
        return new, new

    last, rest = lax.scan(step, a0, (lp_lab[1:], jnp.arange(1, T)))
    log_alpha = jnp.moveaxis(jnp.concatenate([a0[None], rest], axis=0), 0, 1)
    end = jnp.take_along_axis(last, jnp.stack([2 * tl, jnp.maximum(2 * tl - 1, 0)], 1), axis=1)
    nll = -_lse(end[:, 0], jnp.where(tl > 0, end[:, 1], neg))
    return nll, log_alpha


@lower(aten._ctc_loss.default, aten._ctc_loss.Tensor)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    if ctx.out is not None:
        max_tl = (ctx.out[1].shape[-1] - 1) // 2
    else:
        # Lengths given as tensors: log_alpha's width 2*max(target_lengths)+1
        # depends on their values, so it is sized for the longest possible target.
        max_tl = targets.shape[-1] if targets.ndim == 2 else targets.shape[0]
    nll, log_alpha = _ctc(_up(log_probs), targets, input_lengths, target_lengths, blank, max_tl)
    return nll.astype(log_probs.dtype), log_alpha.astype(log_probs.dtype)

