"""Indexing: advanced indexing, gathers and scatters, masked ops, embedding.

PyTorch wraps negative indices (index, index_put, take, put) and raises on
out-of-range ones; XLA clamps gathers and drops scattered updates that fall
out of range. Every lowering here sends its indices through `wrap`; the range
check is not the lowerings' business: bounds.BOUNDS says which arguments of
which ops are indices, and the dispatcher checks them (on the host in debug
mode, inside the op's kernel otherwise: torchtpu.bounds).
"""
import jax
import jax.numpy as jnp
import torch

from .registry import lower
from .util import ctx_dtype

from ..compat import aten


def wrap(index, size):
    """Negative indices count from the end (out-of-range ones are not checked
    here)."""
    index = index.astype(jnp.int64) if index.dtype != jnp.int64 else index
    return jnp.where(index < 0, index + size, index)


def _dim(d, ndim):
    return d % ndim if ndim else 0


def is_mask(t):
    """A boolean (or legacy uint8) index: a torch tensor or a JAX array."""
    return t is not None and t.dtype in (torch.bool, torch.uint8, jnp.bool_, jnp.uint8)


# ---- index / index_put -----------------------------------------------------

def _index_tuple(x, indices):
    """PyTorch's index list (None = full slice) as a JAX index tuple; JAX
    follows the same rule for where advanced-index dims go."""
    return tuple(slice(None) if i is None else wrap(i, x.shape[d])
                 for d, i in enumerate(indices))


@lower(aten.index.Tensor, aten._unsafe_index.Tensor)
def index(x, indices):
    return x[_index_tuple(x, indices)]


# Boolean masks select a value-dependent number of elements: those calls go
# to the CPU fallback.
index.accepts = lambda x, indices: not any(is_mask(i) for i in indices)


def _mask_position(indices):
    """(position, mask) if the only index is one boolean mask, else None."""
    present = [(p, i) for p, i in enumerate(indices) if i is not None]
    if len(present) == 1 and is_mask(present[0][1]) and present[0][1].ndim > 0:
        return present[0]
    return None


def _mask_values_fit(x_ndim, pos, mask_ndim, values_shape):
    """True when values do not vary along the masked (value-dependent) dim
    of x[mask], so x[mask] = values is an elementwise select."""
    tail = x_ndim - pos - mask_ndim
    k = len(values_shape) - tail - 1
    return k < 0 or values_shape[k] == 1


@lower(aten.index_put.default, aten._unsafe_index_put.default)
def index_put(x, indices, values, accumulate=False):
    values = values.astype(x.dtype)
    found = _mask_position(indices)
    if found is not None:
        pos, mask = found
        m = mask.ndim
        mask = mask.astype(jnp.bool_).reshape((1,) * pos + mask.shape + (1,) * (x.ndim - pos - m))
        # values as x[mask] with the masked dim of size 1, then laid out like x
        one = x.shape[:pos] + (1,) + x.shape[pos + m:]
        v = jnp.broadcast_to(values, one).reshape(x.shape[:pos] + (1,) * m + x.shape[pos + m:])
        if accumulate:
            return jnp.where(mask, x + v, x) if x.dtype != jnp.bool_ else x | (mask & v)
        return jnp.where(mask, v, x)
    ref = x.at[_index_tuple(x, indices)]
    if accumulate:
        return ref.add(values) if x.dtype != jnp.bool_ else ref.max(values)
    return ref.set(values)


def _index_put_accepts(x, indices, values, accumulate=False):
    if not any(is_mask(i) for i in indices):
        return True
    found = _mask_position(indices)
    return found is not None and _mask_values_fit(x.dim(), found[0], found[1].dim(), tuple(values.shape))


index_put.accepts = _index_put_accepts


@lower(aten.nonzero_static.default)
def nonzero_static(x, *, size, fill_value=-1):
    if x.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    cols = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(cols, axis=1).astype(jnp.int64)


nonzero_static.static_args = ("size", "fill_value")


# ---- gather / scatter ------------------------------------------------------

def _grid(index, dim):
    """The full index tuple of scatter/gather: `index` on dim, each element's
    own position elsewhere."""
    idx = []
    for d in range(index.ndim):
        if d == dim:
            idx.append(index)
        else:
            idx.append(jnp.broadcast_to(
                jnp.arange(index.shape[d]).reshape([-1 if e == d else 1 for e in range(index.ndim)]),
                index.shape))
    return tuple(idx)


