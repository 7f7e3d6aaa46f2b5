"""Hugging Face Accelerate and Trainer on tpu, as a user's script calls them
after `import torchtpu`: Accelerator() picks tpu, prepare/backward/gather/
save_state/load_state work and train as on CPU, and Trainer with its default
arguments gives a CPU run's losses."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_state(fresh_accelerate_state):
    """Accelerate keeps its state per process; each test starts anew."""
    yield


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(12, 4, generator=g),
                                          torch.randn(12, 2, generator=g))


def test_accelerator_picks_tpu():
    accelerator = Accelerator()
    assert accelerator.device == torch.device("tpu")
    assert accelerator.distributed_type == accelerate.DistributedType.NO
    assert accelerator.num_processes == 1


def test_accelerator_cpu_true_still_gives_cpu():
    assert Accelerator(cpu=True).device == torch.device("cpu")


def test_several_processes_without_local_rank_raise(monkeypatch):
    # WORLD_SIZE as a launcher that is not torchrun might set it (without a
    # process group, which would wait for the other): each process would
    # train alone. Several processes work under torchrun: see
    # tests/test_accelerate_multiproc.py.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not set"):
        Accelerator()


def test_accelerate_launch_starting_one_of_several_processes_warns(monkeypatch):
    """`accelerate launch --num_processes 2` without --multi_gpu runs one
    process (its launcher does not know tpu): that process says so."""
    for name, value in {"ACCELERATE_USE_CPU": "False", "ACCELERATE_MIXED_PRECISION": "no",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.warns(UserWarning, match="started this process alone.*--multi_gpu"):
        accelerator = Accelerator()
    assert accelerator.device == torch.device("tpu") and accelerator.num_processes == 1


@pytest.mark.parametrize("accelerate_first", [False, True], ids=["torchtpu_first",
                                                                   "accelerate_first"])
def test_import_order_and_no_eager_accelerate_import(accelerate_first):
    """`import torchtpu` does not import accelerate; either import order gives
    a tpu Accelerator."""
    imports = "import accelerate, torchtpu" if accelerate_first else \
        "import torchtpu, sys; assert 'accelerate' not in sys.modules; import accelerate"
    script = f"{imports}\nprint(accelerate.Accelerator().device)"
    env = dict(os.environ, TORCHTPU_CACHE_DIR="off")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tpu"


def test_prepare_and_backward_train_as_on_cpu(mode):
    torch.manual_seed(0)
    ref = _mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    accelerator = Accelerator()
    model = copy.deepcopy(ref)
    model, opt, loader = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2),
        torch.utils.data.DataLoader(_data(), batch_size=4))
    assert all(p.is_tpu for p in model.parameters())
    steps = 0
    for (x, y), (cx, cy) in zip(loader, torch.utils.data.DataLoader(_data(), batch_size=4)):
        assert x.is_tpu and y.is_tpu
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        ref_loss = F.mse_loss(ref(cx), cy)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_same(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        steps += 1
    assert steps == 3
    ref_state = ref.state_dict()
    for name, value in accelerator.unwrap_model(model).state_dict().items():
        assert_same(value, ref_state[name], rtol=1e-5, atol=1e-6)


def test_gather_and_reduce():
    accelerator = Accelerator()
    x = torch.arange(6.0).reshape(2, 3)
    gathered = accelerator.gather({"a": x.to(accelerator.device), "b": [x[0].to("tpu")]})
    assert_same(gathered["a"], x)
    assert_same(gathered["b"][0], x[0])
    assert_same(accelerator.gather_for_metrics(x.to("tpu")), x)
    assert_same(accelerator.reduce(x.to("tpu"), reduction="sum"), x)


def _bf16_step(cpu):
    """One prepared bf16 mixed-precision step: the first layer's output dtype
    inside forward, the model's output and the parameters after the step."""
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=cpu, mixed_precision="bf16")
    torch.manual_seed(0)
    model = _mlp()
    inner_dtypes = []
    model[0].register_forward_hook(lambda mod, args, out: inner_dtypes.append(out.dtype))
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = next(iter(torch.utils.data.DataLoader(_data(), batch_size=4)))
    out = model(x.to(accelerator.device))
    accelerator.backward(F.mse_loss(out, y.to(accelerator.device)))
    opt.step()
    return inner_dtypes, out.detach(), accelerator.unwrap_model(model).state_dict()


