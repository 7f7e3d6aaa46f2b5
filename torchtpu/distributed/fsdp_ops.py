"""FSDP2's all-gather copy-in (`torch.ops.fsdp.all_gather_copy_in`) on tpu
tensors, written so that every rank records the same program.

PyTorch's kernel copies this rank's shards into the all-gather output at
the rank's own offset (a view at `rank * numel`) and all-gathers from that
view. In fused mode a view's offset is part of the recorded op, so each
rank's graph would differ from the others' and could not run as one
program over the group's mesh (in_graph.py then runs it op by op). Here the
input is the shards concatenated into a tensor of its own; the all-gather
then overwrites the whole output, so the values are PyTorch's.
"""
import torch

from ..dispatch.plans import SPECIAL


def all_gather_copy_in(all_gather_inputs, all_gather_output, inp_split_sizes,
                       all_gather_input_numel, rank):
    if sum(inp_split_sizes) != all_gather_input_numel or \
            all_gather_output.numel() < all_gather_input_numel * (rank + 1):
        raise RuntimeError(f"fsdp.all_gather_copy_in: split sizes {list(inp_split_sizes)} "
                           f"do not fill {all_gather_input_numel} elements of rank {rank} "
                           f"in an output of {all_gather_output.numel()}")
    with torch.no_grad():
        flat = [t.reshape(-1).to(all_gather_output.dtype) for t in all_gather_inputs]
        all_gather_input = torch.cat(flat) if flat else all_gather_output.new_empty((0,))
    return all_gather_input, all_gather_output


def register():
    """The dispatcher hands FSDP2's copy-in on tpu tensors to the handler
    above (importing FSDP2's collectives defines the op)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # noqa: F401
    SPECIAL[torch.ops.fsdp.all_gather_copy_in.default] = all_gather_copy_in
