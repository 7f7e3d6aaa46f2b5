"""The tpu device: PrivateUse1 for a pure-Python backend, factory kernels, and
the torch.tpu device module."""
import math
import types
import warnings

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from . import graphs, memory, memory_limit, properties, runtime, streams
from .ops import random as _random
from .streams import synchronize

from .compat import aten


def get_device(index=0):
    """The torch.device to hand to .to(), factories and modules."""
    return torch.device("tpu", index)


def _is_in_bad_fork():
    """torch.manual_seed() seeds tpu only outside a forked child, as CUDA."""
    from . import modes  # (its executors need the device registered first)
    return modes.in_forked_child()


def _module():
    mod = types.ModuleType("torch.tpu", "The tpu device module (torchtpu).")

    def device_count():
        return len(runtime.DEVICES)

    def set_device(device):
        index = properties.device_index(device, optional=True)
        if index >= 0:
            properties.set_current_index(index)

    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16]

    mod.is_available = lambda: True
    mod.is_initialized = lambda: True
    # What PyTorch reads of a device module by name (torch.utils.checkpoint
    # saves and restores the device's random state only if it is set).
    mod._initialized = True
    mod._is_in_bad_fork = _is_in_bad_fork
    mod.device_count = device_count
    mod.current_device = properties.current_index
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
    mod.device = properties.device
    mod.device_of = properties.device_of
    mod.get_device_name = properties.get_device_name
    mod.get_device_properties = properties.get_device_properties
    mod.get_device_capability = properties.get_device_capability
    mod.is_bf16_supported = properties.is_bf16_supported
    for name in memory.NAMES:
        setattr(mod, name, getattr(memory, name))
    for name in memory_limit.NAMES:
        setattr(mod, name, getattr(memory_limit, name))
    mod.memory = memory  # torch.tpu.memory._record_memory_history(), as torch.cuda.memory's
    for name in streams.NAMES:
        setattr(mod, name, getattr(streams, name))
    for name in graphs.NAMES:
        setattr(mod, name, getattr(graphs, name))
    return mod


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self):
        return True

    def has_primary_context(self, dev_id):
        return True

    def is_built(self):
        return True


_PRIVATE_USE1 = torch._C._autograd.DeviceType.PrivateUse1


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        # (PyTorch asks this of every autograd node's device guard: once or
        # twice per op of a backward pass.)
        return _PRIVATE_USE1


def _factory(op):
    def kernel(*args, **kwargs):
        from .dispatch import dispatch
        return dispatch(op, args, kwargs)
    return kernel


# An empty tensor's contents are unspecified, so it needs no kernel (a zeros
# kernel compiles once per shape: each new batch shape's .to("tpu") paid a
# compilation for memory its copy then replaced). It is made from a fresh host
# buffer instead: on the CPU platform at any size (device memory is host
# memory, and the OS zeroes pages when first touched), elsewhere up to
# _HOST_EMPTY_MAX_BYTES (a small transfer; a large one would cost more than
# the kernel).
_HOST_EMPTY_MAX_BYTES = 1 << 20


def _empty(op):
    default = _factory(op)

    def kernel(size, *args, **kwargs):
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        if dtype == torch.complex32 or (runtime.PLATFORM != "cpu"
                                        and math.prod(size) * dtype.itemsize > _HOST_EMPTY_MAX_BYTES):
            return default(size, *args, **kwargs)
        from . import modes
        from .tensor import Storage, TpuTensor, contiguous_strides
        size = tuple(size)
        if op is aten.empty_strided.default:
            dense = tuple(args[0]) == contiguous_strides(size)
        else:
            dense = kwargs.get("memory_format") in (None, torch.contiguous_format)
        if dense and kwargs.get("layout") in (None, torch.strided) and not modes.current().fuses:
            index = properties.checked_index(kwargs.get("device"))
            return TpuTensor(Storage(runtime.host_zeros(size, dtype, index), index), size, dtype)
        return default(size, *args, **kwargs)
    return kernel


