"""PyTorch Lightning's Trainer with accelerator="torchtpu": fit, validate
(under inference mode) and predict on one device and with DDP in two
processes, against the same Trainer on CPU."""
import json
import textwrap

import pytest
import torch

from processes import run_ranks

L = pytest.importorskip("lightning")

MODULE = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            self.seen = []

        def training_step(self, batch, i):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.seen.append(float(loss))
            return loss

        def validation_step(self, batch, i):
            x, y = batch
            self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

        def predict_step(self, batch, i):
            return self.net(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def data(batch_size):
        g = torch.Generator().manual_seed(1)
        ds = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
        return torch.utils.data.DataLoader(ds, batch_size=batch_size)

    class TwoRanks:
        # The training batches two ranks of Lightning's DistributedSampler
        # (shuffled, seed 0, reseeded by the epoch) take together at each
        # step, epoch by epoch (one pass over it per epoch).
        def __init__(self, n, per_rank):
            self.n, self.per_rank, self.epoch = n, per_rank, -1

        def __len__(self):
            return self.n // (2 * self.per_rank)

        def __iter__(self):
            self.epoch += 1
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
            ranks, k = (order[0::2], order[1::2]), self.per_rank
            for i in range(len(self)):
                yield ranks[0][i * k:(i + 1) * k] + ranks[1][i * k:(i + 1) * k]

    def run(accelerator, batch_size, two_ranks=False, **trainer_args):
        model = Regression()
        trainer = L.Trainer(accelerator=accelerator, max_epochs=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, **trainer_args)
        train = data(batch_size)
        if two_ranks:
            train = torch.utils.data.DataLoader(train.dataset, batch_sampler=TwoRanks(32, batch_size // 2))
        trainer.fit(model, train, data(batch_size))
        (validated,) = trainer.validate(model, data(batch_size), verbose=False)
        predicted = torch.cat(trainer.predict(model, data(batch_size)))
        return {"losses": model.seen, "val_loss": validated["val_loss"],
                "predicted": predicted.float().tolist(),
                "weight": model.net[0].weight.detach().cpu().tolist(),
                "device_after_fit": str(model.net[0].weight.device),
                "strategy": type(trainer.strategy).__name__,
                "root_device": str(trainer.strategy.root_device)}
""")


def _run_here(accelerator, batch_size, **args):
    namespace = {}
    exec(MODULE, namespace)
    return namespace["run"](accelerator, batch_size, **args)


def _close(a, b, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=rtol, atol=atol)


def test_one_device_fits_validates_and_predicts_as_cpu():
    tpu = _run_here("torchtpu", 8, devices=1)
    cpu = _run_here("cpu", 8, devices=1)
    assert tpu["strategy"] == "SingleDeviceStrategy" and tpu["root_device"] == "tpu:0"
    assert tpu["device_after_fit"] == "cpu"  # moved back when fit ends, as on CUDA
    assert len(tpu["losses"]) == 8
    _close(tpu["losses"], cpu["losses"])
    _close(tpu["weight"], cpu["weight"])
    _close(tpu["val_loss"], cpu["val_loss"])
    _close(tpu["predicted"], cpu["predicted"])


def test_bf16_mixed_autocasts_on_tpu():
    tpu = _run_here("torchtpu", 8, devices=1, precision="bf16-mixed")
    cpu = _run_here("cpu", 8, devices=1, precision="bf16-mixed")
    assert tpu["losses"] != _run_here("torchtpu", 8, devices=1)["losses"]  # not float32's
    _close(tpu["losses"], cpu["losses"], rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="use precision='bf16-mixed'"):
        L.Trainer(accelerator="torchtpu", devices=1, precision="16-mixed")


def test_devices_beyond_the_process_are_refused():
    with pytest.raises(ValueError, match="this process has"):
        L.Trainer(accelerator="torchtpu", devices=[7])


WORKER = MODULE + textwrap.dedent("""\
    import json, sys
    import torchtpu
    report = run("torchtpu", 4, devices=2, strategy="ddp")
    report["backend"] = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    json.dump(report, open(sys.argv[1], "w"))
""")


def test_ddp_in_two_processes_equals_one_cpu_process(tmp_path):
    """Two ranks of 4 samples a step against one CPU process on batches of
    the same 8 (Lightning's DistributedSampler shuffles the training data):
    the same losses (the mean of the ranks'), weights and validation loss;
    predict gives each rank its half of the data."""
    reports = run_ranks(tmp_path, WORKER, 2, timeout=240, per_host=2)
    cpu = _run_here("cpu", 8, two_ranks=True, devices=1)
    for rank, r in enumerate(reports):
        assert r["strategy"] == "DDPStrategy" and r["root_device"] == f"tpu:{rank}"
        _close(r["weight"], cpu["weight"])
        _close(r["val_loss"], cpu["val_loss"])
    _close([(a + b) / 2 for a, b in zip(reports[0]["losses"], reports[1]["losses"])], cpu["losses"])
    # DistributedSampler's split: rank 0 the even samples, rank 1 the odd.
    predicted = [None] * 32
    predicted[0::2], predicted[1::2] = reports[0]["predicted"], reports[1]["predicted"]
    _close(predicted, cpu["predicted"])
    assert json.dumps(reports[0]["backend"]) == '"tpu"'
