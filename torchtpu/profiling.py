"""torchtpu's work in a profile: each fused flush, graph run, compile,
upload and sync as a range named after what ran, why, and the user's line -
in torch.profiler beside the aten ops, and on the host timeline of a device
trace (torchtpu.profiler.trace). With neither recording, a range costs one
check (and none is made per op)."""
import contextlib

import jax
import torch

_recording = torch._C._autograd._profiler_enabled
_NONE = contextlib.nullcontext()
# Whether torchtpu.profiler.trace is writing a device trace.
DEVICE_TRACE = [False]


def recording():
    """Whether a profiler (torch.profiler.profile, autograd's, or a device
    trace) records now."""
    return _recording() or DEVICE_TRACE[0]


class _Span:
    __slots__ = ("torch_range", "jax_range")

    def __init__(self, name, torch_on):
        self.torch_range = torch.autograd.profiler.record_function(name) if torch_on else None
        self.jax_range = jax.profiler.TraceAnnotation(name) if DEVICE_TRACE[0] else None

    def __enter__(self):
        for r in (self.torch_range, self.jax_range):
            if r is not None:
                r.__enter__()

    def __exit__(self, *exc):
        for r in (self.jax_range, self.torch_range):
            if r is not None:
                r.__exit__(*exc)


def span(name):
    """A range named name() while a profiler records, else nothing (name is
    called only then: a user line costs a stack walk)."""
    torch_on = _recording()
    if not torch_on and not DEVICE_TRACE[0]:
        return _NONE
    return _Span(name(), torch_on)