def _as_1d(fn):
    """Run fn on 0-d operands as 1-d ones (PyTorch allows dim 0 / -1 there)."""
    def lowering(x, dim, index, *rest, **kwargs):
        if x.ndim == 0:
            rest = [r.reshape(1) if hasattr(r, "ndim") and r.ndim == 0 and not _weak(r) else r
                    for r in rest]
            out = fn(x.reshape(1), 0, index.reshape(-1), *rest, **kwargs)
            from .registry import ctx
            return out.reshape(tuple(ctx.out[0].shape))
        return fn(x, dim, index, *rest, **kwargs)
    lowering.__name__ = fn.__name__
    return lowering


def _weak(v):
    return getattr(v, "weak_type", False) and v.ndim == 0


@lower(aten.gather.default)
@_as_1d
def gather(x, dim, index, sparse_grad=False):
    dim = _dim(dim, x.ndim)
    if index.ndim == 0:
        index = index.reshape(1)
    if index.size == 0:
        return jnp.zeros(index.shape, x.dtype)
    index = wrap(index, x.shape[dim])
    return x[_grid(index, dim)]


def _scatter_src(index, src):
    """src cut to index's shape (PyTorch reads only that corner)."""
    src = jnp.asarray(src)
    if src.ndim == 0:
        return jnp.broadcast_to(src, index.shape)
    return src[tuple(slice(0, n) for n in index.shape)]


def _scatter(x, dim, index, src, mode):
    dim = _dim(dim, x.ndim)
    if index.size == 0:
        return x
    index = wrap(index.reshape(index.shape or (1,)), x.shape[dim])
    src = _scatter_src(index, src).astype(x.dtype)
    ref = x.at[_grid(index, dim)]
    if mode == "add":
        return ref.add(src) if x.dtype != jnp.bool_ else ref.max(src)
    if mode == "multiply":
        return ref.multiply(src) if x.dtype != jnp.bool_ else ref.min(src)
    return ref.set(src)


@lower(aten.scatter.src, aten.scatter.value)
@_as_1d
def scatter(x, dim, index, src):
    return _scatter(x, dim, index, src, None)


@lower(aten.scatter.reduce, aten.scatter.value_reduce)
@_as_1d
def scatter_reduce_legacy(x, dim, index, src, reduce):
    return _scatter(x, dim, index, src, reduce)


@lower(aten.scatter_add.default)
@_as_1d
def scatter_add(x, dim, index, src):
    return _scatter(x, dim, index, src, "add")


