"""The JAX runtime: platform choice, x64, dtype maps, host<->device transfer.

bootstrap.py starts jax.distributed from torchrun's environment before JAX
creates its backend (coordinator.py serves its coordinator apart from the
ranks); the process-group backend is torchtpu.distributed."""

import os
import warnings

import jax

# int64 and float64 must stay what they are.
jax.config.update("jax_enable_x64", True)
from . import bootstrap  # noqa: E402
bootstrap.initialize_from_env()  # jax.distributed before JAX creates its backend

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from .. import config  # noqa: E402

_PREFERENCE = ("tpu", "gpu", "cpu")


def _choose_platform():
    wanted = config.PLATFORM.text().lower()
    if wanted:
        if wanted not in _PREFERENCE:
            raise ValueError(
                f"TORCHTPU_PLATFORM={wanted!r} is not one of {', '.join(_PREFERENCE)}")
        return wanted
    for name in _PREFERENCE:
        try:
            if jax.devices(name):
                return name
        except RuntimeError:
            continue
    return "cpu"


PLATFORM = _choose_platform()
# tpu:N is this process's N-th device of the platform (its local devices,
# when jax.distributed spans several processes; a process of several on a
# host that sees its own chip only has it as tpu:LOCAL_RANK too).
DEVICES = bootstrap.device_slots(jax.local_devices(backend=PLATFORM))
# Where a kernel's results go when it runs on tpu:N, N > 0 (on tpu:0 they
# follow the inputs, and JAX's default device takes factories).
SHARDINGS = [jax.sharding.SingleDeviceSharding(d) for d in DEVICES]
# The device "tpu" names until set_device: tpu:LOCAL_RANK in one of several
# processes on a host (as torchrun's scripts use cuda:LOCAL_RANK), else tpu:0.
OWN_INDEX = bootstrap.own_device_index(len(DEVICES))
# XLA's options for a one-op kernel (fused graphs take XLA's defaults). On
# the CPU platform its elemental emitters build such a kernel in about two
# thirds of the time of its fusion emitters (the default), and the kernel
# runs as fast; a whole graph runs faster from the fusion emitters. Only on
# the JAX versions it is checked on (XLA refuses an option it does not know),
# and a user's own XLA_FLAGS setting of it wins.
KERNEL_COMPILER_OPTIONS = (
    {"xla_cpu_use_fusion_emitters": False}
    if PLATFORM == "cpu" and jax.__version_info__[:2] == (0, 10)
    and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")
    else None)
# A kernel of more arrays than this is many independent computations (a
# _foreach op's, one per tensor), which the fusion emitters compile faster
# (in parallel): 0.7 s against 0.25 for AdamW's lerp over 12 layers.
KERNEL_MAX_ARRAYS = 16


# A fused graph of fewer ops holding a convolution compiles faster with the
# kernels' options too (a DCGAN's 89-op graph 0.78 s against 1.53); others
# can compile slower with them (a word language model's 98-op graph 1.23 s
# against 0.59, an LSTM's 224-op piece 6.2 s against 1.3, a GPT's 37-op
# optimizer piece 3.0 s against 2.0).
GRAPH_MAX_OPS = 100


# PyTorch rounds each op's float16 and bfloat16 result to its dtype
# (autocast's matmuls, a half-precision model's every op), and so do
# torchtpu's kernels run one by one; XLA by default may carry a fused chain
# of such ops in float32 ("excess precision"), so a fused graph's values
# differ from the same ops run one by one and from CPU's (on a TPU, an
# autocast MLP's parameters off by twice the learning rate after 4 AdamW
# steps where a gradient near zero took the other sign). Every torchtpu
# program rounds as PyTorch does.
ROUNDING_OPTIONS = {"xla_allow_excess_precision": False}


def compiler_options(options=None):
    """XLA's compiler options for a torchtpu program: PyTorch's rounding,
    and options (a kernel's or graph's own) beside it."""
    return {**ROUNDING_OPTIONS, **(options or {})}


def kernel_options(args):
    """XLA's compiler options for a kernel called with args."""
    if len(jax.tree_util.tree_leaves(args)) > KERNEL_MAX_ARRAYS:
        return None
    return KERNEL_COMPILER_OPTIONS


def graph_options(op_names):
    """XLA's compiler options for a fused graph of these ops."""
    if len(op_names) < GRAPH_MAX_OPS and any(name.startswith("aten.convolution") for name in op_names):
        return KERNEL_COMPILER_OPTIONS
    return None


def device(index=0):
    return DEVICES[index]


TORCH_TO_JAX = {
    torch.bool: jnp.bool_,
    torch.uint8: jnp.uint8,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
}
JAX_TO_TORCH = {np.dtype(v): k for k, v in TORCH_TO_JAX.items()}
# complex32 has no JAX dtype: it is stored as complex64 whose parts are
# float16 values (kernels round them, see fit_to).
TORCH_TO_JAX[torch.complex32] = jnp.complex64


def jax_dtype(dtype):
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"tpu tensors do not support dtype {dtype}") from None


def torch_dtype(dtype):
    return JAX_TO_TORCH[np.dtype(dtype)]


