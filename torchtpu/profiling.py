"""torchtpu's work in torch.profiler: each fused flush, graph run, compile,
upload and sync as a range named after what ran, why, and the user's line,
beside the aten ops in the profile's table and trace. With no profiler
recording, a range costs one check (and none is made per op)."""
import contextlib

import torch

_recording = torch._C._autograd._profiler_enabled
_NONE = contextlib.nullcontext()


def recording():
    """Whether a profiler (torch.profiler.profile, or autograd's) records now."""
    return _recording()


def span(name):
    """A profiler range named name() while a profiler records, else nothing
    (name is called only then: a user line costs a stack walk)."""
    if not _recording():
        return _NONE
    return torch.autograd.profiler.record_function(name())
