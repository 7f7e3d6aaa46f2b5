"""debug: like strict, but each op is waited for, so a failure surfaces at the
user's line, and an indexing op's index arguments are checked on the host
before it runs (torchtpu.modes.checks); with TORCHTPU_CHECK_NANS=1 a stop at
the first op producing NaN/Inf, naming the op and the user's line."""
import jax

from . import checks
from .strict import StrictExecutor


class DebugExecutor(StrictExecutor):
    name = "debug"
    waits_each_op = True

    def run(self, kernel, flat, storages):
        outs, written = kernel.jitted(*flat)
        jax.block_until_ready((outs, written))
        return outs, written

    def run_checked(self, kernel, flat, storages, plan, args, kwargs, to_host):
        checks.bounds_on_host(plan, args, kwargs, to_host)
        return super().run_checked(kernel, flat, storages, plan, args, kwargs, to_host)
