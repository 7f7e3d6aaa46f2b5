"""Hugging Face Accelerate on tpu.

Accelerate (1.x) names the devices it knows in its own code:
`PartialState.default_device` tries mps, mlu, sdaa, musa, npu, hpu, cuda, xpu
and neuron, else gives cpu, so `Accelerator()` and the `Trainer` (which builds
one) put every model and batch on cpu. Two changes tell it about tpu:

- `default_device` gives the tpu device whenever tpu is torch's current
  accelerator (`torch.accelerator`), as transformers' TrainingArguments
  already decides. `Accelerator(cpu=True)` and `TrainingArguments(use_cpu=True)`
  never ask it and still give cpu.
- `Accelerator.prepare` points the optimizers it prepares at the parameters
  the model has on tpu, by name: moving a model to tpu keeps its Parameter
  objects unless one cannot be swapped (torchtpu.module_conversion), and an
  optimizer made before `prepare` (Accelerate's usual order) must not step
  a replaced one. Accelerate does the same for XLA devices.

Only one process is covered: Accelerate's multi-process set-up has no branch
for another device, so each process of `accelerate launch` or torchrun would
train alone on its own data; that raises instead.

Importing accelerate costs about a second, so `import torchtpu` does not: each
change is made when its module is first imported (`when_imported`), or at
once if it already is.
"""
import os

import torch

from ..tensor import DEVICE
from .after_import import when_imported


def _tpu_is_the_accelerator():
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == DEVICE.type


def _world_size():
    """The processes launched together (torchrun's and accelerate launch's
    WORLD_SIZE), or those of a process group already set up."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _patch_state(module):
    partial_state = module.PartialState
    accelerate_default = partial_state.default_device.fget

    def default_device(self):
        if not _tpu_is_the_accelerator():
            return accelerate_default(self)
        if _world_size() > 1:
            raise NotImplementedError(
                f"torchtpu: Hugging Face Accelerate runs on {DEVICE.type} in one process "
                f"only; with {_world_size()} processes each would train alone (Accelerate "
                f"sets up no process group for {DEVICE.type}). Use torch.distributed with "
                f"DistributedDataParallel directly, or one process")
        return torch.device(DEVICE.type)  # no index, as accelerate gives torch.device("cuda")

    default_device.__doc__ = accelerate_default.__doc__
    partial_state.default_device = property(default_device)


def _patch_accelerator(module):
    accelerator = module.Accelerator
    accelerate_prepare = accelerator.prepare

    def prepare(self, *args, device_placement=None):
        if not (self.device_placement and self.device.type == DEVICE.type):
            return accelerate_prepare(self, *args, device_placement=device_placement)
        before = self._get_named_parameters(*args)
        result = accelerate_prepare(self, *args, device_placement=device_placement)
        results = result if len(args) > 1 else (result,)
        after = self._get_named_parameters(*results)
        moved = {p: after[name] for name, p in before.items() if name in after}
        for obj in results:
            if isinstance(obj, module.AcceleratedOptimizer):
                obj._switch_parameters(moved)
        return result

    prepare.__doc__ = accelerate_prepare.__doc__
    accelerator.prepare = prepare


_installed = False


def install():
    global _installed
    if _installed:
        return
    _installed = True
    when_imported("accelerate.state", _patch_state)
    when_imported("accelerate.accelerator", _patch_accelerator)
