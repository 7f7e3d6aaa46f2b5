"""The gamma family as PyTorch computes it on CPU: digamma, trigamma and
polygamma, the multivariate log-gamma, the Hurwitz zeta and the
regularized incomplete gamma functions."""
import math

import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
from jax import lax

from ..registry import lower
from ..util import KIND, promote
from .common import guard

from ...compat import aten


def _digamma(x):
    # PyTorch: digamma(0) = -inf (signed like the zero), poles at negative ints are nan.
    out = lax.digamma(x)
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x).astype(x.dtype), out)


def _trigamma(x):
    """PyTorch's trigamma: reflection below 0.5, six recurrence steps, then
    the asymptotic series (jax's polygamma(1, x) is wrong for x < 0)."""
    neg = x < 0.5
    sin_pi_x = jnp.sin(jnp.pi * x)
    result = jnp.where(neg, -(jnp.pi * jnp.pi) / (sin_pi_x * sin_pi_x), 0).astype(x.dtype)
    x = jnp.where(neg, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1. / 6 - ixx * (1. / 30 - ixx * (1. / 42)))) / x
    return jnp.where(neg, -result, result)


_ZETA_A = [12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18]


def _zeta(x, q, scalar=None):
    """Hurwitz zeta as PyTorch's CPU kernel (Cephes): inf at x = 1 and at the
    poles q = 0, -1, ...; nan for x < 1 and for q < 0 with x not an integer.
    The direct sum also covers negative q (polygamma of negative x), where
    jax's zeta does not. Computed in PyTorch's accumulation type for the
    kernel's dtype `scalar` (default q's): float64 for float32, float32 for
    bf16/fp16; rounded to q's dtype."""
    out_dtype = q.dtype
    scalar = jnp.dtype(scalar or q.dtype)
    acc = jnp.float64 if scalar in (jnp.float32, jnp.float64) else jnp.float32
    x, q = jnp.broadcast_arrays(x.astype(acc), q.astype(acc))
    machep = 1.11022302462515654042E-16

    def small(s, b):
        return (-machep * s < b) & (b < machep * s)

    # s = q^-x + (q+1)^-x + ... while fewer than 9 terms were added or a <= 9.
    def cond(st):
        i, a, b, s, done = st
        return jnp.any(~done & ((i < 9) | (a <= 9)))

    def body(st):
        i, a, b, s, done = st
        live = ~done & ((i < 9) | (a <= 9))
        a2 = a + 1
        b2 = jnp.power(a2, -x)
        s2 = s + b2
        return (i + 1, jnp.where(live, a2, a), jnp.where(live, b2, b), jnp.where(live, s2, s),
                done | (live & small(s2, b2)))

    pole = (q <= 0) & (q == jnp.floor(q))
    bad = (x < 1) | ((q <= 0) & ~pole & (x != jnp.floor(x)))
    skip = (x == 1) | pole | bad
    qq = jnp.where(skip, 2, q)
    init = (0, qq, jnp.zeros_like(qq), jnp.power(qq, -x), skip)
    _, a, b, s, done = lax.while_loop(cond, body, init)
    # Euler-Maclaurin tail.
    w = a
    s = jnp.where(done, s, s + b * w / (x - 1) - 0.5 * b)
    a, k = jnp.ones_like(s), 0.0
    for c in _ZETA_A:
        a = a * (x + k)
        b = b / w
        t = a * b / c
        s = jnp.where(done, s, s + t)
        done = done | (jnp.abs(t / s) < machep)
        k += 1
        a = a * (x + k)
        b = b / w
        k += 1
    out = jnp.where(x == 1, jnp.inf, jnp.where(x < 1, jnp.nan, jnp.where(
        pole, jnp.inf, jnp.where(bad, jnp.nan, s))))
    return out.astype(out_dtype)


@lower(aten.polygamma.default)
def polygamma(n, x):
    (x,), res = promote(x, kind=KIND.INT_TO_FLOAT)
    if n == 0:
        return _digamma(x).astype(res)
    if n == 1:
        return _trigamma(x).astype(res)
    # PyTorch: (+-1) * exp(lgamma(n + 1)) * zeta(n + 1, x), the factor in the
    # input's float type (float32 for bf16), the zeta rounded to the input's.
    fdt = jnp.float32 if jnp.dtype(res).itemsize < 4 else res
    # exp(lgamma(n + 1)) as libm rounds it in fdt (not exactly n!).
    lg = np.asarray(math.lgamma(n + 1), fdt)
    fact = np.asarray(math.exp(float(lg)), fdt) * (1 if n % 2 else -1)
    z = _zeta(jnp.asarray(n + 1.0, x.dtype), x, res).astype(res).astype(fdt)
    return (fact * z).astype(res)


@lower(aten.mvlgamma.default)
def mvlgamma(x, p):
    (x,), res = promote(x, kind=KIND.INT_TO_FLOAT)
    return jss.multigammaln(x, p).astype(res)


@lower(aten.special_zeta.default, aten.special_zeta.self_scalar, aten.special_zeta.other_scalar)
@guard("zeta", "h")
def zeta(x, q):
    (x, q), res = promote(x, q, kind=KIND.INT_TO_FLOAT)
    return _zeta(x, q).astype(res)


@lower(aten.igamma.default)
@guard("igamma", "bi")
def igamma(a, x):
    (a, x), res = promote(a, x, kind=KIND.INT_TO_FLOAT)
    return jss.gammainc(a, x).astype(res)


@lower(aten.igammac.default)
@guard("igammac", "bi")
def igammac(a, x):
    (a, x), res = promote(a, x, kind=KIND.INT_TO_FLOAT)
    return jss.gammaincc(a, x).astype(res)
