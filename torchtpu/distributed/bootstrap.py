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
  `torchrun --nproc-per-node` sees every GPU and uses cuda:LOCAL_RANK, the
  process's own device is tpu:LOCAL_RANK, and it is the current device from
  the start. On the CPU platform each process has its own host devices:
  unless XLA's host device count is set, it is raised to LOCAL_WORLD_SIZE so
  that tpu:LOCAL_RANK exists.
"""
import multiprocessing
import os

from . import coordinator

SWITCH = "TORCHTPU_DISTRIBUTED"
PORT = "TORCHTPU_COORDINATOR_PORT"
HEARTBEAT = "TORCHTPU_HEARTBEAT_TIMEOUT"
_NEEDED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def _wanted():
    switch = os.environ.get(SWITCH, "").strip()
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
    port = os.environ.get(PORT) or str(int(os.environ["MASTER_PORT"]) + 1)
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
    if local is not None:
        _host_devices_for(local[1])
    with coordinator.serving(_service_apart()):
        jax.distributed.initialize(coordinator_address(), int(os.environ["WORLD_SIZE"]),
                                   int(os.environ["RANK"]),
                                   heartbeat_timeout_seconds=int(os.environ.get(HEARTBEAT) or 100))
    return True


def _service_apart():
    switch = os.environ.get(coordinator.SWITCH, "").strip()
    if switch not in ("", "0", "1"):
        raise ValueError(f"{coordinator.SWITCH}={switch!r} is not 0 or 1")
    return switch != "0"
