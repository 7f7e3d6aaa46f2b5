"""Module conversion to, on and from tpu (`.to("tpu")`, `.tpu()`, `.to(dtype)`,
`.to("cpu")`, `to_empty`) keeps one parameter where the model had one, and
leaves CPU and meta conversion as PyTorch does it."""
import pytest
import torch
from torch import nn

import torchtpu
from torchtpu import module_conversion

from conftest import assert_same


class TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight, as language
    models tie them, plus a buffer and a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.mid.bias.requires_grad_(False)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        return self.head(self.mid(self.embed(ids)) * self.scale)


def _check_tied(model, device, dtype=torch.float32):
    assert model.head.weight is model.embed.weight
    names = [name for name, _ in model.named_parameters()]
    assert names == ["embed.weight", "mid.weight", "mid.bias"]
    for p in model.parameters():
        assert isinstance(p, nn.Parameter) and p.is_leaf
        assert p.device.type == device and p.dtype == dtype
    assert model.scale.device.type == device
    assert model.embed.weight.requires_grad and not model.mid.bias.requires_grad


@pytest.mark.parametrize("convert", [
    lambda m: m.to("tpu"), lambda m: m.tpu(), lambda m: m.to(torchtpu.get_device()),
    lambda m: m.to(device="tpu", dtype=torch.float32),
], ids=["to_str", "tpu", "to_device", "to_device_dtype"])
def test_to_tpu_keeps_ties_and_gradients_sum_both_uses(mode, convert):
    cpu = TiedLM()
    model = convert(TiedLM())
    model.load_state_dict(cpu.state_dict())
    _check_tied(model, "tpu")
    ids = torch.tensor([[1, 2, 3], [3, 4, 1]])
    cpu(ids).square().sum().backward()
    model(ids.to("tpu")).square().sum().backward()
    assert_same(model.embed.weight.grad, cpu.embed.weight.grad, atol=1e-5, rtol=1e-5)
    assert_same(model.mid.weight.grad, cpu.mid.weight.grad, atol=1e-5, rtol=1e-5)
    assert model.mid.bias.grad is None


def test_to_tpu_values_and_existing_gradients():
    cpu = TiedLM()
    ids = torch.tensor([[1, 2, 3]])
    cpu(ids).sum().backward()
    model = TiedLM()
    model.load_state_dict(cpu.state_dict())
    model(ids).sum().backward()
    model.to("tpu")
    _check_tied(model, "tpu")
    for (name, p), q in zip(model.named_parameters(), cpu.parameters()):
        assert_same(p, q.detach(), rtol=0, atol=0)
        if q.grad is not None:
            assert_same(p.grad, q.grad, rtol=0, atol=0)
    assert_same(model.scale, cpu.scale)


def test_dtype_conversion_on_tpu_keeps_the_same_parameters():
    # As on CUDA: a conversion that stays on the device changes each
    # parameter in place, so optimizers and hooks holding them see it.
    model = TiedLM().to("tpu")
    before = list(model.parameters())
    model.to(torch.float64)
    _check_tied(model, "tpu", torch.float64)
    assert all(a is b for a, b in zip(before, model.parameters()))
    model.half()
    _check_tied(model, "tpu", torch.float16)
    assert all(a is b for a, b in zip(before, model.parameters()))


def test_back_to_cpu_keeps_ties():
    cpu = TiedLM()
    model = TiedLM()
    model.load_state_dict(cpu.state_dict())
    model.to("tpu").to(torch.float64).to("cpu")
    _check_tied(model, "cpu", torch.float64)
    for p, q in zip(model.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.detach(), q.detach().double(), rtol=0, atol=0)


def test_to_empty_on_tpu_keeps_ties():
    with torch.device("meta"):
        model = TiedLM()
    model.head.weight = model.embed.weight  # meta construction keeps the tie
    model.to_empty(device="tpu")
    _check_tied(model, "tpu")
    model.to_empty(device=torchtpu.get_device())
    _check_tied(model, "tpu")


