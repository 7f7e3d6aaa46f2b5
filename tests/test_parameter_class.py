"""A tpu parameter's class rebuilds parameters as nn.Parameter does.

`nn.Parameter(t)` of a tpu tensor keeps t's class, TpuTensor (PyTorch marks
it `_is_param`), where a cuda parameter's class is nn.Parameter. Code that
rebuilds a parameter as `type(p)(data, requires_grad=...)` (Accelerate's
set_module_tensor_to_device, behind from_pretrained's device_map, CPU and
disk offload and load_checkpoint_and_dispatch) must get what nn.Parameter
would give, as it does on CPU and cuda."""
import copy
import os

import pytest
import torch
from torch import nn

from conftest import assert_same
from torchtpu.tensor import TpuTensor


def _pair(make):
    """make(device) on tpu and on CPU."""
    return make("tpu"), make("cpu")


def _value(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 3, generator=g).to(dtype).to(device)


def _check_like(got, want, data):
    """got is the tpu run's rebuilt parameter, want the CPU run's, data what got
    was made from: got is a parameter on data's device (want's, moved there)
    with want's values and requires_grad, and shares data's storage."""
    assert isinstance(got, nn.Parameter) and isinstance(want, nn.Parameter)
    assert got.device == data.device
    assert got.requires_grad == want.requires_grad and got.is_leaf and got.grad_fn is None
    assert got.shape == want.shape and got.dtype == want.dtype
    if data.device.type == "meta":
        return
    torch.testing.assert_close(got.detach().cpu(), want.detach())
    with torch.no_grad():
        data.add_(1)  # the parameter aliases its data, as nn.Parameter's does
    torch.testing.assert_close(got.detach().cpu(), want.detach() + 1)


CALLS = {
    "keyword": lambda cls, data, rg: cls(data, requires_grad=rg),
    "positional": lambda cls, data, rg: cls(data, rg),
    "data_keyword": lambda cls, data, rg: cls(data=data, requires_grad=rg),
}


@pytest.mark.parametrize("requires_grad", [True, False])
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("data_on", ["same", "cpu", "meta"])
def test_type_of_parameter_rebuilds_as_nn_parameter(mode, data_on, call, requires_grad):
    """type(p)(data, requires_grad) for p on tpu gives what it gives for p on
    CPU: nn.Parameter(data, requires_grad), data on tpu, or on cpu or meta
    (Accelerate offloading a tpu parameter)."""
    tpu_p, cpu_p = _pair(lambda d: nn.Parameter(_value(d)))
    assert type(tpu_p) is TpuTensor and type(cpu_p) is nn.Parameter
    tpu_data = _value("tpu" if data_on == "same" else data_on) * 2
    cpu_data = _value("cpu" if data_on == "same" else data_on) * 2
    got = CALLS[call](type(tpu_p), tpu_data, requires_grad)
    want = CALLS[call](type(cpu_p), cpu_data, requires_grad)
    _check_like(got, want, tpu_data)


def test_type_of_parameter_of_a_parameter_and_of_other_dtypes(mode):
    p = nn.Parameter(_value("tpu"))
    again = type(p)(p, requires_grad=False)
    assert type(again) is TpuTensor and isinstance(again, nn.Parameter)
    assert not again.requires_grad and p.requires_grad
    assert_same(again.detach(), _value())
    ints = torch.arange(6, device="tpu").reshape(2, 3)
    q = type(p)(ints, requires_grad=False)
    assert isinstance(q, nn.Parameter) and q.dtype == torch.int64 and q.device == ints.device
    assert_same(q, torch.arange(6).reshape(2, 3))
    # requires_grad=True on integers: nn.Parameter's error (its message is
    # PyTorch's requires_grad_'s for a tensor subclass, capitalized for CPU's).
    with pytest.raises(RuntimeError, match="(?i)only Tensors of floating point"):
        type(p)(ints)
    with pytest.raises(RuntimeError, match="(?i)only Tensors of floating point"):
        nn.Parameter(torch.arange(6))


