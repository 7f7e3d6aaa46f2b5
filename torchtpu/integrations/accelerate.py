"""Hugging Face Accelerate and Trainer on tpu.

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

Several processes (torchrun, or `accelerate launch --multi_gpu`, which runs
torchrun) each train on their own tpu:LOCAL_RANK, joined by torchtpu's tpu
process group. Accelerate has no distributed type for tpu (it would take
`MULTI_TPU` from the device's name, which its enum lacks), so:

- `_prepare_backend` gives `MULTI_GPU`, Accelerate's type for one device per
  process under torch.distributed, with the `tpu` backend, when LOCAL_RANK
  is set and tpu is the accelerator: Accelerate then starts the process
  group, `prepare` wraps models in DDP and shards DataLoaders, and its
  collectives (gather, reduce, wait_for_everyone) go through the group.
- `set_device` gives tpu:local_process_index, where Accelerate would name a
  cuda device for MULTI_GPU (DDP's device_ids are [local_process_index]).
- With FSDP2, `prepare` moves the model to tpu before `fully_shard`, which
  moves a CPU model through `param.data = ...` and cannot make it a tpu one.
- DDP's find_unused_parameters and static_graph cannot work on tpu (the
  reducer then stages through pinned memory, whose allocator a Python
  backend cannot give PyTorch): `prepare_model` refuses them, and Trainer,
  which asks for find_unused_parameters unless told, does not on tpu.

The batches of a loader Accelerate prepared for tpu (Trainer's included)
are bucketed as DeviceLoader buckets its own (torchtpu/buckets.py; the same
`Bucketer`): while the loader iterates, its base_dataloader's batches are
padded on the host before Accelerate sends them to the device, so that a
model fed batches of many lengths compiles a program per bucket.
TORCHTPU_BUCKETS says which buckets, or off. A DeviceLoader around the
loader buckets them itself, with its own `buckets=`.

Several processes without LOCAL_RANK would each train alone: that raises.
`accelerate launch --num_processes N` without --multi_gpu starts one
process (the launcher does not import torchtpu, so it sees no device): that
process warns.

Importing accelerate costs about a second, so `import torchtpu` does not: each
change is made when its module is first imported (`when_imported`), or at
once if it already is.
"""
import os
import warnings
import weakref

import torch

from .. import data, properties
from ..buckets import Bucketer
from ..tensor import DEVICE
from .after_import import when_imported


def _world_size():
    """The processes launched together (torchrun's and accelerate launch's
    WORLD_SIZE), or those of a process group already set up."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _local_rank():
    """The process's index on its host as launchers set it (torchrun, and
    `accelerate launch`'s multi-process launcher, which runs torchrun), or None."""
    local_rank = os.environ.get("LOCAL_RANK", "")
    return int(local_rank) if local_rank.strip().lstrip("-").isdigit() and \
        int(local_rank) >= 0 else None


def _started_alone_by_accelerate_launch():
    """accelerate launch's one-process launcher sets MASTER_ADDR and
    MASTER_PORT only when asked for several processes (or machines), and
    starts just one, with no RANK."""
    env = os.environ
    return "ACCELERATE_MIXED_PRECISION" in env and "ACCELERATE_USE_CPU" in env and \
        "MASTER_ADDR" in env and "MASTER_PORT" in env and "RANK" not in env


def _patch_state(module):
    partial_state = module.PartialState
    distributed_type = module.DistributedType
    accelerate_default = partial_state.default_device.fget
    accelerate_backend = partial_state._prepare_backend
    accelerate_set_device = partial_state.set_device

    def default_device(self):
        if not properties.tpu_is_the_accelerator():
            return accelerate_default(self)
        if _world_size() > 1:
            # Several processes, but none launched as one of several on a host.
            raise RuntimeError(
                f"torchtpu: {_world_size()} processes, but LOCAL_RANK is not set, so "
                f"Accelerate would train each alone on {DEVICE.type}; launch with torchrun "
                "or `accelerate launch --multi_gpu`, or set LOCAL_RANK (and "
                "LOCAL_WORLD_SIZE) as they do")
        return torch.device(DEVICE.type)  # no index, as accelerate gives torch.device("cuda")

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, kind = accelerate_backend(self, cpu, sagemaker_dp, backend)
        if kind != distributed_type.NO or cpu or not properties.tpu_is_the_accelerator():
            return chosen, kind
        if _local_rank() is not None:
            # Accelerate has no MULTI_TPU; MULTI_GPU is its type for one
            # device per process joined by torch.distributed: prepare wraps
            # in DDP and shards loaders, collectives go through the group.
            return backend or DEVICE.type, distributed_type.MULTI_GPU
        if _started_alone_by_accelerate_launch():
            warnings.warn(
                "torchtpu: `accelerate launch` started this process alone: its launcher does "
                f"not know {DEVICE.type} devices, so --num_processes N starts N processes only "
                "with --multi_gpu (or `distributed_type: MULTI_GPU` in Accelerate's config)",
                stacklevel=3)
        return chosen, kind

    def set_device(self):
        if self.device is not None or self.distributed_type == distributed_type.NO or \
                self._cpu or not properties.tpu_is_the_accelerator():
            return accelerate_set_device(self)
        # Accelerate would take MULTI_GPU's device for cuda; DDP's device_ids
        # are [local_process_index], so the device is tpu:local_process_index.
        index, count = self.local_process_index, torch.accelerator.device_count()
        if not 0 <= index < count:
            raise RuntimeError(
                f"torchtpu: local process {index} would use {DEVICE.type}:{index}, but this "
                f"process has {count} {DEVICE.type} device(s): set LOCAL_WORLD_SIZE to the "
                "number of processes on this host (torchrun does)")
        self.device = torch.device(DEVICE.type, index)
        torch.accelerator.set_device_index(index)

    default_device.__doc__ = accelerate_default.__doc__
    _prepare_backend.__doc__ = accelerate_backend.__doc__
    set_device.__doc__ = accelerate_set_device.__doc__
    partial_state.default_device = property(default_device)
    partial_state._prepare_backend = _prepare_backend
    partial_state.set_device = set_device