# Factories whose CompositeExplicit kernels would build the result through an
# out= op (arange -> arange.start_out) go straight to their functional
# lowering; (overload, to(args) -> (overload, args)) normalizes the aliases.
_FACTORIES = {
    # Autograd's zero gradients (sgn's backward); plain zeros here.
    "_efficientzerotensor.default": lambda size, **kw: (aten.zeros.default, (size,), kw),
    "arange.default": lambda end, **kw: (aten.arange.start_step, (0, end, 1), kw),
    "arange.start": lambda start, end, **kw: (aten.arange.start_step, (start, end, 1), kw),
    "arange.start_step": lambda *a, **kw: (aten.arange.start_step, a, kw),
    "eye.default": lambda n, **kw: (aten.eye.m, (n, n), kw),
    "eye.m": lambda *a, **kw: (aten.eye.m, a, kw),
    "linspace.default": lambda *a, **kw: (aten.linspace.default, a, kw),
    "logspace.default": lambda *a, **kw: (aten.logspace.default, a, kw),
    "randperm.default": lambda *a, **kw: (aten.randperm.default, a, kw),
    "randperm.generator": lambda *a, **kw: (aten.randperm.generator, a, kw),
    "tril_indices.default": lambda *a, **kw: (aten.tril_indices.default, a, kw),
    "triu_indices.default": lambda *a, **kw: (aten.triu_indices.default, a, kw),
}


def _lowered_factory(normalize):
    """Dispatch to the op's lowering; without one, build it on CPU and copy it
    over (counted as a CPU fallback)."""
    def kernel(*args, **kwargs):
        from . import dispatch as _dispatch
        from .ops import LOWERINGS
        op, args, kwargs = normalize(*args, **kwargs)
        if op in LOWERINGS:
            return _dispatch.dispatch(op, args, kwargs)
        from . import metrics
        name = str(op)
        metrics.M.cpu_fallbacks[name] += 1
        if name not in _dispatch._warned_fallback:
            _dispatch._warned_fallback.add(name)
            warnings.warn(f"torchtpu: {name} has no tpu lowering; building it on CPU "
                          "(counted in torchtpu.metrics cpu_fallbacks)", stacklevel=2)
        out = op(*args, **dict(kwargs, device="cpu"))
        return _dispatch.to_tpu(out)
    return kernel


_lib = None


def _accelerator_current_device():
    """torch.accelerator's current device index is the C++ device guard's,
    which for a Python backend in torch 2.13 is always 0 and cannot be set:
    make its functions torch.tpu's."""
    acc = torch.accelerator

    def set_device_index(device, /):
        index = properties.device_index(device, optional=True)
        if index >= 0:
            properties.set_current_index(index)

    acc.set_device_index = acc.set_device_idx = set_device_index
    acc.current_device_index = acc.current_device_idx = properties.current_index
    acc.device_index = properties.device


