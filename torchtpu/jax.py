"""A tpu tensor and a jax.Array, each seen as the other without a copy.

to_jax(t) gives the JAX array holding t's values: t's own buffer when t is
its whole storage (a view is read into a new array). JAX arrays are
immutable, so a later in-place op on t gives t a new buffer and leaves the
array as it was. from_jax(a) gives a tpu tensor over a's buffer."""
import jax
import torch

from . import properties, runtime
from .dispatch import device_array
from .tensor import TpuTensor, wrap


def to_jax(t):
    """t's values as a jax.Array on t's device (in fused mode, computing
    t's pending value first)."""
    if not isinstance(t, TpuTensor):
        raise TypeError(f"to_jax() takes a tpu tensor, not a {getattr(t, 'device', type(t).__name__)} "
                        "one (move it with .to('tpu') first)")
    if t.dtype == torch.complex32:
        raise TypeError("to_jax(): JAX has no complex32; convert with .to(torch.complex64) first")
    return device_array(t, "to_jax")


def from_jax(a):
    """A tpu tensor holding a (a jax.Array on one device), over a's own
    buffer when a is on one of torchtpu's devices, else copied to the
    current tpu device."""
    if not isinstance(a, jax.Array):
        raise TypeError(f"from_jax() takes a jax.Array, not {type(a).__name__}")
    devices = a.devices()
    if len(devices) != 1:
        raise ValueError(f"from_jax(): the array is sharded over {len(devices)} devices; "
                         "give it one device's array")
    (dev,) = devices
    if dev in runtime.DEVICES:
        index = runtime.DEVICES.index(dev)
    else:
        index = properties.current_index()
        a = jax.device_put(a, runtime.DEVICES[index])
    return wrap(a, device=index)