def round_to(v, dtype):
    """float32 v rounded to the nearest value of the narrower float dtype
    (bfloat16, float16), kept float32, as CPU's conversion rounds it.
    reduce_precision, which XLA never folds away (a convert pair it may),
    flushes the target's subnormals: float16's, normal float32 numbers, are
    rounded on their grid (bfloat16's are float32 subnormals, which XLA
    flushes anyway)."""
    fi = jnp.finfo(dtype)
    rounded = jax.lax.reduce_precision(v, fi.nexp, fi.nmant)
    if fi.nexp >= jnp.finfo(jnp.float32).nexp:
        return rounded
    q = float(fi.smallest_subnormal)
    return jnp.where(jnp.abs(v) < float(fi.smallest_normal), jnp.round(v / q) * q, rounded)


def fit_to(x, dtype):
    """x (of jax_dtype(dtype)) holding only values of torch dtype dtype:
    complex32's parts rounded to float16, else x itself."""
    if dtype != torch.complex32:
        return x
    return jax.lax.complex(round_to(jnp.real(x), jnp.float16), round_to(jnp.imag(x), jnp.float16))


# Arrays of asynchronous uploads from pinned memory not yet seen complete:
# their sources must not change until then.
_in_flight = []


def wait_transfers():
    """Wait for the asynchronous uploads issued so far (a sync point's duty:
    after it, the user may write the pinned buffers they came from)."""
    if _in_flight:
        # (Held here, these arrays are never donated to a fused graph: the
        # executor donates only arrays nothing else references.)
        jax.block_until_ready(_in_flight)
        _in_flight.clear()


def _note_in_flight(arr):
    _in_flight.append(arr)
    if len(_in_flight) > 64:
        _in_flight[:] = [a for a in _in_flight if not a.is_ready()]


# A TPU has no float64 arithmetic: XLA keeps a float64 as a pair of
# float32s, about 48 bits of mantissa (float64 has 53) in float32's exponent
# range, so an upload rounds its last bits and takes 1e300 to inf and 1e-300
# to 0. Said once, at the first float64 upload.
_FLOAT64_WARNED = False
_WIDE = (torch.float64, torch.complex128)


def _warn_float64_on_tpu():
    global _FLOAT64_WARNED
    _FLOAT64_WARNED = True
    warnings.warn("torchtpu: float64 on a TPU is emulated with pairs of float32s: about 48 bits "
                  "of precision (float64 has 53) and float32's exponent range (beyond about "
                  "3.4e38 a value becomes inf, below about 1.2e-38 it becomes 0); keep data "
                  "that needs float64 exactly on the CPU", stacklevel=4)


def to_device(t: torch.Tensor, dev=None, non_blocking=False):
    """A CPU torch tensor -> a JAX array on the device. A blocking copy takes
    a host copy first, so the CPU tensor is the user's to mutate at once. A
    non_blocking one hands t's memory itself to the asynchronous transfer
    (JAX holds it until the transfer is done): t must stay unchanged until
    the next sync point (wait_transfers), as CUDA asks of pinned sources."""
    t = t.detach()
    if t.dtype in _WIDE and PLATFORM == "tpu" and not _FLOAT64_WARNED:
        _warn_float64_on_tpu()
    if t.dtype == torch.complex32:
        t = t.to(torch.complex64)  # numpy has no complex32
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        host = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        host = t.numpy()
    if not non_blocking:
        return jax.device_put(_host_copy(host), dev or DEVICES[0])
    arr = jax.device_put(host, dev or DEVICES[0])
    if PLATFORM == "cpu" and arr.unsafe_buffer_pointer() == host.ctypes.data:
        # The CPU platform takes a 64-byte-aligned host buffer as the array
        # itself (whatever may_alias says), and only copies others, in the
        # background (torchtpu.pinned makes its buffers so): the tensor
        # must not be the user's buffer, so copy it here.
        return jax.device_put(_host_copy(host), dev or DEVICES[0])
    _note_in_flight(arr)
    return arr


def _aligned(shape, np_dtype, alloc=np.empty):
    """A fresh host array at a 64-byte boundary: the CPU platform takes such
    a buffer as the device array itself, where it copies any other."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
    raw = alloc(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(np_dtype).reshape(shape)


def _host_copy(host):
    """A private copy of host to upload (on the CPU platform, aligned, so the
    upload is that copy and not a second one)."""
    if PLATFORM != "cpu":
        return np.array(host, copy=True)
    out = _aligned(host.shape, host.dtype)
    np.copyto(out, host)
    return out


def host_zeros(shape, dtype, index=0):
    """A zero-filled array on device `index` made from a fresh host buffer,
    with no kernel to compile or run (on the CPU platform it is that buffer:
    the OS zeroes its pages when first touched)."""
    return jax.device_put(_aligned(shape, np.dtype(jax_dtype(dtype)), np.zeros), DEVICES[index])


def to_host(arr, dtype=None) -> torch.Tensor:
    """A JAX array -> a new CPU torch tensor that owns its memory (of torch
    dtype dtype, where the array's dtype stands for another: complex32)."""
    # Waited for first: an array whose computation failed raises its error
    # here, where reading its memory would abort the process (its own
    # allocation having failed, as it ran queued behind others).
    arr.block_until_ready()
    # In row-major order whatever the array's layout on the device: a TPU
    # lays out an array whose last dim is short column-major (a [10, 4]
    # weight as 4 rows of 10), and numpy's copy of it keeps that order,
    # which a tensor's bytes (torch.save writes them) must not.
    host = np.array(arr, copy=True, order="C")
    if host.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    out = torch.from_numpy(host)
    return out.to(dtype) if dtype is not None and dtype != out.dtype else out
