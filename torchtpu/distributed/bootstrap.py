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
"""
import multiprocessing
import os

SWITCH = "TORCHTPU_DISTRIBUTED"
PORT = "TORCHTPU_COORDINATOR_PORT"
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
    jax.distributed.initialize(coordinator_address(), int(os.environ["WORLD_SIZE"]),
                               int(os.environ["RANK"]))
    return True
