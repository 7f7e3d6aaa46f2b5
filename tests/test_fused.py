"""Fused mode: sync points, caching of step graphs, churn fallback, parity with strict."""
import io
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu import metrics


@pytest.fixture
def fused():
    previous = torchtpu.get_eager_mode()
    torchtpu.set_eager_mode("fused")
    metrics.reset()
    yield
    torchtpu.set_eager_mode(previous)


def flushes():
    return metrics.snapshot()["flushes"]


def pending(t):
    from torchtpu.tensor import Pending
    return type(t._storage.array) is Pending


def test_ops_are_recorded_not_run(fused):
    x = torch.arange(6.0, device="tpu").view(2, 3)
    y = x * 2 + 1
    assert pending(y)
    assert y.shape == (2, 3) and y.dtype == torch.float32
    assert y.stride() == (3, 1)
    assert flushes() == {}
    torch.testing.assert_close(y.cpu(), torch.arange(6.0).view(2, 3) * 2 + 1)
    assert flushes() == {"cpu": 1}
    assert not pending(y)


def test_shape_errors_raise_at_the_call(fused):
    a = torch.ones(2, 3, device="tpu")
    b = torch.ones(4, device="tpu")
    with pytest.raises(RuntimeError, match="must match the size|broadcast"):
        a + b
    assert flushes() == {}


@pytest.mark.parametrize("reason, action", [
    ("item", lambda t: t.sum().item()),
    ("item", lambda t: bool(t.sum() > 0)),
    ("cpu", lambda t: t.cpu()),
    ("cpu", lambda t: t.tolist()),
    ("print", lambda t: repr(t)),
    ("cpu", lambda t: torch.save(t, io.BytesIO())),
    ("sync", lambda t: torchtpu.sync()),
    ("sync", lambda t: torch.tpu.synchronize()),
    ("mode_switch", lambda t: torchtpu.set_eager_mode("strict")),
])
def test_sync_points_flush(fused, reason, action):
    t = torch.ones(3, device="tpu") + 1
    assert pending(t)
    action(t)
    assert flushes().get(reason, 0) >= 1, flushes()
    assert not pending(t)


def test_value_dependent_shape_flushes(fused):
    t = torch.tensor([0.0, 1.0, 0.0, 2.0], device="tpu") * 3
    nz = torch.nonzero(t)   # reads the count back: a flush
    assert flushes() == {"nonzero": 1}
    torch.testing.assert_close(nz.cpu(), torch.tensor([[1], [3]]))
    assert metrics.snapshot()["cpu_fallbacks"] == {}


def test_buffer_limit_flushes(fused, monkeypatch):
    torch.ones(2, device="tpu").add(1).cpu()  # (a graph flushed under the default limit)
    monkeypatch.setenv("TORCHTPU_FUSE_MAX_OPS", "10")  # read as the next graph starts
    c = torch.zeros(4, device="tpu")
    for _ in range(25):
        c = c + 1
    assert flushes().get("limit", 0) == 2
    torch.testing.assert_close(c.cpu(), torch.full((4,), 25.0))


def test_intermediates_are_not_outputs(fused):
    y = torch.ones(8, device="tpu")
    c = torch.zeros(8, device="tpu")
    torchtpu.sync()
    for _ in range(50):
        c = c + y
    torchtpu.sync()
    from torchtpu.modes.fused import STATS
    # One graph of 50 ops whose only live result is the final c.
    assert STATS.last_flush["ops"] == 50
    assert STATS.last_flush["outputs"] == 1
    torch.testing.assert_close(c.cpu(), torch.full((8,), 50.0))


def test_views_and_mutation_before_flush(fused):
    ref = torch.arange(12.0).view(3, 4)
    x = ref.to("tpu")
    for t in (ref, x):
        t[1].add_(10)
        t.t()[2].mul_(-1)
        v = t.view(12)
        v[0] = 7
        t.narrow(1, 1, 2).copy_(torch.ones(3, 2, device=t.device))
    assert pending(x)
    torch.testing.assert_close(x.cpu(), ref)
    torch.testing.assert_close(v.cpu(), ref.view(12))


