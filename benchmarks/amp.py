"""Mixed precision: the training steps of benchmarks/fused.py (MLP, small GPT;
AdamW) with forward and loss under torch.autocast("tpu", dtype=torch.bfloat16)
against the same step in float32, in fused and strict mode.

Each figure is the median of several repeats; the two precisions of one model
and mode are timed side by side in one process, their steps alternating.
"""
import torch
import torch.nn.functional as F

import torchtpu
from common import alternating_ms
from fused import TinyGPT, gpt_batch, mlp, mlp_batch


def _step(model, opt, x, y, autocast):
    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("tpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _steps(make_model, make_batch, autocast):
    torch.manual_seed(0)
    model = make_model().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = make_batch()
    return _step(model, opt, x.to("tpu"), y.to("tpu"), autocast)


def amp_training_steps(repeats=7, warmup=3):
    """ms per AdamW step, float32 and bf16 autocast, per model and mode; the
    two precisions' steps alternate, so both see the same machine load."""
    rows = []
    for name, make_model, make_batch in (
            ("MLP 784-1024-1024-10, batch 128", mlp, mlp_batch),
            ("GPT 4 layers d256 h4, seq 128, batch 8, vocab 512", TinyGPT, gpt_batch)):
        for mode in ("fused", "strict"):
            with torchtpu.eager_mode(mode):
                ms = alternating_ms({"f32": _steps(make_model, make_batch, False),
                                     "bf16": _steps(make_model, make_batch, True)},
                                    repeats, warmup)
            rows.append(dict(ms, model=name, mode=mode, ratio=ms["bf16"] / ms["f32"]))
    return rows


amp_training_steps.title = ("Training step (AdamW) under bf16 autocast against float32, "
                            "ms per step, median")
amp_training_steps.columns = [
    ("model", "model", "{}"), ("mode", "mode", "{}"), ("f32", "float32", "{:.1f}"),
    ("bf16", "bf16 autocast", "{:.1f}"), ("ratio", "bf16 / float32", "{:.2f}x"),
]
