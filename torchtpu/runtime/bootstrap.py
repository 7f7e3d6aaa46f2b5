"""jax.distributed started from torch.distributed's environment.

A process that torchrun (or any launcher that sets MASTER_ADDR, MASTER_PORT,
RANK and WORLD_SIZE, WORLD_SIZE > 1) starts joins the others as one JAX
process of many, so that XLA's collectives span them. This must happen
before JAX creates its backend, so the runtime calls `initialize_from_env()`
first; this module imports nothing of torchtpu.

The environment it reads:
- TORCHTPU_DISTRIBUTED: `0` never joins; `1` must join (a missing variable
  is an error); unset joins when the variables above are set, in a process
  that no Python multiprocessing parent started (DataLoader workers inherit
  the environment but are not ranks).
- TORCHTPU_COORDINATOR_PORT: the port of JAX's coordinator on MASTER_ADDR
  (rank 0 serves it); default MASTER_PORT + 1, since torch's store holds
  MASTER_PORT.
- TORCHTPU_HEARTBEAT_TIMEOUT: seconds after which JAX's coordination
  service takes a silent process for dead and ends the others (default
  100, JAX's). A process whose peer died exits no sooner.
- TORCHTPU_COORDINATOR_PROCESS: `1` (default) serves JAX's coordination
  service from a child process of rank 0, so that a dead rank 0 fails the
  others' collectives with a Python error rather than aborting them
  (coordinator.py); `0` serves it in rank 0, as JAX does.
- LOCAL_RANK and LOCAL_WORLD_SIZE (torchrun sets both): several processes
  share this host. As under CUDA, where each process of
  `torchrun --nproc-per-node` uses cuda:LOCAL_RANK, the process's own
  device is tpu:LOCAL_RANK, and it is the current device from the start.
  Each process is given its own chip before the backend starts
  (`tpu_environment`, `gpu_device_ids`): on a TPU host, the TPU runtime's
  per-process variables (a TPU chip opens in one process only); on GPUs,
  jax.distributed's local_device_ids (else each process would take memory
  on every GPU). Variables the user set are kept. A process that then sees
  one device has it under every index below LOCAL_WORLD_SIZE
  (`device_slots`), so tpu:LOCAL_RANK names it. On the CPU platform each
  process has its own host devices: unless XLA's host device count is set,
  it is raised to LOCAL_WORLD_SIZE so that tpu:LOCAL_RANK exists.
- TORCHTPU_TPU_PROCESS_PORT: the first of the LOCAL_WORLD_SIZE ports on
  localhost the TPU runtime's processes meet on (default 8476, as
  PyTorch/XLA's).
"""
import multiprocessing
import os

from .. import config
from . import coordinator

SWITCH = config.DISTRIBUTED.name
# What the TPU runtime (libtpu) reads to give a process some chips of its host.
TPU_TOPOLOGY = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS",
                "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID")
# The grid of P one-chip processes on a host of P chips, as JAX's own
# multi-process tests lay them out.
_PROCESS_BOUNDS = {1: "1,1,1", 4: "2,2,1", 8: "4,2,1"}
_NEEDED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def _wanted():
    switch = config.DISTRIBUTED.text()
    if switch not in ("", "0", "1"):
        raise ValueError(f"{SWITCH}={switch!r} is not 0 or 1")
    if switch == "0":
        return False
    missing = [name for name in _NEEDED if not os.environ.get(name)]
    if switch == "1":
        if missing:
            raise RuntimeError(f"{SWITCH}=1 needs {', '.join(missing)} in the environment")
        return True
    if missing or multiprocessing.parent_process() is not None:
        return False
    return int(os.environ["WORLD_SIZE"]) > 1


def coordinator_address():
    port = config.COORDINATOR_PORT.text() or str(int(os.environ["MASTER_PORT"]) + 1)
    return f"{os.environ['MASTER_ADDR']}:{port}"


