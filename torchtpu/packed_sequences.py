"""PackedSequence on tpu: `pack_padded_sequence` as on CUDA.

`aten::_pack_padded_sequence(input, lengths, batch_first)` reads `lengths` on
the host (a CPU tensor, whatever the input's device) and returns the packed
data on the input's device with `batch_sizes` on the host, where the RNN
ops and `pad_packed_sequence` read it. A lowering can return neither a host
tensor nor a shape that depends on values, and the CPU fallback refuses the
host `lengths`, so the dispatcher runs PyTorch's own composite kernel: it
slices the input by the lengths with ops that come back to the dispatcher
on tpu, and builds `batch_sizes` on the host, as it does for a CUDA input.
Its backward (`_pack_padded_sequence_backward`) is composite already.
"""
import torch

from .dispatch.plans import SPECIAL

aten = torch.ops.aten


def pack_padded_sequence(input, lengths, batch_first):
    return aten._pack_padded_sequence.default._op_dk(
        torch._C.DispatchKey.CompositeExplicitAutograd, input, lengths, batch_first)


def install():
    SPECIAL[aten._pack_padded_sequence.default] = pack_padded_sequence
