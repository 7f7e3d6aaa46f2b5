"""Slices of rows whose count varies from step to step
(torchtpu.dispatch.lengths): ops on them run on rows padded to a bucket,
with CPU's values, and compile once per bucket, not once per length."""
import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu.tensor import GrownStorage, Storage

from conftest import assert_same

nn = torch.nn


def _compilations():
    s = torchtpu.metrics.snapshot()
    return s["compilations"] + s.get("graphs_compiled", 0)


def _ops(x, ix, w, emb):
    """Ops with rules for padded rows, then some without (read exact)."""
    n = x.shape[0]
    y = (x * 2 + 1).relu()
    z = y @ w
    e = F.embedding(ix, emb)
    ruled = [y, z, y.t() @ x, torch.addmm(w[0], y, w), z.sum(0), z.sum(1), y.sum(),
             z.log_softmax(1), z.softmax(-1), torch.where(x > 0, x, w[:, 0]),
             e.reshape(-1, 4).sum(0), e.reshape(n, -1), e.transpose(0, 1), e[:, 1] * 3,
             x.mean(0), y.mean(), z.mean(1, keepdim=True), y.double() + 1, torch.cat([y, z], 1)]
    exact = [x.cumsum(0), x[:-1] - x[1:], z.max(0).values, x.flip(0), torch.cat([y, z])]
    return ruled, exact


def test_ops_on_slices_of_varying_length_equal_cpu(mode):
    # A width of each mode's own: no kernel met in another mode's run.
    width = {"debug": 5, "strict": 6, "fused": 7}[mode]
    data, idx = torch.randn(200, width), torch.randint(0, 10, (200, 3))
    w, emb = torch.randn(width, width), torch.randn(10, 4)
    dt, it, wt, et = data.to("tpu"), idx.to("tpu"), w.to("tpu"), emb.to("tpu")
    for i, n in enumerate([9, 13, 11, 16, 10]):  # after the first: padded to 16
        rows = slice(3 * i, 3 * i + n)
        (ruled, exact), (cpu_ruled, cpu_exact) = _ops(dt[rows], it[rows], wt, et), _ops(
            data[rows], idx[rows], w, emb)
        assert_same(ruled, cpu_ruled)
        assert_same(exact, cpu_exact)
        if i > 0:
            assert type(ruled[0]._storage) is GrownStorage
            assert ruled[0]._storage.grown.shape[0] == 16


def _train(device, lengths, model, loss_fn, batch=4, vocab=50, uploaded=False):
    """SGD on batches sliced at a moving offset, of lengths from lengths (of
    data on the device, or uploaded: sliced on the host, their length marked
    dynamic (uploaded="marked") or not, then moved); returns losses,
    compilations per step and the final parameters."""
    torch.manual_seed(0)
    model = model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = torch.randint(0, vocab, (600, batch), generator=torch.Generator().manual_seed(0))
    if not uploaded:
        # Each test's own batch width: this line moves datasets of several
        # widths, which are no length that varies.
        torch._dynamo.mark_static(data, 1)
        data = data.to(device)
    losses, compiled, i = [], [], 0
    for n in lengths:
        before = _compilations()
        x, y = data[i:i + n], data[i + 1:i + 1 + n].reshape(-1)
        if uploaded == "marked":
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(y, 0)
        if uploaded:
            x, y = x.to(device), y.to(device)
        loss = loss_fn(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if device != "cpu":
            torchtpu.wait_for_compiles()
        compiled.append(_compilations() - before)
        i += n
    return losses, compiled, [p.detach().cpu() for p in model.parameters()]


class _Tagger(nn.Module):
    def __init__(self, vocab=50):
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, 8), nn.Linear(8, vocab)

    def forward(self, x):
        return self.out(torch.tanh(self.emb(x)))


def _tagger_loss(model, x, y):
    weight = torch.linspace(0.5, 1.5, 50, device=x.device)
    return F.cross_entropy(model(x).reshape(-1, 50), y, weight=weight, ignore_index=3)


WARM = [17, 30, 25, 28]  # the first length exact, then padded to 32
# A batch of each mode's own: the first length is noted where a kernel is
# missing, and another mode's run would have compiled those already.
BATCH = {"debug": 4, "strict": 5, "fused": 6}


