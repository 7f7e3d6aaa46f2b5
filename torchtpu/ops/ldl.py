"""The LDLᵀ factorization of a symmetric matrix and solves with it:
LAPACK's sytf2 and sytrs (lower), as PyTorch's CPU kernels run them, so LD
and pivots come back in LAPACK's compact form and agree with CPU's.

Bunch-Kaufman pivoting picks 1x1 or 2x2 diagonal blocks from the values,
so each step is one trip of a while loop over the whole matrix, masked to
the trailing part: one kernel for any matrix of a size, batches vmapped.
"""
import jax
import jax.numpy as jnp
from jax import lax

from .registry import lower

from ..compat import aten

_ALPHA = (1 + 17 ** 0.5) / 8  # Bunch-Kaufman's growth bound


def _first_max(values, where):
    """Index of the first largest of values where `where` (LAPACK's i?amax)."""
    return jnp.argmax(jnp.where(where, values, -1))


def _swapped(idx, i, j):
    """The indices idx with i and j exchanged (a row and column interchange)."""
    return jnp.where(idx == i, j, jnp.where(idx == j, i, idx))


def _sytf2(a):
    """LAPACK's ?sytf2 with uplo='L' on the lower triangle of a: (LD, 1-based
    pivots, info)."""
    n = a.shape[-1]
    idx = jnp.arange(n)
    below = idx[:, None] >= idx[None, :]

    def step(state):
        k, ld, piv, info = state
        col = jnp.abs(ld[:, k])
        absakk = col[k]
        imax = _first_max(col, idx > k)
        colmax = jnp.where(k < n - 1, col[imax], 0)
        # The largest off-diagonal in row (and column) imax of the trailing part.
        row = jnp.abs(ld[imax, :])
        rowmax = row[_first_max(row, (idx >= k) & (idx < imax))]
        col_imax = jnp.abs(ld[:, imax])
        rowmax = jnp.maximum(rowmax, jnp.where(imax < n - 1, col_imax[_first_max(col_imax, idx > imax)], 0))
        singular = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        keep = (absakk >= _ALPHA * colmax) | (absakk >= _ALPHA * colmax * (colmax / rowmax))
        one_at_imax = jnp.abs(ld[imax, imax]) >= _ALPHA * rowmax
        kp = jnp.where(singular | keep, k, imax)
        two = ~singular & ~keep & ~one_at_imax
        kk = k + two.astype(k.dtype)
        # Swap rows and columns kk and kp of the trailing part A[k:, k:].
        perm = _swapped(idx, kk, kp)
        full = jnp.where(below, ld, ld.T)
        trailing = below & (idx[:, None] >= k) & (idx[None, :] >= k)
        ld = jnp.where(trailing & ~singular, full[perm][:, perm], ld)
        later = idx > k
        # A 1x1 block: a rank-1 update, then the column scaled (as ?syr, ?scal).
        d11 = 1 / ld[k, k]
        x = jnp.where(later, ld[:, k], 0)
        one = jnp.where(below, ld + x[:, None] * (-d11 * x)[None, :], ld)
        one = one.at[:, k].set(jnp.where(later, x * d11, one[:, k]))
        # A 2x2 block on k, k+1: the rank-2 update in sytf2's own order.
        c0, c1 = ld[:, k], ld[:, k + 1 if n > 1 else k]
        e21 = ld[jnp.minimum(k + 1, n - 1), k]
        e11 = ld[jnp.minimum(k + 1, n - 1), jnp.minimum(k + 1, n - 1)] / e21
        e22 = ld[k, k] / e21
        e21 = (1 / (e11 * e22 - 1)) / e21
        rest = idx > k + 1
        wk = jnp.where(rest, e21 * (e11 * c0 - c1), 0)
        wkp1 = jnp.where(rest, e21 * (e22 * c1 - c0), 0)
        update = below & rest[None, :]
        twos = jnp.where(update, ld - c0[:, None] * wk[None, :] - c1[:, None] * wkp1[None, :], ld)
        twos = twos.at[:, k].set(jnp.where(rest, wk, ld[:, k]))
        twos = twos.at[:, jnp.minimum(k + 1, n - 1)].set(jnp.where(rest, wkp1, twos[:, jnp.minimum(k + 1, n - 1)]))
        ld = jnp.where(singular, ld, jnp.where(two, twos, one))
        p = (kp + 1).astype(piv.dtype)
        piv = jnp.where(two, piv.at[k].set(-p).at[jnp.minimum(k + 1, n - 1)].set(-p), piv.at[k].set(p))
        info = jnp.where(singular & (info == 0), (k + 1).astype(info.dtype), info)
        return k + 1 + two.astype(k.dtype), ld, piv, info

    state = (jnp.asarray(0), jnp.tril(a), jnp.zeros(n, jnp.int32), jnp.asarray(0, jnp.int32))
    _, ld, piv, info = lax.while_loop(lambda s: s[0] < n, step, state)
    return ld, piv, info


