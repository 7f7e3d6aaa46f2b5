"""The tpu device: registration, torch.tpu, moving data, printing, saving, dtypes."""
import io
import threading

import numpy as np
import pytest
import torch
from conftest import assert_same

import torchtpu


# ---- the device and torch.tpu ------------------------------------------------

def test_get_device():
    assert torchtpu.get_device() == torch.device("tpu", 0)
    assert torchtpu.get_device(0).type == "tpu"


def test_torch_tpu_module():
    assert torch.tpu.is_available() is True
    assert torch.tpu.device_count() >= 1
    assert torch.tpu.current_device() == 0
    torch.tpu.set_device(0)
    torch.tpu.set_device("tpu:0")
    torch.tpu.set_device(torch.device("tpu", 0))
    with pytest.raises(RuntimeError):
        torch.tpu.set_device(5)
    torch.tpu.synchronize()


def test_amp_supported_dtype():
    dtypes = torch.tpu.get_amp_supported_dtype()
    assert torch.bfloat16 in dtypes


def test_current_accelerator():
    acc = torch.accelerator.current_accelerator()
    assert acc is not None and acc.type == "tpu"
    assert torch.accelerator.is_available()


# ---- moving data -------------------------------------------------------------

def test_to_tpu_and_back():
    cpu = torch.randn(3, 4)
    for t in (cpu.to("tpu"), cpu.to(torchtpu.get_device()), cpu.tpu(), cpu.to("tpu:0")):
        assert t.device == torch.device("tpu", 0)
        assert t.is_tpu and not cpu.is_tpu
        back = t.cpu()
        assert back.device.type == "cpu" and not isinstance(back, torchtpu.TpuTensor)
        torch.testing.assert_close(back, cpu, rtol=0, atol=0)


def test_to_dtype_and_device_at_once():
    cpu = torch.randn(3, 4)
    t = cpu.to("tpu", torch.float64)
    assert t.dtype == torch.float64 and t.is_tpu
    assert_same(t, cpu.double())


def test_module_to_device():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torchtpu.get_device())
    for name, value in model.state_dict().items():
        assert value.is_tpu, name
        assert_same(value, ref[name], rtol=0, atol=0)
    assert all(p.is_tpu and p.requires_grad for p in model.parameters())


