"""nn.TransformerEncoder, TransformerEncoderLayer and MultiheadAttention on
tpu tensors in inference (eval mode under no_grad or inference_mode).

There PyTorch takes its "fast path" for the devices it lists, PrivateUse1
among them: one fused CPU/CUDA kernel per layer
(_transformer_encoder_layer_fwd, _native_multi_head_attention), and a
nested tensor for a src_key_padding_mask. On tpu those kernels would run on
the CPU, and a nested tensor cannot be made, so the encoder raised. On tpu
tensors these modules take their ordinary path instead, the ops training
runs (the attention as torchtpu's one op), as when
torch.backends.mha.set_fastpath_enabled(False): unpadded positions get the
fast path's values (up to rounding); padded positions get the ordinary
path's, not the nested tensor's zeros.
"""
import functools

import torch
from torch import nn

from ..tensor import TpuTensor


def _on_tpu(args, kwargs):
    return any(type(a) is TpuTensor for a in args) or any(
        type(a) is TpuTensor for a in kwargs.values())


def _ordinary_path_on_tpu(forward):
    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        mha = torch.backends.mha
        if not (mha.get_fastpath_enabled() and _on_tpu(args, kwargs)):
            return forward(self, *args, **kwargs)
        # The switch is process-wide: a CPU module's forward in another
        # thread meanwhile takes the ordinary path too (same values, slower).
        mha.set_fastpath_enabled(False)
        try:
            return forward(self, *args, **kwargs)
        finally:
            mha.set_fastpath_enabled(True)
    return run


def install():
    for cls in (nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.MultiheadAttention):
        cls.forward = _ordinary_path_on_tpu(cls.forward)