def test_gradient_hooks_move_with_the_parameter(mode):
    cpu, model = TiedLM(), TiedLM()
    model.load_state_dict(cpu.state_dict())
    seen = {"cpu": [], "tpu": []}
    handles = []
    for m, name in ((cpu, "cpu"), (model, "tpu")):
        handles.append(m.embed.weight.register_hook(lambda g: g * 3))
        m.mid.weight.register_post_accumulate_grad_hook(
            lambda p, name=name: seen[name].append(tuple(p.grad.shape)))
    model.to("tpu")
    ids = torch.tensor([[1, 2, 3]])
    for m, x in ((cpu, ids), (model, ids.to("tpu"))):
        m(x).sum().backward()
    assert seen["tpu"] == seen["cpu"] == [(4, 4)]
    assert_same(model.embed.weight.grad, cpu.embed.weight.grad, atol=1e-5, rtol=1e-5)
    for h in handles:
        h.remove()
    for m, x in ((cpu, ids), (model, ids.to("tpu"))):
        m.zero_grad()
        m(x).sum().backward()
    assert_same(model.embed.weight.grad, cpu.embed.weight.grad, atol=1e-5, rtol=1e-5)


def test_parameters_keep_their_identity_through_the_move(mode):
    # As on CUDA: the same Parameter objects, with their Python attributes,
    # hooks and gradients, so an optimizer built before the move trains the
    # moved model (its step matches CPU's).
    torch.manual_seed(0)
    cpu, model = TiedLM(), TiedLM()
    model.load_state_dict(cpu.state_dict())
    weight = model.mid.weight
    weight.tag = "mine"
    seen = []
    weight.register_hook(lambda g: seen.append(g.device.type))
    ids = torch.tensor([[1, 2, 3], [3, 4, 1]])
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (cpu, model)]
    for m in (cpu, model):
        m(ids).sum().backward()  # a CPU gradient, moved with its parameter
    model.to("tpu")
    assert model.mid.weight is weight and weight.is_tpu and weight.tag == "mine"
    assert isinstance(weight, nn.Parameter) and weight.grad.is_tpu
    assert_same(weight.grad, cpu.mid.weight.grad)
    _check_tied(model, "tpu")
    for m, opt, x in ((cpu, opts[0], ids), (model, opts[1], ids.to("tpu"))):
        opt.step()
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
    assert seen == ["cpu", "tpu"]
    assert_same(model.mid.weight, cpu.mid.weight.detach(), atol=1e-5, rtol=1e-5)
    assert_same(model.embed.weight, cpu.embed.weight.detach(), atol=1e-5, rtol=1e-5)
    assert_same(opts[1].state[weight]["exp_avg"], opts[0].state[cpu.mid.weight]["exp_avg"],
                atol=1e-5, rtol=1e-5)
    model.to("cpu")
    assert model.mid.weight is weight and type(weight) is nn.Parameter and weight.tag == "mine"
    assert weight.grad.device.type == "cpu"
    torch.testing.assert_close(weight.detach(), cpu.mid.weight.detach(), atol=1e-5, rtol=1e-5)


def test_parameter_that_cannot_be_swapped_is_replaced_and_its_optimizer_refuses():
    # A weak reference to a parameter blocks torch.utils.swap_tensors: it is
    # replaced (ties kept), and an optimizer still holding it raises at step
    # instead of silently training nothing.
    import weakref
    model = TiedLM()
    early = torch.optim.AdamW(model.parameters())
    held = weakref.ref(model.embed.weight)
    model.to("tpu")
    assert model.embed.weight is not held() and model.mid.weight.is_tpu
    _check_tied(model, "tpu")
    model(torch.tensor([[1, 2]], device="tpu")).sum().backward()
    with pytest.raises(RuntimeError, match="build the optimizer after moving the model"):
        early.step()
    late = torch.optim.AdamW(model.parameters())
    late.step()  # the model's own parameters step as usual


