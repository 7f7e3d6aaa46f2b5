"""Collectives as XLA programs over a group's devices (multi-controller JAX).

Each process holds one shard: its local array. `run(kind, device_ids, x,
**params)` puts the local arrays of the group's processes together as one
global array sharded over a 1-D mesh of their devices (in group-rank order),
runs a jitted `shard_map` of the collective on it and returns this process's
shard of the result, on the same device. Nothing here touches the host: the
values move by XLA's collectives (on CPU, JAX's gloo collectives).

Every process of the group must call `run` with the same kind, parameters,
shapes and dtypes (the process group checks that first): each compiles the
same program, so their collectives meet.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import runtime

AXIS = "ranks"

# Reductions by name: what combines two ranks' values (in rank order, where
# there is no XLA reduction of the kind).
COMBINE = {
    "sum": jnp.add,
    "product": jnp.multiply,
    "min": jnp.minimum,
    "max": jnp.maximum,
    "band": jnp.bitwise_and,
    "bor": jnp.bitwise_or,
    "bxor": jnp.bitwise_xor,
}
REDUCTIONS = tuple(COMBINE) + ("avg",)
_NATIVE = {"sum": lax.psum, "min": lax.pmin, "max": lax.pmax}
# bool values reduce as their logical meaning, as gloo's bytes do.
_BOOL_NATIVE = {"sum": lax.pmax, "max": lax.pmax, "bor": lax.pmax,
                "product": lax.pmin, "min": lax.pmin, "band": lax.pmin}


def available():
    """Whether this process is one of several under jax.distributed."""
    return jax.distributed.is_initialized() and jax.process_count() > 1


@functools.lru_cache(maxsize=None)
def _devices_by_id():
    return {d.id: d for d in jax.devices()}


@functools.lru_cache(maxsize=None)
def _mesh(device_ids):
    devices = _devices_by_id()
    return Mesh(np.array([devices[i] for i in device_ids]), (AXIS,))


def _fold(stacked, op, n):
    """stacked[0] op stacked[1] op ... (rank order)."""
    return functools.reduce(COMBINE[op], [stacked[i] for i in range(n)])


def _reduce_bool(x, op):
    if op == "bxor":
        return (lax.psum(x.astype(jnp.int32), AXIS) % 2).astype(jnp.bool_)
    return _BOOL_NATIVE[op](x.astype(jnp.uint8), AXIS).astype(jnp.bool_)


def _all_reduce(x, *, n, op):
    if x.dtype == jnp.bool_:
        return _reduce_bool(x, op)
    if op == "avg":
        return _mean(lax.psum(x, AXIS), n)
    if op in _NATIVE:
        return _NATIVE[op](x, AXIS)
    return _fold(lax.all_gather(x, AXIS), op, n)


def _reduce(x, *, n, op, root):
    """The reduction on root; the others keep their x (as gloo leaves them),
    so that every rank writes the result and records the same graph."""
    reduced = _all_reduce(x, n=n, op=op)
    return jnp.where(lax.axis_index(AXIS) == root, reduced, x)


def _select(x, root):
    """root's x on every rank, bit for bit: the others contribute zeros to a
    sum over x's bits."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return lax.complex(_select(jnp.real(x), root), _select(jnp.imag(x), root))
    mine = lax.axis_index(AXIS) == root
    if x.dtype == jnp.bool_:
        return lax.psum(jnp.where(mine, x, False).astype(jnp.int32), AXIS).astype(jnp.bool_)
    bits = jnp.dtype(f"uint{x.dtype.itemsize * 8}")
    summed = lax.psum(jnp.where(mine, lax.bitcast_convert_type(x, bits), 0), AXIS)
    return lax.bitcast_convert_type(summed, x.dtype)


def _broadcast(x, *, n, root):
    return _select(x, root)


def _all_gather(x, *, n):
    return lax.all_gather(x, AXIS, tiled=True)


def _rows(x, n):
    """x as n equal rows (row i goes to, or came from, rank i)."""
    return x.reshape(n, -1)


