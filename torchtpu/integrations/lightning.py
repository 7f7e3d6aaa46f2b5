"""PyTorch Lightning on tpu: `Trainer(accelerator="torchtpu")`.

Lightning's own `accelerator="tpu"` is its XLA accelerator, which needs
torch_xla, so torchtpu registers its devices under another name. What
Lightning is told:

- The accelerator: tpu's devices (`devices=N` or a list of indices, "auto"
  or -1 for all), each process's current device set as CUDA's is.
- With one device and no strategy named, the strategy is a single-device one
  on that tpu device: Lightning's default for an accelerator it does not
  know is the CPU.
- Several processes (`devices=N`, or torchrun, or several nodes) take
  Lightning's DDP strategy, whose process group is torchtpu's `tpu` backend
  (PyTorch's default for the device), each process on tpu:LOCAL_RANK; DDP
  is given no device ids (with them Lightning would set DDP up in a CUDA
  stream), and finds the module's device itself.
- `precision="bf16-mixed"` autocasts on tpu (Lightning would autocast CUDA,
  which leaves tpu ops in float32); "16-mixed" is refused, as Accelerate
  refuses fp16 on tpu.

As on CUDA, Lightning moves the model back to the CPU when fit ends.
Each change is made when Lightning's module is first imported, so `import
torchtpu` does not import Lightning (`lightning.pytorch`, and the standalone
`pytorch_lightning`).
"""
import torch

from ..tensor import DEVICE
from .after_import import when_imported

NAME = "torchtpu"


def _parse_devices(devices):
    """Lightning's `devices=` as a list of tpu device indices."""
    count = torch.tpu.device_count()
    if devices in ("auto", -1, "-1"):
        return list(range(count))
    if isinstance(devices, str):
        devices = [int(d) for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
    indices = list(range(devices)) if isinstance(devices, int) else [int(d) for d in devices]
    if not indices or any(not 0 <= i < count for i in indices):
        raise ValueError(f"torchtpu: devices={devices!r} asks for tpu devices {indices}; this "
                         f"process has {count}")
    return indices


def _accelerator_class(accelerators):
    class TorchTPUAccelerator(accelerators.Accelerator):
        """torchtpu's tpu devices, for Lightning's Trainer."""

        def setup_device(self, device):
            if device.type != DEVICE.type:
                raise ValueError(f"torchtpu: the {NAME} accelerator was given device {device}")
            torch.tpu.set_device(device)

        def get_device_stats(self, device):
            return torch.tpu.memory_stats(device)

        def teardown(self):
            pass

        @staticmethod
        def parse_devices(devices):
            return _parse_devices(devices)

        @staticmethod
        def get_parallel_devices(devices):
            return [torch.device(DEVICE.type, i) for i in _parse_devices(devices)]

        @staticmethod
        def auto_device_count():
            return torch.tpu.device_count()

        @staticmethod
        def is_available():
            return True

        @staticmethod
        def name():
            return NAME

        @classmethod
        def register_accelerators(cls, accelerator_registry):
            accelerator_registry.register(NAME, cls, description="torchtpu's tpu devices")

    return TorchTPUAccelerator


def _register_accelerator(accelerators):
    cls = _accelerator_class(accelerators)
    accelerators.TorchTPUAccelerator = cls
    if NAME not in accelerators.AcceleratorRegistry:
        cls.register_accelerators(accelerators.AcceleratorRegistry)


def _ours(connector):
    flag = connector._accelerator_flag
    return flag == NAME or getattr(flag, "name", lambda: None)() == NAME


def _patch_connector(module):
    connector = module._AcceleratorConnector
    choose_strategy = connector._choose_strategy
    init_precision = connector._check_and_init_precision

    def _choose_strategy_on_tpu(self):
        if (_ours(self) and self._num_nodes_flag <= 1 and len(self._parallel_devices) <= 1):
            strategies = module.SingleDeviceStrategy
            return strategies(device=self._parallel_devices[0])
        return choose_strategy(self)

    def _check_and_init_precision_on_tpu(self):
        if _ours(self) and self._precision_flag in ("16-mixed", "bf16-mixed"):
            if self._precision_flag == "16-mixed":
                raise ValueError(f"torchtpu: precision='16-mixed' is not supported on {DEVICE.type}; "
                                 "use precision='bf16-mixed'")
            return module.MixedPrecision("bf16-mixed", DEVICE.type)
        return init_precision(self)

    connector._choose_strategy = _choose_strategy_on_tpu
    connector._check_and_init_precision = _check_and_init_precision_on_tpu


def _patch_ddp(module):
    strategy = module.DDPStrategy
    device_ids = strategy.determine_ddp_device_ids

    def determine_ddp_device_ids(self):
        # None on tpu: given device ids, Lightning wraps DDP's set-up in a
        # CUDA stream; DDP finds the module's one device by itself.
        if self.root_device.type == DEVICE.type:
            return None
        return device_ids(self)

    strategy.determine_ddp_device_ids = determine_ddp_device_ids


def install():
    for package in ("lightning.pytorch", "pytorch_lightning"):
        when_imported(f"{package}.accelerators", _register_accelerator)
        when_imported(f"{package}.trainer.connectors.accelerator_connector", _patch_connector)
        when_imported(f"{package}.strategies.ddp", _patch_ddp)