def test_training_on_varying_lengths_equals_cpu_and_compiles_per_bucket(mode):
    lengths = WARM + [31, 20, 29, 22, 19, 32]
    cpu_losses, _, cpu_params = _train("cpu", lengths, _Tagger, _tagger_loss, batch=BATCH[mode])
    losses, compiled, params = _train("tpu", lengths, _Tagger, _tagger_loss, batch=BATCH[mode])
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    assert_same(params, cpu_params)
    assert compiled[len(WARM):] == [0] * (len(lengths) - len(WARM)), compiled


def test_batches_uploaded_with_their_length_marked_dynamic_compile_per_bucket(mode):
    # Token ids and targets sliced on the host, each step at a new length,
    # marked dynamic (as for torch.compile), then moved: uploaded padded.
    lengths = WARM + [31, 20, 29, 22, 19, 32]
    cpu_losses, _, cpu_params = _train("cpu", lengths, _Tagger, _tagger_loss, uploaded="marked")
    losses, compiled, params = _train("tpu", lengths, _Tagger, _tagger_loss, uploaded="marked")
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    assert_same(params, cpu_params)
    assert compiled[len(WARM):] == [0] * (len(lengths) - len(WARM)), compiled


@pytest.fixture
def no_compiled_graphs(monkeypatch):
    """A process where torch.compile has made no graph (an earlier test's
    would leave uploads' lengths to Dynamo, as in a program that compiles)."""
    from torch._dynamo.utils import counters
    monkeypatch.setitem(counters["stats"], "unique_graphs", 0)


def test_batches_uploaded_unmarked_compile_per_bucket_from_their_third_length(mode, no_compiled_graphs):
    # The same batches moved as they are: from the third length met at
    # that line on, the length is found varying and padded, as if marked.
    lengths = WARM + [31, 20, 29, 22, 19, 32]
    cpu_losses, _, cpu_params = _train("cpu", lengths, _Tagger, _tagger_loss, uploaded="as they are")
    losses, compiled, params = _train("tpu", lengths, _Tagger, _tagger_loss, uploaded="as they are")
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    assert_same(params, cpu_params)
    assert compiled[len(WARM):] == [0] * (len(lengths) - len(WARM)), compiled


def test_a_varying_length_is_found_at_its_third_size_in_as_many_steps_never_in_a_modules_tensors(
        no_compiled_graphs):
    w = torch.zeros(3, device="tpu", requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    kinds = []
    for i, n in enumerate([5, 9, 7, 6, 16, 10, 12]):
        if i == 5:  # once torch.compile has made a graph, the lengths are Dynamo's to find
            torch._dynamo.utils.counters["stats"]["unique_graphs"] += 1
        src = torch.arange(n * 3.0).reshape(n, 3) - 4
        t = src.to("tpu")  # (one line: a batch whose length varies from step to step)
        kinds.append(type(t._storage) is GrownStorage)
        assert_same([t, t.sum(0), t * 2, t[-1], t.t() @ t], [src, src.sum(0), src * 2, src[-1], src.t() @ src])
        (t * w).sum().backward()
        opt.step()
    assert kinds == [False, False, True, True, True, False, False]
    # Sizes moved by one line within a step (a helper), or a dataset in two
    # sizes (train, test): as they are.
    moved = [torch.randn(n, 3).to("tpu") for n in (5, 9, 7, 6, 11)]
    moved += [d.to("tpu") for d in (torch.randn(40, 3), torch.randn(24, 3))]
    assert [type(d._storage) for d in moved] == [Storage] * 7
    # A module's tensors differ in shape from one .to() line: none is padded.
    for _ in range(2):
        model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 7), nn.BatchNorm1d(7),
                              nn.Linear(7, 9), nn.BatchNorm1d(9)).to("tpu")
        tensors = [*model.parameters(), *model.buffers()]
        assert [type(t._storage) for t in tensors] == [Storage] * 21


def _marked(t, *dims):
    for d in dims:
        torch._dynamo.mark_dynamic(t, d)
    return t


def _static(t, *dims):
    for d in dims:
        torch._dynamo.mark_static(t, d)
    return t


