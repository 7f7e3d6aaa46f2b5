"""torch.optim's AdamW on tpu: fused=True (one lowering over all parameters)
against the default foreach implementation (a kernel per _foreach_ op), on
the MLP of benchmarks/fused.py, in fused and strict mode.

Two figures per mode: the whole training step (forward, backward, step,
loss read, then a sync) and opt.step() alone followed by a sync. The two optimizers'
steps alternate, so both see the same machine load; medians of the repeats.
"""
import torch
import torch.nn.functional as F

import torchtpu
from common import alternating_ms
from fused import mlp, mlp_batch


def _setup(fused):
    torch.manual_seed(0)
    model = mlp().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    x, y = (t.to("tpu") for t in mlp_batch())

    def train():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
        # The step's own optimizer work (strict issues it asynchronously)
        # is counted in this step, not in the next one timed.
        torchtpu.sync()

    def step_only():
        opt.step()
        torchtpu.sync()
    return train, step_only


def fused_adamw(repeats=7, warmup=3):
    """ms per MLP training step and per opt.step(), AdamW fused=True against
    foreach, per mode."""
    rows = []
    for mode in ("fused", "strict"):
        with torchtpu.eager_mode(mode):
            runs = {"foreach": _setup(None), "fused": _setup(True)}
            for what, index in (("training step", 0), ("opt.step() + sync", 1)):
                ms = alternating_ms({k: fns[index] for k, fns in runs.items()},
                                    repeats, warmup)
                rows.append(dict(ms, mode=mode, what=what, ratio=ms["foreach"] / ms["fused"]))
    return rows


fused_adamw.title = ("AdamW fused=True against foreach (default) on the MLP 784-1024-1024-10, "
                     "batch 128, ms, median")
fused_adamw.columns = [
    ("mode", "mode", "{}"), ("what", "timed", "{}"), ("foreach", "foreach", "{:.2f}"),
    ("fused", "fused=True", "{:.2f}"), ("ratio", "foreach / fused=True", "{:.2f}x"),
]
