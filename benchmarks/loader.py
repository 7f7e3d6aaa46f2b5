"""A training step fed from a pinned DataLoader: the plain CUDA-style loop
(`.to("tpu", non_blocking=True)` at the step) against
torchtpu.data.DeviceLoader (the next batches copied while the step runs),
and the step alone on a batch already on the device; the share of the copy
that the loader hides."""
import torch
from common import alternating_ms
from torch.utils.data import DataLoader, Dataset

import torchtpu
from torchtpu.data import DeviceLoader

ROWS, FEATURES, HIDDEN = 4096, 2048, 48  # a float32 batch of 32 MiB
STEPS = 8


class _Batches(Dataset):
    """STEPS pinned (x, y) batches, made once: pinning them again in the
    DataLoader is then free, and what is timed is the copy, not the pinning."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.batches = [(torch.randn(ROWS, FEATURES, generator=g).pin_memory(),
                         torch.randn(ROWS, 1, generator=g).pin_memory()) for _ in range(STEPS)]

    def __len__(self):
        return STEPS

    def __getitem__(self, i):
        return self.batches[i]


def loader(repeats=9):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, 1)).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = DataLoader(_Batches(), batch_size=None, pin_memory=True)
    resident = [(x.to("tpu"), y.to("tpu")) for x, y in batches.dataset.batches[:1]] * STEPS

    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()  # the loop logs its loss: a sync point each step

    def epoch(source, move):
        def run():
            for x, y in source:
                if move:
                    x, y = x.to("tpu", non_blocking=True), y.to("tpu", non_blocking=True)
                step(x, y)
        return run

    cases = {"step alone (batch on the device)": epoch(resident, False),
             "plain loop (.to('tpu', non_blocking=True))": epoch(batches, True),
             "DeviceLoader(loader, prefetch=2)": epoch(DeviceLoader(batches), False)}
    rows = []
    for mode in ("strict", "fused"):
        with torchtpu.eager_mode(mode):
            ms = alternating_ms(cases, repeats, warmup=2)
        alone, plain, fed = (ms[name] / STEPS for name in cases)
        copy = plain - alone
        for name, value in zip(cases, (alone, plain, fed)):
            rows.append({"mode": mode, "case": name, "ms": value, "note": ""})
        rows[-2]["note"] = f"the copy adds {copy:.1f} ms a step"
        rows[-1]["note"] = (f"{plain - fed:.1f} ms of it hidden "
                            f"({max(plain - fed, 0) / copy:.0%})" if copy > 0 else "")
    return rows


loader.title = (f"A training step on a {ROWS}x{FEATURES} float32 batch (32 MiB) from a pinned "
                f"DataLoader, ms per step (medians of epochs of {STEPS} steps, cases alternating)")
loader.columns = [("mode", "mode", "{}"), ("case", "case", "{}"), ("ms", "ms per step", "{:.1f}"),
                  ("note", "", "{}")]
