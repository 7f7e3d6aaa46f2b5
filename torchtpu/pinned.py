"""Pinned host memory: CPU buffers that torchtpu allocates and tracks, so
that `pin_memory()`, `is_pinned()` and `DataLoader(pin_memory=True)` work,
and a `non_blocking` copy from one starts an asynchronous transfer instead
of taking a host copy first.

PyTorch finds pinned memory through the accelerator's C++ hooks
(getPinnedMemoryAllocator, isPinnedPtr), which a Python backend cannot
provide in torch 2.13 (torch._C._acc forwards neither). So aten::_pin_memory
and aten::is_pinned get CPU kernels here; both used PyTorch's composite
kernel, which asks those hooks, before.
"""
import mmap
import weakref

import numpy as np
import torch

from . import runtime

# data pointer -> byte size of each live pinned buffer.
_live = {}


def _storage_nbytes(shape, stride, itemsize):
    if any(s == 0 for s in shape):
        return 0
    return itemsize * (1 + sum((s - 1) * st for s, st in zip(shape, stride)))


def _check_device(device):
    if device is not None and torch.device(device).type not in ("tpu", "cpu"):
        raise RuntimeError(f"pin_memory: torchtpu pins memory for the tpu device, not {device}")


# Where a buffer starts past a page boundary. On the CPU platform JAX takes a
# 64-byte-aligned host buffer as the device array itself and copies others
# in the background: 16 bytes in (aligned for every dtype), an upload is
# that asynchronous copy. Elsewhere, page-aligned, for the transfer engine.
_OFFSET = 16 if runtime.PLATFORM == "cpu" else 0


def pinned_buffer(nbytes):
    """A uint8 CPU tensor of nbytes at a page boundary (plus _OFFSET),
    registered as pinned for as long as its memory lives."""
    raw = np.empty(nbytes + 2 * mmap.PAGESIZE, np.uint8)
    start = -raw.ctypes.data % mmap.PAGESIZE + _OFFSET
    buf = raw[start:start + nbytes]
    ptr = buf.ctypes.data
    _live[ptr] = nbytes
    weakref.finalize(buf, _live.pop, ptr, None)
    return torch.from_numpy(buf)


def is_pinned_ptr(ptr):
    if ptr in _live:
        return True
    return any(base <= ptr < base + n for base, n in _live.items())


def is_pinned(self, device=None):
    """aten::is_pinned for CPU tensors: is the tensor's memory a pinned buffer?"""
    _check_device(device)
    storage = self.untyped_storage()
    return storage.nbytes() > 0 and is_pinned_ptr(storage.data_ptr())


def pin_memory(self, device=None):
    """aten::_pin_memory for CPU tensors: a copy in a pinned buffer, with the
    source's sizes and strides (as CUDA's kernel makes it)."""
    _check_device(device)
    nbytes = _storage_nbytes(self.shape, self.stride(), self.element_size())
    storage = pinned_buffer(nbytes).untyped_storage()
    out = torch.empty(0, dtype=self.dtype).set_(storage, 0, self.shape, self.stride())
    out.copy_(self)
    return out


def register(lib):
    lib.impl("_pin_memory", pin_memory, "CPU")
    lib.impl("is_pinned", is_pinned, "CPU")