def _mlp_step_counts(mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16).to("tpu")
    y = torch.randint(0, 4, (8,)).to("tpu")
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def test_training_loop_hits_one_step_graph(fused, fresh_kernels):
    from torchtpu.modes.fused import STATS
    losses, params = _mlp_step_counts("fused")
    # One graph per step; step 1 (no optimizer state yet) and step 2 (state
    # created) may differ, every later step reuses the same graph.
    assert STATS.flushes.get("item") == 10
    assert STATS.graphs_compiled <= 3 + _setup_graphs()
    assert STATS.graph_cache_hits >= 7
    with torchtpu.eager_mode("strict"):
        ref_losses, ref_params = _mlp_step_counts("strict")
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


def _setup_graphs():
    # Graphs flushed while building the model and data (parameter init
    # reads, copies), before the loop.
    return 4


def test_shape_churn_falls_back_to_op_by_op(fused):
    from torchtpu.modes.fused import CHURN_WINDOW, STATS
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 40):
            t = torch.ones(n, device="tpu") * 2 + 1
            assert t.sum().item() == 3.0 * n
    assert STATS.fused_fallbacks >= 1
    # After the fallback the loop stops compiling a graph per iteration.
    assert STATS.graphs_compiled <= CHURN_WINDOW + 2
    assert any("fused graphs keep changing" in str(w.message) for w in caught)


@pytest.mark.parametrize("fn", [
    lambda a, b: (a @ b.t()).relu().sum(dim=1),
    lambda a, b: F.softmax(a * b, dim=-1),
    lambda a, b: torch.where(a > 0, a, b).cumsum(0),
    lambda a, b: F.layer_norm(a + b, (5,)),
    lambda a, b: torch.cat([a, b], 0).max(dim=0).values,
])
def test_fused_matches_strict_forward_and_backward(fn):
    torch.manual_seed(1)
    a0, b0 = torch.randn(4, 5), torch.randn(4, 5)
    results = {}
    for mode in ("strict", "fused"):
        with torchtpu.eager_mode(mode):
            a = a0.to("tpu").requires_grad_()
            b = b0.to("tpu").requires_grad_()
            out = fn(a, b)
            ga, gb = torch.autograd.grad(out.sum(), (a, b))
            results[mode] = (out.detach().cpu(), ga.cpu(), gb.cpu())
    for s, f in zip(results["strict"], results["fused"]):
        torch.testing.assert_close(f, s)


def test_churning_site_recovers_when_a_graph_recurs(fused):
    from torchtpu.modes.fused import STATS

    def step(n):  # every flush happens on the next line: one site
        return (torch.ones(n, device="tpu") * 2 + 1).sum().item()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in range(1, 21):
            assert step(n) == 3.0 * n
        assert STATS.fused_fallbacks >= 1
        hits = STATS.graph_cache_hits
        for _ in range(5):
            assert step(7) == 21.0
    # n=7 recurs: compiled once, then every later step hits it.
    assert STATS.graph_cache_hits - hits >= 4


def test_failed_graph_runs_op_by_op(fused, monkeypatch):
    # A graph that fails to compile or run (an XLA limit, say) falls back to
    # its ops' own kernels: every tensor gets its value, nothing is lost.
    from torchtpu.modes import graph

    def broken(nodes, live_refs, donate=None, when="first call"):
        def run(inputs, scalars):
            raise RuntimeError("graph too large")
        return run
    monkeypatch.setattr(graph, "build", broken)
    x = torch.arange(6.0).to("tpu")
    y = x * 3.5 + 0.25   # a graph key no other test makes
    z = y.exp()
    with pytest.warns(UserWarning, match="failed .*graph too large.*one by one"):
        torch.testing.assert_close(z.cpu(), (torch.arange(6.0) * 3.5 + 0.25).exp())
    torch.testing.assert_close(y.cpu(), torch.arange(6.0) * 3.5 + 0.25)
    assert metrics.snapshot()["fused_fallbacks"] == 1


