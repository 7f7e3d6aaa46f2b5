"""Fused graphs split where their op stream repeats (torchtpu/modes/segments.py):
the pieces found, and training through split graphs against CPU and
against the same graphs compiled whole."""
import pytest
import torch
from torch import nn

import torchtpu
from torchtpu.modes import segments


class _K:
    """A stand-in kernel: the search compares kernels by identity."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


def test_repeats_are_found_at_whole_periods_and_cut_into_pieces():
    a, b, c, d, e, f = (_K(n) for n in "abcdef")
    # A prologue, a 3-op step (whose first two ops are alike) 40 times, an
    # epilogue: the step is the period, not its repeated first op.
    kernels = [a, b] + [c, c, d] * 40 + [e, f]
    regions = segments.repeats(kernels)
    assert regions == [(2, 3, 40)]
    pieces = segments.cuts(len(kernels), regions)
    # 16 periods (48 ops) a piece, then the 8 periods left; the prologue and
    # the epilogue, shorter than half a piece, join the piece before them
    # (the prologue, the first).
    assert pieces == [(0, 50), (50, 98), (98, 124)]
    # Too short a repeat (fewer than 2 pieces' worth of ops) is not one.
    assert segments.repeats([a, b] + [c, d] * 10 + [e]) == []


def _lm(vocab=50, width=16):
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Embedding(vocab, width)
            self.rnn = nn.LSTM(width, width, 2)
            self.decoder = nn.Linear(width, vocab)

        def forward(self, x, hidden):
            out, hidden = self.rnn(self.encoder(x), hidden)
            return self.decoder(out).view(-1, vocab), hidden
    return LM(), vocab


def _train_lm(device, steps=4, bptt=30, batch=4, keep=None):
    """pytorch/examples' word language model, trained by hand: losses and
    final weights; keep: a list each step's output is appended to."""
    torch.manual_seed(0)
    model, vocab = _lm()
    model.to(device)
    data = torch.randint(0, vocab, (steps * bptt + 1, batch),
                         generator=torch.Generator().manual_seed(1)).to(device)
    hidden = tuple(torch.zeros(2, batch, 16, device=device) for _ in range(2))
    losses = []
    for i in range(0, steps * bptt, bptt):
        x, y = data[i:i + bptt], data[i + 1:i + 1 + bptt].reshape(-1)
        hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        out, hidden = model(x, hidden)
        loss = nn.functional.cross_entropy(out, y)
        if keep is not None:
            keep.append(out)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-5.0)
        losses.append(loss.item())
    return torch.tensor(losses), [p.detach().to("cpu") for p in model.parameters()]


