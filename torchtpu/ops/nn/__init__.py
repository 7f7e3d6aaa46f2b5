"""Neural-network lowerings, one module per sub-family:

- common: helpers they share (compute dtype, full precision, per-dim args);
- conv: convolution, plain and transposed, and its backward;
- pool: average, max, adaptive and fractional pooling;
- attention: softmax and log-softmax, scaled_dot_product_attention;
- norm: batch, layer and group normalization;
- loss: nll, margin and multilabel-margin losses, CTC;
- embedding: embedding_bag, dropout's backward;
- activation: rrelu, _trilinear;
- resample: upsampling and grid sampling;
- recurrent: the fused LSTM and GRU cells (nn.LSTM, nn.GRU off the CPU).

Float work runs at full precision (Precision.HIGHEST), convolutions and
attention at the float32 matmul precision the user sets (full by default),
and bf16/f16 inputs compute in float32, as PyTorch's CPU kernels do. Backward ops that have a
simple forward are lowered as the JAX vjp of that forward, so forward and
backward agree by construction.
"""
# In the order they registered as one module, so LOWERINGS fills as before.
from . import conv, pool, attention, norm, loss, embedding, activation, resample, recurrent  # noqa: F401
from .attention import scaled_dot_product_attention  # noqa: F401