def test_failed_op_in_graph_marks_only_its_results_lost(fused, monkeypatch):
    from torchtpu.modes import graph

    def broken(nodes, live_refs, donate=None, when="first call"):
        def run(inputs, scalars):
            raise RuntimeError("graph failed")
        return run
    def failing_mul(kernel, args):
        if "mul" in kernel.name:
            raise RuntimeError("op failed")
        return kernel.jitted(*args)
    monkeypatch.setattr(graph, "build", broken)
    monkeypatch.setattr(graph, "call_jitted", failing_mul)
    x = torch.arange(4.0).to("tpu")
    a = x + 1.5
    b = a * 2.5
    with pytest.warns(UserWarning, match="one by one"), pytest.raises(RuntimeError, match="op failed"):
        b.cpu()
    torch.testing.assert_close(a.cpu(), torch.arange(4.0) + 1.5)   # computed before the failure
    with pytest.raises(RuntimeError, match="has no value"):
        b.cpu()
    with pytest.raises(RuntimeError, match="has no value"):
        b + 1
    monkeypatch.undo()
    # Later graphs are unaffected.
    torch.testing.assert_close((a * 2).cpu(), (torch.arange(4.0) + 1.5) * 2)


def test_equal_and_allclose_read_one_value(fused):
    a = torch.tensor([1.0, 2.0, float("nan")])
    b = a.clone()
    ta, tb = a.to("tpu"), b.to("tpu")
    results = [torch.equal(ta * 1, tb),   # nan != nan
               torch.allclose(ta, tb, equal_nan=True),
               torch.equal(ta[:2], tb[:2]),
               torch.equal(ta, tb[:2])]   # shapes differ: no op runs
    assert flushes() == {"item": 3}
    assert results == [torch.equal(a * 1, b), torch.allclose(a, b, equal_nan=True),
                       torch.equal(a[:2], b[:2]), torch.equal(a, b[:2])] == [False, True, True, False]
    assert metrics.snapshot()["cpu_fallbacks"] == {}
    with pytest.raises(RuntimeError, match="did not match"):
        torch.allclose(ta, torch.ones(3, dtype=torch.long, device="tpu"))


@pytest.mark.parametrize("op", ["__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"])
def test_augmented_bitwise_assignment_records(fused, op):
    # x |= m must not read values back (no flush) and matches CPU.
    x, m = torch.tensor([5, 6, 7]), torch.tensor([3, 1, 2])
    tx, tm = x.to("tpu"), m.to("tpu")
    getattr(tx, op)(tm)
    getattr(tx, op)(1)
    assert flushes() == {}
    getattr(x, op)(m)
    getattr(x, op)(1)
    assert torch.equal(tx.cpu(), x)


def test_linalg_error_check_reads_info(fused):
    # linalg.inv's LAPACK info is read back (a sync, as on CUDA), not run on CPU.
    a = torch.eye(3, device="tpu") * 2
    torch.testing.assert_close(torch.linalg.inv(a).cpu(), torch.eye(3) / 2)
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        torch.linalg.inv(torch.zeros(3, 3, device="tpu"))
    assert flushes() == {"linalg_check": 2}
    assert metrics.snapshot()["cpu_fallbacks"] == {}


def donated():
    return metrics.snapshot()["donated_inputs"]


def test_overwritten_inputs_are_donated(fused):
    # An in-place update whose old value no tensor holds any more: the
    # graph gets that buffer (XLA updates it in place); views see the update.
    x = torch.arange(4.0).to("tpu")
    v = x.view(2, 2)
    torchtpu.sync()
    before = donated()
    x.mul_(2).add_(1)
    torchtpu.sync()
    assert donated() == before + 1
    torch.testing.assert_close(x.cpu(), torch.arange(4.0) * 2 + 1)
    torch.testing.assert_close(v.cpu(), (torch.arange(4.0) * 2 + 1).view(2, 2))


def test_inputs_still_held_are_not_donated(fused):
    x = torch.arange(4.0).to("tpu")
    torchtpu.sync()
    before = donated()
    y = x * 2          # x keeps its value: its buffer is not the graph's to reuse
    z = x.clone()
    z.add_(1)
    torchtpu.sync()
    assert donated() == before
    torch.testing.assert_close(x.cpu(), torch.arange(4.0))
    torch.testing.assert_close(y.cpu(), torch.arange(4.0) * 2)
    torch.testing.assert_close(z.cpu(), torch.arange(4.0) + 1)