# torch.accelerator's memory functions and torch.tpu's answering them.
_ACCELERATOR_MEMORY = {name: name for name in (
    "empty_cache", "memory_stats", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats")} | {"get_memory_info": "mem_get_info"}


def _accelerator_memory():
    """torch.accelerator's memory functions ask the C++ caching allocator,
    which a Python backend has none of (torch 2.13 fails an internal assert,
    and Accelerate's Trainer calls empty_cache through them): while tpu is
    the current accelerator, torch.tpu's answer them."""
    for name, ours in _ACCELERATOR_MEMORY.items():
        theirs = getattr(torch.accelerator.memory, name, None)
        if theirs is not None:  # (torch.accelerator re-exports the same functions)
            routed = _on_tpu(getattr(memory, ours), theirs)
            setattr(torch.accelerator.memory, name, routed)
            setattr(torch.accelerator, name, routed)


def _accelerator_device_functions():
    """torch.accelerator.synchronize, get_device_capability, its streams and
    its Graph ask the C++ device guard, which a Python backend cannot extend:
    most raise "... not supported ...", and its stream's synchronize() returns
    at once, so device-generic timing code would time nothing. While tpu is
    the current accelerator, torch.tpu's functions and graphs answer them."""
    acc = torch.accelerator
    acc.synchronize = _on_tpu(synchronize, acc.synchronize)
    acc.get_device_capability = _on_tpu(_accelerator_capability, acc.get_device_capability)
    acc.current_stream = _on_tpu(streams.current_stream, acc.current_stream)
    acc.set_stream = _on_tpu(streams.set_stream, acc.set_stream)
    if hasattr(acc, "Graph"):  # (torch 2.13 on)
        acc.Graph = graphs.accelerator_graph_class(acc.Graph)


def _accelerator_capability(device=None, /):
    """{"supported_dtypes": the dtypes tpu tensors can be made with and
    converted between}, as torch.accelerator.get_device_capability gives."""
    properties.checked_index(device)
    return {"supported_dtypes": set(runtime.TORCH_TO_JAX)}


def _on_tpu(ours, theirs):
    def routed(*args):
        return (ours if properties.tpu_is_the_accelerator() else theirs)(*args)
    routed.__name__, routed.__doc__ = theirs.__name__, ours.__doc__
    return routed


def register_device():
    """Name PrivateUse1 'tpu' and install torch.tpu (before any tensor exists)."""
    _setup_privateuseone_for_python_backend("tpu", _module(), _Hooks(), _Guard())
    _accelerator_current_device()
    _accelerator_memory()
    _accelerator_device_functions()
    streams.install()
    # torch.Generator(device="tpu"): PyTorch would ask the C++ hooks, which a
    # Python backend cannot give one (torchtpu.ops.random.Generator).
    torch.Generator = _random.Generator


def _optimizers_default_to_foreach():
    """torch.optim picks its multi-tensor (_foreach) path by default only
    for plain Tensor/Parameter types on devices with foreach kernels; tpu
    has them, so let its tensors qualify, as CUDA tensors do."""
    from torch.optim import optimizer
    from .tensor import TpuTensor
    if TpuTensor not in optimizer._foreach_supported_types:
        optimizer._foreach_supported_types.append(TpuTensor)


def _backward_on_calling_thread():
    """Autograd runs a non-CPU device's backward on a thread of its own, so
    that CUDA work can block there. tpu ops never block the host (they are
    issued asynchronously, or recorded), so the thread buys nothing and
    costs a hand-over per backward (about 0.4 ms); run tpu backward on the
    calling thread, as PyTorch does for its lazy tensors. The setting is
    PyTorch's own, thread-local: it holds for the thread importing
    torchtpu, and torch.autograd.set_multithreading_enabled(True) undoes it."""
    torch.autograd.set_multithreading_enabled(False)


def register_kernels():
    global _lib
    _optimizers_default_to_foreach()
    _backward_on_calling_thread()
    _lib = torch.library.Library("aten", "IMPL")
    for name in ("empty.memory_format", "empty_strided", "scalar_tensor",
                 "full", "zeros", "ones"):
        op = getattr(aten, name.split(".")[0])
        op = getattr(op, name.split(".")[1] if "." in name else "default")
        _lib.impl(name, (_empty if name.startswith("empty") else _factory)(op), "PrivateUse1")
    for name, normalize in _FACTORIES.items():
        _lib.impl(name.replace(".default", ""), _lowered_factory(normalize), "PrivateUse1")
    from .ops.nn import scaled_dot_product_attention
    # At the autograd key, ahead of PyTorch's composite (torchtpu.ops.nn.attention).
    _lib.impl("scaled_dot_product_attention", scaled_dot_product_attention, "AutogradPrivateUse1")
    from . import pinned
    pinned.register(_lib)
    from .dispatch import OUT_VIA_FUNCTIONAL, _copy_, dispatch
    _lib.impl("_copy_from", lambda src, dst, non_blocking=False: _copy_(dst, src, non_blocking),
              "PrivateUse1")
    _lib.impl("_copy_from_and_resize", lambda src, dst: _copy_(dst, src), "PrivateUse1")
    # torch.tensor([t[0], t[1]]) of 0-dim tpu tensors reads each element with
    # the Python key excluded, at the backend's own kernel.
    from .dispatch.transfers import _local_scalar_dense
    _lib.impl("_local_scalar_dense", _local_scalar_dense, "PrivateUse1")
    for op in OUT_VIA_FUNCTIONAL:
        # A backend kernel takes the place of the composite one, so these ops
        # reach __torch_dispatch__ (this kernel itself is never reached first).
        _lib.impl(op._schema.name.split("::")[1] + "." + op._overloadname,
                  lambda *a, _op=op, **k: dispatch(_op, a, k), "PrivateUse1")


__all__ = ["get_device", "register_device", "register_kernels"]
