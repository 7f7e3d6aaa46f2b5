"""Random ops: a device generator keyed from torch.manual_seed.

State is (seed, offset) on the host; each random op takes both as dynamic
kernel inputs and folds them into its key, so no op recompiles per call.
"""
import jax
import jax.numpy as jnp
import torch

aten = torch.ops.aten

_state = {"seed": 67280421310721, "offset": 0}


def manual_seed(seed):
    _state["seed"] = int(seed) & 0xFFFFFFFFFFFFFFFF
    _state["offset"] = 0


def seed():
    import random
    manual_seed(random.getrandbits(63))
    return _state["seed"]


def initial_seed():
    return _state["seed"]


def get_rng_state(device="tpu"):
    return torch.tensor([_state["seed"], _state["offset"]], dtype=torch.int64).view(torch.uint8)


def set_rng_state(new_state, device="tpu"):
    seed_, offset = new_state.view(torch.int64).tolist()
    _state["seed"], _state["offset"] = seed_ & 0xFFFFFFFFFFFFFFFF, offset


def next_key():
    """(seed, offset) for the next random op."""
    offset = _state["offset"]
    _state["offset"] = offset + 1
    return _state["seed"], offset


def key_from(seed_, offset):
    key = jax.random.key(jnp.asarray(seed_, jnp.uint64) if False else seed_ & 0xFFFFFFFF)
    return jax.random.fold_in(key, offset)
