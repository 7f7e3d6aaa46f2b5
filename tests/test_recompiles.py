"""No recompile storms: views and writes whose shape is fixed but whose
position moves compile once per shape (offsets are data), in every mode,
with CPU's values."""
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import torchtpu

from conftest import assert_same, make


def _compilations():
    s = torchtpu.metrics.snapshot()
    return s["compilations"] + s.get("graphs_compiled", 0)


def _lm_losses(device, steps, per_step=None):
    """An embedding + linear language model trained by SGD on batches
    sliced at a moving offset of a dataset kept on the device (the usual
    get_batch); per_step(step) is called after each step's loss is read."""
    torch.manual_seed(0)
    vocab, width, bptt = 50, 16, 35
    data = torch.randint(0, vocab, (400, 4), generator=torch.Generator().manual_seed(1)).to(device)
    emb, lin = nn.Embedding(vocab, width).to(device), nn.Linear(width, vocab).to(device)
    opt = torch.optim.SGD(list(emb.parameters()) + list(lin.parameters()), lr=0.1)
    losses = []
    for step in range(steps):
        i = 7 * step
        x, y = data[i:i + bptt], data[i + 1:i + 1 + bptt]
        loss = nn.functional.cross_entropy(lin(emb(x)).view(-1, vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().to("cpu"))
        if per_step is not None:
            per_step(step)
    return torch.stack(losses), lin.weight.detach().to("cpu")


def test_moving_slice_training_compiles_nothing_after_step_two(mode, fresh_kernels):
    counts = []
    losses, weight = _lm_losses("tpu", 10, lambda step: counts.append(_compilations()))
    cpu_losses, cpu_weight = _lm_losses("cpu", 10)
    torch.testing.assert_close(losses, cpu_losses)
    torch.testing.assert_close(weight, cpu_weight)
    assert counts[-1] == counts[1], f"compilations after each step: {counts}"


def test_moving_reads_of_every_view_kind(mode):
    x = torch.randn(20, 6, 5)
    t = x.to("tpu")
    before = None
    for step, i in enumerate([0, 3, 7, 12, 14, 9]):
        got = [t[i:i + 6], t[i], t.narrow(0, i, 4), t[:, :, 1:4][i:i + 3], t[i:i + 6].transpose(0, 2),
               t.select(1, i % 6), t.flatten()[i:i + 40].unfold(0, 8, 4)]
        want = [x[i:i + 6], x[i], x.narrow(0, i, 4), x[:, :, 1:4][i:i + 3], x[i:i + 6].transpose(0, 2),
                x.select(1, i % 6), x.flatten()[i:i + 40].unfold(0, 8, 4)]
        for g, w in zip(got, want):
            # A kernel reading the view, and the view read back to the host
            # (flushed here: fused mode's churn guard counts per line).
            torch.testing.assert_close((g * 2).cpu(), w * 2)
            torch.testing.assert_close(g.cpu(), w)
        if step == 3:
            # (Fused mode compiles some graphs of the second step later:
            # its 14 flushes a step at one line look like churn.)
            torchtpu.sync()
            before = _compilations()
    torchtpu.sync()
    assert _compilations() == before


def test_the_last_rows_read_at_a_moving_offset(mode):
    """A strided window reaching the storage's end (x[:, :2] of its last
    rows) at offsets only known when the kernel runs."""
    x = torch.randn(10, 5)
    t = x.to("tpu")
    for i in range(7):
        assert_same(t[i:i + 3, :2].sum(0), x[i:i + 3, :2].sum(0))
        assert_same(t[i:i + 3, 3:].exp(), x[i:i + 3, 3:].exp())


def test_writes_at_a_moving_offset(mode, fresh_kernels):
    """A cache written at a moving position (rows, and strided columns) and
    a ring buffer: CPU's values, and compilations that stop."""
    buf, cols, ring = torch.zeros(20, 3), torch.zeros(3, 20), torch.zeros(5, 2, 3)
    tbuf, tcols, tring = buf.to("tpu"), cols.to("tpu"), ring.to("tpu")
    before = None
    for step in range(16):
        v = torch.randn(2, 3)
        buf[step:step + 2] = v
        tbuf[step:step + 2] = v.to("tpu")
        cols[:, step] = v[0]
        tcols[:, step] = v[0].to("tpu")
        cols[:, step].mul_(0.5)
        tcols[:, step].mul_(0.5)
        ring[step % 5] += v
        tring[step % 5] += v.to("tpu")
        assert_same(tbuf, buf)
        assert_same(tcols, cols)
        assert_same(tring, ring)
        if step == 5:
            # Each op's first offset keeps its own kernel: fused mode's
            # graph differs when the ring buffer comes back to its first
            # slot (step 5), then recurs.
            torchtpu.sync()
            before = _compilations()
    torchtpu.sync()
    assert _compilations() == before


def test_uploads_and_empty_tensors_of_new_shapes_compile_nothing(mode):
    """An empty tensor's memory is unspecified: .to("tpu") of each new batch
    shape, and torch.empty, need no kernel (in fused mode a live empty
    tensor is recorded, and computed in its graph)."""
    torchtpu.sync()
    before = _compilations()
    for n in range(3, 9):
        for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
            x = make(dtype, (n, n + 1), seed=n)
            t = x.to("tpu")
            assert t.shape == x.shape and t.dtype == x.dtype and t.device.type == "tpu"
            torch.testing.assert_close(t.cpu(), x)
        if mode != "fused":
            e = torch.empty(n, 2, device="tpu", dtype=torch.float16)
            assert e.shape == (n, 2) and e.dtype == torch.float16 and e.device.type == "tpu"
    torchtpu.sync()
    assert _compilations() == before


def test_small_views_download_without_a_kernel_large_ones_with_one(mode):
    """.cpu() of a view of a small storage takes the view on the host (no
    reader kernel per view); of a small view of a large storage, one reader
    per view shape, whatever its position: CPU's values either way."""
    x = torch.randn(6, 5, 4)
    t = x.to("tpu")
    torchtpu.sync()
    before = _compilations()
    for got, want in [(t[2], x[2]), (t.transpose(0, 2), x.transpose(0, 2)), (t[1:5:2, :, 3], x[1:5:2, :, 3]),
                      (t[0, 0].expand(3, 4), x[0, 0].expand(3, 4)), (t.flatten()[7:40].unfold(0, 6, 3),
                                                                      x.flatten()[7:40].unfold(0, 6, 3))]:
        assert_same_values(got.cpu(), want)
    assert _compilations() == before
    big = torch.randn(700, 500)  # 1.4 MB
    tbig = big.to("tpu")
    for i in range(0, 600, 97):
        torch.testing.assert_close(tbig[i, 10:20].cpu(), big[i, 10:20], rtol=0, atol=0)
        if i == 0:
            torchtpu.sync()
            before = _compilations()
    torchtpu.sync()
    assert _compilations() == before


def assert_same_values(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype and got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- tiered compilation (fused mode) ----------------------------------------

@pytest.fixture
def tiered(monkeypatch):
    """Fused mode with every graph compiled in the background (not only
    large ones), and the compile thread held until release() is called: the
    steps before it run op by op, deterministically."""
    from torchtpu import background
    monkeypatch.setenv("TORCHTPU_FUSED_COMPILE", "background")
    monkeypatch.setenv("TORCHTPU_FUSED_BACKGROUND_OPS", "1")
    gate = threading.Event()
    background.submit(gate.wait)
    previous = torchtpu.get_eager_mode()
    torchtpu.set_eager_mode("fused")
    torchtpu.metrics.reset()

    def release():
        gate.set()
        torchtpu.wait_for_compiles()
    yield release
    gate.set()
    torchtpu.wait_for_compiles()
    torchtpu.set_eager_mode(previous)


def _mlp_training(device, steps, between=None, fail_at=None):
    """Losses and final weights of an MLP trained by Adam; between(step) is
    called after each step; at step fail_at, the step raises a shape error
    half-way through its forward (caught, and the step skipped)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 6, generator=g).to(device), torch.randn(8, 3, generator=g).to(device)
    losses = []
    for step in range(steps):
        h = model[1](model[0](x))
        if step == fail_at:
            with pytest.raises(RuntimeError):
                h @ torch.ones(5, 2, device=device)
            opt.zero_grad()
            continue
        loss = nn.functional.mse_loss(model[2](h), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if between is not None:
            between(step)
    return torch.tensor(losses), [p.detach().to("cpu") for p in model.parameters()]


def test_tiered_steps_run_op_by_op_then_fused_with_cpu_results(tiered):
    from torchtpu.modes.fused import STATS

    def between(step):
        if step == 5:
            assert STATS.run_first_met >= 1 and STATS.run_while_compiling >= 1
            assert STATS.graphs_compiled >= 1
            tiered()  # the graphs are compiled: later steps run them
            STATS.graph_cache_hits = 0
            STATS.run_while_compiling = 0
    losses, params = _mlp_training("tpu", 10, between, fail_at=2)
    assert STATS.graph_cache_hits >= 4 and STATS.run_while_compiling == 0
    cpu_losses, cpu_params = _mlp_training("cpu", 10, fail_at=2)
    torch.testing.assert_close(losses, cpu_losses)
    for a, b in zip(params, cpu_params):
        torch.testing.assert_close(a, b)


def test_tiered_graph_whose_compile_fails_runs_op_by_op(tiered, monkeypatch):
    from torchtpu import background, cache
    from torchtpu.modes.fused import STATS

    # Graphs no earlier test or run compiled (in memory, or stored on disk).
    cache.clear()
    monkeypatch.setattr(cache, "_disk", lambda: None)

    def failing():
        raise RuntimeError("XLA ran out of something")
    submit = background.submit
    monkeypatch.setattr(background, "submit", lambda work: submit(failing))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiered()
        # Each step waits for the compile thread (which runs at a lower
        # priority, so on a loaded machine it could lag all six steps): the
        # failure is known by the graph's next flush.
        losses, params = _mlp_training("tpu", 6, lambda step: torchtpu.wait_for_compiles())
    failed = [w for w in caught if "failed to compile" in str(w.message)]
    assert failed and "XLA ran out of something" in str(failed[0].message)
    assert STATS.graph_cache_hits >= 2  # later flushes: op by op, without warning again
    assert len(failed) == STATS.fused_fallbacks
    monkeypatch.undo()
    cpu_losses, cpu_params = _mlp_training("cpu", 6)
    torch.testing.assert_close(losses, cpu_losses)
    for a, b in zip(params, cpu_params):
        torch.testing.assert_close(a, b)


def test_tiered_op_error_raises_at_the_flush_and_loses_only_its_results(tiered, monkeypatch):
    """An op failing in an op-by-op run (here, its kernel) raises at the
    sync point, marks what it feeds lost, and keeps everything else."""
    from torchtpu.modes import graph

    def failing_exp(kernel, args):
        if "exp" in kernel.name:
            raise RuntimeError("op failed")
        return kernel.jitted(*args)
    monkeypatch.setattr(graph, "call_jitted", failing_exp)
    x = torch.arange(4.0).to("tpu")
    a = x * 1.25 + 0.5
    b = a.exp()
    with pytest.raises(RuntimeError, match="op failed"):
        b.cpu()
    torch.testing.assert_close(a.cpu(), torch.arange(4.0) * 1.25 + 0.5)
    with pytest.raises(RuntimeError, match="has no value"):
        b.cpu()


# ---- why it compiled, and the guard ----------------------------------------

def _warm(fn, *args):
    fn(*args)
    torchtpu.sync()


def _line_of(text):
    """file:line of the line of this file holding text."""
    with open(__file__) as f:
        for n, line in enumerate(f, 1):
            if text in line:
                return f"{__file__}:{n}"
    raise AssertionError(text)


@pytest.mark.parametrize("change,difference", [
    ("shape", "argument 0: shape [{n}, 6] -> [{m}, 6]"),
    ("dtype", "argument 0: dtype float32 -> float64"),
    ("static", "argument 1: static value"),
    ("op", "aten.tanh.default -> aten.sigmoid.default"),
])
def test_no_recompiles_names_the_line_and_the_difference(mode, change, difference):
    def step(x, dim=1, last=torch.tanh):
        return last((x * 1.75).sum(dim) + 0.5)  # where a kernel compiles

    # Shapes of this test and mode alone: no earlier case compiled them.
    n = 11 + 2 * ["debug", "strict", "fused"].index(mode) + 6 * ["shape", "dtype", "static", "op"].index(change)
    difference = difference.format(n=n, m=n + 1)
    x = torch.randn(n, 6).to("tpu")
    torchtpu.sync()
    step(x).cpu()
    new = {"shape": (torch.randn(n + 1, 6).to("tpu"),), "dtype": (x.double(),),
           "static": (x, 0), "op": (x, 1, torch.sigmoid)}[change]
    torchtpu.sync()  # (fused mode: the new input's own graph, before the guard)
    with torchtpu.no_recompiles():
        step(x).cpu()  # what compiled before compiles nothing
    out = None
    with pytest.raises(torchtpu.RecompileError) as caught, torchtpu.no_recompiles():
        out = step(*new)
        out.cpu()  # where a fused graph compiles
    message = str(caught.value)
    at = "where a fused graph compiles" if mode == "fused" else "where a kernel compiles"
    assert _line_of(at) in message, message
    if change == "op" and mode != "fused":
        assert "a new kernel of aten.sigmoid.default" in message, message
    else:
        assert difference in message, message
    # Outside the guard it compiles, with CPU's values (fused mode kept the
    # refused graph pending: nothing was lost); explain_compiles() names
    # the line and what differed.
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in new]
    if out is None:  # refused at the op (debug and strict mode)
        out = step(*new)
    torch.testing.assert_close(out.cpu(), step(*cpu))
    report = torchtpu.explain_compiles()
    assert _line_of(at) in report and (difference in report or change == "op"), report


def test_recompiles_error_everywhere_from_the_environment(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text("""
import torch, torchtpu
x = torch.ones(3, device="tpu")
(x * 2).cpu()
try:
    (torch.ones(4, device="tpu") * 2).cpu()
except torchtpu.RecompileError as e:
    print("refused:", e)
""")
    import subprocess
    import sys
    env = dict(__import__("os").environ, TORCHTPU_RECOMPILES="error")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=300)
    # The first kernels compile; the one compiled again is refused, at its line.
    assert "refused:" in out.stdout, out.stderr[-2000:]
    assert f"{script}:6" in out.stdout and "(3,) -> (4,)" in out.stdout, out.stdout


def test_a_step_longer_than_the_fused_limit_makes_the_same_graphs_each_step(monkeypatch):
    """Without a read per step, a step cut at TORCHTPU_FUSE_MAX_OPS is cut
    at the same ops every step (the rest is flushed at the optimizer's
    step): after the first steps, nothing new compiles."""
    monkeypatch.setenv("TORCHTPU_FUSE_MAX_OPS", "45")
    monkeypatch.setenv("TORCHTPU_FUSED_COMPILE", "sync")

    def train(device, steps, counts=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(2)
        x, y = torch.randn(8, 6, generator=g).to(device), torch.randn(8, 3, generator=g).to(device)
        for _ in range(steps):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if counts is not None:
                counts.append(_compilations())
        return [p.detach().to("cpu") for p in model.parameters()]

    counts = []
    with torchtpu.eager_mode("fused"):
        got = train("tpu", 12, counts)
    assert counts[-1] == counts[3], counts
    for a, b in zip(got, train("cpu", 12)):
        torch.testing.assert_close(a, b)


def test_a_step_longer_than_the_fused_limit_without_an_optimizer_makes_the_same_graphs(monkeypatch):
    """A loop that updates its parameters by hand (pytorch/examples' word
    language model) has no optimizer step to flush at: a step cut at the
    limit is flushed at the end of its backward pass instead, so the cuts
    fall at the same ops every step and nothing new compiles or falls back
    to op by op after the first steps."""
    from torchtpu.modes.fused import STATS
    monkeypatch.setenv("TORCHTPU_FUSE_MAX_OPS", "45")
    monkeypatch.setenv("TORCHTPU_FUSED_COMPILE", "sync")

    def train(device, steps, counts=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                              nn.Linear(16, 3)).to(device)
        g = torch.Generator().manual_seed(2)
        x, y = torch.randn(8, 6, generator=g).to(device), torch.randn(8, 3, generator=g).to(device)
        losses = []
        for _ in range(steps):
            model.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)
            losses.append(loss.item())
            if counts is not None:
                counts.append(_compilations())
        return losses, [p.detach().to("cpu") for p in model.parameters()]

    counts = []
    torchtpu.metrics.reset()
    with torchtpu.eager_mode("fused"):
        got = train("tpu", 12, counts)
    assert counts[-1] == counts[3], counts
    assert STATS.fused_fallbacks == 0 and STATS.flushes["step_boundary"] >= 10
    want = train("cpu", 12)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]))
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)


def test_tiered_flush_switches_to_the_graph_ready_half_way(tiered, monkeypatch):
    """The graph's compilation finishes while its ops run one by one: the
    rest of the flush is the graph's, from the same inputs."""
    from torchtpu.modes import graph
    from torchtpu.modes.fused import STATS

    def f(t):
        return ((t * 1.5 - 0.25).tanh() @ t.T + 2.0).softmax(-1).cpu()  # the flush: one line

    x = torch.linspace(-2, 2, 12).reshape(3, 4)
    t = x.to("tpu")
    torchtpu.sync()
    want = ((x * 1.5 - 0.25).tanh() @ x.T + 2.0).softmax(-1)
    torch.testing.assert_close(f(t), want)  # met first: op by op
    calls = []

    def call(kernel, args):
        calls.append(kernel.name)
        if len(calls) == 3:
            tiered()  # the compile thread runs, and finishes the graph
        return kernel.jitted(*args)
    monkeypatch.setattr(graph, "call_jitted", call)
    torch.testing.assert_close(f(t), want)  # met again: compiled meanwhile
    assert STATS.switched_while_compiling == 1 and len(calls) == 3, calls


def test_background_compiles_put_xla_threads_behind_the_program_then_back(tmp_path):
    # A child process: the test changes its threads' priorities.
    script = tmp_path / "behind.py"
    script.write_text("""
import json, os, threading
import jax, jax.numpy as jnp
import torchtpu
from torchtpu import background

def nice(ids):
    return {t: os.getpriority(os.PRIO_PROCESS, t) for t in ids}

jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # XLA's pools are up
xla = background._xla_threads()
before = nice(xla)
me = threading.get_native_id()
try:  # whether this process may raise a thread's priority again
    os.setpriority(os.PRIO_PROCESS, me, before.get(me, 0) + 1)
    os.setpriority(os.PRIO_PROCESS, me, 0)
    may_raise = True
except OSError:
    may_raise = False

def work():
    compiled = jax.jit(lambda x: jnp.tanh(x @ x.T)).lower(jnp.ones((8, 8))).compile()
    return nice(xla), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), compiled

job = background.submit(work)
background.wait()
during, compile_thread, compiled = job.value
print(json.dumps({"xla": len(xla), "may_raise": may_raise, "before": before, "during": during,
                  "after": nice(xla), "compile_thread": compile_thread,
                  "value": float(compiled(jnp.ones((8, 8)))[0, 0])}))
""")
    import json
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TORCHTPU_PLATFORM="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["value"] == pytest.approx(float(torch.tanh(torch.tensor(8.0))))
    assert got["compile_thread"] == 10
    assert got["xla"] > 0  # XLA's pools: unnamed threads Python did not start
    if got["may_raise"]:
        assert all(n == 10 for n in got["during"].values()), got
    else:  # (left alone: their priority could not be raised back)
        assert got["during"] == got["before"], got
    assert got["after"] == got["before"], got


def test_a_background_compile_waits_until_the_program_stops_compiling():
    import time
    from torchtpu import background
    background.wait()
    started = []
    compiled = torchtpu.metrics.snapshot()["compilations"]
    for n in range(3, 7):  # the program compiles kernels (new shapes), a job queued meanwhile
        last = time.monotonic()  # (the op's kernel compiles after this)
        torch.ones(13, 17 + n, device="tpu").cumsum(0).cpu()  # (shapes no other test uses)
        if n == 3:
            background.submit(lambda: started.append(time.monotonic()))
    assert torchtpu.metrics.snapshot()["compilations"] >= compiled + 4
    background.wait()
    assert started and started[0] - last >= background.QUIET