class _TiedLM(torch.nn.Module):
    """An embedding and an output layer sharing one weight, as language
    models tie them."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_tied_weights_of_a_model_built_on_tpu():
    # A model built on the device (the other way in, beside .to(), which
    # keeps ties too: tests/test_module_conversion.py) keeps its weights
    # tied, and the shared weight's gradient sums both uses, as on CPU.
    torch.manual_seed(0)
    cpu = _TiedLM()
    with torch.device(torchtpu.get_device()):
        model = _TiedLM()
    assert model.head.weight is model.embed.weight and model.head.weight.is_tpu
    assert len(list(model.parameters())) == 1
    model.load_state_dict(cpu.state_dict())
    ids = torch.tensor([[1, 2, 3], [3, 4, 1]])
    cpu(ids).square().sum().backward()
    model(ids.to("tpu")).square().sum().backward()
    assert_same(model.embed.weight.grad, cpu.embed.weight.grad, atol=1e-5, rtol=1e-5)


def test_item():
    t = torch.tensor([2.5, -1.0]).tpu()
    assert t[0].item() == 2.5
    assert torch.tensor(7).tpu().item() == 7
    assert isinstance(torch.tensor(7).tpu().item(), int)
    assert torch.tensor(True).tpu().item() is True


def test_tolist():
    cpu = torch.tensor([[1, 2], [3, 4]])
    assert cpu.tpu().tolist() == [[1, 2], [3, 4]]
    assert torch.tensor([0.5, 1.5]).tpu().tolist() == [0.5, 1.5]


def test_numpy_after_cpu():
    cpu = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = cpu.tpu()
    arr = t.cpu().numpy()
    assert arr.dtype.name == "float32" and arr.shape == (2, 3)
    assert arr.tolist() == cpu.tolist()
    with pytest.raises(TypeError):
        t.numpy()


def test_cpu_scalar_mixing_allowed():
    x = torch.tensor([1.0, 2.0]).tpu()
    out = x + torch.tensor(3.0)
    assert_same(out, torch.tensor([4.0, 5.0]))


def test_device_mixing_raises_like_cuda():
    x = torch.ones(3).tpu()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3) + x
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(torch.ones(2, 2).tpu(), torch.ones(2, 2))


# ---- printing ----------------------------------------------------------------

def test_repr_shows_device():
    cpu = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    text = repr(cpu.tpu())
    assert text == "tensor([[1., 2.],\n        [3., 4.]], device='tpu:0')"
    assert str(cpu.tpu()) == text


def test_repr_with_dtype_and_grad():
    x = torch.tensor([1.0, 2.0], dtype=torch.float64).tpu()
    assert repr(x) == "tensor([1., 2.], device='tpu:0', dtype=torch.float64)"
    leaf = torch.tensor([1.0, 2.0]).tpu().requires_grad_()
    assert repr(leaf) == "tensor([1., 2.], device='tpu:0', requires_grad=True)"
    assert repr(leaf * 2) == "tensor([2., 4.], device='tpu:0', grad_fn=<MulBackward0>)"


def test_print(capsys):
    print(torch.tensor([5]).tpu())
    assert capsys.readouterr().out == "tensor([5], device='tpu:0')\n"


# ---- saving and loading --------------------------------------------------------

def _roundtrip(obj, **load_kw):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **load_kw)


def test_save_load_tensor():
    cpu = torch.randn(3, 2)
    loaded = _roundtrip(cpu.tpu())
    assert loaded.is_tpu
    assert_same(loaded, cpu, rtol=0, atol=0)
    loaded = _roundtrip(cpu.tpu(), map_location="cpu")
    assert loaded.device.type == "cpu" and not isinstance(loaded, torchtpu.TpuTensor)
    torch.testing.assert_close(loaded, cpu, rtol=0, atol=0)


def test_save_load_state_dict():
    model = torch.nn.Linear(3, 2)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    model.to("tpu")
    state = _roundtrip(model.state_dict(), map_location="cpu")
    for k, v in state.items():
        assert v.device.type == "cpu"
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)
    fresh = torch.nn.Linear(3, 2).to("tpu")
    fresh.load_state_dict(_roundtrip(model.state_dict()))
    for k, v in fresh.state_dict().items():
        assert_same(v, ref[k], rtol=0, atol=0)


# ---- random numbers --------------------------------------------------------------

def test_manual_seed_reproducible():
    def draw():
        return [torch.rand(4, device="tpu").cpu(), torch.randn(2, 3, device="tpu").cpu(),
                torch.randint(0, 1000, (5,), device="tpu").cpu()]
    torch.manual_seed(123)
    a = draw()
    torch.manual_seed(123)
    b = draw()
    torch.manual_seed(124)
    c = draw()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert not torch.equal(a[0], c[0])
    assert a[0].dtype == torch.float32 and a[2].dtype == torch.int64
    assert (a[0] >= 0).all() and (a[0] < 1).all()
    assert (a[2] >= 0).all() and (a[2] < 1000).all()


def test_tpu_manual_seed_and_rng_state():
    torch.tpu.manual_seed(7)
    state = torch.tpu.get_rng_state()
    assert state.dtype == torch.uint8
    a = torch.rand(4, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    b = torch.rand(4, device="tpu").cpu()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.tpu.manual_seed_all(7)
    c = torch.rand(4, device="tpu").cpu()
    torch.testing.assert_close(a, c, rtol=0, atol=0)


# ---- factories and dtypes ---------------------------------------------------------

def test_factories():
    assert_same(torch.zeros(2, 3, device="tpu"), torch.zeros(2, 3))
    assert_same(torch.ones(2, dtype=torch.int32, device="tpu"), torch.ones(2, dtype=torch.int32))
    assert_same(torch.full((2,), 3.5, device="tpu"), torch.full((2,), 3.5))
    assert_same(torch.tensor([1, 2, 3], device="tpu"), torch.tensor([1, 2, 3]))
    assert_same(torch.arange(1, 10, 2, device="tpu"), torch.arange(1, 10, 2))
    assert_same(torch.arange(0, 1, 0.25, device="tpu"), torch.arange(0, 1, 0.25))
    assert torch.empty(4, 5, device="tpu").shape == (4, 5)


def test_int64_stays_int64():
    t = torch.arange(5, device="tpu")
    assert t.dtype == torch.int64
    assert_same(t, torch.arange(5))
    big = torch.tensor([2**40 + 1, -(2**41) - 3, 2**62], dtype=torch.int64)
    back = big.tpu().cpu()
    assert back.dtype == torch.int64 and back.tolist() == big.tolist()
    assert_same(big.tpu() + 1, big + 1, rtol=0, atol=0)


def test_float64_stays_float64():
    cpu = torch.tensor([1 / 3, 2 ** -40], dtype=torch.float64)
    t = cpu.tpu()
    assert t.dtype == torch.float64
    assert_same(t * 3, cpu * 3, rtol=0, atol=0)
    assert (t * 3).cpu().tolist() == (cpu * 3).tolist()


def test_bfloat16():
    cpu = torch.randn(8).bfloat16()
    t = cpu.tpu()
    assert t.dtype == torch.bfloat16
    assert_same(t, cpu, rtol=0, atol=0)
    assert_same(t * 2 + 1, cpu * 2 + 1)
    assert_same(t.float(), cpu.float())
    x = torch.randn(4, 3)
    assert_same(x.tpu().to(torch.bfloat16), x.to(torch.bfloat16), rtol=0, atol=0)
    assert_same(x.tpu().bfloat16() @ x.tpu().bfloat16().t(), x.bfloat16() @ x.bfloat16().t())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_intermediate_rounding_matches_cpu_conversion(dtype):
    # The rounding lowerings apply where CPU rounds to bf16/f16 (and that
    # complex32 storage uses): float16 subnormals kept, overflow to inf,
    # ties to even.
    import jax
    from torchtpu.runtime import round_to
    g = torch.Generator().manual_seed(0)
    v = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-7, 1e-6, 3e-5, 1e-3, 1., 1e4, 7e4)]
                  + [torch.tensor([65519., 65520., -65520., float("inf"), 0., -0.])])
    got = jax.jit(lambda x: round_to(x, jax.numpy.dtype(str(dtype).split(".")[1])))(v.numpy())
    assert torch.equal(torch.from_numpy(np.asarray(got)), v.to(dtype).float())


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex32():
    # Stored as complex64 with float16 parts: every result and every write
    # rounds as CPU does (float16 subnormals and overflow to inf included).
    def parts(t):
        return torch.view_as_real(t.cpu() if t.device.type == "tpu" else t)
    v = torch.tensor([70000., 1e-6, 3.14159265, -2.5e-7]) + 1j * torch.tensor([1.0001, -6e-8, 0.1, 2.])
    src = v.to(torch.complex64)
    x = src.chalf()
    t = src.to("tpu").chalf()
    assert t.dtype == torch.complex32 and t.cpu().dtype == torch.complex32
    assert torch.equal(parts(t), parts(x))
    assert torch.equal(parts(x.to("tpu")), parts(x))
    assert torch.equal(parts(t * t), parts(x * x))
    assert torch.equal(parts(t.to(torch.complex64)), parts(x.to(torch.complex64)))
    acc, acc_cpu = torch.zeros(4, dtype=torch.chalf, device="tpu"), torch.zeros(4, dtype=torch.chalf)
    acc.add_(src.to("tpu") * 1.0001)
    acc_cpu.add_(src * 1.0001)
    assert torch.equal(parts(acc.to(torch.complex64)), parts(acc_cpu.to(torch.complex64)))


@torch.library.custom_op("torchtpu_test::scaled_softplus", mutates_args=())
def _scaled_softplus(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.nn.functional.softplus(x) * scale


@_scaled_softplus.register_fake
def _(x, scale):
    return torch.empty_like(x)


def test_custom_op_with_python_kernel_runs_on_tpu():
    # A library's custom op whose kernel is Python over torch ops runs on tpu
    # (its ops come through the dispatcher), not on the CPU fallback.
    torchtpu.metrics.reset()
    x = torch.randn(3, 4)
    got = _scaled_softplus(x.to("tpu"), 2.5)
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), _scaled_softplus(x, 2.5))
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == {}


# ---- autograd's threads ----------------------------------------------------------

def _backward_thread():
    """The thread a tpu backward pass runs its hooks on, and x's gradient."""
    seen = []
    x = torch.arange(4.0, device="tpu", requires_grad=True)
    y = x * x
    y.register_hook(lambda g: seen.append(threading.current_thread()))
    y.sum().backward()
    return seen, x.grad


def test_backward_runs_on_the_calling_thread():
    # tpu ops never block the host, so backward runs where it is called (as
    # for CPU tensors), not on a device thread of autograd's.
    assert torch.autograd.is_multithreading_enabled() is False
    seen, grad = _backward_thread()
    assert seen == [threading.current_thread()]
    assert_same(grad, 2 * torch.arange(4.0))


def test_backward_from_another_thread():
    # The setting is thread-local: another thread gets autograd's default
    # (a device thread) and the same gradients.
    result = []
    worker = threading.Thread(target=lambda: result.append(
        (torch.autograd.is_multithreading_enabled(), _backward_thread())))
    worker.start()
    worker.join()
    enabled, (seen, grad) = result[0]
    assert enabled is True
    assert seen and seen[0] is not worker
    assert_same(grad, 2 * torch.arange(4.0))
