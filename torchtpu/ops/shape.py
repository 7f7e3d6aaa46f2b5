"""Shape ops that make new tensors (views are handled by the dispatcher):
concatenation, flips and rolls, padding, triangles, dtype reinterpretation."""
import jax
import jax.numpy as jnp
from jax import lax

from .registry import lower
from .util import ctx_dtype

from ..compat import aten


def _out_shape(i=0):
    from .registry import ctx
    return tuple(ctx.out[i].shape)


def _dim(d, ndim):
    return d % ndim if ndim else 0


@lower(aten.cat.default)
def cat(tensors, dim=0):
    # Dtypes are promoted over all inputs; legacy 1-D empty tensors are skipped
    # for shapes, as in PyTorch.
    dtype = ctx_dtype()
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return jnp.zeros(_out_shape(), dtype)
    dim = _dim(dim, kept[0].ndim)
    return jnp.concatenate([t.astype(dtype) for t in kept], axis=dim)


@lower(aten.stack.default)
def stack(tensors, dim=0):
    dtype = ctx_dtype()
    return jnp.stack([t.astype(dtype) for t in tensors], axis=_dim(dim, tensors[0].ndim + 1))


@lower(aten._unsafe_view.default, aten._reshape_copy.default, aten.view_copy.default,
       aten._reshape_alias_copy.default)
def reshape(x, *args, **kwargs):
    return x.reshape(_out_shape())


reshape.meta_contiguous = True


@lower(aten.expand_copy.default)
def expand_copy(x, size, implicit=False):
    return jnp.broadcast_to(x, _out_shape())


@lower(aten.permute_copy.default)
def permute_copy(x, dims):
    return jnp.transpose(x, [_dim(d, x.ndim) for d in dims])


@lower(aten.flip.default)
def flip(x, dims):
    if x.ndim == 0:
        return x
    return jnp.flip(x, [_dim(d, x.ndim) for d in dims]) if dims else x


@lower(aten.roll.default)
def roll(x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), tuple(_dim(d, x.ndim) for d in dims))


@lower(aten.repeat.default)
def repeat(x, repeats):
    return jnp.tile(x, tuple(repeats)).reshape(_out_shape())


@lower(aten.constant_pad_nd.default)
def constant_pad_nd(x, pad, value=0):
    # pad pairs run from the last dim backwards; negative pads crop (lax.pad
    # does both).
    config = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        config[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    if jnp.iscomplexobj(value) and not jnp.iscomplexobj(x):
        value = jnp.real(value)
    return lax.pad(x, jnp.asarray(value).astype(x.dtype), config)


def _pad_by_index(x, padding, nd, source):
    """x padded along its last nd dims by a gather: source(j, n) is the input
    index of output position j, counted from the input's start (negative
    before it); a negative pad crops that side, as in PyTorch."""
    for i in range(nd):
        d = x.ndim - 1 - i
        lo, hi = padding[2 * i], padding[2 * i + 1]
        n = x.shape[d]
        x = jnp.take(x, source(jnp.arange(n + lo + hi) - lo, n), axis=d)
    return x


def _replicate(x, padding, nd):
    return _pad_by_index(x, padding, nd, lambda j, n: jnp.clip(j, 0, n - 1))


def _reflect(x, padding, nd):
    if min(padding) >= 0:
        width = [(0, 0)] * (x.ndim - nd) + [
            (padding[2 * i], padding[2 * i + 1]) for i in reversed(range(nd))]
        return jnp.pad(x, width, mode="reflect")
    # With a pad that crops, the other side still reflects about the whole
    # input's edge (its values may lie in the cropped part).
    return _pad_by_index(x, padding, nd, lambda j, n: jnp.where(
        j < 0, -j, jnp.where(j >= n, 2 * (n - 1) - j, j)))


def _pad_mode(pad, nd):
    def fwd(x, padding):
        return pad(x, padding, nd)

    def bwd(grad, x, padding):
        _, vjp = jax.vjp(lambda v: pad(v, padding, nd), x)
        return vjp(grad.astype(x.dtype))[0]
    return fwd, bwd


for _nd in (1, 2, 3):
    for _name, _pad in (("reflection", _reflect), ("replication", _replicate)):
        _fwd, _bwd = _pad_mode(_pad, _nd)
        lower(getattr(aten, f"{_name}_pad{_nd}d").default)(_fwd)
        lower(getattr(aten, f"{_name}_pad{_nd}d_backward").default)(_bwd)


@lower(aten.tril.default)
def tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@lower(aten.triu.default)
def triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


@lower(aten.diag_embed.default)
def diag_embed(x, offset=0, dim1=-2, dim2=-1):
    n = x.shape[-1]
    m = n + abs(offset)
    i = jnp.arange(n)
    rows, cols = i + max(-offset, 0), i + max(offset, 0)
    out = jnp.zeros(x.shape[:-1] + (m, m), x.dtype).at[..., rows, cols].set(x)
    nd = x.ndim + 1
    return jnp.moveaxis(out, (-2, -1), (_dim(dim1, nd), _dim(dim2, nd)))


# ---- scatters into views (functionalized writes through a view) -----------

@lower(aten.slice_scatter.default)
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    dim = _dim(dim, x.ndim)
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, end, step)
    return x.at[tuple(index)].set(src.astype(x.dtype))


@lower(aten.select_scatter.default)
def select_scatter(x, src, dim, index):
    dim = _dim(dim, x.ndim)
    where = [slice(None)] * x.ndim
    where[dim] = index % x.shape[dim]
    return x.at[tuple(where)].set(src.astype(x.dtype))


# Backward of a select/slice: the gradient scattered into zeros, one op
# instead of the decomposition's two (a transformer's backward has a dozen).
@lower(aten.select_backward.default)
def select_backward(grad, input_sizes, dim, index):
    return select_scatter(jnp.zeros(tuple(input_sizes), grad.dtype), grad, dim, index)


@lower(aten.slice_backward.default)
def slice_backward(grad, input_sizes, dim, start, end, step):
    return slice_scatter(jnp.zeros(tuple(input_sizes), grad.dtype), grad, dim, start, end, step)


@lower(aten.diagonal_scatter.default)
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    dim1, dim2 = _dim(dim1, x.ndim), _dim(dim2, x.ndim)
    n = src.shape[-1]
    i = jnp.arange(n)
    rows, cols = i + max(-offset, 0), i + max(offset, 0)
    moved = jnp.moveaxis(x, (dim1, dim2), (-2, -1))
    moved = moved.at[..., rows, cols].set(src.astype(x.dtype))
    return jnp.moveaxis(moved, (-2, -1), (dim1, dim2))

