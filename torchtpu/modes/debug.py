"""debug: like strict, but each op is waited for, so a failure surfaces at the
user's line; TORCHTPU_CHECK_NANS=1 stops at the first op producing NaN/Inf."""
import os

import jax
import jax.numpy as jnp

from .strict import StrictExecutor


@jax.jit
def _nonfinite(x):
    return jnp.logical_not(jnp.all(jnp.isfinite(x)))


class DebugExecutor(StrictExecutor):
    name = "debug"

    def run(self, kernel, flat, call):
        outs, written = kernel.jitted(*flat)
        jax.block_until_ready((outs, written))
        if os.environ.get("TORCHTPU_CHECK_NANS") == "1":
            for arr in tuple(outs) + tuple(written):
                if jnp.issubdtype(arr.dtype, jnp.inexact) and bool(_nonfinite(arr)):
                    raise RuntimeError(f"torchtpu: {kernel.name} produced NaN or Inf "
                                       "(TORCHTPU_CHECK_NANS=1)")
        return outs, written