def test_donated_buffer_goes_to_the_value_that_replaced_it(fused):
    # g has w's shape and is recorded first; w's old buffer must still go to
    # w's new value (updated in place), not to g (which would make XLA copy w).
    w_cpu = torch.randn(64, 64)
    # An op's result: on the CPU platform an upload's array is the host copy
    # itself, which XLA cannot take over (it copies a donated upload once).
    w = w_cpu.to("tpu") * 1
    torchtpu.sync()
    old = w._storage.array.unsafe_buffer_pointer()
    g = w * 2
    w.sub_(g * 0.1)
    torchtpu.sync()
    assert w._storage.array.unsafe_buffer_pointer() == old
    assert g._storage.array.unsafe_buffer_pointer() != old
    torch.testing.assert_close(w.cpu(), w_cpu - w_cpu * 2 * 0.1)
    torch.testing.assert_close(g.cpu(), w_cpu * 2)


def test_training_step_donates_parameters_and_state(fused):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(16, 8).to("tpu")
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        before = donated()
        torchtpu.sync()
    # weight and bias, their exp_avg and exp_avg_sq
    assert donated() - before == 6


def _deep_stack_steps(device, steps, checkpointed=False):
    """A stack of 60 Linear+Tanh blocks (a forward of over 100 ops) trained
    with Adam: losses, final weights, and whether each loss was still
    pending when its backward pass had run."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                 for _ in range(60)).to(device)
    opt = torch.optim.Adam(blocks.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g).to(device), torch.randn(4, 8, generator=g).to(device)
    losses, pending_after = [], []
    for _ in range(steps):
        h = x
        for i, block in enumerate(blocks):
            h = checkpoint(block, h, use_reentrant=False) if checkpointed and i % 2 else block(h)
        loss = F.mse_loss(h, y)
        opt.zero_grad()
        loss.backward()
        if device != "cpu":
            pending_after.append(pending(loss))
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses), [p.detach().cpu() for p in blocks.parameters()], pending_after


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_long_forward_is_flushed_when_its_backward_starts(fused, monkeypatch, checkpointed):
    """A forward of over FORWARD_FLUSH_OPS ops runs as its own graph while
    the backward is recorded: flushed at the backward's first op, the same
    graphs every step, and CPU's losses and weights."""
    from torchtpu.modes.fused import STATS
    monkeypatch.setenv("TORCHTPU_FUSED_COMPILE", "sync")
    losses, params, pending_after = _deep_stack_steps("tpu", 6, checkpointed)
    assert STATS.flushes.get("backward") == 6, STATS.flushes
    assert pending_after == [False] * 6  # (each loss was in its forward's graph)
    compiled = STATS.graphs_compiled
    more, _, _ = _deep_stack_steps("tpu", 6, checkpointed)
    assert STATS.graphs_compiled == compiled  # (the same graphs: nothing new compiles)
    ref_losses, ref_params, _ = _deep_stack_steps("cpu", 6, checkpointed)
    torch.testing.assert_close(losses, ref_losses)
    torch.testing.assert_close(more, ref_losses)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b)


def _gradient_penalty_steps(device, steps):
    """A critic of 25 residual blocks (a forward of over 100 ops) trained
    with a WGAN-GP gradient penalty: autograd.grad with create_graph, then
    a backward pass through that gradient; losses and final weights."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(25))
    head = torch.nn.Linear(16, 1)
    critic = torch.nn.ModuleList([blocks, head]).to(device)

    def score(x):
        for lin in blocks:
            x = x + 0.3 * torch.tanh(lin(x))
        return head(x)
    opt = torch.optim.SGD(critic.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        real, fake = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 16, generator=g).to(device)
        alpha = torch.rand(8, 1, generator=g).to(device)
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        (grads,) = torch.autograd.grad(score(mixed).sum(), mixed, create_graph=True)
        penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean()
        loss = score(fake).mean() - score(real).mean() + 10 * penalty
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses), [p.detach().cpu() for p in critic.parameters()]


def test_a_gradient_penalty_over_a_long_forward_trains_as_cpu(fused, monkeypatch):
    """Both backward passes of a step (the penalty's, under create_graph, and
    the loss's through it) start after a long forward and flush it first;
    the losses and weights are CPU's."""
    from torchtpu.modes.fused import STATS
    monkeypatch.setenv("TORCHTPU_FUSED_COMPILE", "sync")
    losses, params = _gradient_penalty_steps("tpu", 4)
    assert STATS.flushes.get("backward") == 8, STATS.flushes
    ref_losses, ref_params = _gradient_penalty_steps("cpu", 4)
    torch.testing.assert_close(losses, ref_losses)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b)


