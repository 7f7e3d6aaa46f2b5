"""embedding_bag (sum, mean, max) with its backwards, embedding's max_norm
renormalization, and dropout's backward."""
import jax
import jax.numpy as jnp

from ..registry import lower
from ..util import ctx_dtype
from .common import _compute_dtype, _up, aten


# mode 0/1/2 = sum/mean/max; padding_idx -1 = none.

def _bag_layout(indices, offsets, num_bags, padding_idx):
    """Each index's bag, and whether it counts (inside a bag, not padding)."""
    L = indices.shape[0]
    pos = jnp.arange(L)
    bag = jnp.searchsorted(offsets[:num_bags], pos, side="right") - 1
    end = offsets[num_bags] if offsets.shape[0] > num_bags else L
    valid = (pos < end) & (bag >= 0)
    if padding_idx >= 0:
        valid = valid & (indices != padding_idx)
    return jnp.clip(bag, 0, max(num_bags - 1, 0)), valid


def _bag_counts(bag, valid, num_bags):
    return jax.ops.segment_sum(valid.astype(jnp.int64), bag, num_bags)


@lower(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    B = offsets.shape[0] - (1 if include_last_offset else 0)
    L = indices.shape[0]
    bag, valid = _bag_layout(indices, offsets, B, padding_idx)
    counts = _bag_counts(bag, valid, B)
    rows = _up(weight)[indices]
    if per_sample_weights is not None:
        rows = rows * _up(per_sample_weights)[:, None]
    if mode == 2:
        # The first maximum of each bag and feature (CPU's order); empty bags give 0.
        vals = jnp.where(valid[:, None], rows, -jnp.inf)
        best = jax.ops.segment_max(vals, bag, B)
        hit = valid[:, None] & (vals == best[bag])
        first = jax.ops.segment_min(jnp.where(hit, jnp.arange(L)[:, None], L), bag, B)
        empty = (counts == 0)[:, None]
        safe = jnp.where(empty, 0, first)
        out = jnp.where(empty, 0, jnp.take_along_axis(rows, safe, axis=0))
        max_indices = jnp.where(empty, 0, indices[safe])
    else:
        out = jax.ops.segment_sum(jnp.where(valid[:, None], rows, 0), bag, B)
        if mode == 1:
            out = out / jnp.maximum(counts, 1)[:, None]
    # offset2bag, bag_size and max_indices as PyTorch's CPU kernel leaves them.
    fast_sum = mode == 0 and padding_idx < 0 and _compute_dtype(weight.dtype) == jnp.float32
    offset2bag = jnp.zeros((0,), jnp.int64) if fast_sum else bag.astype(jnp.int64)
    bag_size = jnp.zeros((B,), jnp.int64) if mode == 0 else counts
    if mode != 2:
        max_indices = bag_size
    return out.astype(weight.dtype), offset2bag, bag_size, max_indices


@lower(aten._embedding_bag_backward.default)
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices,
                           num_weights, scale_grad_by_freq, mode, sparse, per_sample_weights,
                           padding_idx=-1):
    B, D = grad.shape
    g = _up(grad)
    bag, valid = _bag_layout(indices, offsets, B, padding_idx)
    if mode == 2:
        counts = _bag_counts(bag, valid, B)
        contrib = jnp.where((counts > 0)[:, None], g, 0)
        out = jnp.zeros((num_weights, D), g.dtype).at[maximum_indices, jnp.arange(D)].add(contrib)
        return out.astype(grad.dtype)
    rows = g[bag]
    if per_sample_weights is not None:
        rows = rows * _up(per_sample_weights)[:, None]
    if mode == 1:
        rows = rows / jnp.maximum(_bag_counts(bag, valid, B), 1)[bag][:, None]
    if scale_grad_by_freq:
        # PyTorch's CPU kernel scales the k-th distinct index (in sorted order)
        # by the frequency of sorted(indices)[k], not of the index itself.
        freq = jnp.zeros((num_weights,), g.dtype).at[indices].add(1)
        rank = jnp.cumsum(freq > 0) - 1
        rows = rows / freq[jnp.sort(indices)[rank[indices]]][:, None]
    out = jnp.zeros((num_weights, D), g.dtype).at[indices].add(jnp.where(valid[:, None], rows, 0))
    return out.astype(grad.dtype)


embedding_bag_backward.accepts = lambda *a, **k: not (a[9] if len(a) > 9 else k.get("sparse"))


@lower(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode,
                                              padding_idx=-1):
    bag, valid = _bag_layout(indices, offsets, grad.shape[0], padding_idx)
    out = jnp.sum(_up(grad)[bag] * _up(weight)[indices], axis=1)
    return jnp.where(valid, out, 0).astype(grad.dtype)


@lower(aten.native_dropout_backward.default)
def native_dropout_backward(grad, mask, scale):
    out = ctx_dtype()  # grad's, or float32 for an integer or bool grad, as on CPU
    return grad.astype(out) * mask.astype(out) * jnp.asarray(scale).astype(out)


@lower(aten.embedding_renorm.default)
def embedding_renorm(weight, indices, max_norm, norm_type):
    # nn.Embedding(max_norm=): each row indices name whose norm is above
    # max_norm is scaled to it, by max_norm / (norm + 1e-7) as ATen does. A
    # repeated index writes the same row twice.
    idx = indices.reshape(-1)
    rows = _up(weight[idx])
    norms = jnp.linalg.norm(rows, ord=norm_type, axis=-1, keepdims=True)
    scale = jnp.where(norms > max_norm, max_norm / (norms + 1e-7), 1)
    return weight.at[idx].set((rows * scale).astype(weight.dtype))
