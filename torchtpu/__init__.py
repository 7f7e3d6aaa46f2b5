"""torchtpu: an eager-first, native TPU backend for PyTorch, on JAX."""
from . import runtime  # noqa: F401  (x64 and platform first)
from . import device as _device

_device.register_device()

from . import cache, metrics, ops  # noqa: E402
ops.load_all()
_device.register_kernels()

from . import amp  # noqa: E402

amp.register()  # torch.autocast("tpu") with CUDA's op policy

from . import module_conversion as _module_conversion  # noqa: E402

_module_conversion.install()  # tied parameters stay tied through .to()

from . import serialization as _serialization  # noqa: E402

_serialization.install()  # torch.save / torch.load of tpu tensors



from . import compile as _compile  # noqa: E402

_compile.register()

from .integrations import accelerate as _accelerate  # noqa: E402

_accelerate.install()  # Accelerator() and Trainer pick tpu (when accelerate is imported)

from .integrations import lightning as _lightning  # noqa: E402

_lightning.install()  # Trainer(accelerator="torchtpu") (when Lightning is imported)

from .integrations import flex_attention as _flex_attention  # noqa: E402

_flex_attention.install()  # torch.nn.attention.flex_attention on tpu tensors, eagerly

from .integrations import transformer as _transformer  # noqa: E402

_transformer.install()  # nn.TransformerEncoder's inference on tpu: no CPU fast path

from .integrations import control_flow as _control_flow  # noqa: E402

_control_flow.install()  # torch.cond, while_loop, map, scan on tpu tensors, eagerly

import torch.distributed as _dist  # noqa: E402

if _dist.is_available():
    from . import distributed as _distributed
    _distributed.register()

# sync: all issued work, uploads from pinned memory included (streams.synchronize).
from .device import get_device, synchronize as sync  # noqa: E402
from .modes import eager_mode, get_eager_mode, set_eager_mode  # noqa: E402
# Stop at the first op producing NaN/Inf (TORCHTPU_CHECK_NANS=1 at start).
from .modes.checks import set_check_nans  # noqa: E402
# Wait for the fused graphs compiling in the background (tiered compilation).
from .background import wait as wait_for_compiles  # noqa: E402
# Why something compiled again, and a guard against it.
from .recompiles import RecompileError, explain_compiles, no_recompiles  # noqa: E402
from .tensor import TpuTensor  # noqa: E402
from .kernels import custom_jax_kernel  # noqa: E402
from .reporting import report  # noqa: E402
from . import profiler  # noqa: E402,F401  (torchtpu.profiler.trace)
from . import jax  # noqa: E402,F401  (torchtpu.jax.to_jax, from_jax, functionalize)
from . import data  # noqa: E402,F401  (torchtpu.data.DeviceLoader)
from .jax import export  # noqa: E402
# `%load_ext torchtpu` in IPython: the %tpu_mode and %tpu_metrics magics.
from .ipython import load_ipython_extension  # noqa: E402,F401

__version__ = "0.1.0"

__all__ = ["get_device", "eager_mode", "get_eager_mode", "set_eager_mode", "set_check_nans", "sync",
           "wait_for_compiles", "explain_compiles", "report", "no_recompiles", "RecompileError",
           "TpuTensor", "metrics", "cache", "custom_jax_kernel"]

cache.start_prefetch()  # loads, on a thread, what the last run's start-up loaded
