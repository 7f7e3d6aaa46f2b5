"""Hugging Face Accelerate and Trainer in two processes on tpu, as
`accelerate launch --multi_gpu` and torchrun start them: each process trains
on its own tpu:LOCAL_RANK through torchtpu's tpu process group (DDP), and
the losses, gathered predictions and final weights are those of one CPU
process on the whole batch, computed here."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from processes import free_port, run_ranks

pytest.importorskip("accelerate")

# The run every worker makes: 32 samples, 4 per process per micro-step, 2
# micro-steps per optimizer step (16 samples), 2 epochs; a checkpoint after
# the first epoch, the second epoch run again from it.
N, PER_PROCESS, ACCUMULATE, EPOCHS, CLIP, LR = 32, 4, 2, 2, 0.5, 0.1
EVAL_N = 10  # not a multiple of the 2 x 4 samples of an evaluation step

LOOP_WORKER = textwrap.dedent(f"""\
    import json, os, sys
    import torch, torch.nn.functional as F
    import torchtpu
    from accelerate import Accelerator

    N, PER_PROCESS, ACCUMULATE, CLIP, LR = {N}, {PER_PROCESS}, {ACCUMULATE}, {CLIP}, {LR}
    EVAL_N = {EVAL_N}
    # A report's path (tests/processes.py), or the folder of all (accelerate launch).
    out = sys.argv[1]
    if os.path.isdir(out):
        out = os.path.join(out, f"rank{{os.environ['RANK']}}.json")
    ckpt = os.path.join(os.path.dirname(out), "ckpt")
    from accelerate.utils import FullyShardedDataParallelPlugin
    fsdp = os.environ.get("WORKER_FSDP2") == "1"
    acc = Accelerator(gradient_accumulation_steps=ACCUMULATE,
                      mixed_precision=os.environ.get("WORKER_MIXED_PRECISION", "no"),
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2) if fsdp else None)
    rank = acc.process_index
    report = {{"device": str(acc.device), "type": str(acc.distributed_type.value),
               "num_processes": acc.num_processes, "main": acc.is_main_process,
               "local_main": acc.is_local_main_process,
               "backend": torch.distributed.get_backend()}}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model[0].register_forward_hook(lambda m, a, out: report.update(inner=str(out.dtype)))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 4, generator=g), torch.randn(N, 2, generator=g)
    ex = torch.randn(EVAL_N, 4, generator=g)
    data = torch.utils.data
    train = data.DataLoader(data.TensorDataset(x, y), batch_size=PER_PROCESS)
    evaluation = data.DataLoader(data.TensorDataset(ex), batch_size=PER_PROCESS)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, opt, train, evaluation = acc.prepare(model, opt, train, evaluation)
    report["ddp"] = type(model).__name__

    def epoch():
        losses, norms = [], []
        for xb, yb in train:
            assert xb.device == acc.device and xb.shape[0] == PER_PROCESS
            with acc.accumulate(model):
                loss = F.mse_loss(model(xb), yb)
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), CLIP).item())
                opt.step()
                opt.zero_grad()
            losses.append(acc.gather(loss.detach()[None]).tolist())
        return losses, norms

    def weights():
        # Whole tensors on every rank (FSDP2's are DTensors, gathered here).
        state = acc.unwrap_model(model).state_dict()
        return {{k: (v.full_tensor() if fsdp else v).cpu().tolist() for k, v in state.items()}}

    report["epoch1"] = epoch()
    acc.save_state(ckpt)
    report["epoch2"] = epoch()
    report["weights"] = weights()
    acc.load_state(ckpt)
    report["epoch2_again"] = epoch()
    report["weights_again"] = weights()

    with torch.no_grad():
        preds = [acc.gather_for_metrics(model(xb)) for (xb,) in evaluation]
    report["predictions"] = torch.cat(preds).cpu().tolist()
    t = torch.full((rank + 1, 2), float(rank + 1), device=acc.device)
    report["padded"] = acc.gather(acc.pad_across_processes(t, pad_index=-1)).cpu().tolist()
    report["reduced"] = acc.reduce(t.sum(0), reduction="sum").cpu().tolist()
    report["mean"] = acc.reduce(t[0], reduction="mean").cpu().tolist()
    if acc.is_main_process:
        with open(os.path.join(ckpt, "main_was_here"), "w") as f:
            f.write("1")
    acc.wait_for_everyone()
    report["saw_main"] = os.path.exists(os.path.join(ckpt, "main_was_here"))
    from accelerate.utils import DistributedDataParallelKwargs
    for flag in () if fsdp else ("find_unused_parameters", "static_graph"):
        try:
            Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(**{{flag: True}})]).prepare(
                torch.nn.Linear(2, 2))
        except NotImplementedError as e:
            report[flag] = str(e)
    json.dump(report, open(out, "w"))