def test_parameter_data_set_to_a_tpu_tensor_moves_it_in_place(mode):
    # `p.data = p.to(device)`, as FullyShardedDataParallel moves a model to
    # its device_id: on CUDA the Parameter object itself moves, so an
    # optimizer built before trains it, and it aliases the tensor it was given.
    torch.manual_seed(0)
    cpu, model = nn.Linear(3, 2), nn.Linear(3, 2)
    model.load_state_dict(cpu.state_dict())
    weight = model.weight
    weight.tag = "mine"
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (cpu, model)]
    for p in model.parameters():
        p.data = p.to("tpu")
    assert model.weight is weight and weight.is_tpu and isinstance(weight, nn.Parameter)
    assert weight.requires_grad and weight.tag == "mine" and model.bias.is_tpu
    x = torch.randn(4, 3)
    for _ in range(2):
        for m, opt, inp in ((cpu, opts[0], x), (model, opts[1], x.to("tpu"))):
            m(inp).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert_same(model.weight, cpu.weight.detach(), atol=1e-6, rtol=1e-6)
    assert_same(model.bias, cpu.bias.detach(), atol=1e-6, rtol=1e-6)

    p, given = nn.Parameter(torch.ones(2)), torch.zeros(2, device="tpu")
    p.data = given
    given.add_(5)
    assert_same(p, torch.full((2,), 5.0))
    assert p.requires_grad and p.grad_fn is None


def test_parameter_data_that_cannot_move_in_place_raises():
    import weakref
    p = nn.Parameter(torch.ones(2))
    held = weakref.ref(p)
    with pytest.raises(RuntimeError, match="cannot move this cpu Parameter to tpu in place"):
        p.data = torch.zeros(2, device="tpu")
    assert held() is p and p.device.type == "cpu" and torch.equal(p.detach(), torch.ones(2))


def test_with_swapping_conversion_on(monkeypatch):
    # torch.__future__'s swap flag: parameters are swapped in place, on CPU
    # as PyTorch does, and to and from tpu; ties kept.
    monkeypatch.setattr(torch.__future__, "_swap_module_params_on_conversion", True)
    model = TiedLM()
    weight = model.mid.weight
    model.to(torch.float64)
    assert model.mid.weight is weight and weight.dtype == torch.float64
    model.to("tpu")
    _check_tied(model, "tpu", torch.float64)
    model.to("cpu")
    _check_tied(model, "cpu", torch.float64)
    assert model.mid.weight is weight
    assert torch.__future__.get_swap_module_params_on_conversion()


def test_shared_submodule_stays_shared():
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), shared).to("tpu")
    assert model[0] is model[2]
    assert len(list(model.parameters())) == 2
    assert all(p.is_tpu for p in model.parameters())


def test_tied_training_step_matches_cpu(mode):
    torch.manual_seed(0)
    cpu = TiedLM()
    model = TiedLM()
    model.load_state_dict(cpu.state_dict())
    model.to("tpu")
    ids = torch.tensor([[1, 2, 3], [3, 4, 1]])
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (cpu, model)]
    for _ in range(2):
        for m, opt, x in ((cpu, opts[0], ids), (model, opts[1], ids.to("tpu"))):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert model.head.weight is model.embed.weight
    assert_same(model.embed.weight, cpu.embed.weight.detach(), atol=1e-5, rtol=1e-5)
    assert_same(model.mid.weight, cpu.mid.weight.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("convert", [
    lambda m: m.to(torch.float64), lambda m: m.to("meta"), lambda m: m.to_empty(device="cpu"),
    lambda m: m.to_empty(device="meta"),
], ids=["cpu_float64", "meta", "to_empty_cpu", "to_empty_meta"])
def test_cpu_and_meta_conversion_as_pytorch_does_it(convert, monkeypatch):
    """Conversions that involve no tpu tensor give what PyTorch's own
    Module._apply gives: the same parameter objects kept or replaced, the
    same ties kept or broken."""
    def layout(model, before):
        params = [model.embed.weight, model.mid.weight, model.mid.bias, model.head.weight]
        return ([p is q for p, q in zip(params, before)], params[0] is params[3],
                [(p.device, p.dtype) for p in params])

    ours = TiedLM()
    before = [ours.embed.weight, ours.mid.weight, ours.mid.bias, ours.head.weight]
    got = layout(convert(ours), before)
    monkeypatch.setattr(nn.Module, "_apply", module_conversion._module_apply)
    theirs = TiedLM()
    before = [theirs.embed.weight, theirs.mid.weight, theirs.mid.bias, theirs.head.weight]
    assert got == layout(convert(theirs), before)
