"""torch.compile(model) with the default backend on a Hugging Face model on tpu
against the same model uncompiled: one AdamW training step of a tiny GPT-2
built from a config, in strict and fused mode.

Dynamo's graphs on tpu tensors go to the `tpu` backend (Inductor cannot serve
the device), which makes each AOTAutograd graph one XLA computation; what
Dynamo cannot capture of the model's code (graph breaks) runs as written.
Both models warm up past Dynamo's recompile limit first; their steps then
alternate, and each figure is the median of the repeats.
"""
import logging
import statistics
import time
import warnings

import torch

import torchtpu
from common import settle


def _gpt2():
    import transformers
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).to("tpu")


def _step(run, opt, ids):
    def step():
        loss = run(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    return step


def compiled_hf_step(repeats=9, warmup=12, modes=("strict", "fused")):
    torch._logging.set_logs(dynamo=logging.ERROR)  # Dynamo's recompile-limit warning
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1)).to("tpu")
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-per-process routing warning
        for mode in modes:
            with torchtpu.eager_mode(mode):
                steps = {}
                for name in ("eager", "compiled"):
                    model = _gpt2()
                    run = torch.compile(model) if name == "compiled" else model
                    steps[name] = _step(run, torch.optim.AdamW(model.parameters(), lr=1e-3), ids)
                    for _ in range(warmup):
                        steps[name]()
                settle()
                times = {name: [] for name in steps}
                for _ in range(repeats):
                    for name, step in steps.items():
                        start = time.perf_counter()
                        step()
                        times[name].append(time.perf_counter() - start)
                eager, compiled = (statistics.median(times[n]) * 1e3 for n in ("eager", "compiled"))
                rows.append({"mode": mode, "eager": eager, "compiled": compiled,
                             "ratio": compiled / eager})
    torch._dynamo.reset()
    return rows


compiled_hf_step.title = ("torch.compile(model), default backend, on a tiny Hugging Face GPT-2 "
                          "on tpu: AdamW step against the uncompiled model")
compiled_hf_step.columns = [("mode", "mode", "{}"), ("eager", "uncompiled ms", "{:.1f}"),
                            ("compiled", "compiled ms", "{:.1f}"),
                            ("ratio", "compiled / uncompiled", "{:.2f}")]
