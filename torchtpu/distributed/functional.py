"""The functional collectives (`torch.ops._c10d_functional.*`, which DTensor,
tensor parallelism and `torch.distributed._functional_collectives` call) on
tpu tensors.

PyTorch's own kernels for these ops look the group's backend up by device in
C++, where a process group written in Python holds only gloo. On tpu tensors
they reach the dispatcher instead, which hands them to the handlers here:
each resolves the group by name and runs the group's collective, so the
functional ops take the same path as `dist.all_reduce` and friends (XLA
collectives under jax.distributed, after the ranks' agreement; gloo on host
copies otherwise). On XLA, all_reduce, all_gather_into_tensor and
reduce_scatter_tensor return the collective's result as it comes, with no
copy into a prepared tensor. A collective is issued when its op returns, so
`wait_tensor` gives its input back: reading the result waits for it.
batch_p2p_ops runs its sends and receives in an order every rank derives
alike (p2p.py).
"""
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions,
                                       AllreduceOptions, AllToAllOptions, BroadcastOptions,
                                       ReduceScatterOptions)
from torch.distributed import distributed_c10d as c10d

from ..compat import c10d_functional, has_op
from ..dispatch.plans import SPECIAL
from . import p2p
from .process_group import TpuProcessGroup

functional = c10d_functional


def _group(group_name):
    """The process group a functional collective names (a name, or the group)."""
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    return c10d._resolve_process_group(group_name)


def _options(cls, reduce_op):
    name = reduce_op.upper()
    op = getattr(dist.ReduceOp, name, None) if name.isidentifier() else None
    if not isinstance(op, dist.ReduceOp.RedOpType):
        raise RuntimeError(f"Unrecognized reduce_op: {reduce_op}")
    opts = cls()
    opts.reduceOp = op
    return opts


def _on_xla(group, tensors):
    """Whether group runs these tensors' collective on XLA, where its result
    comes as a new tensor (no copy into a prepared one)."""
    return isinstance(group, TpuProcessGroup) and group._on_xla(tensors)


def _fresh(t):
    """A contiguous copy of t: the result of a functional collective is a new
    tensor, never its input."""
    return t.clone(memory_format=torch.contiguous_format)


def _check_group_size(name, group, group_size):
    if group_size != group.size():
        raise RuntimeError(f"{name}: group_size {group_size} does not match the size "
                           f"{group.size()} of group {group.group_name}")


# ---- all_reduce --------------------------------------------------------------

def all_reduce_(input, reduce_op, group_name):
    _group(group_name).allreduce([input], _options(AllreduceOptions, reduce_op)).wait()
    return input


def all_reduce(input, reduce_op, group_name):
    group = _group(group_name)
    if _on_xla(group, [input]):
        return group.reduced("all_reduce", [input], _options(AllreduceOptions, reduce_op))[0]
    return all_reduce_(_fresh(input), reduce_op, group_name)


def all_reduce_coalesced_(inputs, reduce_op, group_name):
    opts = _options(AllreduceCoalescedOptions, reduce_op)
    _group(group_name).allreduce_coalesced(list(inputs), opts).wait()
    return inputs


def all_reduce_coalesced(inputs, reduce_op, group_name):
    group = _group(group_name)
    if _on_xla(group, inputs):
        opts = _options(AllreduceCoalescedOptions, reduce_op)
        return group.reduced("all_reduce_coalesced", list(inputs), opts)
    return all_reduce_coalesced_([_fresh(t) for t in inputs], reduce_op, group_name)


# ---- all_gather, reduce_scatter ---------------------------------------------

def all_gather_into_tensor_out(input, group_size, group_name, *, out):
    group = _group(group_name)
    _check_group_size("all_gather_into_tensor", group, group_size)
    group._allgather_base(out, input.contiguous(), AllgatherOptions()).wait()
    return out


def _gathered_shape(input, group_size):
    if input.dim() == 0:
        return (group_size,)
    return (input.shape[0] * group_size,) + tuple(input.shape[1:])


def all_gather_into_tensor(input, group_size, group_name):
    group = _group(group_name)
    shape = _gathered_shape(input, group_size)
    if _on_xla(group, [input]):
        _check_group_size("all_gather_into_tensor", group, group_size)
        return group.gathered("all_gather_into_tensor", input, shape)
    return all_gather_into_tensor_out(input, group_size, group_name, out=input.new_empty(shape))


