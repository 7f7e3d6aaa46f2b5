"""debug: like strict, but each op is waited for, so a failure surfaces at the
user's line. The dispatcher adds debug mode's checks (torchtpu.errors):
index bounds before each indexing op, and with TORCHTPU_CHECK_NANS=1 a stop
at the first op producing NaN/Inf, naming the op and the user's line."""
import jax
import jax.numpy as jnp

from .strict import StrictExecutor


@jax.jit
def _nonfinite(x):
    return jnp.logical_not(jnp.all(jnp.isfinite(x)))


def any_nonfinite(arrays):
    """True if any floating/complex array holds NaN or Inf (waits for them)."""
    for arr in arrays:
        if hasattr(arr, "dtype") and jnp.issubdtype(arr.dtype, jnp.inexact) and bool(_nonfinite(arr)):
            return True
    return False


def replay_for_nan(g):
    """Run a fused graph's recorded ops one by one on its inputs; the (index,
    op name) of the first op whose outputs hold NaN/Inf, or None."""
    values = {}
    for ni, (kernel, refs) in enumerate(g.nodes):
        args = []
        for r in refs:
            if r[0] == "p":
                args.append(values[(r[1], r[2])])
            elif r[0] == "a":
                args.append(g.inputs[r[1]])
            else:
                args.append(g.scalars[r[1]])
        outs, written = kernel.jitted(*args)
        produced = tuple(outs) + tuple(written)
        if any_nonfinite(produced):
            return ni, kernel.name
        for j, v in enumerate(produced):
            values[(ni, j)] = v
    return None


class DebugExecutor(StrictExecutor):
    name = "debug"

    def run(self, kernel, flat, storages):
        outs, written = kernel.jitted(*flat)
        jax.block_until_ready((outs, written))
        return outs, written
