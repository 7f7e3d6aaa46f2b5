"""torchtpu.profiler.trace(logdir): a device trace of a block of the program,
as JAX writes it (XProf: TensorBoard's profile plugin and Perfetto read it);
torchtpu.profiler.device_trace_handler(logdir), given to torch.profiler's
on_trace_ready, writes one of each window the profiler records."""
import contextlib

import jax

from . import modes, profiling
from .integrations.after_import import when_imported


def _start(logdir):
    """What ran before is finished first (a sync point), then JAX traces."""
    modes.sync("profiler")
    jax.profiler.start_trace(str(logdir))
    profiling.DEVICE_TRACE[0] = True


def _stop():
    """What was issued is finished (a sync point) before the trace ends."""
    try:
        modes.sync("profiler")
    finally:
        profiling.DEVICE_TRACE[0] = False
        jax.profiler.stop_trace()


@contextlib.contextmanager
def trace(logdir):
    """Write a device trace of the block to logdir. Each XLA computation in
    it is named after its kernel (tpu_aten_addmm_default) or fused graph
    (tpu_fused_57ops), and torchtpu's ranges (flushes, graph runs, compiles,
    uploads, syncs, with the user's lines) sit on the host timeline beside
    them. What ran before the block is finished first, and what the block
    issued is finished before the trace ends (two sync points)."""
    _start(logdir)
    try:
        yield
    finally:
        _stop()


class device_trace_handler:
    """on_trace_ready for torch.profiler.profile: each window the profiler
    records (the whole block, or each active window of its schedule) also
    writes a device trace to logdir, as trace(logdir) does; then calls
    `then(prof)` if given (torch.profiler.tensorboard_trace_handler, say).
    The device trace spans the recording itself: the profiler starts and
    stops it with its own trace (on_trace_ready is called only after)."""

    def __init__(self, logdir, then=None):
        self.logdir, self.then = logdir, then

    def __call__(self, prof):
        if self.then is not None:
            self.then(prof)


def _patch_profiler(module):
    kineto = module._KinetoProfile
    start_trace, stop_trace = kineto.start_trace, kineto.stop_trace

    def start_trace_on_tpu(self):
        start_trace(self)
        handler = getattr(self, "on_trace_ready", None)
        if isinstance(handler, device_trace_handler):
            _start(handler.logdir)

    def stop_trace_on_tpu(self):
        handler = getattr(self, "on_trace_ready", None)
        try:
            if isinstance(handler, device_trace_handler):
                _stop()
        finally:
            stop_trace(self)

    kineto.start_trace, kineto.stop_trace = start_trace_on_tpu, stop_trace_on_tpu


when_imported("torch.profiler.profiler", _patch_profiler)
