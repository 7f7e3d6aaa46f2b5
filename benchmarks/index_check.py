"""The cost of the out-of-range index check (torchtpu.bounds) in strict and
fused mode: the same work with the check on and off, side by side in one
process (bounds.set_enabled rebuilds the kernels), each figure the median of
several repeats, then the median over turns taken in the order on, off,
off, on, twice.

- µs per indexing op: a chain of index_select / embedding calls (each op's
  flag computed on device, the flags read at the sync ending the chain);
- µs per plain op while a flag is unread: `c = c + y` after one checked op
  (what the dispatcher pays to track the values that depend on the flag);
- ms per training step: the MLP and GPT steps of benchmarks/fused.py (their
  cross_entropy and embedding, forward and backward, are checked).
"""
import statistics

import torch
import torch.nn.functional as F

import torchtpu
from torchtpu import bounds
from common import timings
from fused import TinyGPT, gpt_batch, mlp, mlp_batch, training_step


def _chains(n_ops):
    """(name, make(), run(state)) of the per-op loops; make builds tpu inputs."""
    def select():
        table = torch.randn(256, 64).to("tpu")
        return table, torch.randperm(256).to("tpu")

    def run_select(state):
        c, idx = state
        for _ in range(n_ops):
            c = c.index_select(0, idx)
        torchtpu.sync()

    def run_embedding(state):
        c, idx = state
        for _ in range(n_ops):
            c = F.embedding(idx, c)
        torchtpu.sync()

    def plain():
        y = torch.randn(128, 128).to("tpu")
        return y, torch.tensor([0]).to("tpu")

    def run_plain(state):
        y, idx = state
        c = y.index_select(0, idx.expand(128))  # one checked op: its flag stays unread
        for _ in range(n_ops - 1):
            c = c + y
        torchtpu.sync()

    return [("index_select 256x64, 256 indices", select, run_select),
            ("embedding 256x64, 256 indices", select, run_embedding),
            ("c = c + y (128x128) after a checked op", plain, run_plain)]


# On, off, off, on, twice: drift in the machine's load falls on both alike.
_ORDER = (True, False, False, True) * 2


def _side_by_side(measure):
    """{True: on, False: off}: measure() (a number, or a dict of numbers) with
    the check on and off, each the median of its turns in _ORDER."""
    turns = {True: [], False: []}
    try:
        for on in _ORDER:
            bounds.set_enabled(on)
            turns[on].append(measure())
    finally:
        bounds.set_enabled(True)

    def median(values):
        if isinstance(values[0], dict):
            return {k: statistics.median(v[k] for v in values) for k in values[0]}
        return statistics.median(values)
    return {on: median(v) for on, v in turns.items()}


def index_check(n_ops=200, repeats=9, step_repeats=5):
    rows = []
    for mode in ("strict", "fused"):
        with torchtpu.eager_mode(mode):
            for name, make, run in _chains(n_ops):
                state = make()
                t = _side_by_side(lambda: timings(lambda: run(state), repeats, warmup=2)[0])
                rows.append({"what": name, "mode": mode, "unit": "µs per op",
                             "on": t[True] / n_ops * 1e6, "off": t[False] / n_ops * 1e6})
    for name, make_model, make_batch in (("MLP step (AdamW), cross_entropy checked", mlp, mlp_batch),
                                         ("GPT step (AdamW), embedding + cross_entropy checked",
                                          TinyGPT, gpt_batch)):
        ms = _side_by_side(lambda: training_step(make_model, make_batch, repeats=step_repeats,
                                                 modes=("fused", "strict")))
        for mode in ("strict", "fused"):
            rows.append({"what": name, "mode": mode, "unit": "ms per step",
                         "on": ms[True][mode], "off": ms[False][mode]})
    for r in rows:
        r["ratio"] = r["on"] / r["off"]
    return rows


index_check.title = ("Out-of-range index check: cost with the check on vs off (same process, "
                     "median of repeats)")
index_check.columns = [("what", "work", "{}"), ("mode", "mode", "{}"), ("unit", "unit", "{}"),
                       ("on", "check on", "{:.1f}"), ("off", "check off", "{:.1f}"),
                       ("ratio", "on / off", "{:.3f}x")]
