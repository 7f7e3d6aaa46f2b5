"""Factories, copies and dtype conversion."""
import jax.numpy as jnp
import numpy as np

from .registry import lower
from .util import ctx_dtype

from ..compat import aten


def _out_shape(i=0):
    from .registry import ctx
    return tuple(ctx.out[i].shape)


# zeros_like and ones_like are lowered rather than decomposed into full_like:
# backward starts with ones_like, every step (the decomposition cost ~50 us
# on the host).
# (x.new_zeros and the other new_* run these factories: dispatch.rewrites.)
@lower(aten.empty.memory_format, aten.empty_strided.default, aten.zeros.default,
       aten.empty_like.default, aten.zeros_like.default)
def zeros(*args, **kwargs):
    return jnp.zeros(_out_shape(), ctx_dtype())


@lower(aten.ones.default, aten.ones_like.default)
def ones(*args, **kwargs):
    return jnp.ones(_out_shape(), ctx_dtype())


# empty_strided and the *_like give CPU's strides (a CPU tensor's .to("tpu")
# allocates with its strides, as CUDA does; preserve_format keeps them).
zeros.keeps_strides = ones.keeps_strides = True


def _fill_value(value, dtype):
    # A complex fill into a real tensor keeps the real part, as PyTorch does.
    if jnp.iscomplexobj(value) and not jnp.issubdtype(dtype, jnp.complexfloating):
        value = jnp.real(value)
    return jnp.asarray(value).astype(dtype)


@lower(aten.full.default)
def full(*args, fill_value=None, **kwargs):
    if fill_value is None:
        fill_value = args[-1]
    dtype = ctx_dtype()
    return jnp.full(_out_shape(), _fill_value(fill_value, dtype), dtype)


@lower(aten.full_like.default)
def full_like(x, fill_value, **kwargs):
    dtype = ctx_dtype()
    return jnp.full(x.shape, _fill_value(fill_value, dtype), dtype)


full_like.keeps_strides = True


@lower(aten.scalar_tensor.default)
def scalar_tensor(value, **kwargs):
    return _fill_value(value, ctx_dtype())


@lower(aten.fill.Scalar, aten.fill.Tensor)
def fill(x, value):
    return jnp.full(x.shape, _fill_value(value, x.dtype), x.dtype)


@lower(aten.zero.default)
def zero(x):
    return jnp.zeros_like(x)


@lower(aten.copy.default)
def copy(dst, src, non_blocking=False):
    return jnp.broadcast_to(convert(src, dst.dtype), dst.shape)


def convert(x, dtype):
    """PyTorch's dtype conversion: complex -> real drops the imaginary part,
    float -> int truncates toward zero, anything -> bool is `!= 0`."""
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    if dtype == jnp.bool_:
        return x != 0
    if jnp.iscomplexobj(x) and not jnp.issubdtype(dtype, jnp.complexfloating):
        x = jnp.real(x)
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(dtype, jnp.integer):
        # XLA's float->int conversion truncates; make it explicit for clarity.
        x = jnp.trunc(x)
    return x.astype(dtype)


@lower(aten._to_copy.default, aten.clone.default, aten.lift_fresh_copy.default)
def to_copy(x, **kwargs):
    return convert(x, ctx_dtype())


# A copy of a transposed tensor keeps its strides (preserve_format), as on CPU.
to_copy.keeps_strides = True


# ---- ranges ----------------------------------------------------------------

@lower(aten.arange.start_step)
def arange(start, end, step=1, **kwargs):
    # Like CPU: start + step * i in int64 for integer outputs (arguments
    # truncated), in double for float/double, in float for half types.
    dtype = ctx_dtype()
    n = _out_shape()[0]
    if jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_:
        start, step, comp = int(start), int(step), jnp.int64
    else:
        comp = jnp.float64 if jnp.dtype(dtype).itemsize >= 4 else jnp.float32
    i = jnp.arange(n, dtype=jnp.int64).astype(comp)
    return (jnp.asarray(start, comp) + jnp.asarray(step, comp) * i).astype(dtype)


# The output length depends on their values.
arange.static_args = ("start", "end", "step")


@lower(aten.linspace.default)
def linspace(start, end, steps, **kwargs):
    dtype = ctx_dtype()
    return _linspace(start, end, steps, dtype)


def _linspace(start, end, steps, dtype):
    # CPU: step in the output type (double for integers), the first half
    # counted from start and the second from end.
    if jnp.issubdtype(dtype, jnp.complexfloating):
        comp = dtype
    elif jnp.issubdtype(dtype, jnp.floating):
        comp = jnp.float64 if dtype == jnp.float64 else jnp.float32
    else:
        comp = jnp.float64
    start = jnp.asarray(start).astype(comp)
    end = jnp.asarray(end).astype(comp)
    if steps == 1:
        return jnp.broadcast_to(start, (1,)).astype(dtype) if dtype != jnp.bool_ else (
            jnp.broadcast_to(start != 0, (1,)))
    i = jnp.arange(steps)
    step = (end - start) / max(steps - 1, 1)
    out = jnp.where(i < steps // 2, start + step * i.astype(comp),
                    end - step * (steps - 1 - i).astype(comp))
    return convert(out, dtype)


@lower(aten.logspace.default)
def logspace(start, end, steps, base=10.0, **kwargs):
    dtype = ctx_dtype()
    comp = dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.float64
    exps = _linspace(start, end, steps, comp)
    return convert(jnp.power(jnp.asarray(base, comp), exps), dtype)


@lower(aten.eye.default, aten.eye.m)
def eye(n, m=None, **kwargs):
    return jnp.eye(n, n if m is None else m, dtype=ctx_dtype())


@lower(aten.tril_indices.default)
def tril_indices(row, col, offset=0, **kwargs):
    r, c = np.tril_indices(row, offset, col)
    return jnp.asarray(np.stack([r, c]), ctx_dtype())


@lower(aten.triu_indices.default)
def triu_indices(row, col, offset=0, **kwargs):
    r, c = np.triu_indices(row, offset, col)
    return jnp.asarray(np.stack([r, c]), ctx_dtype())