def _batched(fn, core_dims):
    """fn over the leading dims of its arguments (core_dims: each one's own)."""
    def run(*args):
        batch = args[0].shape[:args[0].ndim - core_dims[0]]
        flat = [x.reshape((-1,) + x.shape[x.ndim - d:]) for x, d in zip(args, core_dims)]
        outs = jax.vmap(fn)(*flat)
        return tuple(o.reshape(batch + o.shape[1:]) for o in outs)
    return run


@lower(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(a, *, hermitian=False, check_errors=False):
    if a.shape[-1] == 0:
        batch = a.shape[:-2]
        return a, jnp.zeros(batch + (0,), jnp.int32), jnp.zeros(batch, jnp.int32)
    return _batched(_sytf2, (2,))(a)


# Complex matrices (symmetric or Hermitian, ?sytrf / ?hetrf) and check_errors
# (raised from info on the host) take the CPU kernel.
linalg_ldl_factor_ex.accepts = lambda a, *, hermitian=False, check_errors=False, **_: (
    not check_errors and not a.dtype.is_complex)


def _swap_rows(b, i, j):
    return b[_swapped(jnp.arange(b.shape[0]), i, j)]


def _sytrs(ld, piv, b):
    """LAPACK's ?sytrs with uplo='L': solves A X = B from sytf2's LD and pivots."""
    n = ld.shape[-1]
    idx = jnp.arange(n)

    def forward(state):  # L D Y = B
        k, b = state
        two = piv[k] < 0
        k1 = jnp.minimum(k + 1, n - 1)
        b = _swap_rows(b, jnp.where(two, k1, k), jnp.abs(piv[k]) - 1)
        one = jnp.where((idx > k)[:, None], b - ld[:, k][:, None] * b[k][None, :], b)
        one = one.at[k].set(one[k] * (1 / ld[k, k]))
        rest = (idx > k + 1)[:, None]
        twos = jnp.where(rest, b - ld[:, k][:, None] * b[k][None, :], b)
        twos = jnp.where(rest, twos - ld[:, k1][:, None] * twos[k1][None, :], twos)
        akm1k = ld[k1, k]
        akm1, ak = ld[k, k] / akm1k, ld[k1, k1] / akm1k
        denom = akm1 * ak - 1
        bkm1, bk = twos[k] / akm1k, twos[k1] / akm1k
        twos = twos.at[k].set((ak * bkm1 - bk) / denom).at[k1].set((akm1 * bk - bkm1) / denom)
        return k + 1 + two.astype(k.dtype), jnp.where(two, twos, one)

    def backward(state):  # Lᵀ X = Y, from the last block up
        k, b = state
        two = piv[k] < 0
        after = (idx > k)[:, None]

        def minus_dot(b, row, col):  # b[row] -= ld[after, col] . b[after]
            return b.at[row].add(-jnp.sum(jnp.where(after, ld[:, col][:, None] * b, 0), axis=0))
        b = minus_dot(b, k, k)
        km1 = jnp.maximum(k - 1, 0)
        b = jnp.where(two, minus_dot(b, km1, km1), b)
        b = _swap_rows(b, k, jnp.abs(piv[k]) - 1)
        return k - 1 - two.astype(k.dtype), b

    _, b = lax.while_loop(lambda s: s[0] < n, forward, (jnp.asarray(0), b))
    _, b = lax.while_loop(lambda s: s[0] >= 0, backward, (jnp.asarray(n - 1), b))
    return (b,)


@lower(aten.linalg_ldl_solve.default)
def linalg_ldl_solve(ld, pivots, b, *, hermitian=False):
    batch = jnp.broadcast_shapes(ld.shape[:-2], b.shape[:-2])
    ld = jnp.broadcast_to(ld, batch + ld.shape[-2:])
    pivots = jnp.broadcast_to(pivots, batch + pivots.shape[-1:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:]).astype(ld.dtype)
    if ld.shape[-1] == 0 or b.shape[-1] == 0:
        return b
    return _batched(_sytrs, (2, 1, 2))(ld, pivots, b)[0]


linalg_ldl_solve.accepts = lambda ld, pivots, b, *, hermitian=False, **_: not ld.dtype.is_complex
