"""A tpu tensor and a jax.Array seen as each other without copies
(torchtpu.jax.to_jax, from_jax): values, dtypes, views, fused mode's
pending values, autograd on the tensor side, and the errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchtpu
from torchtpu.jax import from_jax, to_jax


def test_a_whole_tensor_is_its_own_buffer(mode):
    t = torch.arange(12.0).reshape(3, 4).to("tpu") * 2
    a = to_jax(t)
    assert isinstance(a, jax.Array) and a.shape == (3, 4) and a.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a), (torch.arange(12.0).reshape(3, 4) * 2).numpy())
    assert from_jax(a)._storage.array is a  # and back, over the same buffer


def test_views_and_dtypes(mode):
    base = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    t = base.to("tpu")
    np.testing.assert_array_equal(np.asarray(to_jax(t[1:, ::2].T)), base[1:, ::2].T.numpy())
    h = torch.randn(5).to(torch.bfloat16)
    assert to_jax(h.to("tpu")).dtype == jnp.bfloat16
    assert from_jax(jnp.ones(3, jnp.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="complex32"):
        to_jax(torch.zeros(2, dtype=torch.complex32, device="tpu"))


def test_a_jax_array_becomes_a_tensor_torch_computes_and_differentiates(mode):
    a = jnp.linspace(0.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)
    before = np.asarray(a).copy()
    t = from_jax(a).requires_grad_()
    assert t.device == torch.device("tpu:0") and t.shape == (2, 3)
    (t.sin() * t).sum().backward()
    x = torch.tensor(np.asarray(a), requires_grad=True)
    (x.sin() * x).sum().backward()
    torch.testing.assert_close(t.grad.cpu(), x.grad)
    # An in-place op gives the tensor a new buffer; the array stays as it was.
    with torch.no_grad():
        t.add_(1)
    np.testing.assert_array_equal(np.asarray(a), before)
    np.testing.assert_array_equal(t.detach().cpu().numpy(), before + 1)


def test_a_pending_fused_value_is_computed_first():
    with torchtpu.eager_mode("fused"):
        t = torch.ones(4, device="tpu").cumsum(0) * 3
        np.testing.assert_array_equal(np.asarray(to_jax(t)), [3.0, 6.0, 9.0, 12.0])


def test_wrong_inputs_raise():
    with pytest.raises(TypeError, match="tpu tensor"):
        to_jax(torch.ones(2))
    with pytest.raises(TypeError, match="jax.Array"):
        from_jax(np.ones(2))
