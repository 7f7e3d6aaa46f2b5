"""Custom JAX and Pallas kernels in a PyTorch model.

RMSNorm written in JAX and a bias + GELU written as a Pallas kernel become
torch ops with torchtpu.custom_jax_kernel. A small model uses them, trains a
few steps on tpu, and is checked against the same model written in torch
ops on CPU.

    python examples/custom_kernel.py          # TORCHTPU_EAGER_MODE=fused to fuse each step
"""
import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl

import torchtpu


# ---- the kernels ------------------------------------------------------------

@torchtpu.custom_jax_kernel
def rms_norm(x, weight, eps=1e-6):
    """JAX: its gradient comes from jax.vjp; eps is traced (no recompiles)."""
    variance = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + eps) * weight


def _bias_gelu_kernel(x_ref, b_ref, o_ref):
    h = x_ref[...] + b_ref[...]
    o_ref[...] = h * jax.nn.sigmoid(1.702 * h)


def _bias_gelu_grad_kernel(g_ref, x_ref, b_ref, o_ref):
    h = x_ref[...] + b_ref[...]
    s = jax.nn.sigmoid(1.702 * h)
    o_ref[...] = g_ref[...] * (s + 1.702 * h * s * (1 - s))


def _bias_gelu_vjp(grad, x, b):
    # pallas_call has no reverse-mode rule of its own: the gradient is a
    # Pallas kernel too. b broadcasts over the rows: its gradient is summed.
    d = pl.pallas_call(_bias_gelu_grad_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       interpret=_INTERPRET)(grad, x, jnp.broadcast_to(b, x.shape))
    return d, d.sum(axis=0)


# Pallas compiles for TPU and GPU; elsewhere it runs in its interpreter.
_INTERPRET = jax.default_backend() not in ("tpu", "gpu")


@torchtpu.custom_jax_kernel(vjp=_bias_gelu_vjp)
def bias_gelu(x, b):
    return pl.pallas_call(_bias_gelu_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=_INTERPRET)(x, jnp.broadcast_to(b, x.shape))


# ---- the same math in torch ops -----------------------------------------------

def rms_norm_torch(x, weight, eps=1e-6):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def bias_gelu_torch(x, b):
    h = x + b
    return h * torch.sigmoid(1.702 * h)


class Model(torch.nn.Module):
    def __init__(self, dim=32, hidden=64, kernels=True):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.norm_weight = torch.nn.Parameter(torch.ones(hidden))
        self.bias = torch.nn.Parameter(torch.zeros(hidden))
        self.down = torch.nn.Linear(hidden, dim)
        self.norm, self.act = ((rms_norm, bias_gelu) if kernels else
                               (rms_norm_torch, bias_gelu_torch))

    def forward(self, x):
        return self.down(self.act(self.norm(self.up(x), self.norm_weight), self.bias))


def train(model, x, y, steps=5):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    torch.manual_seed(0)
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    reference = Model(kernels=False)
    model = Model(kernels=True)
    model.load_state_dict(reference.state_dict())
    model.to("tpu")
    losses = train(model, x.to("tpu"), y.to("tpu"))
    ref_losses = train(reference, x, y)
    print("tpu losses:      ", " ".join(f"{v:.5f}" for v in losses))
    print("torch-ops losses:", " ".join(f"{v:.5f}" for v in ref_losses))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5, msg=name)
    print(f"eager mode {torchtpu.get_eager_mode()}: the custom-kernel model matches the "
          "torch-ops model after", len(losses), "steps")


if __name__ == "__main__":
    main()
