"""The dispatcher: every aten op on a tpu tensor comes here.

- `core`: the one place for view and mutation rules; runs an op's kernel on
  the active executor, or its decomposition, or the CPU fallback;
- `plans`: what each OpOverload's schema says, read once; SPECIAL, the ops
  with a handler of their own;
- `kernels`: kernel keys (each argument's spec) and the traceable kernel
  around a lowering; PyTorch's meta kernels for shapes and dtypes;
- `host`: values between host and device;
- handler modules, which fill SPECIAL when imported: `transfers` (copies,
  .to(), .item(), resize_), `dynamic_shapes` (nonzero, mask indexing,
  unique, bincount), `rewrites` (ops rewritten into others), `growth`
  (tensors grown step by step by torch.cat: padded to buckets), `lengths`
  (ops on slices of rows whose count varies: computed padded to buckets).
"""
from .. import tensor
from . import dynamic_shapes, growth, lengths, rewrites, transfers
from .core import copy_into, cpu_fallback, dispatch, plan_of, resize
from .host import device_array, download, to_tpu, user_download
from .plans import SPECIAL
from .rewrites import OUT_VIA_FUNCTIONAL
from .transfers import _copy_

# Every op on a tpu tensor comes here, once the handler modules above have
# filled SPECIAL.
tensor.set_dispatcher(dispatch, user_download)

__all__ = ["dispatch", "plan_of", "resize", "copy_into", "cpu_fallback", "device_array", "download",
           "to_tpu", "SPECIAL", "OUT_VIA_FUNCTIONAL", "dynamic_shapes", "growth", "lengths", "rewrites", "transfers",
           "_copy_"]
