"""GradScaler's ops: the non-finite check with unscaling, and the scale update.

torch.amp.GradScaler calls the in-place forms; the dispatcher runs these
functional forms and writes the results back. Both compute as PyTorch's CPU
and CUDA kernels do (aten/src/ATen/native/AmpKernels), so a tpu GradScaler
skips the same steps and keeps the same scale as a CUDA one. The kernels'
argument checks that PyTorch's meta kernels lack run ahead of these, at each
call (torchtpu.amp).
"""
import jax.numpy as jnp
import numpy as np
from jax import lax

from .registry import lower

from ..compat import aten


@lower(aten._amp_foreach_non_finite_check_and_unscale.default)
def amp_foreach_non_finite_check_and_unscale(self, found_inf, inv_scale):
    """Each gradient times inv_scale (in float32 for half types, unchanged
    where inv_scale is 1); found_inf set to 1 if any value is inf or NaN,
    else left as it was."""
    inv = inv_scale.reshape(())
    any_bad = jnp.zeros((), bool)
    out = []
    for g in self:
        any_bad = any_bad | ~jnp.all(jnp.isfinite(g))
        opmath = jnp.promote_types(g.dtype, jnp.float32)
        scaled = (g.astype(opmath) * inv.astype(opmath)).astype(g.dtype)
        out.append(jnp.where(inv == 1, g, scaled))
    return out, jnp.where(any_bad, jnp.ones_like(found_inf), found_inf)


def _times(scale, factor):
    """float32 scale times a Python float, as CPU's kernel takes it: the
    product rounded to double, then to float32. For a factor float32 holds
    exactly (GradScaler's 2.0 and 0.5) float32's own product is that same
    value. Otherwise it is computed on the mantissas as integers: a TPU
    emulates float64 with float32 pairs, which round differently and lose
    bits at small scales."""
    f32 = np.float32(factor)
    if float(f32) == factor:
        return scale * f32
    mf, ef = _mantissa(factor)  # factor = mf * 2^ef, mf < 2^53
    u64 = jnp.uint64
    bits = lax.bitcast_convert_type(scale, jnp.uint32)
    ex = ((bits >> 23) & 0xFF).astype(jnp.int32)
    mx = ((bits & 0x7FFFFF) | (1 << 23)).astype(u64)  # (a normal scale's 24 bits)
    # The exact product mx * mf, 76 or 77 bits, as h * 2^24 + l.
    a = mx * u64(mf >> 24)
    b = mx * u64(mf & 0xFFFFFF)
    h = a + (b >> 24)
    l = b & 0xFFFFFF
    # Rounded to double's 53 bits (round half to even): d * 2^shift.
    long = h >> 52 != 0
    d = jnp.where(long, h, (h << 1) | (l >> 23))
    rest = jnp.where(long, l, (l << 1) & 0xFFFFFF)  # the 24 bits dropped
    d = _round_even(d, rest >> 23, rest & 0x7FFFFF)
    shift = jnp.where(long, 24, 23) + ex - 150 + ef
    carry = d >> 53 != 0
    d, shift = jnp.where(carry, d >> 1, d), jnp.where(carry, shift + 1, shift)
    # Then to float32: its biased exponent, and the bits dropped from d's
    # 53, more for a subnormal result (which the float ops after flush).
    exp = shift + 52 + 127
    drop = (29 + jnp.clip(1 - exp, 0, 34)).astype(u64)
    m = _round_even(d >> drop, (d >> (drop - 1)) & 1, d & ((u64(1) << (drop - 1)) - 1))
    # m's top bit (2^23, or 2^24 if rounding carried) lands in the exponent.
    out = (jnp.maximum(exp - 1, 0).astype(u64) << 23) + m
    out = jnp.where(out >= 255 << 23, u64(255 << 23), out)  # overflow: inf
    out = lax.bitcast_convert_type(out.astype(jnp.uint32) | (bits & 0x80000000), jnp.float32)
    # A zero, subnormal, inf or NaN scale: float32's own product (XLA
    # flushes subnormal floats to zero, on CPU as on TPU).
    return jnp.where((ex != 0) & (ex != 255), out, scale * f32)


def _mantissa(x):
    """(m, e) with x == m * 2**e exactly, m an integer below 2**53."""
    m, e = np.frexp(x)
    return int(m * 2.0 ** 53), int(e) - 53


def _round_even(kept, half, sticky):
    """kept rounded by the dropped bits: half (the first dropped bit) and
    sticky (whether any later one is set); ties to even."""
    up = (half != 0) & ((sticky != 0) | ((kept & 1) != 0))
    return kept + up.astype(kept.dtype)


@lower(aten._amp_update_scale.default)
def amp_update_scale(self, growth_tracker, found_inf, scale_growth_factor,
                     scale_backoff_factor, growth_interval):
    """After an inf: scale *= backoff, tracker = 0. Otherwise the tracker
    counts successful steps; at growth_interval the scale grows (unless that
    overflows float32) and the tracker restarts. The products are taken in
    double and rounded to float32, as the kernels do."""
    found = found_inf.reshape(self.shape) != 0
    tracker = growth_tracker.reshape(self.shape)
    backed_off = _times(self, scale_backoff_factor)
    grown = _times(self, scale_growth_factor)
    successful = tracker + 1
    grow = successful == growth_interval
    scale = jnp.where(found, backed_off,
                      jnp.where(grow & jnp.isfinite(grown), grown, self))
    tracker = jnp.where(found | grow, jnp.zeros_like(tracker), successful)
    return scale, tracker.reshape(growth_tracker.shape)
