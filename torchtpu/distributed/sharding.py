"""DTensor's sharding rules for torchtpu's own attention ops.

scaled_dot_product_attention on tpu runs as torchtpu::attention and
torchtpu::attention_backward (torchtpu.ops.nn.attention), which DTensor has
no rules for: a model whose heads tensor parallelism splits (q, k and v
projections ColwiseParallel) would raise there. As PyTorch's rules for its
fused attention ops do, a call computes shard by shard when q, k and v are
split alike along a dim before the last two (the batch, or the heads), the
mask split with them where it spans that dim; otherwise all replicated.
Not split: a call with dropout (each shard would draw the same mask), and
heads of grouped-query attention (a shard's query heads must meet the key
heads they group with).
"""
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

_registered = False


def _splits(q, k, mask, dropout_p):
    """[(q's dim, the mask's dim or None)] of the dims a call may be split along."""
    if dropout_p > 0:
        return []
    found = []
    for dim in range(q.ndim - 2):
        if dim == q.ndim - 3 and k.shape[dim] != q.shape[dim]:
            continue  # grouped-query heads
        mask_dim = None
        if mask is not None:
            mask_dim = dim - (q.ndim - mask.ndim)
            if mask_dim < 0 or mask.shape[mask_dim] == 1:
                mask_dim = None
        found.append((dim, mask_dim))
    return found


def _mask_placement(mask, mask_dim):
    if mask is None:
        return None
    return Replicate() if mask_dim is None else Shard(mask_dim)


def _forward(q, k, v, mask, is_causal, scale, dropout_p, seed, offset):
    rules = [([Replicate()], [Replicate()] * 3 + [_mask_placement(mask, None)] + [None] * 5)]
    for dim, mask_dim in _splits(q, k, mask, dropout_p):
        rules.append(([Shard(dim)], [Shard(dim)] * 3 + [_mask_placement(mask, mask_dim)] + [None] * 5))
    return rules


def _backward(grad, q, k, v, mask, is_causal, scale, dropout_p, seed, offset, mask_grad):
    # The mask's gradient: replicated, split with it, or (a mask every shard
    # shares) each shard's part of the sum; an empty tensor when not asked for.
    def mask_grad_placement(mask_dim, split):
        if not mask_grad or mask is None:
            return Replicate()
        if mask_dim is not None:
            return Shard(mask_dim)
        return Partial() if split else Replicate()
    rules = [([Replicate()] * 3 + [mask_grad_placement(None, False)],
              [Replicate()] * 4 + [_mask_placement(mask, None)] + [None] * 6)]
    for dim, mask_dim in _splits(q, k, mask, dropout_p):
        rules.append(([Shard(dim)] * 3 + [mask_grad_placement(mask_dim, True)],
                      [Shard(dim)] * 4 + [_mask_placement(mask, mask_dim)] + [None] * 6))
    return rules


def register():
    """Once: DTensor runs torchtpu's attention ops by the rules above."""
    global _registered
    if not _registered:
        register_sharding(torch.ops.torchtpu.attention.default)(_forward)
        register_sharding(torch.ops.torchtpu.attention_backward.default)(_backward)
        _registered = True