def test_type_of_parameter_without_data():
    """nn.Parameter() is an empty CPU parameter; so is type(p)()."""
    got, want = type(nn.Parameter(_value("tpu")))(), nn.Parameter()
    assert type(got) is nn.Parameter and got.device.type == "cpu"
    assert got.shape == want.shape == (0,) and got.requires_grad


def test_internal_construction_from_a_storage(mode):
    """torchtpu's own TpuTensor(storage, shape, dtype, stride, offset)."""
    t = torch.arange(12.0, device="tpu").reshape(3, 4)
    shape = tuple(t._storage.array.shape)  # the whole storage, without a view
    whole = TpuTensor(t._storage, shape, torch.float32)
    view = TpuTensor(t._storage, (4, 2), torch.float32, (1, 4), 1)
    grad = TpuTensor(t._storage, shape, torch.float32, requires_grad=True)
    assert type(whole) is TpuTensor and not isinstance(whole, nn.Parameter)
    assert_same(whole, torch.arange(12.0).reshape(shape))
    assert_same(view, torch.arange(12.0).as_strided((4, 2), (1, 4), 1))
    assert grad.requires_grad and grad.is_leaf


def test_rebuilding_and_converting_modules_keeps_working(mode):
    """deepcopy, Module._apply (dtype and device moves), to_empty and
    type(p)(p.data, ...) on a tpu model give tpu parameters."""
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model = copy.deepcopy(cpu_model).to("tpu")
    x = torch.randn(5, 3)
    copied = copy.deepcopy(model)
    for p in copied.parameters():
        assert type(p) is TpuTensor and isinstance(p, nn.Parameter) and p.requires_grad
    assert_same(copied(x.to("tpu")), cpu_model(x))
    for name, p in list(copied.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        module = copied.get_submodule(module_name)
        rebuilt = p.__class__(p.data, requires_grad=p.requires_grad)
        assert rebuilt.device == p.device and isinstance(rebuilt, nn.Parameter)
        setattr(module, attr, rebuilt)
    assert_same(copied(x.to("tpu")), cpu_model(x))
    doubled = copy.deepcopy(model).double()
    assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float64 for p in doubled.parameters())
    assert_same(doubled(x.double().to("tpu")), copy.deepcopy(cpu_model).double()(x.double()))
    empty = copy.deepcopy(model).to_empty(device="tpu")
    assert all(isinstance(p, nn.Parameter) and p.device.type == "tpu" for p in empty.parameters())
    back = copy.deepcopy(model).to("cpu")
    assert all(type(p) is nn.Parameter for p in back.parameters())
    assert_same(model(x.to("tpu")), back(x))


# ---- Accelerate ------------------------------------------------------------

accelerate = pytest.importorskip("accelerate")
from accelerate import (cpu_offload, disk_offload, init_empty_weights,  # noqa: E402
                        load_checkpoint_and_dispatch)
from accelerate.utils import set_module_tensor_to_device  # noqa: E402


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)
        self.register_buffer("scale", torch.full((2,), 0.5))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale


def _nets():
    torch.manual_seed(0)
    cpu_net = _Net()
    return copy.deepcopy(cpu_net).to("tpu"), cpu_net


