"""strict: each op is one jitted call, issued asynchronously; the host runs
ahead until a value is needed."""
import jax

from .. import bounds
from . import checks


class StrictExecutor:
    name = "strict"
    # What the code outside modes/ asks of an executor (never its name):
    records = False        # ops run as they come (fused mode and capture record them into graphs)
    fuses = False          # recorded ops are issued by flushes as the program runs (fused mode)
    waits_each_op = False  # each op is waited for, its index bounds checked first (debug mode)
    replays = False        # what is recorded runs at each replay of a captured graph (capture)

    def __init__(self):
        self._last = None

    def run(self, kernel, flat, storages):
        outs, written = kernel.jitted(*flat)
        self._last = (outs, written)
        return outs, written

    def run_checked(self, kernel, flat, storages, plan, args, kwargs, to_host):
        """run, with the checks this mode makes around an op (NaN/Inf, when
        switched on); the dispatcher calls it instead of run when
        waits_each_op or checks.CHECK_NANS. plan, args and kwargs are the
        op's; to_host reads a tpu tensor's values on the host."""
        return checks.nan_checked_run(self, kernel, flat, storages)

    def replaced(self, storage):
        """storage's value is about to be replaced whole by an upload (the
        empty buffer .to("tpu") makes); fused mode drops the op that made it."""

    def concrete(self, storage, reason="read", to_host=False):
        """storage's array once its value is computed; a sync point.
        to_host: the caller reads it to the host next (a download)."""
        if to_host:
            self._start_copy(storage)
        bounds.check()  # a read is a sync point: out-of-range indices raise here
        return storage.array

    @staticmethod
    def _start_copy(storage):
        """A download's copy starts before the index checks' flags are
        read: the two round trips overlap (on a TPU host each costs about a
        millisecond, as much as a small step)."""
        if bounds.unread and isinstance(storage.array, jax.Array):
            storage.array.copy_to_host_async()

    def sync(self, reason="sync"):
        if self._last is not None:
            jax.block_until_ready(self._last)
            self._last = None
        bounds.check()
