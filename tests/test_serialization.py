"""Saving and loading tpu models and tensors: torch.save / torch.load (every
map_location form, weights_only True and False, CPU checkpoints onto tpu),
safetensors, and Hugging Face save_pretrained / from_pretrained. Each loads
leaf parameters with requires_grad kept, the saved values, dtypes and
buffers, and one parameter where the saved model had one."""
import io
import operator
import pickle
import warnings
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch import nn

import torchtpu
from torchtpu.tensor import TpuTensor

from conftest import assert_same

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
          torch.int32, torch.uint8, torch.bool, torch.complex64]


class TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight, a frozen
    parameter, and buffers (BatchNorm's running statistics and its int64
    step count)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.mid.bias.requires_grad_(False)

    def forward(self, ids):
        return self.head(self.norm(self.mid(self.embed(ids))))


def _trained_cpu_model():
    """A CPU model whose parameters and buffers are not their initial values."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3], [3, 4, 1]])).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model


def _on_tpu(cpu_model):
    model = TiedLM()
    model.load_state_dict(cpu_model.state_dict())
    return model.to("tpu")


def _round_trip(obj, **load_kwargs):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, **load_kwargs)


def _check_model(loaded, cpu_model, device="tpu"):
    """loaded has cpu_model's parameters and buffers, on device, as leaf
    parameters with their requires_grad, and the embedding tie kept."""
    assert loaded.head.weight is loaded.embed.weight
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in cpu_model.named_parameters()]
    for (name, p), q in zip(loaded.named_parameters(), cpu_model.parameters()):
        assert isinstance(p, nn.Parameter) and p.is_leaf, name
        assert p.requires_grad == q.requires_grad and p.grad is None, name
        assert p.device.type == device and p.dtype == q.dtype, name
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=0, atol=0)
    for (name, b), c in zip(loaded.named_buffers(), cpu_model.buffers()):
        assert b.device.type == device and b.dtype == c.dtype and not b.requires_grad, name
        torch.testing.assert_close(b.cpu(), c, rtol=0, atol=0)


def _check_trains_as_cpu(model, cpu_model):
    """One step on each: the loaded tpu model trains as its CPU original."""
    ids = torch.tensor([[1, 5, 7], [2, 2, 9]])
    for m, x in ((cpu_model, ids), (model, ids.to("tpu"))):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(x).square().mean().backward()
        opt.step()
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        assert_same(p.detach(), q.detach(), atol=1e-5, rtol=1e-5)


# ---- torch.save / torch.load ----------------------------------------------

def test_whole_model_round_trip(mode):
    cpu_model = _trained_cpu_model()
    model = _on_tpu(cpu_model)
    loaded = _round_trip(model, weights_only=False)
    assert type(loaded) is TiedLM
    _check_model(loaded, cpu_model)
    _check_trains_as_cpu(loaded, cpu_model)


def test_whole_model_weights_only_as_on_cpu():
    # weights_only=True (the default) refuses module classes for tpu models
    # as for CPU ones, and loads them once allowlisted, nothing more.
    cpu_model = _trained_cpu_model()
    for model in (cpu_model, _on_tpu(cpu_model)):
        with pytest.raises(pickle.UnpicklingError, match="TiedLM"):
            _round_trip(model)
    allowed = [TiedLM, nn.Embedding, nn.Linear, nn.BatchNorm1d]
    with torch.serialization.safe_globals(allowed):
        _check_model(_round_trip(_on_tpu(cpu_model)), cpu_model)


MAP_LOCATIONS = {
    "none": (None, "tpu"),
    "str": ("tpu", "tpu"),
    "str_index": ("tpu:0", "tpu"),
    "device": (torch.device("tpu"), "tpu"),
    "get_device": (torchtpu.get_device(), "tpu"),
    "dict_to_cpu": ({"tpu:0": "cpu"}, "cpu"),
    "str_cpu": ("cpu", "cpu"),
    "callable_keep_host": (lambda storage, location: storage, "cpu"),
    "callable_default": (lambda storage, location: None, "tpu"),
    "callable_restore_on_tpu": (
        lambda storage, location: torch.serialization.default_restore_location(storage, "tpu"),
        "tpu"),
}


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("where", MAP_LOCATIONS, ids=list(MAP_LOCATIONS))
def test_state_dict_round_trip(where, weights_only):
    map_location, device = MAP_LOCATIONS[where]
    cpu_model = _trained_cpu_model()
    state = _round_trip(_on_tpu(cpu_model).state_dict(), map_location=map_location,
                        weights_only=weights_only)
    expected = cpu_model.state_dict()
    assert list(state) == list(expected)
    for name, value in state.items():
        assert value.device.type == device and value.dtype == expected[name].dtype, name
        assert value.is_leaf and not value.requires_grad, name
        torch.testing.assert_close(value.cpu(), expected[name], rtol=0, atol=0)
    model = TiedLM().to("tpu")
    model.load_state_dict(state)
    _check_model(model, cpu_model)
    # The tied entries are one storage in the file, and load as one.
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()
    state["embed.weight"].add_(1)
    torch.testing.assert_close(state["head.weight"].cpu(), expected["embed.weight"] + 1)


@pytest.mark.parametrize("map_location", ["tpu", torch.device("tpu"), {"cpu": "tpu"},
                                          lambda s, loc: torch.serialization.default_restore_location(s, "tpu")],
                         ids=["str", "device", "dict", "callable"])
def test_cpu_checkpoint_onto_tpu(map_location):
    cpu_model = _trained_cpu_model()
    loaded = _round_trip(cpu_model, map_location=map_location, weights_only=False)
    _check_model(loaded, cpu_model)
    assert all(type(p) is TpuTensor for p in loaded.parameters())
    _check_trains_as_cpu(loaded, _trained_cpu_model())
    state = _round_trip(cpu_model.state_dict(), map_location=map_location)
    assert all(v.device.type == "tpu" for v in state.values())
    model = TiedLM().to("tpu")
    model.load_state_dict(state)
    _check_model(model, cpu_model)


def test_training_resumes_from_a_checkpoint(mode):
    """Model and AdamW state saved after a step, loaded into a fresh model and
    optimizer: the next steps are those of the run that was not stopped."""
    ids = torch.tensor([[1, 5, 7], [2, 2, 9]], device="tpu")

    def step(model, opt):
        model(ids).square().mean().backward()
        opt.step()
        opt.zero_grad()

    model = _on_tpu(_trained_cpu_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt)
    checkpoint = _round_trip({"model": model.state_dict(), "opt": opt.state_dict()})
    assert all(v.is_tpu for v in checkpoint["opt"]["state"][0].values() if v.dim())
    resumed = TiedLM().to("tpu")
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(checkpoint["opt"])
    for _ in range(2):
        step(model, opt)
        step(resumed, resumed_opt)
    for p, q in zip(resumed.parameters(), model.parameters()):
        # The same ops on the same values (fused mode may fuse the two
        # models' steps differently: float rounding).
        assert_same(p.detach(), q.detach().cpu(), rtol=1e-6, atol=1e-7)


def test_parameters_keep_requires_grad_and_attributes():
    trained = nn.Parameter(torch.randn(3, 2).to("tpu"))
    frozen = nn.Parameter(torch.randn(4).to("tpu"), requires_grad=False)
    trained.note = "kept"  # Hugging Face marks its parameters so
    a, b = _round_trip([trained, frozen])  # weights_only=True
    for got, want in ((a, trained), (b, frozen)):
        assert isinstance(got, nn.Parameter) and type(got) is TpuTensor
        assert got.is_leaf and got.requires_grad == want.requires_grad
        assert_same(got.detach(), want.detach().cpu(), rtol=0, atol=0)
    assert a.note == "kept"
    a.sum().backward()
    assert_same(a.grad, torch.ones(3, 2))


def test_tensor_with_requires_grad_and_non_leaf():
    leaf = torch.randn(3, requires_grad=True)
    made = leaf.to("tpu") * 2  # not a leaf: saved as its values, a leaf on load
    got_leaf, got_made = _round_trip([leaf.detach().to("tpu").requires_grad_(), made])
    cpu_leaf, cpu_made = _round_trip([leaf, leaf * 2])
    for got, want in ((got_leaf, cpu_leaf), (got_made, cpu_made)):
        assert got.is_leaf and want.is_leaf and got.requires_grad == want.requires_grad
        assert_same(got.detach(), want.detach())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes(dtype):
    from conftest import ON_TPU, make
    cpu = make(dtype, (3, 5))
    # A TPU keeps float64 as a pair of float32s (about 48 bits of mantissa):
    # the upload rounds, and says so once (runtime.to_device).
    exact = dict(rtol=2.0 ** -47, atol=0) if ON_TPU and dtype == torch.float64 else dict(rtol=0, atol=0)
    got = _round_trip({"x": cpu.to("tpu")})["x"]
    assert_same(got, cpu, **exact)
    assert got.dtype == dtype
    assert_same(_round_trip(cpu, map_location="tpu"), cpu, **exact)


def test_float64_on_a_tpu_says_it_is_emulated(monkeypatch):
    """On a TPU the first float64 upload warns that float64 is emulated
    there (its precision and range), once; on the CPU platform nothing is
    said."""
    from torchtpu import runtime
    monkeypatch.setattr(runtime, "_FLOAT64_WARNED", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.ones(3, dtype=torch.float64).to("tpu")
    said = [w for w in caught if "float64 on a TPU is emulated" in str(w.message)]
    assert len(said) == (1 if runtime.PLATFORM == "tpu" else 0)


def test_views_stay_views_of_one_storage():
    base = torch.arange(12.0).to("tpu")
    saved = {"base": base, "row": base.view(3, 4)[1], "col": base.view(3, 4)[:, 2],
             "t": base.view(3, 4).t()}
    cpu = {k: v.cpu() for k, v in saved.items()}
    got = _round_trip(saved)
    for name, value in got.items():
        assert_same(value, cpu[name], rtol=0, atol=0)
        assert value.stride() == saved[name].stride()
        assert value.storage_offset() == saved[name].storage_offset()
    got["base"].mul_(10)  # written through the base: every view sees it
    for name in ("row", "col", "t"):
        assert_same(got[name], cpu[name] * 10, rtol=0, atol=0)


def test_saving_is_a_sync_point_and_changes_nothing(mode):
    x = torch.randn(4, 3)
    t = x.to("tpu")
    y = t * 2 + 1  # pending in fused mode
    buffer = io.BytesIO()
    torch.save({"y": y, "t": t}, buffer)
    if mode == "fused":
        from torchtpu.tensor import Pending
        assert type(y._storage.array) is not Pending
    # The saved tensors are untouched and go on as before; a second save
    # after a write has the new values.
    t.add_(1)
    assert_same(t, x + 1)
    assert_same(y * 1, x * 2 + 1)
    torch.save(t, buffer2 := io.BytesIO())
    buffer.seek(0)
    buffer2.seek(0)
    assert_same(torch.load(buffer)["t"], x, rtol=0, atol=0)
    assert_same(torch.load(buffer2), x + 1, rtol=0, atol=0)


def test_file_mmap_and_legacy_formats(tmp_path):
    cpu_model = _trained_cpu_model()
    model = _on_tpu(cpu_model)
    path = tmp_path / "m.pt"
    torch.save(model.state_dict(), path)
    for kwargs in (dict(), dict(mmap=True), dict(mmap=True, map_location="cpu")):
        state = torch.load(path, **kwargs)
        fresh = TiedLM().to("tpu")
        fresh.load_state_dict(state)
        _check_model(fresh, cpu_model)
    torch.save(model, path, _use_new_zipfile_serialization=False)
    _check_model(torch.load(path, weights_only=False), cpu_model)
    # Plain pickle (multiprocessing, copy by pickling) writes the same way.
    _check_model(pickle.loads(pickle.dumps(model)), cpu_model)


def test_tpu_checkpoint_loads_without_torchtpu(tmp_path):
    # As a CUDA checkpoint on a machine without CUDA: map_location="cpu".
    import subprocess
    import sys
    cpu_model = _trained_cpu_model()
    model = _on_tpu(cpu_model)
    torch.save({"state": model.state_dict(), "weight": model.mid.weight}, tmp_path / "tpu.pt")
    script = (
        "import sys, torch\n"
        "d = torch.load(sys.argv[1], map_location='cpu')\n"
        "torch.save(d, sys.argv[2])\n"
        "assert 'torchtpu' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "tpu.pt"), str(tmp_path / "cpu.pt")],
                   check=True)
    loaded = torch.load(tmp_path / "cpu.pt", map_location="cpu")
    assert type(loaded["weight"]) is nn.Parameter and loaded["weight"].requires_grad
    torch.testing.assert_close(loaded["weight"].detach(), cpu_model.mid.weight.detach(), rtol=0, atol=0)
    for name, value in cpu_model.state_dict().items():
        assert type(loaded["state"][name]) is torch.Tensor
        torch.testing.assert_close(loaded["state"][name], value, rtol=0, atol=0)


def test_load_onto_a_missing_device_raises():
    buffer = io.BytesIO()
    torch.save(torch.ones(2).to("tpu"), buffer)
    buffer.seek(0)
    with pytest.raises(RuntimeError, match="torch.tpu.device_count"):
        torch.load(buffer, map_location=f"tpu:{torch.tpu.device_count()}")


def test_untyped_storage_of_tpu_tensors():
    t = torch.arange(6.0).to("tpu")
    v = t.view(2, 3)[1]
    s = t.untyped_storage()
    assert s.device == torch.device("tpu", 0) and s.nbytes() == 24
    assert v.untyped_storage() is s and v.data_ptr() == t.data_ptr() + 12
    other = torch.arange(6.0).to("tpu")
    assert other.untyped_storage().data_ptr() != s.data_ptr()
    torch.testing.assert_close(torch.frombuffer(bytearray(bytes(s.cpu())), dtype=torch.float32),
                               torch.arange(6.0))
    # set_ onto another tpu tensor's storage aliases it, as on CPU.
    alias = torch.empty(0, device="tpu").set_(s, 2, (2, 2), (2, 1))
    t.add_(1)
    assert_same(alias, (torch.arange(6.0) + 1)[2:].view(2, 2))
    with pytest.raises(RuntimeError, match="out of bounds"):
        torch.empty(0, device="tpu").set_(s, 4, (2, 2), (2, 1))
    with pytest.raises(RuntimeError, match="cannot view"):
        torch.empty(0, dtype=torch.int32, device="tpu").set_(s, 0, (6,), (1,))
    # Reads download, as a CUDA storage's do; writing its bytes is refused.
    assert s[7] == (torch.arange(6.0) + 1).untyped_storage()[7]
    with pytest.raises(RuntimeError, match="no host memory"):
        s[0] = 1
    # Pickled (as multiprocessing would), it comes back as bytes on tpu.
    copied = pickle.loads(pickle.dumps(s))
    assert copied.device == s.device and copied.nbytes() == 24
    assert_same(torch.empty(0, device="tpu").set_(copied, 0, (6,), (1,)), torch.arange(6.0) + 1)


def test_tensor_with_python_attributes():
    # A plain tensor's own attributes: weights_only needs TpuTensor allowed,
    # as it does for any tensor subclass.
    t = torch.arange(3.0).to("tpu")
    t.tag = "mine"
    got = _round_trip(t, weights_only=False)
    assert got.tag == "mine" and type(got) is TpuTensor
    with pytest.raises(pickle.UnpicklingError, match="TpuTensor"):
        _round_trip(t)
    with torch.serialization.safe_globals([TpuTensor]):
        assert _round_trip(t).tag == "mine"


# ---- safetensors ----------------------------------------------------------

safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.mark.parametrize("device", ["tpu", "tpu:0", torch.device("tpu"), torchtpu.get_device(), 0],
                         ids=["str", "str_index", "device", "get_device", "index"])
def test_safetensors_files(tmp_path, device):
    from conftest import make
    from safetensors import safe_open
    cpu = {str(dtype): make(dtype, (2, 3), seed=i) for i, dtype in enumerate(DTYPES)
           if dtype != torch.complex64}  # safetensors has no complex64 for torch
    path = tmp_path / "t.safetensors"
    safetensors_torch.save_file({k: v.to("tpu") for k, v in cpu.items()}, path)
    on_cpu = safetensors_torch.load_file(path)
    on_tpu = safetensors_torch.load_file(path, device=device)
    for name, value in cpu.items():
        torch.testing.assert_close(on_cpu[name], value, rtol=0, atol=0)
        assert_same(on_tpu[name], value, rtol=0, atol=0)
        assert on_tpu[name].is_leaf and not on_tpu[name].requires_grad
    with safe_open(path, framework="pt", device=device) as f:
        assert sorted(f.keys()) == sorted(cpu)
        assert_same(f.get_tensor("torch.float32"), cpu["torch.float32"], rtol=0, atol=0)
        assert_same(f.get_slice("torch.int64")[1:], cpu["torch.int64"][1:], rtol=0, atol=0)


def test_safetensors_refuses_shared_tensors_as_on_cpu(tmp_path):
    cpu_model = _trained_cpu_model()
    for model in (cpu_model, _on_tpu(cpu_model)):
        with pytest.raises(RuntimeError, match="share memory"):
            safetensors_torch.save_file(model.state_dict(), tmp_path / "m.safetensors")


def test_safetensors_save_and_load_model(tmp_path):
    cpu_model = _trained_cpu_model()
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_model(_on_tpu(cpu_model), path)
    cpu_path = tmp_path / "cpu.safetensors"
    safetensors_torch.save_model(cpu_model, cpu_path)
    assert set(safetensors_torch.load_file(path)) == set(safetensors_torch.load_file(cpu_path))
    for device in ("tpu", "cpu"):
        model = TiedLM().to("tpu")
        missing, unexpected = safetensors_torch.load_model(model, path, device=device)
        assert (set(missing), unexpected) == (set(), [])
        _check_model(model, cpu_model)


# ---- Hugging Face ---------------------------------------------------------

def _gpt2():
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="sdpa"))


@pytest.mark.parametrize("device_map", ["tpu", torchtpu.get_device(), {"": "tpu"}],
                         ids=["str", "device", "dict"])
def test_hugging_face_save_pretrained_and_from_pretrained(tmp_path, device_map):
    """GPT-2 (tied embedding and output layer) trained a step on tpu, saved,
    and loaded with device_map on tpu: a working tied model with the saved
    values, whose outputs and next training step match CPU's."""
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    cpu_model = _gpt2()
    model = _gpt2()
    model.load_state_dict(cpu_model.state_dict())
    model.to("tpu")
    for m, x in ((cpu_model, ids), (model, ids.to("tpu"))):
        m(input_ids=x, labels=x).loss.backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
        m.zero_grad()
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, device_map=device_map)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    expected = dict(cpu_model.named_parameters())
    for name, p in loaded.named_parameters():
        assert p.is_tpu and isinstance(p, nn.Parameter) and p.is_leaf and p.requires_grad, name
        assert_same(p.detach(), expected[name].detach(), atol=1e-5, rtol=1e-5)
    cpu_model.eval()
    assert_same(loaded(input_ids=ids.to("tpu")).logits, cpu_model(input_ids=ids).logits,
                atol=1e-4, rtol=1e-4)
    loaded.train()
    cpu_model.train()
    for m, x in ((cpu_model, ids), (loaded, ids.to("tpu"))):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m(input_ids=x, labels=x).loss.backward()
        opt.step()
    for name, p in loaded.named_parameters():
        assert_same(p.detach(), expected[name].detach(), atol=1e-4, rtol=1e-4)


