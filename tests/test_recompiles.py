"""No recompile storms: views and writes whose shape is fixed but whose
position moves compile once per shape (offsets are data), in every mode,
with CPU's values."""
import torch
import torch.nn as nn

import torchtpu

from conftest import assert_same


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


def test_moving_slice_training_compiles_nothing_after_step_two(mode):
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
            assert_same(g * 2, w * 2)  # a kernel reading the view
            assert_same(g, w)          # the view read back to the host
        if step == 2:
            # (Fused mode compiles some graphs of the second step at the
            # third: its 14 flushes a step at one line look like churn.)
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


def test_writes_at_a_moving_offset(mode):
    """A ring buffer and a cache written at a position that moves."""
    buf, ring = torch.zeros(12, 3), torch.zeros(5, 2, 3)
    tbuf, tring = buf.to("tpu"), ring.to("tpu")
    before = None
    for step in range(9):
        v = torch.randn(2, 3)
        i = (3 * step) % 10
        buf[i:i + 2] = v
        tbuf[i:i + 2] = v.to("tpu")
        ring[step % 5] += v
        tring[step % 5] += v.to("tpu")
        buf[:, step % 3].mul_(0.5)
        tbuf[:, step % 3].mul_(0.5)
        assert_same(tbuf, buf)
        assert_same(tring, ring)
        if step == 1:
            torchtpu.sync()
            before = _compilations()
    torchtpu.sync()
    assert _compilations() == before