def test_set_module_tensor_to_device(mode):
    """Accelerate's set_module_tensor_to_device on a model on tpu, as on a
    model on CPU: a new value (from CPU or tpu), a move to meta and back (what
    its offload hooks do each forward), and a buffer."""
    net, cpu_net = _nets()
    x = torch.randn(5, 3)
    weight = torch.randn(4, 3)
    for model, device, value in ((net, "tpu", weight), (cpu_net, "cpu", weight)):
        set_module_tensor_to_device(model, "a.weight", device, value=value)
    assert type(net.a.weight) is TpuTensor and isinstance(net.a.weight, nn.Parameter)
    assert net.a.weight.requires_grad == cpu_net.a.weight.requires_grad
    assert_same(net.a.weight, cpu_net.a.weight)
    bias = torch.randn(2)
    set_module_tensor_to_device(net, "b.bias", "tpu", value=bias.to("tpu"))
    set_module_tensor_to_device(cpu_net, "b.bias", "cpu", value=bias)
    set_module_tensor_to_device(net, "scale", "tpu", value=torch.full((2,), 2.0))
    set_module_tensor_to_device(cpu_net, "scale", "cpu", value=torch.full((2,), 2.0))
    assert_same(net(x.to("tpu")), cpu_net(x))

    set_module_tensor_to_device(net, "a.weight", "meta")
    assert net.a.weight.device.type == "meta" and isinstance(net.a.weight, nn.Parameter)
    assert net.a.weight.requires_grad
    set_module_tensor_to_device(net, "a.weight", "tpu", value=weight * 3)
    set_module_tensor_to_device(cpu_net, "a.weight", "cpu", value=weight * 3)
    assert net.a.weight.device.type == "tpu" and isinstance(net.a.weight, nn.Parameter)
    assert_same(net(x.to("tpu")), cpu_net(x))

    net.b.weight.requires_grad_(False)
    cpu_net.b.weight.requires_grad_(False)
    set_module_tensor_to_device(net, "b.weight", "cpu")  # off tpu, no value
    assert type(net.b.weight) is nn.Parameter and not net.b.weight.requires_grad
    assert_same(net.b.weight.detach().to("tpu"), cpu_net.b.weight.detach())
    set_module_tensor_to_device(net, "b.weight", "tpu")
    assert type(net.b.weight) is TpuTensor and not net.b.weight.requires_grad
    assert_same(net(x.to("tpu")), cpu_net(x))


def test_init_empty_weights_with_tpu_the_default_device():
    """init_empty_weights moves each new parameter to meta as
    type(p)(p.to("meta"), **p.__dict__): a tpu parameter's __dict__ holds
    torchtpu's handle on its data too."""
    made = {}
    for device in ("tpu", "cpu"):
        torch.set_default_device(device)
        try:
            with init_empty_weights():
                made[device] = _Net()
        finally:
            torch.set_default_device(None)
    for (name, p), (_, q) in zip(made["tpu"].named_parameters(), made["cpu"].named_parameters()):
        assert type(p) is type(q) is nn.Parameter, name
        assert p.device.type == "meta" and p.requires_grad and p.shape == q.shape
    assert made["tpu"].scale.device.type == "tpu"  # buffers are left where they were made


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_accelerate_offload_executing_on_tpu(mode, offload, tmp_path):
    """cpu_offload and disk_offload of a CPU model, run on tpu, give the CPU
    model's outputs (the weights are on meta between forwards)."""
    torch.manual_seed(0)
    cpu_net = _Net()
    net = copy.deepcopy(cpu_net)
    if offload == "cpu":
        cpu_offload(net, execution_device=torch.device("tpu"))
    else:
        disk_offload(net, str(tmp_path), execution_device=torch.device("tpu"))
    x = torch.randn(5, 3)
    for _ in range(2):
        assert_same(net(x.to("tpu")), cpu_net(x))
        assert net.a.weight.device.type == "meta" and isinstance(net.a.weight, nn.Parameter)


# ---- transformers' from_pretrained -----------------------------------------

transformers = pytest.importorskip("transformers")
from accelerate.utils import compute_module_sizes  # noqa: E402


def _gpt2():
    # Tied embedding and output layer; dropout off, so CPU and tpu agree.
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="sdpa")).eval()


def _llama_config():
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")


def _saved(model, path, bin_file=False):
    """model saved as from_pretrained reads it: safetensors, or pytorch_model.bin."""
    if bin_file:
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
    else:
        model.save_pretrained(path)
    return str(path)


def _ids():
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))


def _check_device_map_is_respected(model, device_map):
    """As transformers' tests check it: modules on cpu or disk have their
    parameters on meta (the hooks bring them in), the others on tpu."""
    for name, p in model.named_parameters():
        key = name
        while key and key not in device_map:
            key = ".".join(key.split(".")[:-1])
        where = device_map[key]
        if where in ("cpu", "disk"):
            assert p.device == torch.device("meta"), name
        else:
            want = torch.device("tpu", where) if isinstance(where, int) else torch.device(where)
            assert p.device.type == "tpu" and p.device.index == (want.index or 0), name
        assert isinstance(p, nn.Parameter), name