def test_sending_a_tpu_tensor_to_another_process_raises_rather_than_copying():
    """torch.multiprocessing shares a CUDA tensor's memory with the process
    it is sent to (Hogwild training writes the parent's model from its
    workers). A tpu tensor cannot be shared, and a copy would lose the
    other side's writes without a word: sending one raises at the sender's
    line, as it does for PyTorch's other devices without shared memory.
    The recipe the message gives, a CPU tensor in shared memory, works."""
    ctx = torch.multiprocessing.get_context("spawn")
    model = torch.nn.Linear(2, 2).to("tpu")
    with pytest.raises(RuntimeError, match="tpu tensors cannot be shared between processes"):
        ctx.Process(target=operator.iadd, args=(model.weight.data, 1)).start()
    with pytest.raises(RuntimeError, match="tpu tensors cannot be shared between processes"):
        ForkingPickler.dumps(model)  # (a Queue pickles with it too)
    shared = torch.zeros(3).share_memory_()
    child = ctx.Process(target=operator.iadd, args=(shared, 1))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert torch.equal(shared, torch.ones(3))  # the child's write, seen here
    # Pickling for files and copies is unchanged.
    t = torch.arange(3.0, device="tpu")
    assert_same(pickle.loads(pickle.dumps(t)), torch.arange(3.0))


def test_an_array_laid_out_column_major_saves_its_values():
    """A TPU lays out an array whose last dim is short column-major on the
    device (a [10, 4] embedding as 4 rows of 10); its tensor's storage bytes,
    what torch.save writes, are still row-major, and .cpu() is contiguous.
    The CPU platform takes the same layout when asked for it."""
    from jax.experimental.layout import Format, Layout
    import jax
    values = torch.randn(10, 4)
    where = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    array = jax.device_put(values.numpy(), Format(Layout(major_to_minor=(1, 0)), where))
    t = torchtpu.jax.from_jax(array)
    assert t.cpu().is_contiguous()
    assert_same(t, values, rtol=0, atol=0)
    storage = t.untyped_storage().cpu()
    assert torch.equal(torch.empty(0).set_(storage, 0, (10, 4), (4, 1)), values)
    assert_same(_round_trip({"w": t})["w"], values, rtol=0, atol=0)
    assert_same(_round_trip(nn.Parameter(t), weights_only=False), values, rtol=0, atol=0)