""")


def _cpu_run(autocast=False):
    """The same run in one CPU process, each optimizer step on the whole
    16-sample batch: (the losses of each process's 4 samples at each
    micro-step, the clipped gradients' norms, per epoch; the final weights;
    the evaluation's predictions)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 4, generator=g), torch.randn(N, 2, generator=g)
    ex = torch.randn(EVAL_N, 4, generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    step = 2 * PER_PROCESS * ACCUMULATE
    epochs = []
    for _ in range(EPOCHS):
        losses, norms = [], []
        for start in range(0, N, step):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x[start:start + step]).float()
            per_sample = F.mse_loss(out, y[start:start + step], reduction="none").mean(1)
            losses += per_sample.reshape(-1, PER_PROCESS).mean(1).reshape(-1, 2).tolist()
            per_sample.mean().backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            opt.step()
            opt.zero_grad()
        epochs.append((losses, norms))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        predictions = model(ex).float()
    return epochs, model.state_dict(), predictions


def _check_loop(reports, autocast=False, fsdp2=False):
    # bf16: torch.testing's rtol; the data are of order 1, and an output near 0
    # is a difference of bf16 values of that order, each one rounding
    # (2**-8 of it) from another order of summation's.
    tol = dict(rtol=1.6e-2, atol=2 ** -8) if autocast else dict(rtol=1e-5, atol=1e-6)
    epochs, weights, predictions = _cpu_run(autocast)
    for rank, r in enumerate(reports):
        assert r["device"] == f"tpu:{rank}" and r["backend"] == "tpu"
        if fsdp2:
            assert r["type"] == "FSDP" and r["ddp"] == "FSDPSequential"
        else:
            assert r["type"] == "MULTI_GPU" and r["ddp"] == "DistributedDataParallel"
        assert r["num_processes"] == 2 and r["main"] == r["local_main"] == (rank == 0)
        for got, want in zip((r["epoch1"], r["epoch2"], r["epoch2_again"]), epochs + epochs[1:]):
            torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), **tol)
            torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), **tol)
        for name, value in weights.items():
            torch.testing.assert_close(torch.tensor(r["weights"][name]), value, **tol)
        # From the checkpoint, the second epoch again, bit for bit.
        assert r["epoch2_again"] == r["epoch2"] and r["weights_again"] == r["weights"]
        # All ten predictions, in order: the padding of the last step dropped.
        torch.testing.assert_close(torch.tensor(r["predictions"]), predictions, **tol)
        assert r["padded"] == [[1.0, 1.0], [-1.0, -1.0], [2.0, 2.0], [2.0, 2.0]]
        assert r["reduced"] == [5.0, 5.0] and r["mean"] == [1.5, 1.5]
        assert r["saw_main"]
        for flag in () if fsdp2 else ("find_unused_parameters", "static_graph"):
            assert "find_unused_parameters=True and static_graph=True do not work" in r[flag]
        assert r["inner"] == ("torch.bfloat16" if autocast else "torch.float32")
    # The two processes' weights are the same; the clipped norms too.
    assert reports[0]["weights"] == reports[1]["weights"]


