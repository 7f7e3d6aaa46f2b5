"""Randomized leaky relu and the _trilinear product."""
import jax
import jax.numpy as jnp

from ..registry import lower
from ..util import ctx_dtype, matmul_precision
from .common import _up, aten


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


@lower(aten._trilinear.default, matmul=True)
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
    res = jnp.einsum(",".join(subs) + "->" + out, *operands, precision=matmul_precision())
    # A dim no input has stays size 1 (unless summed).
    res = res.reshape(tuple(sizes[d] for d in range(ndim) if d not in set(sumdim)))
    return res.astype(ctx_dtype())
