"""Batched point-to-point ops on the `tpu` process group:
`torch.distributed.batch_isend_irecv` and `_c10d_functional.batch_p2p_ops`.

PyTorch runs a batch on a process group written in Python as its isends
and irecvs one after another, in each rank's own order. The tpu group's
send and recv wait for their peer (the ranks agree on each transfer, then
it runs as an XLA collective between the two devices), so two ranks that
both list their send first would wait for each other. Here each rank runs
its batch in one order every rank derives alike: transfers by pair of
ranks (the pair with the lower ranks first), within a pair the lower
rank's sends first, each direction in list order. Every pair then meets,
whatever order the ranks listed their ops in, and the n-th send from a to
b still goes into b's n-th recv from a, as PyTorch pairs them.
"""
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import host
from .process_group import TpuProcessGroup

_original = c10d.batch_isend_irecv


def run(group, ops):
    """ops: (is_send, tensor, peer's group rank, tag) of this rank, run in
    the order above; a finished Work per op, in ops' order."""
    me = group.rank()

    def order(i):
        is_send, _, peer, _ = ops[i]
        if peer == me:
            raise ValueError(f"batch_isend_irecv: rank {me} sends to or receives from itself")
        low, high = min(me, peer), max(me, peer)
        sender = me if is_send else peer
        return (low, high, sender != low, i)

    for i in sorted(range(len(ops)), key=order):
        is_send, tensor, peer, tag = ops[i]
        if is_send:
            group.send([tensor], peer, tag).wait()
        else:
            group.recv([tensor], peer, tag).wait()
    return [host.done(tensor) for _, tensor, _, _ in ops]


def batch_isend_irecv(p2p_op_list):
    """torch.distributed.batch_isend_irecv: on a tpu group, the batch in the
    order above; on other groups, PyTorch's own."""
    c10d._check_p2p_op_list(p2p_op_list)
    group = p2p_op_list[0].group or c10d._get_default_group()
    if not isinstance(group, TpuProcessGroup):
        return _original(p2p_op_list)
    return run(group, [(op.op is dist.isend, op.tensor, op.group_peer, op.tag)
                       for op in p2p_op_list])


def batch_p2p_ops(op_list, peer_list, tag_list, tensors, group):
    """The functional op: peers are global ranks; irecv's tensors come back
    written, isend's as empty tensors (PyTorch's kernel's results)."""
    for op in op_list:
        if op not in ("isend", "irecv"):
            raise ValueError(f"batch_p2p_ops: unknown op {op!r}, not isend or irecv")
    run(group, [(op == "isend", t, dist.get_group_rank(group, peer), tag)
                for op, peer, tag, t in zip(op_list, peer_list, tag_list, tensors)])
    return [t if op == "irecv" else t.new_empty((0,)) for op, t in zip(op_list, tensors)]


def install():
    """torch.distributed's batch_isend_irecv goes through the function above."""
    dist.batch_isend_irecv = c10d.batch_isend_irecv = batch_isend_irecv