def test_uploads_padded_only_along_a_marked_dim(mode):
    for n in [5, 9, 7]:
        src = torch.arange(n * 3.0).reshape(n, 3) - 4
        t = _marked(src.clone(), 0).to("tpu")
        assert type(t._storage) is GrownStorage
        assert_same([t, t.sum(0), t * 2, t[-1], t.t()], [src, src.sum(0), src * 2, src[-1], src.t()])
        t.add_(1)  # a write: its values, padded or not
        t[0] = 9
        want = src + 1
        want[0] = 9
        assert_same(t, want)
        # Along another dim (batch-first): the same values.
        u = _marked(src.t().contiguous(), 1).to("tpu")
        assert type(u._storage) is GrownStorage
        assert_same([u, u.sum(1), u.softmax(0), u.reshape(-1)], [src.t(), src.t().sum(1), src.t().softmax(0),
                                                                   src.t().reshape(-1)])
        # Marked static, or two dims marked dynamic: uploaded as they are.
        assert type(_static(src.clone(), 0).to("tpu")._storage) is not GrownStorage
        assert type(_marked(src.clone(), 0, 1).to("tpu")._storage) is not GrownStorage
        # Into a tensor a view of which exists: it keeps its storage, the view sees the data.
        buf = torch.empty(n, 3, device="tpu")
        view = buf[1:]
        buf.copy_(_marked(src.clone(), 0))
        assert type(buf._storage) is not GrownStorage
        assert_same(view, src[1:])


class _LanguageModel(nn.Module):
    def __init__(self, vocab=50, width=16):
        super().__init__()
        self.emb, self.rnn = nn.Embedding(vocab, width), nn.LSTM(width, width, 2)
        self.out = nn.Linear(width, vocab)

    def forward(self, x):
        return self.out(self.rnn(self.emb(x))[0])


def _lm_loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, 50), y)


@pytest.mark.parametrize("eager", ["strict", "fused"])
def test_lstm_on_varying_lengths_equals_cpu_and_compiles_per_bucket(eager):
    lengths = WARM + [31, 20, 29, 18]
    cpu_losses, _, cpu_params = _train("cpu", lengths, _LanguageModel, _lm_loss)
    with torchtpu.eager_mode(eager):
        losses, compiled, params = _train("tpu", lengths, _LanguageModel, _lm_loss)
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    assert_same(params, cpu_params, atol=1e-5, rtol=1e-4)
    if eager == "strict":  # (fused mode's graphs hold one LSTM cell a time step)
        assert compiled[len(WARM):] == [0] * (len(lengths) - len(WARM)), compiled


@pytest.mark.parametrize("eager", ["strict", "fused"])
def test_full_batches_after_a_short_one_keep_their_own_length(eager):
    # pytorch/examples' word_language_model: bptt slices of one length, each
    # epoch's last one short. The full ones after it run as before it, at
    # their own length: not padded (to 32), and compiling nothing new.
    lengths = [20, 20, 20, 11] * 2 + [20, 20]
    cpu_losses, _, cpu_params = _train("cpu", lengths, _LanguageModel, _lm_loss, batch=7)
    with torchtpu.eager_mode(eager):
        losses, compiled, params = _train("tpu", lengths, _LanguageModel, _lm_loss, batch=7)
        data = torch.randint(0, 50, (40, 7), generator=torch.Generator().manual_seed(1))
        model = _LanguageModel()
        model.load_state_dict(dict(zip(model.state_dict(), params)))
        tpu_model = _LanguageModel().to("tpu")
        tpu_model.load_state_dict(model.state_dict())
        dt = data.to("tpu")
        outs = [tpu_model(dt[i:i + n]) for i, n in [(0, 20), (20, 11), (5, 20)]]
        assert [type(o._storage) is GrownStorage for o in outs] == [False, True, False]
        assert_same(outs, [model(data[i:i + n]) for i, n in [(0, 20), (20, 11), (5, 20)]],
                    atol=1e-5, rtol=1e-4)
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    assert_same(params, cpu_params, atol=1e-5, rtol=1e-4)
    if eager == "strict":  # (fused mode compiles the short step's graph when it recurs)
        assert compiled[4:] == [0] * (len(lengths) - 4), compiled


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_nll_loss_counts_only_the_true_rows(reduction):
    data, targets = torch.randn(100, 7), torch.randint(0, 7, (100,))
    targets[::5] = 2  # ignored below
    weight = torch.rand(7) + 0.5
    dt, tt, wt = data.to("tpu").requires_grad_(), targets.to("tpu"), weight.to("tpu")
    data.requires_grad_()
    for i, n in enumerate([10, 21, 14, 30]):
        rows = slice(2 * i, 2 * i + n)

        def loss(x, t, w):
            return F.nll_loss(x[rows].log_softmax(1), t[rows], weight=w, ignore_index=2,
                              reduction=reduction)
        got, want = loss(dt, tt, wt), loss(data, targets, weight)
        assert_same(got, want)
        assert_same(torch.autograd.grad(got.sum(), dt)[0], torch.autograd.grad(want.sum(), data)[0])