def _patch_accelerator(module):
    accelerator = module.Accelerator
    accelerate_prepare = accelerator.prepare

    def prepare(self, *args, device_placement=None):
        if not (self.device_placement and self.device.type == DEVICE.type):
            return accelerate_prepare(self, *args, device_placement=device_placement)
        if self.is_fsdp2:
            # fully_shard moves a CPU model by `param.data = param.to(device)`,
            # which cannot make a CPU tensor a tpu one; moved before, the
            # model keeps its Parameter objects, which the optimizer holds.
            for obj in args:
                if isinstance(obj, torch.nn.Module):
                    obj.to(self.device)
        before = self._get_named_parameters(*args)
        result = accelerate_prepare(self, *args, device_placement=device_placement)
        results = result if len(args) > 1 else (result,)
        after = self._get_named_parameters(*results)
        moved = {p: after[name] for name, p in before.items() if name in after}
        for obj in results:
            if isinstance(obj, module.AcceleratedOptimizer):
                obj._switch_parameters(moved)
        return result

    accelerate_prepare_model = accelerator.prepare_model

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        ddp = self.ddp_handler
        if self.device.type == DEVICE.type and self.multi_device and not evaluation_mode \
                and ddp is not None and (ddp.find_unused_parameters or ddp.static_graph):
            raise NotImplementedError(_UNUSED_PARAMETERS)
        return accelerate_prepare_model(self, model, device_placement, evaluation_mode)

    prepare.__doc__ = accelerate_prepare.__doc__
    prepare_model.__doc__ = accelerate_prepare_model.__doc__
    accelerator.prepare = prepare
    accelerator.prepare_model = prepare_model


_UNUSED_PARAMETERS = (
    f"torchtpu: DistributedDataParallel's find_unused_parameters=True and static_graph=True "
    f"do not work on {DEVICE.type}: DDP's reducer then stages through pinned host memory, "
    "whose allocator a Python backend cannot give PyTorch (torch 2.13). Leave both False "
    "(Trainer: ddp_find_unused_parameters=False; torchtpu makes that Trainer's default on "
    f"{DEVICE.type}), or use FSDP2, which has no such reducer")


def _patch_trainer(module):
    trainer = module.Trainer
    transformers_build = trainer._build_accelerator_args

    def _build_accelerator_args(self, **kwargs):
        args = transformers_build(self, **kwargs)
        # Trainer asks DDP to find unused parameters unless told otherwise,
        # which DDP cannot do on tpu (_UNUSED_PARAMETERS); a model that does
        # leave some unused then gets DDP's own error, which names the flag.
        if self.args.ddp_find_unused_parameters is None and self.args.device.type == DEVICE.type:
            for handler in args.get("kwargs_handlers", ()):
                if type(handler).__name__ == "DistributedDataParallelKwargs":
                    handler.find_unused_parameters = False
        return args

    _build_accelerator_args.__doc__ = transformers_build.__doc__
    trainer._build_accelerator_args = _build_accelerator_args


def _patch_data_loader(module):
    shard = module.DataLoaderShard
    accelerate_iter = shard.__iter__
    bucketers = weakref.WeakKeyDictionary()  # loader -> its Bucketer, kept across epochs

    def __iter__(self):
        base = vars(self).get("base_dataloader")
        if self.device is None or torch.device(self.device).type != DEVICE.type or \
                base is None or isinstance(base, data.FedBelow):
            # Not sent to tpu, or a DeviceLoader feeds it (and buckets).
            return accelerate_iter(self)
        bucketer = bucketers.get(self)
        if bucketer is None:
            bucketer = bucketers[self] = Bucketer("auto", loader=base)
        return data.fed_below(self, bucketer.padded)

    __iter__.__doc__ = accelerate_iter.__doc__
    shard.__iter__ = __iter__


def install():
    when_imported("accelerate.state", _patch_state)
    when_imported("accelerate.data_loader", _patch_data_loader)
    when_imported("accelerate.accelerator", _patch_accelerator)
    when_imported("transformers.trainer", _patch_trainer)
