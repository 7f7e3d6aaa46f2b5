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
    """float32 scale times a Python float, taken in double and rounded to
    float32. For a factor float32 holds exactly (GradScaler's 2.0 and 0.5)
    float32's own product is that same correctly rounded value, and needs
    no float64 on the device."""
    if float(np.float32(factor)) == factor:
        return scale * np.float32(factor)
    return (scale.astype(jnp.float64) * factor).astype(scale.dtype)


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
