"""torch.distributed.checkpoint (DCP) of an FSDP2 model and its AdamW state
on tpu: saved by 2 processes, loaded by 2 fresh ones (one more step equals
continuing the original run) and resharded into 1 process (a 1-rank FSDP2
group, a plain tpu model with no process group, and `dcp_to_torch_save`),
each against the same training in torch ops on CPU."""
import textwrap
import warnings

import pytest
import torch
from processes import run_ranks

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

# What the workers and the CPU reference share: the model, the batch, a step.
COMMON = textwrap.dedent("""\
    import torch, torch.nn as nn, torch.nn.functional as F

    def make(seed=0):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def batch():
        g = torch.Generator().manual_seed(1)
        return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)

    def step(model, opt, x, y):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
""")

# Set-up of a worker: an FSDP2 model on tpu over all ranks, its optimizer.
WORKER_SETUP = COMMON + textwrap.dedent("""\
    import datetime, json, os, sys, warnings
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torchtpu
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard
    warnings.simplefilter("ignore", FutureWarning)
    out, checkpoint = sys.argv[1], os.environ["CHECKPOINT"]
    device = torch.device("tpu", torch.tpu.current_device())
    dist.init_process_group(device_id=device, timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    X, Y = batch()
    rows = slice(8 // world * rank, 8 // world * (rank + 1))
    x, y = X[rows].to("tpu"), Y[rows].to("tpu")
    result = {}

    def sharded(seed):
        model = make(seed).to("tpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def full(model):
        return [p.full_tensor().cpu().tolist() for p in model.parameters()]

    def state(model, opt):
        return {"model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, opt)}

    def load(model, opt):
        sd = state(model, opt)
        dcp.load(sd, checkpoint_id=checkpoint)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])

    def finish():
        result["fallbacks"] = dict(torchtpu.metrics.M.cpu_fallbacks)
        dist.destroy_process_group()
        json.dump(result, open(out, "w"))
""")

# Two processes: train 2 steps, save; a fresh model (another init, no
# optimizer state yet) loads it; one more step on both.
WORKER_SAVE = WORKER_SETUP + textwrap.dedent("""\
    model, opt = sharded(0)
    for _ in range(2):
        step(model, opt, x, y)
    dcp.save(state(model, opt), checkpoint_id=checkpoint)
    result["saved"] = full(model)
    fresh, fresh_opt = sharded(5)
    result["fresh_before"] = full(fresh)
    load(fresh, fresh_opt)
    result["loaded"] = full(fresh)
    step(model, opt, x, y)
    step(fresh, fresh_opt, x, y)
    result["continued"], result["fresh_after"] = full(model), full(fresh)
    finish()
""")

# One process (a 1-rank group): the 2-rank checkpoint into a 1-rank FSDP2
# model and optimizer, then the third step on the whole batch.
WORKER_RESHARD = WORKER_SETUP + textwrap.dedent("""\
    model, opt = sharded(5)
    load(model, opt)
    result["loaded"] = full(model)
    step(model, opt, x, y)
    result["after"] = full(model)
    finish()
""")

# The workers' own make, batch and step, for the CPU reference.
_shared = {}
exec(COMMON, _shared)
make, batch, step = _shared["make"], _shared["batch"], _shared["step"]


def reference(steps):
    """The parameters and AdamW state after `steps` steps in one process on
    CPU on the whole batch (2 ranks' half batches averaged are the same)."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = batch()
    for _ in range(steps):
        step(model, opt, x, y)
    return model, opt


def assert_close(got, want, what):
    got = [torch.tensor(g) for g in got] if isinstance(got[0], list) else list(got)
    want = [w.detach() for w in want]
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        g = g.detach().cpu()
        assert (g.dtype, g.shape) == (w.dtype, w.shape), f"{what} {i}"
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), \
            f"{what} {i}: off by {(g - w).abs().max().item():.3g}"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, monkeypatch_module):
    path = tmp_path_factory.mktemp("dcp") / "checkpoint"
    monkeypatch_module.setenv("CHECKPOINT", str(path))
    reports = run_ranks(tmp_path_factory.mktemp("save"), WORKER_SAVE, 2, timeout=240)
    return path, reports


def test_two_processes_save_and_load_an_fsdp2_model_and_its_optimizer(checkpoint):
    _, reports = checkpoint
    after2, after3 = reference(2)[0], reference(3)[0]
    for r in reports:
        assert r["fallbacks"] == {}
        assert_close(r["saved"], after2.parameters(), "saved parameter")
        # the fresh model started elsewhere, so the load is what moved it
        assert not all(torch.equal(torch.tensor(a), torch.tensor(b))
                       for a, b in zip(r["fresh_before"], r["saved"]))
        assert r["loaded"] == r["saved"]
        # Adam's moments and step count came back too: the step after the
        # load is the original run's next step, bit for bit
        assert r["fresh_after"] == r["continued"]
        assert_close(r["continued"], after3.parameters(), "third-step parameter")


def test_one_process_fsdp2_loads_the_two_process_checkpoint(checkpoint, tmp_path):
    _, reports = checkpoint
    (r,) = run_ranks(tmp_path, WORKER_RESHARD, 1, timeout=240)
    assert r["fallbacks"] == {}
    assert r["loaded"] == reports[0]["saved"]
    assert_close(r["after"], reference(3)[0].parameters(), "third-step parameter")


def test_a_plain_tpu_model_loads_it_without_a_process_group(checkpoint):
    path, reports = checkpoint
    model = make(5).to("tpu")
    sd = {"model": model.state_dict()}
    with warnings.catch_warnings():
        # DCP says it assumes one process when torch.distributed is not set up
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    assert all(p.device.type == "tpu" for p in model.parameters())
    assert [p.cpu().tolist() for p in model.parameters()] == reports[0]["saved"]
    assert_close(list(model.parameters()), reference(2)[0].parameters(), "parameter")


def test_dcp_to_torch_save_gives_the_full_model_and_optimizer_state(checkpoint, tmp_path):
    path, _ = checkpoint
    dcp_to_torch_save(path, tmp_path / "full.pt")
    loaded = torch.load(tmp_path / "full.pt", map_location="tpu")
    model, opt = reference(2)
    names = [n for n, _ in model.named_parameters()]
    assert list(loaded["model"]) == names
    assert all(t.device.type == "tpu" for t in loaded["model"].values())
    assert_close(list(loaded["model"].values()), model.parameters(), "parameter")
    for name, p in zip(names, model.parameters()):
        got, want = loaded["optim"]["state"][name], opt.state[p]
        assert sorted(got) == sorted(want), name
        assert_close([got[k] for k in sorted(want)], [want[k] for k in sorted(want)],
                     f"{name} AdamW state")


def test_a_wrong_shape_raises_as_on_cpu(checkpoint):
    path, _ = checkpoint
    errors = []
    for device in ("cpu", "tpu"):
        sd = {"model": {"0.weight": torch.zeros(3, 8, device=device)}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            with pytest.raises(CheckpointException) as info:
                dcp.load(sd, checkpoint_id=path)
        errors.append({rank: (type(e), str(e)) for rank, (e, _) in info.value.failures.items()})
    assert errors[0][0][0] is ValueError
    assert errors[1] == errors[0]
