"""What torch.cuda tells about a device, for tpu: the device index rules,
names, properties, capability, and the device context manager."""
import os
import re

import torch

from . import runtime


# The current device (torch.tpu.set_device, torch.tpu.device(N)): where
# "tpu" without an index places tensors. One per process, as torchtpu's
# executors are; tpu:LOCAL_RANK at first when processes share a host.
_current = 0


def current_index():
    return _current


def tpu_is_the_accelerator():
    """Whether torch.accelerator's current accelerator is tpu (it is unless
    another accelerator's backend is in the process too)."""
    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == "tpu"


def set_current_index(index):
    global _current
    check_index(index)
    _current = index
    _resolve_bare_device(index != 0)


# torchtpu's factories see "tpu" without an index and place it on the
# current device. PyTorch's C++ code resolves it first where it converts
# (x.to("tpu"), torch.tensor(data, device="tpu")), through the device guard
# of a Python backend, which in torch 2.13 always answers device 0. While
# the current device is not tpu:0 those entry points name it explicitly.
_UNRESOLVED = {}


def _bare(device):
    if isinstance(device, str) and device == "tpu":
        return torch.device("tpu", _current)
    if isinstance(device, torch.device) and device.type == "tpu" and device.index is None:
        return torch.device("tpu", _current)
    return device


def _resolving_to(to):
    def to_current(self, *args, **kwargs):
        if args:
            args = (_bare(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _bare(kwargs["device"])
        return to(self, *args, **kwargs)
    return to_current


def _resolving_factory(factory):
    def on_current(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _bare(kwargs["device"])
        return factory(*args, **kwargs)
    return on_current


def _resolve_bare_device(on):
    if on and not _UNRESOLVED:
        _UNRESOLVED.update(to=torch.Tensor.to, tensor=torch.tensor, as_tensor=torch.as_tensor)
        torch.Tensor.to = _resolving_to(_UNRESOLVED["to"])
        torch.tensor = _resolving_factory(_UNRESOLVED["tensor"])
        torch.as_tensor = _resolving_factory(_UNRESOLVED["as_tensor"])
    elif not on and _UNRESOLVED:
        torch.Tensor.to = _UNRESOLVED.pop("to")
        torch.tensor = _UNRESOLVED.pop("tensor")
        torch.as_tensor = _UNRESOLVED.pop("as_tensor")


def device_index(device, optional=False):
    """The tpu device index that device (an int, a str, a torch.device, or
    None when optional) names; -1 for None; the current device for "tpu"
    without an index. A device of another type raises ValueError, as
    torch.cuda's index helper does."""
    if device is None:
        if optional:
            return -1
        return _current
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "tpu":
            raise ValueError(f"Expected a tpu device, but got: {device}")
        return _current if device.index is None else device.index
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    raise ValueError("Expected a torch.device with a specified index or an integer, "
                     f"but got:{device}")


def check_index(index):
    """Raise for a device index this process does not have, as CUDA does."""
    if index != -1 and not 0 <= index < len(runtime.DEVICES):
        raise RuntimeError(f"tpu:{index} is not available: torch.tpu.device_count() is "
                           f"{len(runtime.DEVICES)} (CUDA error: invalid device ordinal)")


if runtime.OWN_INDEX:
    set_current_index(runtime.OWN_INDEX)


class device:
    """Context manager that selects the tpu device (as torch.cuda.device).
    A negative index or None makes it a no-op."""

    def __init__(self, device):
        self.idx = device_index(device, optional=True)
        self.prev_idx = -1

    def __enter__(self):
        if self.idx >= 0:
            self.prev_idx = _current
            set_current_index(self.idx)
        return self

    def __exit__(self, *exc):
        if self.prev_idx >= 0:
            set_current_index(self.prev_idx)
        return False


class device_of(device):
    """device() of a tensor's device; a no-op for a tensor not on tpu."""

    def __init__(self, obj):
        super().__init__(obj.get_device() if obj.device.type == "tpu" else -1)


def checked_index(device):
    """The index of the device that device names, which this process must
    have; the current device for None or "tpu"."""
    index = device_index(device, optional=True)
    check_index(index)
    return _current if index < 0 else index


def _jax_device(d=None):
    return runtime.device(checked_index(d))


def platform_memory_stats(d=None):
    """The platform's own memory statistics (TPU and GPU report them), or None."""
    try:
        return _jax_device(d).memory_stats() or None
    except Exception:  # a platform without the call
        return None


def host_memory():
    """(available, total) bytes of host memory: the CPU platform's memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def total_memory(d=None):
    stats = platform_memory_stats(d)
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return host_memory()[1]


def get_device_name(device=None):
    """The platform's name of the device (e.g. 'TPU v5 lite'; 'cpu' on CPU)."""
    return _jax_device(device).device_kind


def get_device_capability(device=None):
    """(major, minor): a GPU's compute capability, a TPU's generation (v4 ->
    (4, 0)), (0, 0) on CPU."""
    dev = _jax_device(device)
    cc = getattr(dev, "compute_capability", None)
    if cc:
        major, _, minor = str(cc).partition(".")
        return int(major), int(minor or 0)
    m = re.search(r"v(\d+)", dev.device_kind) if dev.platform == "tpu" else None
    return (int(m.group(1)), 0) if m else (0, 0)


class _DeviceProperties:
    """What torch.cuda.get_device_properties' readers touch."""

    def __init__(self, dev, index):
        self.name = dev.device_kind
        self.platform = dev.platform
        self.index = index
        self.total_memory = total_memory(index)
        self.major, self.minor = get_device_capability(index)
        # Cores of the device: a TPU chip's TensorCores, a GPU's SMs, the host's CPUs.
        cores = getattr(dev, "num_cores", 0) or getattr(dev, "core_count", 0)
        self.multi_processor_count = int(cores or os.cpu_count() or 1)
        self.is_integrated = dev.platform == "cpu"
        self.is_multi_gpu_board = False

    def __repr__(self):
        return (f"_TpuDeviceProperties(name='{self.name}', platform='{self.platform}', "
                f"major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1024 * 1024)}MB, "
                f"multi_processor_count={self.multi_processor_count})")


def get_device_properties(device=None):
    index = checked_index(device)
    return _DeviceProperties(runtime.device(index), index)


def is_bf16_supported(including_emulation=True):
    """XLA computes bfloat16 on every platform it drives."""
    return True
