"""torch.compile(backend="tpu") training steps beside the eager modes and the
donating jax.jit step: the MLP and the small GPT of benchmarks/fused.py,
AdamW, measured side by side in one process, blocks of steps alternating;
default mode and mode="reduce-overhead" (each graph a replayed capture).

The compiled step is what a script writes: the model's loss compiled (its
backward compiled by AOTAutograd) and the optimizer's step compiled, Adam's
step counts on the device (capturable=True; without it they are CPU tensors
and the optimizer graph runs op by op), then the loss read on the host.
"""
import logging

import torch
import torch.nn.functional as F

import torchtpu
from fused import BLOCK, TinyGPT, gpt_batch, jax_mlp_step_fn, loop_ms, mlp, mlp_batch, step_fn

def compiled_step_fn(make_model, make_batch, mode="strict", device="tpu", compile_mode=None):
    """One compiled AdamW step of a fresh model (seeded) as run(); with
    compile_mode="reduce-overhead" its graphs are replayed captures."""
    torch.manual_seed(0)
    model = make_model()
    x, y = make_batch()
    with torchtpu.eager_mode(mode):
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)
        x, y = x.to(device), y.to(device)

    # dynamic=False: the MLP's and the GPT's steps share this code, and
    # Dynamo would otherwise make the second one's sizes symbolic.
    @torch.compile(backend="tpu", dynamic=False, mode=compile_mode)
    def loss_of(x, y):
        out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y)

    opt_step = torch.compile(opt.step, backend="tpu", dynamic=False, mode=compile_mode)

    def run():
        with torchtpu.eager_mode(mode):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(x, y)
            loss.backward()
            opt_step()
            return loss.item()
    return run


def compiled_steps(repeats=9):
    """ms per AdamW step: compiled (strict and fused around it) vs fused and
    strict eager vs the jax.jit MLP step."""
    torch._logging.set_logs(dynamo=logging.ERROR)
    rows = []
    for name, make_model, make_batch, n in (
            ("MLP 784-1024-1024-10, batch 128", mlp, mlp_batch, 2 * repeats),
            ("GPT 4 layers d256 h4, seq 128, batch 8", TinyGPT, gpt_batch, repeats)):
        fns = {"compiled": compiled_step_fn(make_model, make_batch),
               "replayed": compiled_step_fn(make_model, make_batch,
                                            compile_mode="reduce-overhead"),
               "compiled_fused": compiled_step_fn(make_model, make_batch, "fused"),
               "fused": step_fn(make_model, make_batch, "fused"),
               "strict": step_fn(make_model, make_batch, "strict")}
        if make_model is mlp:
            fns["jax_jit"] = jax_mlp_step_fn()
        ms = loop_ms(fns, n, warmup=3)
        ms.setdefault("jax_jit", float("nan"))
        rows.append(dict(ms, model=name, of_jit=ms["compiled"] / ms["jax_jit"],
                         replayed_of_jit=ms["replayed"] / ms["jax_jit"],
                         of_fused=ms["fused"] / ms["compiled"],
                         replayed_of_fused=ms["fused"] / ms["replayed"]))
    torch._dynamo.reset()
    return rows


compiled_steps.title = ('torch.compile(backend="tpu") training step (AdamW), ms per step, median '
                        f"of blocks of {BLOCK} steps each ending with a synchronize, side by "
                        'side: compiled (default mode, and mode="reduce-overhead": replayed) vs '
                        "fused vs strict vs one jax.jit function")
compiled_steps.columns = [
    ("model", "model", "{}"), ("compiled", "compiled (strict)", "{:.2f}"),
    ("replayed", "reduce-overhead (strict)", "{:.2f}"),
    ("compiled_fused", "compiled (fused)", "{:.2f}"), ("fused", "fused", "{:.2f}"),
    ("strict", "strict", "{:.2f}"), ("jax_jit", "jax.jit step", "{:.2f}"),
    ("of_jit", "compiled / jax.jit", "{:.2f}x"),
    ("replayed_of_jit", "reduce-overhead / jax.jit", "{:.2f}x"),
    ("of_fused", "fused / compiled", "{:.2f}x"),
    ("replayed_of_fused", "fused / reduce-overhead", "{:.2f}x"),
]