def _gpt2_device_map(h0, h1):
    return {"transformer.wte": "tpu", "transformer.wpe": "tpu", "transformer.drop": "tpu",
            "transformer.h.0": h0, "transformer.h.1": h1, "transformer.h.2": "tpu:0",
            "transformer.h.3": h1, "transformer.ln_f": "tpu", "lm_head": "tpu"}


@pytest.mark.parametrize("offload", ["cpu", "disk_safetensors", "disk_bin"])
def test_from_pretrained_with_a_device_map_offloading(mode, offload, tmp_path):
    """from_pretrained with a device_map putting modules on tpu, cpu and disk
    (offload_folder) gives the CPU model's logits."""
    cpu_model = _gpt2()
    saved = _saved(cpu_model, tmp_path / "model", bin_file=offload == "disk_bin")
    kwargs = {}
    if offload == "cpu":
        device_map = _gpt2_device_map("cpu", "tpu")
    else:
        device_map = _gpt2_device_map("disk", "cpu")
        kwargs = {"offload_folder": str(tmp_path / "offload")}
    if offload == "disk_bin":
        kwargs["use_safetensors"] = False
    model = transformers.GPT2LMHeadModel.from_pretrained(saved, device_map=device_map, **kwargs)
    assert model.hf_device_map == device_map
    _check_device_map_is_respected(model, device_map)
    with torch.no_grad():
        want = cpu_model(_ids()).logits
        for _ in range(2):  # the offloaded weights go back to meta after each forward
            got = model(_ids().to("tpu")).logits
            assert_same(got, want)
    _check_device_map_is_respected(model, device_map)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_from_pretrained_auto_device_map_as_transformers_tests_it(offload, tmp_path):
    """transformers' test_cpu_offload and test_disk_offload_*: device_map
    "auto" with max_memory for accelerator 0 (tpu:0 here) and cpu."""
    cpu_model = _gpt2()
    size = compute_module_sizes(cpu_model)[""]
    saved = _saved(cpu_model, tmp_path / "model")
    with torch.no_grad():
        want = cpu_model(_ids()).logits
    if offload == "cpu":
        max_memory, kwargs, places = {0: int(0.5 * size), "cpu": size * 2}, {}, {0, "cpu"}
    else:
        max_memory = {0: int(0.5 * size), "cpu": int(0.1 * size)}
        kwargs, places = {"offload_folder": str(tmp_path / "offload")}, {0, "disk"}
    model = transformers.GPT2LMHeadModel.from_pretrained(
        saved, device_map="auto", max_memory=max_memory, **kwargs)
    assert set(model.hf_device_map.values()) == places
    _check_device_map_is_respected(model, model.hf_device_map)
    with torch.no_grad():
        assert_same(model(_ids().to("tpu")).logits, want)


def test_init_empty_weights_and_load_checkpoint_and_dispatch(mode, tmp_path):
    """Accelerate's big-model inference: an empty Llama filled from a
    checkpoint, dispatched over tpu, cpu and disk."""
    config = _llama_config()
    torch.manual_seed(0)
    cpu_model = transformers.LlamaForCausalLM(config).eval()
    saved = _saved(cpu_model, tmp_path / "model")
    with init_empty_weights():
        empty = transformers.LlamaForCausalLM(config)
    device_map = {"model.embed_tokens": "tpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "tpu", "model.rotary_emb": "tpu", "lm_head": "tpu"}
    model = load_checkpoint_and_dispatch(empty, saved, device_map=device_map,
                                         offload_folder=str(tmp_path / "offload"))
    _check_device_map_is_respected(model, device_map)
    with torch.no_grad():
        assert_same(model(_ids().to("tpu")).logits, cpu_model(_ids()).logits)