def test_a_new_kernel_is_traced_once_without_a_disk_cache(fused):
    # (The suite runs with TORCHTPU_CACHE_DIR=off.) A new op's kernel is
    # traced as it is recorded (for its result's shape); running a graph
    # met for the first time op by op compiles each kernel from that trace,
    # not tracing it again.
    from jax import monitoring
    from torchtpu import cache
    assert cache._disk() is None
    traced = []
    trace_event = "/jax/core/compile/jaxpr_trace_duration"
    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: traced.append(str(kw.get("fun_name"))) if event == trace_event else None)
    x = torch.randn(7, 13)
    y = x.to("tpu")
    for _ in range(40):  # a graph of 120 ops: met the first time, it runs op by op
        y = torch.special.erfcx(y * 0.37) + 2.5
    assert pending(y)
    assert len(traced) >= 3, traced  # the new kernels, traced as recorded
    compiled_before = metrics.snapshot()["compilations"]
    del traced[:]
    got = y.cpu()
    assert metrics.snapshot()["compilations"] - compiled_before >= 3  # its kernels
    assert not [name for name in traced if "aten" in name], traced
    want = x
    for _ in range(40):
        want = torch.special.erfcx(want * 0.37) + 2.5
    torch.testing.assert_close(got, want)


def _small_graph(t):
    return (torch.special.i0e(t * 0.41) - 0.75).cumprod(1)


@pytest.mark.parametrize("kernels_compiled", [False, True])
def test_a_small_graph_waits_for_xla_only_if_its_kernels_would(fused, kernels_compiled):
    # A graph under TORCHTPU_FUSED_BACKGROUND_OPS ops compiles at once when
    # its ops' kernels are new (faster than compiling those); when they are
    # all compiled, it is tiered as a large graph is: op by op when met
    # first, compiled in the background when met again, fused once ready.
    from torchtpu.modes.fused import STATS
    x = torch.randn(9, 23 + kernels_compiled)  # (shapes of its own per case)
    want = _small_graph(x)
    if kernels_compiled:
        with torchtpu.eager_mode("strict"):
            torch.testing.assert_close(_small_graph(x.to("tpu")).cpu(), want)
    compiled, first_met, hits = STATS.graphs_compiled, STATS.run_first_met, STATS.graph_cache_hits
    for i in range(4):  # (one line: fused mode tells graphs met again by their line)
        torch.testing.assert_close(_small_graph(x.to("tpu")).cpu(), want)
        if i == 0:
            assert (STATS.graphs_compiled - compiled, STATS.run_first_met - first_met) == (
                (0, 1) if kernels_compiled else (1, 0))
        if i == 1:
            torchtpu.wait_for_compiles()
    assert STATS.graphs_compiled - compiled == 1
    assert STATS.graph_cache_hits - hits >= 2


def test_graph_scalars_travel_packed_and_promote_as_python_scalars():
    """A compiled graph takes its Python float and int scalars as one array of
    each (a transfer per kind, not per scalar), and inside they promote as
    the Python scalars do: a bfloat16 tensor times a float stays bfloat16."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from torchtpu.modes.graph import ScalarPacking
    scalars = [0.5, 3, True, 2.5, -7]
    packing = ScalarPacking(scalars)
    packed = packing.pack(scalars)
    assert [a.dtype for a in packed[:2]] == [np.float64, np.int64]
    assert [len(a) for a in packed[:2]] == [2, 2] and packed[2] == (True,)
    for dtype in (jnp.bfloat16, jnp.float32, jnp.int32):
        x = jnp.arange(3).astype(dtype)
        got = jax.jit(lambda x, packed: [x * s for s in packing.unpack(packed)])(x, packed)
        want = jax.jit(lambda x, scalars: [x * s for s in scalars])(x, scalars)
        assert [g.dtype for g in got] == [w.dtype for w in want]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(w, np.float64))
