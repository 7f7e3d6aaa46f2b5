"""torchtpu.profiler.trace(logdir): a device trace of a block of the program,
as JAX writes it (XProf: TensorBoard's profile plugin and Perfetto read it)."""
import contextlib

import jax

from . import modes, profiling


@contextlib.contextmanager
def trace(logdir):
    """Write a device trace of the block to logdir. Each XLA computation in
    it is named after its kernel (tpu_aten_addmm_default) or fused graph
    (tpu_fused_57ops), and torchtpu's ranges (flushes, graph runs, compiles,
    uploads, syncs, with the user's lines) sit on the host timeline beside
    them. What ran before the block is finished first, and what the block
    issued is finished before the trace ends (two sync points)."""
    modes.sync("profiler")
    jax.profiler.start_trace(str(logdir))
    profiling.DEVICE_TRACE[0] = True
    try:
        yield
    finally:
        try:
            modes.sync("profiler")
        finally:
            profiling.DEVICE_TRACE[0] = False
            jax.profiler.stop_trace()
