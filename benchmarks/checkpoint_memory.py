"""Activation checkpointing (torch.utils.checkpoint): the memory XLA assigns
a GPT training step with and without it, in fused mode, replayed
(torch.tpu.graph) and compiled (`torch.compile(backend="tpu")`).

The model is workloads.py's TinyGPT at 8 layers (d128, 4 heads, seq 128,
batch 8, vocab 512, dropout off), its blocks run one by one, each under
`checkpoint(block, ..., use_reentrant=False)` or not; AdamW, the same seed
both ways. Each path and way runs in a process of its own (the programs it
loaded are then its alone): warm-up steps, the median of timed steps, one
more step. Columns:

- peak temp: XLA's temporary bytes (intermediates, activations kept for the
  backward among them) of the largest of the programs the workload loaded
  (torchtpu.memory.compiled_programs()); a step of several programs runs
  them one after another, so the step's peak is its largest program's,
  not their sum;
- peak footprint: the largest program's arguments + outputs (less those
  written over donated arguments) + temporaries: it counts what one
  program hands the next (torch.compile's forward and backward are two
  programs, the saved activations an output of the one, an argument of
  the other), which temporaries alone miss;
- of unchecked: the checkpointed row's figure over the unchecked one's;
- loss difference: the largest |loss| difference, over all the steps, from
  the unchecked run of the same path (checkpointing recomputes, it should
  change no result).

A control row measures pure JAX: an 8-block MLP (batch 4096, width 128)
with and without jax.checkpoint around each block, one jax.jit step.

    python benchmarks/checkpoint_memory.py [--paths fused replayed]
"""
import argparse
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import print_rows, table, timings, worker_rows  # noqa: E402

PATHS = ("fused", "replayed", "compiled")
SIZE = {"vocab": 512, "d": 128, "heads": 4, "layers": 8, "seq": 128}
BATCH = 8
WARMUP, REPEATS = 3, 5
MODEL = "GPT 8 layers d128 h4, seq 128, batch 8, vocab 512, AdamW"
CONTROL = "MLP 8 blocks w128, batch 4096 (value and gradient)"


def gpt(checkpointed, **size):
    """workloads.py's TinyGPT with its blocks run one by one, each under
    torch.utils.checkpoint if checkpointed (else as TransformerEncoder
    runs them)."""
    from torch.utils.checkpoint import checkpoint
    from workloads import TinyGPT

    class GPT(TinyGPT):
        def forward(self, tokens):
            h = self.embed(tokens) + self.pos
            for block in self.blocks.layers:
                if checkpointed:
                    h = checkpoint(block, h, self.mask, None, True, use_reentrant=False)
                else:
                    h = block(h, self.mask, None, True)
            return self.head(h)
    return GPT(**size)


def _step(path, make_model, make_batch):
    """The path's training step as run() -> the loss."""
    if path == "fused":
        from fused import step_fn
        return step_fn(make_model, make_batch, "fused")
    if path == "replayed":
        from fused import replayed_step_fn
        return replayed_step_fn(make_model, make_batch)
    if path == "compiled":
        import logging

        import torch
        from compiled import compiled_step_fn
        torch._logging.set_logs(dynamo=logging.ERROR)
        return compiled_step_fn(make_model, make_batch)
    raise ValueError(f"unknown path {path!r}")


def measure(path, checkpointed, size=SIZE, batch=BATCH, warmup=WARMUP, repeats=REPEATS):
    """One path's figures, one way (in a process of its own: its programs are
    the ones loaded after the start). path "jax": the jax.jit control."""
    if path == "jax":
        return _jax_control(checkpointed, repeats=repeats)
    # The step's graphs compiled whole: a graph split into pieces (where its
    # op stream repeats, as a GPT's layers do) holds what one piece hands
    # the next outside any program, where no program's figures see it.
    previous = os.environ.get("TORCHTPU_FUSED_SPLIT_OPS")
    os.environ["TORCHTPU_FUSED_SPLIT_OPS"] = "0"
    try:
        return _measure(path, checkpointed, size, batch, warmup, repeats)
    finally:
        if previous is None:
            del os.environ["TORCHTPU_FUSED_SPLIT_OPS"]
        else:
            os.environ["TORCHTPU_FUSED_SPLIT_OPS"] = previous