def _reduce_scatter(x, *, n, op, cpu):
    rows = _rows(x, n)
    if rows.dtype == jnp.bool_ or op not in ("sum", "avg"):
        # Row i of every rank, on rank i, combined in rank order.
        mine = lax.all_to_all(rows, AXIS, 0, 0)
        if rows.dtype == jnp.bool_:
            return _bool_rows(mine, op)
        return _fold(mine, op, n)
    if cpu:
        # JAX's CPU reduce-scatter (gloo's halving-doubling) leaves later
        # collectives between the processes tens of ms slower, and has known
        # faults (timeouts ignored, wrong values for large chunks): sum all
        # rows and keep this rank's, as PyTorch's gloo backend does.
        out = lax.dynamic_index_in_dim(lax.psum(rows, AXIS), lax.axis_index(AXIS), 0,
                                       keepdims=False)
    else:
        out = lax.psum_scatter(rows, AXIS, scatter_dimension=0, tiled=True).reshape(-1)
    return _mean(out, n) if op == "avg" else out


def _mean(total, n):
    """AVG: the sum over n ranks divided by n; for integers, truncated toward
    zero, as NCCL averages them (gloo refuses)."""
    if jnp.issubdtype(total.dtype, jnp.integer):
        return lax.div(total, jnp.asarray(n, total.dtype))
    return total / jnp.asarray(n, total.dtype)


def _bool_rows(rows, op):
    as_int = rows.astype(jnp.int32)
    if op == "bxor":
        return (as_int.sum(0) % 2).astype(jnp.bool_)
    if op in ("product", "min", "band"):
        return as_int.min(0).astype(jnp.bool_)
    return as_int.max(0).astype(jnp.bool_)


def _all_to_all(x, *, n):
    return lax.all_to_all(_rows(x, n), AXIS, 0, 0).reshape(-1)


def _scatter(x, *, n, root):
    """x: n rows on every rank (zeros but on root); row i of root's to rank i."""
    return lax.all_to_all(_rows(x, n), AXIS, 0, 0)[root]


def _permute(x, *, n, pairs):
    return lax.ppermute(x, AXIS, pairs)


BODIES = {
    "all_reduce": _all_reduce,
    "reduce": _reduce,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "scatter": _scatter,
    "permute": _permute,
}


def body(kind, device_ids, params):
    """Collective `kind` on one shard (inside a shard_map over the mesh of
    device_ids); params: (name, value) pairs."""
    params = dict(params)
    if kind == "reduce_scatter":
        params["cpu"] = _devices_by_id()[device_ids[0]].platform == "cpu"
    return functools.partial(BODIES[kind], n=len(device_ids), **params)


def mesh(device_ids):
    """The 1-D mesh of device_ids (in group-rank order), axis AXIS."""
    return _mesh(tuple(device_ids))


@functools.lru_cache(maxsize=None)
def _program(kind, device_ids, params):
    mesh = _mesh(device_ids)
    jitted = jax.jit(jax.shard_map(body(kind, device_ids, params), mesh=mesh,
                                   in_specs=P(AXIS), out_specs=P(AXIS)),
                     compiler_options=runtime.KERNEL_COMPILER_OPTIONS)  # one op's program
    return jitted, NamedSharding(mesh, P(AXIS))


def run(kind, device_ids, x, **params):
    """This process's shard of collective `kind` over the devices device_ids
    (global JAX device ids, in group-rank order), x its local array on its
    device. The result has at least one dimension; shapes: all_reduce,
    reduce, broadcast and permute keep x's (a scalar becomes (1,)), all_gather
    concatenates along dim 0, reduce_scatter, all_to_all and scatter are
    flat."""
    jitted, sharding = _program(kind, tuple(device_ids), tuple(sorted(params.items())))
    if x.ndim == 0:
        x = x.reshape(1)
    n = len(device_ids)
    whole = jax.make_array_from_single_device_arrays(
        (n * x.shape[0],) + x.shape[1:], sharding, [x])
    return jitted(whole).addressable_shards[0].data


def barrier(device_ids, device):
    """Wait until every device of the group has reached it (a tiny psum)."""
    one = jax.device_put(np.ones(1, np.int32), device)
    run("all_reduce", device_ids, one, op="sum").block_until_ready()