def _limits(dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf, jnp.inf
    if dtype == jnp.bool_:
        return False, True
    info = jnp.iinfo(dtype)
    return info.min, info.max


@lower(aten.scatter_reduce.two)
@_as_1d
def scatter_reduce(x, dim, index, src, reduce, include_self=True):
    dim = _dim(dim, x.ndim)
    if index.size == 0:
        return x
    index = wrap(index.reshape(index.shape or (1,)), x.shape[dim])
    src = _scatter_src(index, src).astype(x.dtype)
    where = _grid(index, dim)
    hit = jnp.zeros(x.shape, jnp.int64).at[where].add(1)
    lo, hi = _limits(x.dtype)
    identity = {"sum": 0, "mean": 0, "prod": 1, "amax": lo, "amin": hi}[reduce]
    start = x if include_self else jnp.where(hit > 0, jnp.asarray(identity, x.dtype), x)
    ref = start.at[where]
    if reduce in ("sum", "mean"):
        out = ref.add(src) if x.dtype != jnp.bool_ else ref.max(src)
    elif reduce == "prod":
        out = ref.multiply(src) if x.dtype != jnp.bool_ else ref.min(src)
    elif reduce == "amax":
        out = ref.max(src)
    else:
        out = ref.min(src)
    if reduce == "mean":
        count = hit + 1 if include_self else jnp.maximum(hit, 1)
        if jnp.issubdtype(x.dtype, jnp.integer):
            out = jnp.floor_divide(out, count.astype(x.dtype))
        else:
            out = (out / count.astype(x.dtype)).astype(x.dtype)
    return out


# ---- index_* along a dim ---------------------------------------------------

def _along(x, dim, index, fn):
    """Apply fn(x_moved, index) with dim moved to the front, then move back."""
    if x.ndim == 0:
        return fn(x.reshape(1), wrap(index.reshape(-1), 1)).reshape(())
    dim = _dim(dim, x.ndim)
    index = wrap(index.reshape(-1), x.shape[dim])
    out = fn(jnp.moveaxis(x, dim, 0), index)
    return jnp.moveaxis(out, 0, dim)


def _source(x, dim, source):
    if x.ndim == 0 or source.ndim == 0:
        return source.reshape((-1,) + (1,) * max(x.ndim - 1, 0)) if source.ndim else source
    return jnp.moveaxis(source, _dim(dim, x.ndim), 0)


@lower(aten.index_select.default)
def index_select(x, dim, index):
    if x.ndim == 0:
        from .registry import ctx
        return x.reshape(1)[wrap(index.reshape(-1), 1)].reshape(tuple(ctx.out[0].shape))
    dim = _dim(dim, x.ndim)
    return jnp.take(x, wrap(index.reshape(-1), x.shape[dim]), axis=dim)


@lower(aten.index_add.default)
def index_add(x, dim, index, source, alpha=1):
    src = _source(x, dim, source).astype(x.dtype)
    if not (isinstance(alpha, int) and alpha == 1):
        src = src * jnp.asarray(alpha).astype(x.dtype)
    if x.dtype == jnp.bool_:
        return _along(x, dim, index, lambda v, i: v.at[i].max(src))
    return _along(x, dim, index, lambda v, i: v.at[i].add(src))


@lower(aten.index_copy.default)
def index_copy(x, dim, index, source):
    src = _source(x, dim, source).astype(x.dtype)
    return _along(x, dim, index, lambda v, i: v.at[i].set(src))


@lower(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(x, dim, index, value):
    value = jnp.asarray(value)
    if jnp.iscomplexobj(value) and not jnp.iscomplexobj(x):
        value = jnp.real(value)
    value = value.astype(x.dtype)
    return _along(x, dim, index, lambda v, i: v.at[i].set(value))


@lower(aten.index_reduce.default)
def index_reduce(x, dim, index, source, reduce, include_self=True):
    # The same reductions as scatter_reduce, over whole slices.
    if x.ndim == 0:
        return scatter_reduce(x, 0, index, source, reduce, include_self)
    dim = _dim(dim, x.ndim)
    index = wrap(index.reshape(-1), x.shape[dim])
    shape = [1] * x.ndim
    shape[dim] = -1
    full = jnp.broadcast_to(index.reshape(shape), source.shape)
    red = {"mean": "mean", "prod": "prod", "amax": "amax", "amin": "amin"}[reduce]
    return scatter_reduce(x, dim, full, source, red, include_self)


# ---- masks -----------------------------------------------------------------

@lower(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(x, mask, value):
    value = jnp.asarray(value)
    if jnp.iscomplexobj(value) and not jnp.iscomplexobj(x):
        value = jnp.real(value)
    return jnp.where(mask, value.astype(x.dtype), x).astype(ctx_dtype())


@lower(aten.masked_scatter.default)
def masked_scatter(x, mask, source):
    # The k-th True position takes source's k-th element: a running count
    # of the mask gives each position its source element (static shapes).
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    x = jnp.broadcast_to(x, shape)
    flat_mask = jnp.broadcast_to(mask, shape).reshape(-1)
    src = source.reshape(-1).astype(x.dtype)
    if src.size == 0:
        return x
    pos = jnp.clip(jnp.cumsum(flat_mask.astype(jnp.int64)) - 1, 0, src.size - 1)
    return jnp.where(flat_mask, src[pos], x.reshape(-1)).reshape(shape)


@lower(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad, mask, sizes):
    # source's gradient: grad at the True positions, in order, zero-padded.
    n = 1
    for s in sizes:
        n *= s
    shape = jnp.broadcast_shapes(grad.shape, mask.shape)
    flat_mask = jnp.broadcast_to(mask, shape).reshape(-1)
    g = jnp.broadcast_to(grad, shape).reshape(-1)
    pos = jnp.where(flat_mask, jnp.cumsum(flat_mask.astype(jnp.int64)) - 1, n)
    return jnp.zeros(n, grad.dtype).at[pos].set(g, mode="drop").reshape(tuple(sizes))


# ---- flat indexing ---------------------------------------------------------

@lower(aten.take.default)
def take(x, index):
    flat = x.reshape(-1)
    if flat.size == 0:
        return jnp.zeros(index.shape, x.dtype)
    return flat[wrap(index, flat.size)]


@lower(aten.put.default)
def put(x, index, source, accumulate=False):
    flat = x.reshape(-1)
    if index.size == 0:
        return x
    ref = flat.at[wrap(index.reshape(-1), flat.size)]
    src = source.reshape(-1).astype(x.dtype)
    out = (ref.add(src) if x.dtype != jnp.bool_ else ref.max(src)) if accumulate else ref.set(src)
    return out.reshape(x.shape)


# ---- embedding -------------------------------------------------------------

@lower(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, wrap(indices, weight.shape[0]), axis=0)


@lower(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = indices.reshape(-1).astype(jnp.int64)
    g = grad.reshape(idx.shape[0], -1)
    keep = idx != padding_idx
    if scale_grad_by_freq:
        counts = jnp.zeros(num_weights, jnp.int64).at[idx].add(1)
        g = g / counts[idx][:, None].astype(g.dtype)
    g = jnp.where(keep[:, None], g, jnp.zeros((), g.dtype))
    out = jnp.zeros((num_weights, g.shape[1]), g.dtype).at[idx].add(g)
    return out.reshape((num_weights,) + grad.shape[indices.ndim:])


# ---- writes at a dynamic offset ------------------------------------------------
# torchtpu::write_at(base, src, dim, offset): base with src written over it
# from `offset` along `dim` (a functional dynamic_update_slice). The offset
# is a Scalar, so a kernel feeds it instead of keying on it: the grown
# storages of torchtpu.dispatch.growth extend by one step per call without
# compiling one kernel per length.
_WRITE_LIB = torch.library.Library("torchtpu", "FRAGMENT")
_WRITE_LIB.define("write_at(Tensor base, Tensor src, int dim, Scalar offset) -> Tensor")
_WRITE_LIB.impl("write_at", lambda base, src, dim, offset: torch.empty_like(base), "Meta")


@lower(torch.ops.torchtpu.write_at.default)
def write_at(base, src, dim, offset):
    starts = [jnp.asarray(offset if d == dim else 0, jnp.int32) for d in range(base.ndim)]
    return jax.lax.dynamic_update_slice(base, src.astype(base.dtype), starts)


# ---- lengths padded to a bucket ------------------------------------------------
# torchtpu::mask_past(x, dim, extent, fill): x with every position from
# `extent` on along `dim` set to fill. torchtpu::read_rows(src, start,
# count, rows): `rows` rows of src from `start`, those from `count` on zeros
# (and never read past src's end). Extents and starts are Scalars, fed at run
# time: the tensors of a length that varies (torchtpu.dispatch.lengths) are
# computed on arrays padded to a bucket, one kernel per bucket, not per length.
_WRITE_LIB.define("mask_past(Tensor x, int dim, Scalar extent, Scalar fill) -> Tensor")
_WRITE_LIB.impl("mask_past", lambda x, dim, extent, fill: torch.empty_like(x), "Meta")
_WRITE_LIB.define("read_rows(Tensor src, Scalar start, Scalar count, int rows) -> Tensor")
_WRITE_LIB.impl("read_rows", lambda src, start, count, rows: src.new_empty((rows,) + src.shape[1:]),
                "Meta")


def _before(extent, length, dim, ndim):
    """Whether each position along dim comes before extent, shaped to
    broadcast against an array of ndim dims."""
    shape = [1] * ndim
    shape[dim] = length
    return (jnp.arange(length) < extent).reshape(shape)


@lower(torch.ops.torchtpu.mask_past.default)
def mask_past(x, dim, extent, fill):
    return jnp.where(_before(extent, x.shape[dim], dim, x.ndim), x, jnp.asarray(fill, x.dtype))


@lower(torch.ops.torchtpu.read_rows.default)
def read_rows(src, start, count, rows):
    valid = _before(count, rows, 0, src.ndim)
    index = jnp.where(valid.reshape(rows), start + jnp.arange(rows), 0)
    return jnp.where(valid, jnp.take(src, index, axis=0, mode="clip"), jnp.zeros((), src.dtype))
