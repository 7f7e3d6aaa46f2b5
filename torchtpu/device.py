"""The tpu device: PrivateUse1 for a pure-Python backend, factory kernels, and
the torch.tpu device module."""
import types

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from . import runtime
from .ops import random as _random

aten = torch.ops.aten


def get_device(index=0):
    """The torch.device to hand to .to(), factories and modules."""
    return torch.device("tpu", index)


def _module():
    mod = types.ModuleType("torch.tpu", "The tpu device module (torchtpu).")

    def device_count():
        return len(runtime.DEVICES)

    def current_device():
        return 0

    def set_device(device):
        index = torch.device(device).index if not isinstance(device, int) else device
        if index not in (None, 0):
            raise RuntimeError(f"tpu:{index} is not available; torchtpu drives one device (tpu:0)")

    def synchronize(device=None):
        from . import modes
        modes.sync()

    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16]

    mod.is_available = lambda: True
    mod.is_initialized = lambda: True
    mod._is_in_bad_fork = lambda: False
    mod.device_count = device_count
    mod.current_device = current_device
    mod.set_device = set_device
    mod.synchronize = synchronize
    mod.get_amp_supported_dtype = get_amp_supported_dtype
    mod.manual_seed = _random.manual_seed
    mod.manual_seed_all = _random.manual_seed
    mod.seed = _random.seed
    mod.seed_all = _random.seed
    mod.initial_seed = _random.initial_seed
    mod.get_rng_state = _random.get_rng_state
    mod.set_rng_state = _random.set_rng_state
    mod.platform = runtime.PLATFORM
    return mod


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self):
        return True

    def has_primary_context(self, dev_id):
        return True

    def is_built(self):
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _factory(op):
    def kernel(*args, **kwargs):
        from .dispatch import dispatch
        return dispatch(op, args, kwargs)
    return kernel


_lib = None


def register_device():
    """Name PrivateUse1 'tpu' and install torch.tpu (before any tensor exists)."""
    _setup_privateuseone_for_python_backend("tpu", _module(), _Hooks(), _Guard())


def register_kernels():
    global _lib
    _lib = torch.library.Library("aten", "IMPL")
    for name in ("empty.memory_format", "empty_strided", "scalar_tensor",
                 "full", "zeros", "ones"):
        op = getattr(aten, name.split(".")[0])
        op = getattr(op, name.split(".")[1] if "." in name else "default")
        _lib.impl(name, _factory(op), "PrivateUse1")
    from .dispatch import _copy_
    _lib.impl("_copy_from", lambda src, dst, non_blocking=False: _copy_(dst, src), "PrivateUse1")
    _lib.impl("_copy_from_and_resize", lambda src, dst: _copy_(dst, src), "PrivateUse1")


__all__ = ["get_device", "register_device", "register_kernels"]
