"""Out-of-range indices raise in every mode, as on CPU: debug mode at the op's
line, strict and fused mode at the next sync point, naming the op and the
line; what the bad op produced is lost; the next step works."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu import bounds
from conftest import assert_same, platform_tol

def _approx():
    """pytest.approx's tolerance for a loss compared with CPU's (rel 1e-5;
    on a TPU its exp and log's measured error on top: conftest.platform_tol)."""
    return {"rel": platform_tol(1e-5, 0)["rtol"]}


def _ones(i):
    return torch.ones(i.shape, device=i.device)


# (name, fn(x, i) -> the tensor the op produced or wrote, the op named in the
# message, whether negative indices count from the end). x is arange(5.0).
# Each fn is on one line: the message must name that line.
CASES = [
    ("index", lambda x, i: x[i], "aten.index.Tensor", True),
    ("index_dim1", lambda x, i: x.view(1, 5)[:, i], "aten.index.Tensor", True),
    ("setitem", lambda x, i: (x.__setitem__(i, -1.0), x)[1], "aten.index_put_", True),
    ("index_put_acc", lambda x, i: x.index_put_((i,), torch.tensor(2.0), accumulate=True), "aten.index_put_", True),
    ("index_select", lambda x, i: x.index_select(0, i), "aten.index_select", False),
    ("gather", lambda x, i: x.gather(0, i), "aten.gather", False),
    ("scatter", lambda x, i: x.scatter(0, i, 9.0), "aten.scatter.value", False),
    ("scatter_", lambda x, i: x.scatter_(0, i, _ones(i) * 7), "aten.scatter_.src", False),
    ("scatter_add", lambda x, i: x.scatter_add(0, i, _ones(i)), "aten.scatter_add", False),
    ("scatter_reduce", lambda x, i: x.scatter_reduce(0, i, _ones(i) * 9, "amax"), "aten.scatter_reduce.two", False),
    ("index_add", lambda x, i: x.index_add(0, i, _ones(i)), "aten.index_add", False),
    ("index_copy_", lambda x, i: x.index_copy_(0, i, _ones(i) * 3), "aten.index_copy_", False),
    ("index_fill", lambda x, i: x.index_fill(0, i, -2.0), "aten.index_fill.int_Scalar", True),
    ("index_reduce", lambda x, i: x.index_reduce(0, i, _ones(i) * 2, "prod"), "aten.index_reduce", False),
    ("embedding", lambda x, i: F.embedding(i, x.view(5, 1)), "aten.embedding", False),
    ("embedding_bag", lambda x, i: F.embedding_bag(i.view(1, -1), x.view(5, 1)), "aten._embedding_bag_forward_only", False),
    ("take", lambda x, i: x.take(i), "aten.take", True),
    ("put_", lambda x, i: x.put_(i, _ones(i) * 4), "aten.put_", True),
    ("nll_loss", lambda x, i: F.nll_loss(x.expand(i.numel(), 5), i, reduction="none"), "aten.nll_loss_forward", False),
]
IDS = [c[0] for c in CASES]
GOOD = [4, 0, 2]


def _cpu(fn, i):
    """fn on CPU: (exception type, the written/produced tensor or None)."""
    x = torch.arange(5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # index_reduce is in beta
        try:
            return None, fn(x, torch.tensor(i))
        except (IndexError, RuntimeError) as e:
            return type(e), x


def _bad_cases():
    for name, fn, op, negative in CASES:
        yield pytest.param(fn, op, [1, 7], id=f"{name}-too_large")
        yield pytest.param(fn, op, [-6] if negative else [-1], id=f"{name}-negative")


def _line(fn):
    return f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno}"


@pytest.mark.parametrize("fn,op,bad", list(_bad_cases()))
def test_out_of_range_raises(mode, fn, op, bad):
    cpu_type, _ = _cpu(fn, bad)
    assert cpu_type is not None, "CPU raises for this index"
    x = torch.arange(5.0).to("tpu")
    i = torch.tensor(bad).to("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "debug":
            # At the op's line, before it runs: what it would write is left
            # as it was (CPU may have written the in-range elements first).
            with pytest.raises(cpu_type) as err:
                fn(x, i)
            assert_same(x, torch.arange(5.0))
        else:
            out = fn(x, i)
            with pytest.raises(cpu_type) as err:
                out.cpu()  # the next sync point
            with pytest.raises(RuntimeError, match="this tensor has no value") as lost:
                out.cpu()
            assert type(err.value).__name__ in str(lost.value)
        assert f"({op} at {_line(fn)})" in str(err.value)
        # The next call, with indices in range, works and matches CPU.
        assert_same(fn(torch.arange(5.0).to("tpu"), torch.tensor(GOOD).to("tpu")),
                    _cpu(fn, GOOD)[1])


@pytest.mark.parametrize("name,fn", [(c[0], c[1]) for c in CASES if c[3]],
                         ids=[c[0] for c in CASES if c[3]])
def test_negative_in_range(mode, name, fn):
    i = [-1, -5, 2]
    assert_same(fn(torch.arange(5.0).to("tpu"), torch.tensor(i).to("tpu")), _cpu(fn, i)[1])


def test_message_wording(mode):
    x = torch.zeros(2, 3).to("tpu")
    for fn, exc, text in (
            (lambda: x[:, torch.tensor([0, 3])], IndexError,
             "index 3 is out of bounds for dimension 1 with size 3"),
            (lambda: x[torch.tensor([-3])], IndexError,
             "index -3 is out of bounds for dimension 0 with size 2"),
            (lambda: x.take(torch.tensor([6]).to("tpu")), IndexError,
             "out of range: tried to access index 6 on a tensor of 6 elements."),
            (lambda: F.embedding_bag(torch.tensor([[0, 1, 1, 9]]).to("tpu"), x), RuntimeError,
             "Index 3 of input takes value 9 which is not in the valid range [0, 2)")):
        with pytest.raises(exc) as err:
            fn()
            torchtpu.sync()
        assert f"torchtpu: {text} (" in str(err.value)


def test_first_of_several_index_tensors(mode):
    # x[i, j]: the first out-of-range index names its own dim.
    x = torch.zeros(4, 3).to("tpu")
    i, j = torch.tensor([0, 1]).to("tpu"), torch.tensor([5, 1]).to("tpu")
    with pytest.raises(IndexError, match="index 5 is out of bounds for dimension 1 with size 3"):
        x[i, j]
        torchtpu.sync()


@pytest.mark.parametrize("sync", ["item", "print", "torchtpu.sync", "torch.tpu.synchronize",
                                  "tolist"])
def test_raised_at_each_sync_point(mode, sync, capsys):
    if mode == "debug":
        pytest.skip("debug mode raises at the op (test_out_of_range_raises)")
    x = torch.arange(5.0).to("tpu")
    y = x.gather(0, torch.tensor([9]).to("tpu")).sum()
    with pytest.raises(RuntimeError, match="index 9 is out of bounds"):
        {"item": lambda: y.item(), "print": lambda: print(y),
         "torchtpu.sync": torchtpu.sync, "torch.tpu.synchronize": torch.tpu.synchronize,
         "tolist": lambda: y.tolist()}[sync]()
    with pytest.raises(RuntimeError, match="no value"):
        y.item()


def test_only_dependents_are_lost(mode):
    if mode == "debug":
        pytest.skip("debug mode raises at the op, before anything depends on it")
    x = torch.arange(5.0).to("tpu")
    before = x * 2
    bad = x[torch.tensor([7]).to("tpu")]
    derived = bad + before   # depends on the bad op
    view = bad.view(1)       # shares its storage
    after = before + 1       # does not
    with pytest.raises(IndexError):
        torchtpu.sync()
    for t in (bad, derived, view):
        with pytest.raises(RuntimeError, match="no value"):
            t.cpu()
    assert_same(after, torch.arange(5.0) * 2 + 1)
    assert_same(before, torch.arange(5.0) * 2)
    assert_same(x, torch.arange(5.0))


def test_two_bad_ops_first_raised_both_lost(mode):
    if mode == "debug":
        pytest.skip("debug mode raises at the first op")
    x = torch.arange(5.0).to("tpu")
    a = x.index_select(0, torch.tensor([5]).to("tpu"))
    good = x.take(torch.tensor([1]).to("tpu"))
    b = x.gather(0, torch.tensor([6]).to("tpu"))
    with pytest.raises(IndexError, match="index 5 is out of bounds"):
        torchtpu.sync()
    # Only the first bad value is known: what the ops checked after it made
    # is lost with that error too.
    for t in (a, good, b):
        with pytest.raises(RuntimeError, match="IndexError: index 5 is out of bounds"):
            t.cpu()
    torchtpu.sync()  # nothing left to raise


def test_one_bad_op_keeps_later_good_ones(mode):
    if mode == "debug":
        pytest.skip("debug mode raises at the op")
    x = torch.arange(5.0).to("tpu")
    a = x.index_select(0, torch.tensor([5]).to("tpu"))
    good = x.take(torch.tensor([1, -1]).to("tpu"))
    with pytest.raises(IndexError, match="index 5 is out of bounds"):
        torchtpu.sync()
    with pytest.raises(RuntimeError, match="no value"):
        a.cpu()
    assert_same(good, torch.arange(5.0).take(torch.tensor([1, -1])))


def test_cpu_index_tensor(mode):
    x = torch.arange(5.0).to("tpu")
    with pytest.raises(IndexError, match="index 8 is out of bounds"):
        x[torch.tensor([8])]
        torchtpu.sync()
    assert_same(x[torch.tensor([3, -1])], torch.arange(5.0)[torch.tensor([3, -1])])


def test_mode_switch_raises_and_switches():
    with torchtpu.eager_mode("strict"):
        x = torch.arange(5.0).to("tpu").take(torch.tensor([5]).to("tpu"))
        with pytest.raises(IndexError, match="aten.take"):
            torchtpu.set_eager_mode("debug")
        assert torchtpu.get_eager_mode() == "debug"
        with pytest.raises(RuntimeError, match="no value"):
            x.cpu()


@pytest.mark.parametrize("eager", ["strict", "fused"])
def test_unread_flags_are_bounded(monkeypatch, eager):
    # A loop that never syncs reads its flags every MAX_UNREAD checked ops
    # (fused mode: their flag is pending in the graph, which runs there).
    monkeypatch.setattr(bounds, "MAX_UNREAD", 3)
    with torchtpu.eager_mode(eager):
        x = torch.arange(5.0).to("tpu")
        x.index_select(0, torch.tensor([9]).to("tpu"))
        x.index_select(0, torch.tensor([0]).to("tpu"))
        with pytest.raises(IndexError, match="index 9 is out of bounds"):
            x.index_select(0, torch.tensor([1]).to("tpu"))
        assert not bounds.unread


def test_embedding_dense_backward_checks_rows(mode):
    # CPU's kernel skips an out-of-range row here (its forward raised first);
    # on tpu the scatter would drop it silently, so it raises too.
    grad = torch.ones(2, 3).to("tpu")
    with pytest.raises(IndexError, match=r"index 5 is out of bounds .*aten.embedding_dense_backward"):
        torch.ops.aten.embedding_dense_backward(grad, torch.tensor([1, 5]).to("tpu"), 5, -1, False)
        torchtpu.sync()


def _model(blocks=0):
    torch.manual_seed(0)
    # blocks: Linear+Tanh pairs; 60 make a forward of over 100 ops, which
    # fused mode flushes when the backward starts, before the step's read.
    middle = [m for _ in range(blocks) for m in (torch.nn.Linear(4, 4), torch.nn.Tanh())]
    return torch.nn.Sequential(torch.nn.Embedding(10, 4), *middle, torch.nn.Linear(4, 3))


def _step(model, opt, tokens, target):
    opt.zero_grad()
    loss = F.cross_entropy(model(tokens), target)
    loss.backward()
    opt.step()
    return loss.item()


@pytest.mark.parametrize("blocks", [0, 60], ids=["short", "long-forward"])
def test_training_step_with_bad_token(mode, blocks):
    """A step given an out-of-range token raises (debug: at the embedding;
    else: at loss.item()); parameters it updated are lost, restored from a
    checkpoint, and the next steps train as on CPU."""
    cpu = _model(blocks)
    checkpoint = {k: v.clone() for k, v in cpu.state_dict().items()}
    model = _model(blocks).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens, target = torch.tensor([1, 12]), torch.tensor([0, 2])
    with pytest.raises(IndexError) as err:
        _step(model, opt, tokens.to("tpu"), target.to("tpu"))
    assert "index 12 is out of bounds for dimension 0 with size 10 (aten.embedding at" in str(err.value)
    assert f"{__file__}:" in str(err.value)
    if mode != "debug":
        with pytest.raises(RuntimeError, match="no value"):
            model[0].weight.cpu()  # the optimizer wrote it from the bad step's gradients
    model.load_state_dict(checkpoint)
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.5)
    good = torch.tensor([1, 9])
    for _ in range(2):
        loss = _step(model, opt, good.to("tpu"), target.to("tpu"))
        cpu_loss = _step(cpu, cpu_opt, good, target)
        assert loss == pytest.approx(cpu_loss, **_approx())
    for p, q in zip(model.parameters(), cpu.parameters()):
        assert_same(p, q, **platform_tol(1e-5, 1e-6))


def test_eval_with_bad_token_then_good(mode):
    model = _model()
    dev = _model().to("tpu")
    with torch.no_grad():
        with pytest.raises(IndexError, match="aten.embedding"):
            print(dev(torch.tensor([[10]]).to("tpu")))
        assert_same(dev(torch.tensor([[9, 0]]).to("tpu")), model(torch.tensor([[9, 0]])))
    for p, q in zip(dev.parameters(), model.parameters()):
        assert_same(p, q)  # a forward pass writes nothing: nothing lost


def test_in_backward(mode):
    # An index op inside backward (gather's backward scatters; index's
    # backward puts) with indices in range: values as on CPU.
    x = torch.randn(4, 3)
    idx = torch.tensor([[0, 2, 1], [3, 3, 0]])
    xt = x.to("tpu").requires_grad_()
    xc = x.clone().requires_grad_()
    (xt.gather(0, idx.to("tpu")) * 2).sum().backward()
    (xc.gather(0, idx) * 2).sum().backward()
    assert_same(xt.grad, xc.grad)


def test_switch_off_builds_unchecked_kernels():
    # The benchmark's switch: kernels built without it flag nothing.
    with torchtpu.eager_mode("strict"):
        try:
            bounds.set_enabled(False)
            y = torch.arange(5.0).to("tpu")[torch.tensor([7]).to("tpu")]
            assert not bounds.unread
            y.cpu()
        finally:
            bounds.set_enabled(True)
        with pytest.raises(IndexError):
            torch.arange(5.0).to("tpu")[torch.tensor([7]).to("tpu")].cpu()


class _ReadInBackward(torch.autograd.Function):
    """Identity whose backward reads a value (a sync point inside backward)."""
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        g.sum().item()
        return g


def test_sync_inside_backward_raises_from_backward(mode):
    if mode == "debug":
        pytest.skip("debug mode raises at the forward op")
    w = torch.randn(5, 2).to("tpu").requires_grad_()
    out = _ReadInBackward.apply(F.embedding(torch.tensor([7]).to("tpu"), w))
    with pytest.raises(IndexError, match="index 7 is out of bounds .*aten.embedding"):
        out.sum().backward()
    assert w.grad is None
    cpu_w = w.detach().cpu().requires_grad_()
    F.embedding(torch.tensor([4]), cpu_w).sum().backward()
    F.embedding(torch.tensor([4]).to("tpu"), w).sum().backward()
    assert_same(w.grad, cpu_w.grad)


def test_a_failed_check_passes_over_a_dead_weak_proxy(mode):
    """A failed check finds what it marks lost among all live objects; a
    dead weakref.proxy among them (any use of it raises ReferenceError) is
    passed over, and the IndexError is what the user gets."""
    import weakref

    class Thing:
        pass
    thing = Thing()
    proxy = weakref.proxy(thing)
    del thing
    x = torch.arange(5.0).to("tpu")
    with pytest.raises(IndexError, match="index 9 is out of bounds"):
        x.index_select(0, torch.tensor([9]).to("tpu")).cpu()
    with pytest.raises(ReferenceError):
        proxy.anything  # (the proxy is dead)


def test_fused_loss_read_waits_for_its_own_checks_only():
    """Fused mode: a loss read after the optimizer step has its own index
    checks read (those of the forward, whose graph ran when the backward
    began), not the later ones: the step's backward still runs on the device
    while the host goes on. A bad index after the loss raises at the next
    sync point, naming its line, and what it produced is lost."""
    with torchtpu.eager_mode("fused"):
        cpu = _model(60)
        model = _model(60).to("tpu")
        opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (cpu, model)]
        tokens, target = torch.tensor([1, 9]), torch.tensor([0, 2])
        for _ in range(2):
            loss = _step(model, opts[1], tokens.to("tpu"), target.to("tpu"))
            assert bounds.unread  # the backward's checks: not read by the loss read
            assert loss == pytest.approx(_step(cpu, opts[0], tokens, target), **_approx())
        opts[1].zero_grad()
        loss = F.cross_entropy(model(tokens.to("tpu")), target.to("tpu"))
        loss.backward()
        opts[1].step()
        late = model[0].weight.sum(1)[torch.tensor([11]).to("tpu")]  # out of range, after the loss
        opts[0].zero_grad()
        want = F.cross_entropy(cpu(tokens), target)
        assert loss.item() == pytest.approx(want.item(), **_approx())
        with pytest.raises(IndexError, match=r"index 11 is out of bounds .*aten.index.Tensor at .*test_index_bounds.py:"):
            torchtpu.sync()
        with pytest.raises(RuntimeError, match="no value"):
            late.cpu()
        want.backward()
        opts[0].step()
        for p, q in zip(model.parameters(), cpu.parameters()):
            assert_same(p, q, **platform_tol(1e-5, 1e-6))


def test_fused_graph_failing_before_its_check_leaves_later_checks_working():
    """A fused graph that fails (here: out of memory) before its indexing op
    ran raises at its flush, and loses its index-check flag with its other
    results. The flag goes back to the one before that graph: a later index
    op and its read give CPU's value, and later syncs raise nothing."""
    with torchtpu.eager_mode("fused"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the graph's op-by-op retry)
        x = torch.arange(5.0).to("tpu")
        i = torch.tensor([1]).to("tpu")
        huge = torch.ones(2 ** 36, device="tpu")  # noqa: F841  (fails when the graph runs)
        y = x[i]
        with pytest.raises(torch.OutOfMemoryError):
            y.item()
        z = x[torch.tensor([2, -1]).to("tpu")] * 2
        assert_same(z, torch.arange(5.0)[torch.tensor([2, -1])] * 2)
        torchtpu.sync()
        with pytest.raises(RuntimeError, match="no value"):
            y.cpu()
        bad = x[torch.tensor([9]).to("tpu")]
        with pytest.raises(IndexError, match="index 9 is out of bounds"):
            torchtpu.sync()
        with pytest.raises(RuntimeError, match="no value"):
            bad.cpu()