def test_mixed_precision_bf16_as_on_cpu():
    """Accelerator(mixed_precision="bf16") autocasts forward to bfloat16 on tpu
    as on CPU (outputs back in float32, as Accelerate gives them)."""
    tpu_dtypes, tpu_out, tpu_state = _bf16_step(cpu=False)
    cpu_dtypes, cpu_out, cpu_state = _bf16_step(cpu=True)
    assert tpu_dtypes == cpu_dtypes == [torch.bfloat16]
    assert tpu_out.dtype == torch.float32
    bf16 = dict(rtol=1.6e-2, atol=1e-5)  # torch.testing's bfloat16 tolerance
    assert_same(tpu_out, cpu_out, **bf16)
    for name, value in tpu_state.items():
        assert value.dtype == torch.float32, name
        assert_same(value, cpu_state[name], **bf16)


def test_mixed_precision_fp16_refused_by_accelerate():
    """Accelerate allows fp16 only on the devices it lists (its GradScaler
    choice would otherwise be CUDA's): it raises, nothing trains silently."""
    # (Accelerate 1.16 names tpu in its refusal; earlier ones list the devices.)
    with pytest.raises(ValueError, match="fp16 mixed precision (requires a device|is not supported on 'tpu')"):
        Accelerator(mixed_precision="fp16")


def _step(accelerator, model, opt, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.detach().cpu()


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "torch_save"])
def test_save_state_load_state_round_trip(tmp_path, safe_serialization):
    """save_state after one step, two more steps, load_state: the parameters
    and optimizer state are the saved ones again (on tpu), and the next step
    repeats the step after saving."""
    torch.manual_seed(0)
    accelerator = Accelerator()
    model = _mlp()
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    batches = [(x.to("tpu"), y.to("tpu")) for x, y in
               torch.utils.data.DataLoader(_data(), batch_size=4)]
    _step(accelerator, model, opt, batches[0])
    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    accelerator.save_state(tmp_path, safe_serialization=safe_serialization)
    after_save = _step(accelerator, model, opt, batches[1])
    _step(accelerator, model, opt, batches[2])
    accelerator.load_state(tmp_path)
    for name, value in model.state_dict().items():
        assert_same(value, saved[name])
    for state in opt.state_dict()["state"].values():
        assert state["exp_avg"].is_tpu and state["exp_avg_sq"].is_tpu
    torch.testing.assert_close(_step(accelerator, model, opt, batches[1]), after_save)


def _trainer_losses(use_cpu, output_dir, early_optimizer=False):
    transformers = pytest.importorskip("transformers")

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    args = transformers.TrainingArguments(output_dir=str(output_dir), max_steps=3,
                                          per_device_train_batch_size=2, report_to="none",
                                          logging_steps=1, use_cpu=use_cpu)
    # An optimizer built on the CPU model, before Trainer moves it.
    optimizers = (torch.optim.AdamW(model.parameters(), lr=1e-3), None) if early_optimizer else (None, None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   optimizers=optimizers)
    trainer.train()
    device = next(model.parameters()).device
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], device


def test_trainer_default_arguments_match_cpu(tmp_path):
    tpu_losses, tpu_device = _trainer_losses(False, tmp_path / "tpu")
    cpu_losses, cpu_device = _trainer_losses(True, tmp_path / "cpu")
    assert tpu_device.type == "tpu" and cpu_device.type == "cpu"
    assert len(tpu_losses) == len(cpu_losses) == 3
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses),
                               rtol=1e-4, atol=1e-5)


def test_trainer_with_an_optimizer_built_before_the_move_trains_as_on_cpu(tmp_path):
    # Trainer moves the model after the user built the optimizer: the move
    # keeps the Parameter objects, so the optimizer steps the tpu model.
    tpu_losses, tpu_device = _trainer_losses(False, tmp_path / "tpu", early_optimizer=True)
    cpu_losses, _ = _trainer_losses(True, tmp_path / "cpu", early_optimizer=True)
    assert tpu_device.type == "tpu"
    assert tpu_losses[0] != tpu_losses[-1]
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses),
                               rtol=1e-4, atol=1e-5)