def all_gather_into_tensor_coalesced(inputs, group_size, group_name):
    return [all_gather_into_tensor(t, group_size, group_name) for t in inputs]


def reduce_scatter_tensor_out(input, reduce_op, group_size, group_name, *, out):
    group = _group(group_name)
    _check_group_size("reduce_scatter_tensor", group, group_size)
    opts = _options(ReduceScatterOptions, reduce_op)
    group._reduce_scatter_base(out, input.contiguous(), opts).wait()
    return out


def reduce_scatter_tensor(input, reduce_op, group_size, group_name):
    if input.dim() == 0 or input.shape[0] % group_size:
        raise RuntimeError(f"reduce_scatter_tensor: the input's first dimension "
                           f"({tuple(input.shape)}) must be divisible by group_size "
                           f"({group_size})")
    shape = (input.shape[0] // group_size,) + tuple(input.shape[1:])
    group = _group(group_name)
    if _on_xla(group, [input]):
        _check_group_size("reduce_scatter_tensor", group, group_size)
        opts = _options(ReduceScatterOptions, reduce_op)
        return group.scattered("reduce_scatter_tensor", input, opts, shape)
    return reduce_scatter_tensor_out(input, reduce_op, group_size, group_name,
                                     out=input.new_empty(shape))


def reduce_scatter_tensor_coalesced(inputs, reduce_op, group_size, group_name):
    return [reduce_scatter_tensor(t, reduce_op, group_size, group_name) for t in inputs]


# ---- all_to_all, broadcast, send/recv, wait ----------------------------------

def all_to_all_single(input, output_split_sizes, input_split_sizes, group_name):
    rows = sum(output_split_sizes) if output_split_sizes else input.shape[0]
    out = input.new_empty((rows,) + tuple(input.shape[1:]))
    _group(group_name).alltoall_base(out, input.contiguous(), list(output_split_sizes),
                                     list(input_split_sizes), AllToAllOptions()).wait()
    return out


def broadcast_(input, src, group_name):
    opts = BroadcastOptions()
    opts.rootRank = src
    _group(group_name).broadcast([input], opts).wait()
    return input


def broadcast(input, src, group_name):
    return broadcast_(_fresh(input), src, group_name)


def isend(tensor, dst, tag, group_name):
    group = _group(group_name)  # dst: a global rank
    group.send([tensor], dist.get_group_rank(group, dst), tag).wait()
    return tensor.new_empty((0,))  # as PyTorch's kernel returns


def irecv(tensor, src, tag, group_name):
    group = _group(group_name)
    group.recv([tensor], dist.get_group_rank(group, src), tag).wait()
    return tensor


def batch_p2p_ops(op_list, peer_list, tag_list, tensors, group_name):
    return p2p.batch_p2p_ops(op_list, peer_list, tag_list, tensors, _group(group_name))


def wait_tensor(tensor):
    # The collective was issued when its op returned; a read of the result
    # waits for it.
    return tensor


HANDLERS = {
    functional.all_reduce.default: all_reduce,
    functional.all_reduce_.default: all_reduce_,
    functional.all_reduce_coalesced.default: all_reduce_coalesced,
    functional.all_reduce_coalesced_.default: all_reduce_coalesced_,
    functional.all_gather_into_tensor.default: all_gather_into_tensor,
    functional.all_gather_into_tensor_out.default: all_gather_into_tensor_out,
    functional.all_gather_into_tensor_coalesced.default: all_gather_into_tensor_coalesced,
    functional.reduce_scatter_tensor.default: reduce_scatter_tensor,
    functional.reduce_scatter_tensor_out.default: reduce_scatter_tensor_out,
    functional.reduce_scatter_tensor_coalesced.default: reduce_scatter_tensor_coalesced,
    functional.all_to_all_single.default: all_to_all_single,
    functional.broadcast.default: broadcast,
    functional.broadcast_.default: broadcast_,
    functional.isend.default: isend,
    functional.irecv.default: irecv,
    functional.batch_p2p_ops.default: batch_p2p_ops,
    functional.wait_tensor.default: wait_tensor,
}
HANDLERS = {op: handler for op, handler in HANDLERS.items() if has_op(op)}


def register():
    """The dispatcher hands these ops on tpu tensors to the handlers above;
    torch.distributed.batch_isend_irecv takes p2p.py's order on tpu groups."""
    SPECIAL.update(HANDLERS)
    p2p.install()
