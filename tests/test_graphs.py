"""Graph capture and replay (torch.tpu.TPUGraph, torch.tpu.graph): a captured
training step replayed on new data trains as CPU eager does; a sync inside
capture raises at the user's line; replay dispatches no op."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu import metrics

from models import CNN, Transformer
from conftest import assert_at_line, assert_same, platform_tol, to_cpu

STEPS = 5
WARMUP = 3


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _data(n, shape=(4, 6)):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=g), torch.randn(shape[0], 3, generator=g))
            for _ in range(n)]


# model, the shape of a batch
MODELS = {"cnn": (CNN, (4, 2, 6, 6)), "transformer": (Transformer, (4, 5, 8))}


OPTIMIZERS = {
    "sgd": lambda params, tpu: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    # CUDA graphs need capturable=True for Adam(W): its step counts stay on the device.
    "adamw": lambda params, tpu: torch.optim.AdamW(params, lr=0.01, capturable=tpu),
}


def _step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_replayed_training_step_trains_as_cpu(mode, optimizer):
    _check_training(_mlp, (4, 6), optimizer, mode)


def test_replayed_step_of_a_long_forward_trains_as_cpu(mode):
    """A forward of more ops than fused mode runs before its backward
    (FORWARD_FLUSH_OPS) is captured whole with its backward: capture makes
    one graph of the step, as for a short one."""
    from torchtpu.modes import fused

    def deep():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(6, 6)]
        for _ in range(fused.FORWARD_FLUSH_OPS // 2):
            layers += [torch.nn.Tanh(), torch.nn.Linear(6, 6)]
        return torch.nn.Sequential(*layers, torch.nn.Linear(6, 3))
    _check_training(deep, (4, 6), "adamw", mode, dict(rtol=1e-4, atol=1e-5))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_replayed_cnn_and_transformer_steps_train_as_cpu(name, optimizer):
    cls, shape = MODELS[name]

    def make():
        torch.manual_seed(0)
        return cls()
    # Gradients of convolutions and attention, and Adam's second moments of
    # them, differ from CPU's by float32 rounding at the level the training
    # tests use (tests/test_training.py), in eager mode too.
    _check_training(make, shape, optimizer, torchtpu.get_eager_mode(), dict(rtol=1e-4, atol=1e-5))


def _check_training(make, shape, optimizer, mode, tol=None):
    tol = platform_tol(**(tol or dict(rtol=1e-5, atol=1e-6)))
    data = _data(WARMUP + STEPS, shape)
    cpu = make()
    model = make().to("tpu")
    cpu_opt = OPTIMIZERS[optimizer](cpu.parameters(), False)
    opt = OPTIMIZERS[optimizer](model.parameters(), True)
    static_x, static_y = data[0][0].to("tpu"), data[0][1].to("tpu")
    # Warm-up, as CUDA scripts do before capture (on a side stream there).
    for x, y in data[:WARMUP]:
        static_x.copy_(x)
        static_y.copy_(y)
        opt.zero_grad(set_to_none=True)
        _step(model, opt, static_x, static_y)
        cpu_opt.zero_grad(set_to_none=True)
        _step(cpu, cpu_opt, x, y)
    g = torch.tpu.TPUGraph()
    opt.zero_grad(set_to_none=True)
    with torch.tpu.graph(g):
        static_loss = _step(model, opt, static_x, static_y)
    # Capture records the step without running it, as on CUDA.
    for p, q in zip(model.parameters(), cpu.parameters()):
        assert_same(p, q, **tol)
    assert torchtpu.get_eager_mode() == mode
    for x, y in data[WARMUP:]:
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()
        cpu_opt.zero_grad(set_to_none=True)
        cpu_loss = _step(cpu, cpu_opt, x, y)
        assert_same(static_loss.detach(), cpu_loss.detach(), **tol)
    for p, q in zip(model.parameters(), cpu.parameters()):
        assert_same(p, q, **tol)
        assert_same(p.grad, q.grad, **tol)
    for state, cpu_state in zip(opt.state.values(), cpu_opt.state.values()):
        for name, value in cpu_state.items():
            if name != "step":
                assert_same(state[name], value, **tol)


def test_forward_capture_gives_cpu_result(mode):
    cpu = _mlp()
    model = _mlp().to("tpu")
    static_x = torch.zeros(4, 6, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.no_grad(), torch.tpu.graph(g):
        static_out = model(static_x).softmax(-1)
    assert static_out.shape == (4, 3) and static_out.dtype == torch.float32
    for x, _ in _data(3):
        static_x.copy_(x)
        g.replay()
        with torch.no_grad():
            assert_same(static_out, cpu(x).softmax(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not hasattr(torch.accelerator, "Graph"), reason="torch.accelerator.Graph is torch 2.13's")
def test_torch_accelerator_graph_captures_and_replays_on_tpu(mode):
    """Device-generic capture (torch.accelerator.Graph, PyTorch's own
    docstring example first) gives tpu graphs while tpu is the accelerator."""
    x = torch.zeros([2000], device=torch.accelerator.current_accelerator())
    stream = torch.Stream()
    graph = torch.accelerator.Graph()
    assert isinstance(graph, torch.accelerator.Graph) and isinstance(graph, torch.tpu.TPUGraph)
    with stream, graph:
        x += 1
    graph.replay()
    graph.replay()
    assert_same(x, torch.full((2000,), 2.0))
    # keep_graph, a shared pool, capture_begin/capture_end and instantiate.
    cpu = _mlp()
    model = _mlp().to("tpu")
    static_x = torch.zeros(4, 6, device="tpu")
    g = torch.accelerator.Graph(keep_graph=True, pool=graph.pool(), capture_error_mode="relaxed")
    with torch.no_grad():
        g.capture_begin()
        static_out = model(static_x).softmax(-1)
        g.capture_end()
    g.instantiate()
    for batch, _ in _data(2):
        static_x.copy_(batch)
        g.replay()
        with torch.no_grad():
            assert_same(static_out, cpu(batch).softmax(-1), rtol=1e-5, atol=1e-6)
    # An error in the block ends the capture; the next one starts afresh.
    with pytest.raises(ValueError, match="in the block"):
        with torch.accelerator.Graph():
            static_x * 3
            raise ValueError("in the block")
    assert not torch.tpu.is_current_stream_capturing()
    g.reset()
    with g:
        doubled = static_x * 2
    g.replay()
    assert_same(doubled, static_x.cpu() * 2)


def test_replay_dispatches_no_op():
    model = _mlp().to("tpu")
    static_x = torch.zeros(4, 6, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        static_out = model(static_x).sum()
        static_out.backward()
    metrics.reset()
    for _ in range(3):
        g.replay()
    assert metrics.M.ops_dispatched == 0
    assert metrics.M.extra["graph_replays"] == 3
    expected = [p.grad.clone() for p in model.parameters()]  # ops on replay's results
    assert metrics.M.ops_dispatched > 0
    cpu = _mlp()
    cpu(torch.zeros(4, 6)).sum().backward()
    for got, q in zip(expected, cpu.parameters()):
        assert_same(got, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sync", ["item", "print", "cpu", "nonzero", "synchronize"])
def test_sync_inside_capture_raises_at_the_users_line(sync, capsys):
    model = _mlp().to("tpu")
    weight = model[0].weight
    before = to_cpu(weight)
    static_x = torch.ones(4, 6, device="tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.tpu.TPUGraph()
    with pytest.raises(RuntimeError, match="capturing") as excinfo:
        with torch.tpu.graph(g):
            loss = model(static_x).sum()
            loss.backward()
            opt.step()
            if sync == "item":
                loss.item()  # the sync
            elif sync == "print":
                print(loss)  # the sync
            elif sync == "cpu":
                loss.cpu()  # the sync
            elif sync == "nonzero":
                torch.nonzero(static_x)  # the sync
            else:
                torch.tpu.synchronize()  # the sync
    assert __file__ in str(excinfo.value)
    if sync != "synchronize":
        assert_at_line(excinfo, "# the sync", __file__)
    # The capture is abandoned: the mode is back, the parameters as before.
    assert torchtpu.get_eager_mode() in ("debug", "strict", "fused")
    assert_same(weight.detach(), before)
    with pytest.raises(RuntimeError, match="holds no capture"):
        g.replay()


def test_adam_without_capturable_refuses_capture():
    model = _mlp().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.ones(4, 6, device="tpu")
    _step(model, opt, x, torch.zeros(4, 3, device="tpu"))
    g = torch.tpu.TPUGraph()
    with pytest.raises(RuntimeError, match="capturable is False"):
        with torch.tpu.graph(g):
            model(x).sum().backward()
            opt.step()


def test_replay_draws_fresh_random_numbers_as_eager_does(mode):
    static_x = torch.ones(64, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        static_out = F.dropout(static_x, 0.5) + torch.rand(64, device="tpu")
    torch.manual_seed(7)
    eager = [to_cpu(F.dropout(static_x, 0.5) + torch.rand(64, device="tpu")) for _ in range(2)]
    torch.manual_seed(7)
    replayed = []
    for _ in range(2):
        g.replay()
        replayed.append(to_cpu(static_out))
    assert not torch.equal(replayed[0], replayed[1])
    for got, want in zip(replayed, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Values a dropout of p=0.5 and a uniform draw can make.
    assert ((replayed[0] < 1) | ((replayed[0] >= 2) & (replayed[0] < 3))).all()


def test_reset_and_recapture():
    static_x = torch.ones(3, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out = static_x * 2
    with pytest.raises(RuntimeError, match="reset"):
        with torch.tpu.graph(g):
            pass
    g.reset()
    with torch.tpu.graph(g):
        out2 = static_x + 5
    g.replay()
    assert_same(out2, torch.full((3,), 6.0))
    assert not torch.tpu.is_current_stream_capturing()
    assert out.shape == (3,)


def test_replay_updates_parameters_in_their_buffers():
    model = torch.nn.Linear(8, 8).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.ones(2, 8, device="tpu")
    model(x).sum().backward()
    opt.step()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        model(x).sum().backward()
        opt.step()
    g.replay()
    before = to_cpu(model.weight)
    pointer = model.weight._storage.array.unsafe_buffer_pointer()
    g.replay()
    # Donated: XLA wrote the new weight over the old one.
    assert model.weight._storage.array.unsafe_buffer_pointer() == pointer
    assert not torch.equal(to_cpu(model.weight), before)
    # A second holder of a donated buffer keeps its value.
    alias = model.weight._storage.array
    kept = to_cpu(model.weight)
    g.replay()
    assert not alias.is_deleted()
    torch.testing.assert_close(torch.tensor(np.asarray(alias)), kept)


def test_make_graphed_callables_trains_as_cpu():
    data = _data(4)
    cpu = _mlp()
    module = _mlp().to("tpu")
    sample = torch.randn(4, 6, device="tpu", requires_grad=True)
    graphed = torch.tpu.make_graphed_callables(module, (sample,))
    assert graphed is module
    for x, y in data:
        xt = x.to("tpu").requires_grad_()
        xc = x.clone().requires_grad_()
        # No zero_grad: the graphed backward's gradients accumulate as CPU's do.
        F.mse_loss(graphed(xt), y.to("tpu")).backward()
        F.mse_loss(cpu(xc), y).backward()
        assert_same(xt.grad, xc.grad, rtol=1e-5, atol=1e-6)
    for p, q in zip(module.parameters(), cpu.parameters()):
        assert_same(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_make_graphed_function_forward_matches_cpu():
    w = torch.randn(6, 3)
    wt = w.to("tpu").requires_grad_()

    def fn(x, w):
        return torch.tanh(x @ w), x.sum()

    f = torch.tpu.make_graphed_callables(fn, (torch.zeros(4, 6, device="tpu"), wt))
    for x, _ in _data(2):
        out, total = f(x.to("tpu"), wt)
        assert_same(out, torch.tanh(x @ w), rtol=1e-5, atol=1e-6)
        assert_same(total, x.sum(), rtol=1e-5, atol=1e-6)
        out.sum().backward()
    wc = w.clone().requires_grad_()
    for x, _ in _data(2):
        torch.tanh(x @ wc).sum().backward()
    assert_same(wt.grad, wc.grad, rtol=1e-5, atol=1e-6)


class _Decoder(torch.nn.Module):
    """One token per call against a static key/value cache at a tensor position."""

    def __init__(self, vocab=11, dim=8, length=6):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Embedding(length, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.length = length

    def step(self, token, pos, k_cache, v_cache):
        h = self.embed(token) + self.position(pos)  # (1, dim)
        q, k, v = self.qkv(h).chunk(3, -1)
        k_cache.index_copy_(0, pos, k)
        v_cache.index_copy_(0, pos, v)
        visible = torch.arange(self.length, device=pos.device) <= pos
        scores = (q @ k_cache.T).masked_fill(~visible, float("-inf"))
        h = h + scores.softmax(-1) @ v_cache
        next_token = self.head(h).argmax(-1)
        token.copy_(next_token)
        pos.add_(1)
        return next_token


def test_replayed_greedy_decode_with_static_cache_gives_cpu_tokens(mode):
    def run(device, replay):
        model = _Decoder().to(device)
        token = torch.tensor([3], device=device)
        pos = torch.tensor([0], device=device)
        k_cache = torch.zeros(model.length, 8, device=device)
        v_cache = torch.zeros(model.length, 8, device=device)
        tokens = []
        with torch.no_grad():
            if not replay:
                for _ in range(model.length):
                    tokens.append(int(model.step(token, pos, k_cache, v_cache)))
                return tokens
            g = torch.tpu.TPUGraph()
            with torch.tpu.graph(g):
                static_next = model.step(token, pos, k_cache, v_cache)
            for _ in range(model.length):
                g.replay()
                tokens.append(int(static_next))
        assert int(pos) == model.length
        return tokens

    expected = run("cpu", replay=False)
    assert len(set(expected)) > 2  # the tokens depend on the cache and the position
    assert run("tpu", replay=True) == expected


def test_graph_keeps_reading_the_storage_it_captured():
    static_x = torch.ones(4, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out = static_x * 2
    static_x.copy_(torch.arange(4.0))
    g.replay()
    assert_same(out, torch.arange(4.0) * 2)
    # As on CUDA: a tensor given a new storage (resize_ growing it) is no
    # longer what the graph reads; the graph holds the one it captured.
    static_x.resize_(16)
    static_x.fill_(5.0)
    g.replay()
    assert_same(out, torch.arange(4.0) * 2)


def test_out_of_range_index_in_replay_raises_at_the_next_sync():
    table = torch.randn(5, 3)
    static_index = torch.tensor([0, 4], device="tpu")
    tpu_table = table.to("tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        rows = tpu_table.index_select(0, static_index)  # the indexing op
        total = rows.sum()
    g.replay()
    assert_same(rows, table.index_select(0, torch.tensor([0, 4])))
    static_index.copy_(torch.tensor([1, 2]))
    g.replay()
    assert_same(total, table[1:3].sum())
    static_index.copy_(torch.tensor([1, 5]))
    g.replay()
    with pytest.raises(IndexError, match="index_select") as excinfo:
        total.item()
    assert f"{__file__}:" in str(excinfo.value)
    line = next(i for i, text in enumerate(open(__file__), 1) if "# the indexing op" in text)
    assert f":{line})" in str(excinfo.value)
    with pytest.raises(RuntimeError, match="no value"):
        total.item()  # what the bad op fed stays lost
    static_index.copy_(torch.tensor([3, 0]))
    g.replay()
    assert_same(total, table[[3, 0]].sum())


def test_replay_with_nan_checks_raises_on_a_nan():
    from torchtpu.modes import checks
    static_x = torch.ones(3, device="tpu")
    torchtpu.set_check_nans(True)
    try:
        g = torch.tpu.TPUGraph()
        with torch.tpu.graph(g):
            out = static_x.log()
        g.replay()
        assert_same(out, torch.zeros(3))
        assert not checks.FUSED_LINES  # nothing of the capture left for fused mode
        static_x.copy_(torch.tensor([1.0, -1.0, 1.0]))
        with pytest.raises(RuntimeError, match="NaN or Inf"):
            g.replay()
    finally:
        torchtpu.set_check_nans(False)


def test_replayed_cross_entropy_step_trains_as_cpu():
    data = [(x, (y.abs() * 3).long().clamp(max=2)[:, 0]) for x, y in _data(4)]
    cpu = _mlp()
    model = _mlp().to("tpu")
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    static_x, static_y = data[0][0].to("tpu"), data[0][1].to("tpu")
    g = torch.tpu.TPUGraph()
    opt.zero_grad(set_to_none=True)
    with torch.tpu.graph(g):
        F.cross_entropy(model(static_x), static_y).backward()
        opt.step()
    for x, y in data:
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()
        cpu_opt.zero_grad(set_to_none=True)
        F.cross_entropy(cpu(x), y).backward()
        cpu_opt.step()
    for p, q in zip(model.parameters(), cpu.parameters()):
        assert_same(p, q, rtol=1e-5, atol=1e-6)