def _measure(path, checkpointed, size, batch, warmup, repeats):
    import torchtpu
    from torchtpu.memory import compiled_programs
    from workloads import gpt_batch
    before = {p.id for p in compiled_programs()}
    run = _step(path, functools.partial(gpt, checkpointed, **size),
                functools.partial(gpt_batch, batch, size["seq"], size["vocab"]))
    losses = []

    def step():
        losses.append(run())
    for _ in range(warmup):
        step()
    median, _ = timings(step, repeats, warmup=0)
    step()
    torchtpu.wait_for_compiles()
    programs = [p for p in compiled_programs() if p.id not in before]
    return {"path": path, "checkpointed": checkpointed, "programs": len(programs),
            "temp": max(p.temp for p in programs), "footprint": max(p.footprint for p in programs),
            "ms": median * 1e3, "losses": losses}


def _jax_control(checkpointed, blocks=8, batch=4096, width=128, repeats=REPEATS):
    """The control: XLA's temporary bytes for an 8-block MLP's gradient step,
    with and without jax.checkpoint around each block, as one jax.jit."""
    import time

    import jax
    import jax.numpy as jnp
    keys = jax.random.split(jax.random.PRNGKey(0), blocks + 1)
    ws = [jax.random.normal(k, (width, width)) / width ** 0.5 for k in keys[1:]]
    x = jax.random.normal(keys[0], (batch, width))

    def block(w, h):
        return jnp.tanh(h @ w)
    if checkpointed:
        block = jax.checkpoint(block)

    def loss(ws):
        h = x
        for w in ws:
            h = block(w, h)
        return jnp.mean(h ** 2)
    compiled = jax.jit(jax.value_and_grad(loss)).lower(ws).compile()
    value, _ = compiled(ws)
    start = time.perf_counter()
    for _ in range(repeats):
        value, grads = compiled(ws)
        jax.block_until_ready(grads)
    stats = compiled.memory_analysis()
    return {"path": "jax", "checkpointed": checkpointed, "programs": 1,
             "temp": stats.temp_size_in_bytes,
             "footprint": (stats.argument_size_in_bytes + stats.output_size_in_bytes
                           - stats.alias_size_in_bytes + stats.temp_size_in_bytes),
             "ms": (time.perf_counter() - start) / repeats * 1e3, "losses": [float(value)]}


def compare(plain, checked, model=MODEL):
    """The table's two rows of a path from its measures without and with
    checkpointing: each figure also as a share of the unchecked run's, and
    the largest loss difference from it over the steps (None: a different
    number of steps)."""
    rows = []
    for row in (plain, checked):
        same = len(row["losses"]) == len(plain["losses"])
        rows.append(dict(row, model=model if row["path"] != "jax" else CONTROL,
                         path=row["path"] if row["path"] != "jax" else "jax.jit (control)",
                         way="checkpointed" if row["checkpointed"] else "not",
                         temp_mb=row["temp"] / 2 ** 20, footprint_mb=row["footprint"] / 2 ** 20,
                         temp_of=row["temp"] / plain["temp"],
                         footprint_of=row["footprint"] / plain["footprint"],
                         loss=row["losses"][-1],
                         loss_diff=max(abs(a - b) for a, b in zip(row["losses"], plain["losses"]))
                         if same else None))
    return rows


def checkpoint_memory(paths=PATHS, timeout=1200):
    rows = []
    for path in paths + ("jax",):
        plain, checked = (worker_rows(__file__, [path, str(c)], timeout)[0] for c in (False, True))
        two = compare(plain, checked)
        if two[1]["loss_diff"] is None or two[1]["loss_diff"] > 1e-4:
            raise AssertionError(f"{path}: checkpointed losses {checked['losses']} differ from "
                                 f"the unchecked run's {plain['losses']}")
        rows += two
    return rows


checkpoint_memory.title = ("Activation checkpointing: XLA's peak memory for a training step (the "
                           "largest of its programs), with and without torch.utils.checkpoint "
                           "around each block")
checkpoint_memory.columns = [
    ("path", "path", "{}"), ("model", "model", "{}"), ("way", "checkpointing", "{}"),
    ("programs", "programs loaded", "{}"), ("temp_mb", "peak temp (MiB)", "{:.1f}"),
    ("temp_of", "of unchecked", "{:.0%}"), ("footprint_mb", "peak footprint (MiB)", "{:.1f}"),
    ("footprint_of", "of unchecked", "{:.0%}"), ("ms", "step (ms, median)", "{:.1f}"),
    ("loss", "final loss", "{:.6f}"), ("loss_diff", "loss difference", "{:.1e}"),
]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2)
    parser.add_argument("--paths", nargs="+", default=list(PATHS))
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, os.path.join(HERE, ".."))
        path, checkpointed = args.worker[0], args.worker[1] == "True"
        print_rows([measure(path, checkpointed)])
    else:
        print(table(checkpoint_memory, checkpoint_memory(tuple(args.paths))))
