"""Checks run around an executor's run: debug mode's index bounds before each
indexing op, and with NaN/Inf checks on (TORCHTPU_CHECK_NANS=1 or
torchtpu.set_check_nans) a stop at the first op producing NaN/Inf, naming
the op and the user's line. In fused mode an op is recorded, not run: its
line is logged, and a flushed graph whose results hold NaN/Inf is replayed
op by op to find it."""
import sys

import jax
import jax.numpy as jnp

from .. import bounds, config, errors
from .refs import Result, arguments


# ---- the NaN/Inf switch ----------------------------------------------------------

def check_nans_enabled():
    return config.CHECK_NANS.on()


# Read once for strict and fused mode (the dispatcher tests it per op);
# debug mode also reads the variable live. set_check_nans() changes it.
CHECK_NANS = check_nans_enabled()


def nan_checks_on():
    """Whether NaN/Inf checks run now: set at run time or in the environment."""
    return CHECK_NANS or check_nans_enabled()


def set_check_nans(on=True):
    """Turn NaN/Inf checks on or off at run time (TORCHTPU_CHECK_NANS=1 at start)."""
    global CHECK_NANS
    CHECK_NANS = bool(on)
    config.CHECK_NANS.set("1" if on else "0")


def nan_message(op, line):
    return (f"torchtpu: {op} produced NaN or Inf (TORCHTPU_CHECK_NANS=1); "
            f"issued at {line}")


# Fused mode with NaN checks on: (kernel, user line) per recorded op, in
# recording order (nan_checked_run logs them; the flush takes them).
FUSED_LINES = []


def graph_lines(g):
    """The issuing lines of a fused graph's nodes, if checks recorded them."""
    nodes = getattr(g, "nodes", None) or []
    n = len(nodes)
    if len(FUSED_LINES) < n:
        return None
    entries = FUSED_LINES[:n]
    if any(k is not node[0] for (k, _), node in zip(entries, nodes)):
        return None
    return [line for _, line in entries]


# ---- the checks --------------------------------------------------------------------


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
        outs, written = kernel.jitted(*arguments(refs, values, g.inputs, g.scalars, fence=False))
        produced = tuple(outs) + tuple(written)
        if any_nonfinite(produced):
            return ni, kernel.name
        for j, v in enumerate(produced):
            values[Result(ni, j)] = v
    return None


def bounds_on_host(plan, args, kwargs, to_host):
    """Debug mode's check before an op: its index arguments in range, read
    on the host (to_host(t): a tpu tensor's values as a CPU tensor)."""
    bounds.check_on_host(plan.func, args, kwargs, plan.functional,
                         errors.user_line(sys._getframe(1)), to_host)


def nan_checked_run(ex, kernel, flat, storages):
    """ex.run, then with NaN/Inf checks on, a stop if the op produced one
    (recorded ops: their line is logged for the flush's check)."""
    outs, written = ex.run(kernel, flat, storages)
    if not nan_checks_on():
        return outs, written
    arrays = tuple(outs) + tuple(written)
    if any(not hasattr(a, "block_until_ready") for a in arrays):
        # Recorded, not run (fused): remember where, check at the flush.
        FUSED_LINES.append((kernel, errors.user_line(sys._getframe(1))))
        return outs, written
    if any_nonfinite(arrays):
        raise RuntimeError(nan_message(kernel.name, errors.user_line(sys._getframe(1))))
    return outs, written


def after_flush(g, results):
    """Fused mode: with NaN checks on, a flushed graph whose results hold
    NaN/Inf is replayed op by op to name the first op that produced one."""
    if not FUSED_LINES and not nan_checks_on():
        return
    lines = graph_lines(g)
    del FUSED_LINES[:len(g.nodes)]
    if not nan_checks_on():
        return
    if not any_nonfinite(results):
        return
    found = replay_for_nan(g)
    if found is None:
        raise RuntimeError("torchtpu: a fused graph produced NaN or Inf "
                           "(TORCHTPU_CHECK_NANS=1)")
    i, name = found
    line = lines[i] if lines else "<line not recorded: set TORCHTPU_CHECK_NANS=1 before the op>"
    raise RuntimeError(nan_message(name, line))