def _launch(cmd, env, timeout):
    """cmd run in a session of its own, ended whole after timeout; its output."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0]
        pytest.fail(f"{cmd} did not end within {timeout} s:\n{log[-5000:]}")
    assert proc.returncode == 0, log[-10000:]
    return log


def test_accelerate_launch_two_processes_train_as_one_cpu_process(tmp_path):
    """The real `accelerate launch --multi_gpu --num_processes 2` (Accelerate's
    torchrun launcher): DDP on tpu:0 and tpu:1, gradient accumulation with
    clipping, save_state/load_state, gather_for_metrics, pad/reduce."""
    script = tmp_path / "worker.py"
    script.write_text(LOOP_WORKER)
    env = dict(os.environ, TORCHTPU_COORDINATOR_PORT=str(free_port()),
               HF_HOME=str(tmp_path / "hf"))  # no accelerate config file
    env.pop("TORCHTPU_DISTRIBUTED", None)
    _launch([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
             "--num_processes", "2", "--main_process_port", str(free_port()),
             "--mixed_precision", "no", "--dynamo_backend", "no", "--num_machines", "1",
             str(script), str(tmp_path)], env, timeout=240)
    reports = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    _check_loop(reports)
    saved = sorted(os.listdir(tmp_path / "ckpt"))
    assert saved == ["main_was_here", "model.safetensors", "optimizer.bin",
                     "random_states_0.pkl", "random_states_1.pkl"], saved


@pytest.mark.parametrize("eager_mode,mixed_precision,fsdp2", [
    ("fused", "no", False), ("strict", "bf16", False), ("strict", "no", True)],
    ids=["fused", "bf16", "fsdp2"])
def test_torchrun_two_processes_train_as_one_cpu_process(tmp_path, eager_mode, mixed_precision,
                                                         fsdp2):
    """The same run under torchrun's environment: in fused mode; with bf16
    mixed precision (against CPU's bf16 autocast); with Accelerate's FSDP2
    plugin (fully_shard instead of DDP, a sharded checkpoint)."""
    reports = run_ranks(tmp_path, LOOP_WORKER, 2, timeout=240,
                        env={"LOCAL_WORLD_SIZE": "2", "TORCHTPU_EAGER_MODE": eager_mode,
                             "WORKER_MIXED_PRECISION": mixed_precision,
                             "WORKER_FSDP2": "1" if fsdp2 else "0"})
    _check_loop(reports, autocast=mixed_precision == "bf16", fsdp2=fsdp2)


# Trainer: a tiny GPT-2, 2 samples per process (4 a step), 4 steps, a
# checkpoint every 2; evaluate() with compute_metrics; a second Trainer
# resumes from the first checkpoint. Each rank records the files it wrote.
TRAINER_RUN = textwrap.dedent("""\
    import json, os, sys
    import torch, transformers

    def files_written(log):
        # Which files this process writes: torch.save and safetensors' save_file.
        import safetensors.torch
        for module, name in ((torch, "save"), (safetensors.torch, "save_file")):
            original = getattr(module, name)
            def writer(obj, f, *args, _original=original, **kwargs):
                if isinstance(f, (str, os.PathLike)):
                    log.append("/".join(os.fspath(f).split(os.sep)[-3:]))
                return _original(obj, f, *args, **kwargs)
            setattr(module, name, writer)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            self.ids = torch.randint(0, 96, (n, 16), generator=torch.Generator().manual_seed(seed))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def metrics(prediction):
        # Over all eval samples, gathered in order: next-token accuracy, and
        # the logits weighted by the sample's index.
        logits, labels = prediction.predictions, prediction.label_ids
        order = torch.arange(len(labels), dtype=torch.float32)[:, None, None].numpy()
        return {"accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean()),
                "ordered": float((order * logits).mean()), "samples": len(labels)}

    def run(output_dir, per_device, use_cpu, resume=None, per_device_eval=2):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        args = transformers.TrainingArguments(
            output_dir=output_dir, max_steps=4, per_device_train_batch_size=per_device,
            per_device_eval_batch_size=per_device_eval, save_steps=2, logging_steps=1,
            report_to="none", use_cpu=use_cpu, learning_rate=1e-3, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(16, 1),
                                       eval_dataset=Tokens(8, 2), compute_metrics=metrics)
        trainer.train(resume_from_checkpoint=resume)
        evaluated = trainer.evaluate()
        return {"losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
                "eval": {k: evaluated[k] for k in
                         ("eval_loss", "eval_accuracy", "eval_ordered", "eval_samples")},
                "device": str(trainer.args.device),
                "parallel_mode": str(trainer.args.parallel_mode.value),
                "model": type(trainer.model_wrapped).__name__,
                "weights": {k: v.float().cpu().flatten()[:64].tolist()
                            for k, v in trainer.model.state_dict().items()}}
""")

TRAINER_WORKER = TRAINER_RUN + textwrap.dedent("""\
    import torchtpu
    out = sys.argv[1]
    report = {"written": []}
    files_written(report["written"])
    output_dir = os.path.join(os.path.dirname(out), "run")
    report["first"] = run(output_dir, 2, False)
    report["checkpoints"] = sorted(os.listdir(output_dir))
    report["resumed"] = run(os.path.join(os.path.dirname(out), "resumed"), 2, False,
                            resume=os.path.join(output_dir, "checkpoint-2"))
    json.dump(report, open(out, "w"))
""")


def test_trainer_two_processes_train_evaluate_resume_as_one_cpu_process(tmp_path):
    """Trainer under torchrun's environment: DDP on tpu:0 and tpu:1; its
    losses, evaluation (compute_metrics over all 8 samples) and weights
    those of one CPU process with the whole batch (evaluated 2 samples at a
    time, as each process does: eval_loss averages per-batch losses); checkpoints written by
    rank 0 only (each rank its RNG state); resuming from step 2 gives the
    first run's last two steps bit for bit."""
    pytest.importorskip("transformers")
    reports = run_ranks(tmp_path, TRAINER_WORKER, 2, timeout=300,
                        env={"LOCAL_WORLD_SIZE": "2", "HF_HUB_OFFLINE": "1"})
    namespace = {}
    exec(TRAINER_RUN, namespace)
    cpu = namespace["run"](str(tmp_path / "cpu"), 4, True)
    for rank, r in enumerate(reports):
        first, resumed = r["first"], r["resumed"]
        assert first["device"] == f"tpu:{rank}" and first["parallel_mode"] == "distributed"
        assert first["model"] == "DistributedDataParallel"
        assert list(first["losses"]) == ["1", "2", "3", "4"]
        torch.testing.assert_close(torch.tensor(list(first["losses"].values())),
                                   torch.tensor(list(cpu["losses"].values())), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(list(first["eval"].values())),
                                   torch.tensor(list(cpu["eval"].values()), dtype=torch.float32),
                                   rtol=1e-4, atol=1e-5)
        assert first["eval"]["eval_samples"] == 8
        for name, value in cpu["weights"].items():
            torch.testing.assert_close(torch.tensor(first["weights"][name]), torch.tensor(value),
                                       rtol=1e-4, atol=1e-5)
        # Steps 1-2 from the checkpoint's log history, 3-4 trained again.
        assert resumed["losses"] == first["losses"]
        assert resumed["weights"] == first["weights"] and resumed["eval"] == first["eval"]
    assert reports[0]["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    assert reports[0]["first"]["weights"] == reports[1]["first"]["weights"]
    # Rank 1 writes its RNG state alone; rank 0 the model, optimizer and the rest.
    assert sorted(reports[1]["written"]) == ["resumed/checkpoint-4/rng_state_1.pth",
                                             "run/checkpoint-2/rng_state_1.pth",
                                             "run/checkpoint-4/rng_state_1.pth"]
    assert "run/checkpoint-2/model.safetensors" in reports[0]["written"]
    assert "run/checkpoint-2/optimizer.pt" in reports[0]["written"]
    assert not any("rng_state_1" in f for f in reports[0]["written"])