def test_writes_to_padded_tensors_and_through_slices(mode):
    data = torch.randn(50, 3)
    dt = data.to("tpu")
    for i, n in enumerate([5, 9, 7]):
        rows = slice(i, i + n)
        y, yc = dt[rows] * 2, data[rows] * 2
        y.add_(1)
        yc.add_(1)
        y[0] = 5.0
        yc[0] = 5.0
        assert_same(y + 1, yc + 1)
        dt[rows].mul_(3)  # a write through the slice reaches the data
        data[rows].mul_(3)
        assert_same((dt[rows] - 1).sum(0), (data[rows] - 1).sum(0))
    assert_same(dt, data)


def test_stack_of_a_varying_count(mode):
    items = [torch.randn(3, 2) for _ in range(20)]
    tpu_items = [t.to("tpu") for t in items]
    for k in [9, 12, 10, 15]:
        got, want = torch.stack(tpu_items[:k]), torch.stack(items[:k])
        assert got.shape == want.shape
        assert_same([got, (got * 2).sum(0), got.mean(0), got[-1]],
                    [want, (want * 2).sum(0), want.mean(0), want[-1]])


def _padded_rows(t):
    """t (CPU) on the tpu as a tensor of padded rows: its storage holds a
    bucket of them, zeros past its own."""
    from torchtpu.dispatch import growth, lengths
    n = t.shape[0]
    extra = torch.zeros((lengths.bucket(n + 1) - n,) + t.shape[1:], dtype=t.dtype)
    return growth.grown_tensor(torch.cat([t, extra]).to("tpu"), 0, n, t.dtype)


def test_pointwise_ops_on_padded_rows_give_opinfo_samples_cpu_values():
    """PyTorch's own samples for every op it tags pointwise, its tensors of the
    input's rows padded: CPU's values, and results that stay padded."""
    from torch.testing._internal.common_methods_invocations import op_db

    from torchtpu.dispatch import lengths
    names = {op._schema.name.split("::")[1] for op, rule in lengths.PADDED.items()
             if rule is lengths._pointwise}
    ran = padded = 0
    for info in op_db:
        if info.name.split(".")[0] not in names:
            continue
        for s in list(info.sample_inputs("cpu", torch.float32))[:2]:
            x = s.input
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] < 2:
                continue
            try:
                want = info(x, *s.args, **s.kwargs)
            except Exception:
                continue  # (CPU refuses the sample)

            def moved(a):
                if isinstance(a, torch.Tensor):
                    return _padded_rows(a) if a.dim() and a.shape[0] == x.shape[0] else a.to("tpu")
                return a
            got = info(moved(x), *[moved(a) for a in s.args],
                       **{k: moved(v) for k, v in s.kwargs.items()})
            assert_same(got, want, equal_nan=True, msg=lambda m: f"{info.name}: {m}")
            ran += 1
            padded += isinstance(got, torch.Tensor) and type(got._storage) is GrownStorage
    assert ran > 120 and padded > 100, (ran, padded)  # (133 and 122 samples when written)


def test_lengths_off_pads_nothing(monkeypatch):
    from torchtpu.dispatch import lengths
    monkeypatch.setattr(lengths, "ENABLED", False)
    data = torch.randn(40, 3)
    dt = data.to("tpu")
    for i, n in enumerate([5, 9, 7]):
        y = dt[i:i + n] * 2
        assert type(y._storage) is not GrownStorage
        assert_same(y.sum(0), (data[i:i + n] * 2).sum(0))
    items = [t.to("tpu") for t in torch.randn(12, 2)]
    for k in [9, 11]:
        assert type(torch.stack(items[:k])._storage) is not GrownStorage
    assert type(_marked(torch.arange(6), 0).to("tpu")._storage) is not GrownStorage
