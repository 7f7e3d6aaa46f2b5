"""debug: like strict, but each op is waited for, so a failure surfaces at the
user's line. The dispatcher adds debug mode's checks (torchtpu.modes.checks):
index bounds before each indexing op, and with TORCHTPU_CHECK_NANS=1 a stop
at the first op producing NaN/Inf, naming the op and the user's line."""
import jax

from .strict import StrictExecutor


class DebugExecutor(StrictExecutor):
    name = "debug"
    waits_each_op = True

    def run(self, kernel, flat, storages):
        outs, written = kernel.jitted(*flat)
        jax.block_until_ready((outs, written))
        return outs, written