def _local():
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) when torchrun says several processes
    share this host, else None."""
    rank, size = os.environ.get("LOCAL_RANK", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    if not (rank.strip().isdigit() and size.strip().isdigit()) or int(size) < 2:
        return None
    if int(rank) >= int(size):
        raise ValueError(f"LOCAL_RANK={rank} is not below LOCAL_WORLD_SIZE={size}")
    return int(rank), int(size)


def _host_devices_for(local_world_size):
    """On the CPU platform, one host device per local rank at least (unless
    the user set the count): tpu:LOCAL_RANK must exist in every process."""
    import jax
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    if jax.config.jax_num_cpu_devices < local_world_size:
        jax.config.update("jax_num_cpu_devices", local_world_size)


def tpu_chips():
    """The TPU chips on this host's PCI bus (0 off TPU hosts), read without
    starting the TPU runtime."""
    from ..compat import tpu_chip_count
    return tpu_chip_count()


def tpu_environment(local_rank, local_world_size, world_size, chips, environ):
    """The TPU runtime's variables that give this process (local_rank of
    local_world_size on a host of `chips` chips) chip local_rank alone: {}
    off TPU hosts, and when the user set any of them. RuntimeError where
    torchtpu cannot lay the processes out (several hosts, or not one
    process per chip): the user sets them then."""
    if chips == 0 or any(name in environ for name in TPU_TOPOLOGY):
        return {}
    if world_size != local_world_size or local_world_size != chips or \
            chips not in _PROCESS_BOUNDS:
        raise RuntimeError(
            f"torchtpu: {local_world_size} processes on a host of {chips} TPU chips "
            f"({world_size} in all): torchtpu gives each process a chip of its own only "
            "for one process per chip on one host; set TPU_VISIBLE_CHIPS, "
            "TPU_CHIPS_PER_PROCESS_BOUNDS, TPU_PROCESS_BOUNDS, TPU_PROCESS_ADDRESSES, "
            "TPU_PROCESS_PORT and CLOUD_TPU_TASK_ID for each process")
    base = config.TPU_PROCESS_PORT.number(environ)
    return {
        "TPU_VISIBLE_CHIPS": str(local_rank),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": _PROCESS_BOUNDS[chips],
        "TPU_PROCESS_ADDRESSES": ",".join(f"localhost:{base + i}"
                                          for i in range(local_world_size)),
        "TPU_PROCESS_PORT": str(base + local_rank),
        "CLOUD_TPU_TASK_ID": str(local_rank),
        # libtpu refuses a second process on the host without it.
        "ALLOW_MULTIPLE_LIBTPU_LOAD": environ.get("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
    }


def gpu_device_ids(local_rank, local_world_size, environ):
    """jax.distributed's local_device_ids for this process: [local_rank],
    unless the user or the launcher chose the visible GPUs already
    (JAX_LOCAL_DEVICE_IDS, JAX_CUDA_VISIBLE_DEVICES, or CUDA_VISIBLE_DEVICES
    naming fewer GPUs than there are processes here). It applies to GPUs
    only: JAX ignores it on TPU and CPU."""
    if environ.get("JAX_LOCAL_DEVICE_IDS") or environ.get("JAX_CUDA_VISIBLE_DEVICES"):
        return None
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([v for v in visible.split(",") if v.strip()]) < local_world_size:
        return None
    return [local_rank]


def device_slots(devices):
    """What tpu:0, tpu:1, ... name: JAX's local devices; in one of several
    JAX processes on a host that sees one device (its own chip), that device
    under every index below LOCAL_WORLD_SIZE, so that tpu:LOCAL_RANK (and
    set_device(LOCAL_RANK)) names it, as cuda:LOCAL_RANK names a torchrun
    process's GPU. Tensors on two of those indices are still on two devices
    to PyTorch (CUDA's error)."""
    import jax
    local = _local()
    devices = list(devices)
    if local is None or len(devices) != 1 or not jax.distributed.is_initialized():
        return devices
    return devices * local[1]


def own_device_index(device_count):
    """The index N of tpu:N this process uses by default: LOCAL_RANK when it
    is one of several JAX processes sharing a host, else 0. A LOCAL_RANK
    this process has no device for raises RuntimeError, as CUDA's invalid
    device ordinal would at set_device(LOCAL_RANK)."""
    import jax
    local = _local()
    if local is None or not jax.distributed.is_initialized():
        return 0
    if local[0] >= device_count:
        raise RuntimeError(
            f"LOCAL_RANK={local[0]} names tpu:{local[0]}, but this process has "
            f"{device_count} device(s): give each of the {local[1]} processes on this host "
            "a device of its own (on the CPU platform, XLA's host device count)")
    return local[0]


def initialize_from_env():
    """Start jax.distributed as the environment says (see the module's
    docstring); True when this process is one of several JAX processes."""
    import jax
    if jax.distributed.is_initialized():
        return True
    if not _wanted():
        return False
    # Collectives between processes on the CPU platform go through gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    local = _local()
    device_ids = None
    if local is not None:
        _host_devices_for(local[1])
        os.environ.update(tpu_environment(*local, int(os.environ["WORLD_SIZE"]), tpu_chips(),
                                          os.environ))
        device_ids = gpu_device_ids(*local, os.environ)
    with coordinator.serving(_service_apart()):
        jax.distributed.initialize(coordinator_address(), int(os.environ["WORLD_SIZE"]),
                                   int(os.environ["RANK"]), local_device_ids=device_ids,
                                   heartbeat_timeout_seconds=config.HEARTBEAT_TIMEOUT.number())
    return True


def _service_apart():
    switch = config.COORDINATOR_PROCESS.text()
    if switch not in ("", "0", "1"):
        raise ValueError(f"{config.COORDINATOR_PROCESS.name}={switch!r} is not 0 or 1")
    return switch != "0"