def _gpt_like(device, steps=3):
    """A deep stack of identical pre-norm blocks trained by AdamW."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))
    model = nn.Sequential(*[Block() for _ in range(16)], nn.Linear(16, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses), [p.detach().to("cpu") for p in model.parameters()]


@pytest.fixture
def fused_sync(monkeypatch):
    """Fused mode, every new graph compiled when met, metrics from zero."""
    monkeypatch.setenv("TORCHTPU_FUSED_COMPILE", "sync")
    with torchtpu.eager_mode("fused"):
        torchtpu.metrics.reset()
        yield
    torchtpu.sync()


@pytest.mark.parametrize("train", [_train_lm, _gpt_like], ids=["lstm", "layer-stack"])
def test_split_graphs_train_as_cpu_and_as_whole_graphs(fused_sync, monkeypatch, train):
    losses, params = train("tpu")
    s = torchtpu.metrics.snapshot()
    assert s["graphs_split"] >= 1
    # Pieces alike share a program: fewer are compiled than run.
    assert 0 < s["piece_programs"] < s["graph_pieces"], s
    cpu_losses, cpu_params = train("cpu")
    torch.testing.assert_close(losses, cpu_losses)
    for got, want in zip(params, cpu_params):
        torch.testing.assert_close(got, want)
    monkeypatch.setenv("TORCHTPU_FUSED_SPLIT_OPS", "0")
    torchtpu.metrics.reset()
    whole_losses, whole_params = train("tpu")
    assert torchtpu.metrics.snapshot()["graphs_split"] == 0
    torch.testing.assert_close(losses, whole_losses)
    for got, want in zip(params, whole_params):
        torch.testing.assert_close(got, want)


def test_split_graphs_in_the_background_train_as_cpu(monkeypatch):
    """Tiered: the split graph's pieces compile on the compile thread while
    its flushes run op by op; once they are done, the steps run them."""
    monkeypatch.delenv("TORCHTPU_FUSED_COMPILE", raising=False)
    with torchtpu.eager_mode("fused"):
        torchtpu.metrics.reset()
        # (A step's graph holds its backward and the next step's forward:
        # the fourth step's is the first met again, and compiled.)
        first, _ = _train_lm("tpu", steps=5)
        torchtpu.wait_for_compiles()
        losses, params = _train_lm("tpu", steps=5)
        s = torchtpu.metrics.snapshot()
    assert s["graphs_split"] >= 1 and s["graph_cache_hits"] >= 3, s
    cpu_losses, cpu_params = _train_lm("cpu", steps=5)
    torch.testing.assert_close(losses, cpu_losses)
    torch.testing.assert_close(first, cpu_losses)
    for got, want in zip(params, cpu_params):
        torch.testing.assert_close(got, want)


def test_new_graphs_sharing_pieces_still_compiling_train_as_cpu(monkeypatch):
    """Graphs of the same ops with another output kept, met while the first
    graphs' pieces are still compiling: they share those pieces, run op by
    op meanwhile (a graph may run only what is compiled), without a
    warning, and train as on CPU before and after the pieces are done."""
    import threading
    import warnings

    from torchtpu import background
    monkeypatch.setenv("TORCHTPU_FUSED_COMPILE", "background")
    gate = threading.Event()
    background.submit(gate.wait)  # the compile thread waits for the gate
    try:
        with torchtpu.eager_mode("fused"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torchtpu.metrics.reset()
            # Its graph recurs: its pieces are queued (the compile thread waits).
            _train_lm("tpu", steps=4, batch=5)  # (a batch no other test uses)
            assert torchtpu.metrics.snapshot()["piece_programs"] > 0
            # The same ops, an output kept: new graphs, most of their pieces the same.
            losses, params = _train_lm("tpu", steps=4, batch=5, keep=[])
            gate.set()
            torchtpu.wait_for_compiles()
            later, _ = _train_lm("tpu", steps=4, batch=5, keep=[])
    finally:
        gate.set()
        torchtpu.wait_for_compiles()
    assert not [w for w in caught if "torchtpu" in str(w.message)], [str(w.message) for w in caught]
    cpu_losses, cpu_params = _train_lm("cpu", steps=4, batch=5)
    torch.testing.assert_close(losses, cpu_losses)
    torch.testing.assert_close(later, cpu_losses)
    for got, want in zip(params, cpu_params):
        torch.testing.assert_close(got, want)


def test_a_piece_that_fails_to_compile_runs_its_graph_op_by_op(monkeypatch):
    """A piece's compile that fails (as an XLA limit would) fails its graph's:
    one warning, and the graph's ops run one by one, with CPU's results."""
    from torchtpu.modes import graph
    monkeypatch.setenv("TORCHTPU_FUSED_COMPILE", "background")
    traced = graph.call_traced

    def failing(kernel, args):
        if "lstm_cell_backward" in str(kernel.name):
            raise RuntimeError("piece too large")
        return traced(kernel, args)
    monkeypatch.setattr(graph, "call_traced", failing)
    with torchtpu.eager_mode("fused"):
        torchtpu.metrics.reset()
        with pytest.warns(UserWarning, match="failed to compile .*piece too large.*one by one"):
            _train_lm("tpu", steps=4, batch=6)  # (a batch no other test uses)
            torchtpu.wait_for_compiles()
            losses, params = _train_lm("tpu", steps=4, batch=6)
        s = torchtpu.metrics.snapshot()
        assert s["graphs_split"] >= 1 and s["fused_fallbacks"] >= 1, s
    cpu_losses, cpu_params = _train_lm("cpu", steps=4, batch=6)
    torch.testing.assert_close(losses, cpu_losses)
    for got, want in zip(params, cpu_params):
        torch.testing.assert_close(got, want)
