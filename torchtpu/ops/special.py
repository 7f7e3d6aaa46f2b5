"""Special functions: Bessel and Airy functions and the orthogonal
polynomials of torch.special, as PyTorch computes them on CPU (Cephes
approximations and three-term recurrences, aten/src/ATen/native/Math.h).
Branch conditions, thresholds and the order of operations follow Math.h so
that values match, nan and edge cases included."""
import jax.numpy as jnp
import torch
from jax import lax

from . import lower
from .pointwise import guard
from .util import KIND, promote

aten = torch.ops.aten


def _overloads(op):
    return (op.default, op.x_scalar, op.n_scalar)


# ---- orthogonal polynomials -----------------------------------------------

def _order(n):
    """static_cast<int64_t>(n) as the CPU kernel does it: truncation, with
    nan, inf and out-of-range values becoming INT64_MIN (negative: result 0)."""
    ok = jnp.isfinite(n) & (jnp.abs(n) < 2.0 ** 63)
    return jnp.where(ok, n, -1).astype(jnp.int64)


def _recur(n, p, q, step, run):
    """q after r = step(k, p, q); p, q = q, r for k = 1 .. n-1 where run,
    stopping at a nan q as PyTorch's loops do. k is a float of q's dtype."""
    def live(k, q):
        return run & (k < n) & ~jnp.isnan(q)

    def body(s):
        k, p, q = s
        m = live(k, q)
        r = step(k.astype(q.dtype), p, q)
        return k + 1, jnp.where(m, q, p), jnp.where(m, r, q)

    p, q = jnp.broadcast_arrays(p, q)
    _, _, q = lax.while_loop(lambda s: jnp.any(live(s[0], s[2])), body,
                             (jnp.ones((), jnp.int64), p, q))
    return q


def _polynomial(name):
    """Register fn(x, n) (x, n in the computation dtype, n already int64) as
    the lowering of all three overloads of aten.special_<name>."""
    def deco(fn):
        @guard(name, "h")
        def lowering(x, n):
            (x, n), res = promote(x, n, kind=KIND.INT_TO_FLOAT)
            x, n = jnp.broadcast_arrays(x, n)
            return fn(x, _order(n)).astype(res)
        lower(*_overloads(getattr(aten, "special_" + name)))(lowering)
        return fn
    return deco


# Chebyshev polynomials of the four kinds, plain and shifted (argument
# 2x - 1). Per kind: its degree-1 value given y (the argument), its values
# at the two ends of [-1, 1] and its trigonometric form, used above a
# degree threshold inside the interval. Degree >= 2 runs T's recurrence.
def _chebyshev(kind, shifted, threshold):
    def fn(x, n):
        y = x + x - 1 if shifted else x
        nf = n.astype(x.dtype)
        even = n % 2 == 0
        sign = jnp.where(even, 1, -1).astype(x.dtype)
        p1 = {"t": y, "u": y + y, "v": y + y - 1, "w": y + y + 1}[kind]
        top = {"t": 1, "u": nf + 1, "v": 1, "w": nf + nf + 1}[kind]
        bottom = {"t": sign, "u": sign * (nf + 1), "v": sign * (nf + nf + 1), "w": sign}[kind]
        if shifted:
            at_top, at_bottom = x == 1, x == 0
        else:
            at_top, at_bottom = (x == 1), (x == -1)

        trig = (n > threshold) & (jnp.abs(y) < 1)
        theta = jnp.arccos(jnp.where(trig, y, 0))
        if kind == "t":
            tv = jnp.cos(nf * theta)
        elif kind == "u":
            s = jnp.sin(theta)
            tv = jnp.where(s != 0, jnp.sin((nf + 1) * theta) / s,
                           (nf + 1) * jnp.cos((nf + 1) * theta) / y)
        elif kind == "v":
            tv = jnp.where(jnp.sin(theta / 2) != 1,
                           jnp.cos((nf + 0.5) * theta) / jnp.cos(theta / 2), bottom)
        else:
            # PyTorch's shifted W returns the bottom value here, the plain W
            # the top one (theta/2 rounds cos to 1 only near y = 1).
            tv = jnp.where(jnp.cos(theta / 2) != 1,
                           jnp.sin((nf + 0.5) * theta) / jnp.sin(theta / 2),
                           sign if shifted else top)

        edge = at_top | at_bottom
        rec = _recur(n, jnp.ones_like(x), p1, lambda k, p, q: (y + y) * q - p, ~edge & ~trig)
        out = jnp.where(n == 0, 1, jnp.where(n == 1, p1, rec))
        out = jnp.where(trig, tv, out)
        out = jnp.where(at_top, top, jnp.where(at_bottom, bottom, out))
        return jnp.where(n < 0, 0, out)
    return fn


for _kind, _plain, _shifted in [("t", 6, 6), ("u", 8, 6), ("v", 8, 6), ("w", 8, 4)]:
    _polynomial(f"chebyshev_polynomial_{_kind}")(_chebyshev(_kind, False, _plain))
    _polynomial(f"shifted_chebyshev_polynomial_{_kind}")(_chebyshev(_kind, True, _shifted))


def _hermite_limit(x):
    # Above this degree PyTorch returns nan instead of running the recurrence.
    return 128 if x.dtype == jnp.float32 else 512


@_polynomial("hermite_polynomial_h")
def _hermite_h(x, n):
    rec = _recur(n, jnp.ones_like(x), x + x, lambda k, p, q: (x + x) * q - (k + k) * p, n > 1)
    out = jnp.where(n > _hermite_limit(x), jnp.nan, rec)
    out = jnp.where(n == 0, 1, jnp.where(n == 1, x + x, out))
    return jnp.where(n < 0, 0, out)


@_polynomial("hermite_polynomial_he")
def _hermite_he(x, n):
    rec = _recur(n, jnp.ones_like(x), x, lambda k, p, q: x * q - k * p, n > 1)
    out = jnp.where(n > _hermite_limit(x), jnp.nan, rec)
    out = jnp.where(n == 0, 1, jnp.where(n == 1, x, out))
    return jnp.where(n < 0, 0, out)


@_polynomial("laguerre_polynomial_l")
def _laguerre_l(x, n):
    rec = _recur(n, jnp.ones_like(x), 1 - x,
                 lambda k, p, q: (((k + k) + (1 - x)) * q - k * p) / (k + 1), x != 0)
    out = jnp.where(n == 0, 1, jnp.where(n == 1, 1 - x, rec))
    out = jnp.where(x == 0, 1, out)
    return jnp.where(n < 0, 0, out)


@_polynomial("legendre_polynomial_p")
def _legendre_p(x, n):
    edge = jnp.abs(x) == 1
    rec = _recur(n, jnp.ones_like(x), x,
                 lambda k, p, q: ((k + k + 1) * x * q - k * p) / (k + 1), ~edge)
    out = jnp.where(n == 0, 1, jnp.where(n == 1, x, rec))
    out = jnp.where(edge, jnp.where((x > 0) | (n % 2 == 0), 1, -1), out)
    return jnp.where(n < 0, 0, out)
