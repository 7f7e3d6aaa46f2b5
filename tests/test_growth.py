"""Tensors grown step by step by torch.cat (torchtpu.dispatch.growth): the
values equal CPU's at every step, through views, writes and attention, and
the number of compilations grows with the number of buckets, not steps."""
import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu.dispatch import growth
from torchtpu.tensor import GrownStorage

from conftest import assert_same


def _compilations():
    s = torchtpu.metrics.snapshot()
    return s["compilations"] + s.get("graphs_compiled", 0)


def _grow(x, xt, ids, it, steps):
    """steps of a decode loop's bookkeeping: a float cache and token ids
    extended by one, the last token read through views."""
    for _ in range(steps):
        new = torch.randn(x.shape[0], 1, x.shape[2])
        x, xt = torch.cat([x, new], 1), torch.cat([xt, new.to("tpu")], 1)
        tok = torch.randint(0, 50, (ids.shape[0], 1))
        ids, it = torch.cat([ids, tok], -1), torch.cat([it, tok.to("tpu")], -1)
        assert_same(it[:, -1], ids[:, -1])
        assert_same(it[:, -1:] + 1, ids[:, -1:] + 1)
        assert_same((it[:, -1:] == 7).any(-1), (ids[:, -1:] == 7).any(-1))
    return x, xt, ids, it


def test_grown_tensors_equal_cpu_and_compile_per_bucket(mode, monkeypatch, fresh_kernels):
    monkeypatch.setattr(growth, "GROWTH_MIN", 16)
    x = torch.randn(2, 3, 4)
    ids = torch.randint(0, 50, (2, 5))
    x, xt, ids, it = _grow(x, x.to("tpu"), ids, ids.to("tpu"), 14)  # into the bucket of 32
    assert type(xt._storage) is GrownStorage and type(it._storage) is GrownStorage
    # (Fused mode's first graphs in a bucket differ in what they donate.)
    x, xt, ids, it = _grow(x, xt, ids, it, 3)
    torchtpu.sync()
    torchtpu.metrics.reset()
    # 10 more steps stay in the bucket of 32: nothing new to compile.
    x, xt, ids, it = _grow(x, xt, ids, it, 10)
    assert x.shape[1] == 30
    torchtpu.sync()
    assert _compilations() == 0, torchtpu.metrics.snapshot()
    assert torchtpu.metrics.snapshot().get("grown_cuts", 0) == 0
    # Read whole, they are CPU's (cut from the padded arrays).
    assert_same(xt, x)
    assert_same(it, ids)
    # Into the next buckets (64, then 128), and on.
    x, xt, ids, it = _grow(x, xt, ids, it, 40)
    assert xt._storage.grown.shape[1] == 128
    assert_same(xt.sum(1), x.sum(1))
    assert_same(it, ids)


def test_a_write_ends_the_growth_and_keeps_every_value(mode):
    x = torch.randn(3, 2)
    xt = x.to("tpu")
    for _ in range(4):
        new = torch.randn(3, 1)
        x, xt = torch.cat([x, new], 1), torch.cat([xt, new.to("tpu")], 1)
    assert type(xt._storage) is GrownStorage and xt._storage.grown is not None
    view, cview = xt[:, -2:], x[:, -2:]
    view.mul_(10)  # through a view: the base sees it
    cview.mul_(10)
    assert xt._storage.grown is None
    assert_same(xt, x)
    assert_same(view, cview)
    # Growing on from the written tensor.
    for _ in range(3):
        new = torch.randn(3, 1)
        x, xt = torch.cat([x, new], 1), torch.cat([xt, new.to("tpu")], 1)
        xt[:, 0] += 1
        x[:, 0] += 1
    assert_same(xt, x)


def test_cats_that_do_not_grow_are_plain(mode):
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    at, bt = a.to("tpu"), b.to("tpu")
    c, ct = torch.cat([a, b], 0), torch.cat([at, bt], 0)
    assert type(ct._storage) is not GrownStorage
    # Along another dim than the first cat's, or with a mixed dtype: plain.
    d = torch.cat([c, torch.randn(4, 1)], 1)
    dt = torch.cat([ct, d[:, -1:].to("tpu")], 1)
    e = torch.cat([d, torch.ones(4, 1, dtype=torch.float64)], 1)
    et = torch.cat([dt, torch.ones(4, 1, dtype=torch.float64).to("tpu")], 1)
    assert type(et._storage) is not GrownStorage
    assert_same(dt, d)
    assert_same(et, e)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "broadcast"])
def test_attention_over_a_grown_cache_equals_cpu(mode, mask_kind):
    q = torch.randn(2, 4, 1, 8)
    k, v = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    kt, vt, qt = k.to("tpu"), v.to("tpu"), q.to("tpu")
    mask = torch.ones(2, 1, 1, 3, dtype=torch.bool)
    mt = mask.to("tpu")
    for step in range(20):
        nk, nv = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
        k, kt = torch.cat([k, nk], 2), torch.cat([kt, nk.to("tpu")], 2)
        v, vt = torch.cat([v, nv], 2), torch.cat([vt, nv.to("tpu")], 2)
        nm = torch.rand(2, 1, 1, 1) > 0.3
        mask, mt = torch.cat([mask, nm], -1), torch.cat([mt, nm.to("tpu")], -1)
        if mask_kind == "bool":
            m, mtpu = mask, mt
        elif mask_kind == "float":
            m = torch.where(mask, 0.0, -1e4)
            mtpu = torch.where(mt, 0.0, -1e4)
        elif mask_kind == "broadcast":
            m = torch.randn(2, 4, 1, 1)
            mtpu = m.to("tpu")
        else:
            m = mtpu = None
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        got = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mtpu, enable_gqa=True)
        assert_same(got, want)
    assert type(kt._storage) is GrownStorage


def _mask_step(mask):
    """One step of an attention mask as generate() (transformers 5.17) keeps
    it: a column of mask.new_ones() joined on, then read as a bool mask
    padded to a static cache's length (by a pad that shrinks as it grows),
    or cropped to one, and its checks (sums: a grown result read whole
    would be cut)."""
    mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], -1)
    b = mask.to(torch.bool)
    n = mask.shape[-1]
    return mask, (F.pad(b, (0, 40 - n)), F.pad(mask, (2, 38 - n), value=7), F.pad(b, (0, 20 - n)),
                  F.pad(mask, (0, 0, 1, 0), value=3).sum(-1), b.sum(), (~b).sum(-1))


def test_a_grown_mask_as_generate_reads_it_is_never_cut(mode, monkeypatch, fresh_kernels):
    # new_ones reads only the mask's dtype and device, and a pad's result is
    # the padded array padded (or cropped) to its static length: neither
    # cuts the mask to its length, so its steps compile nothing new in a bucket.
    monkeypatch.setattr(growth, "GROWTH_MIN", 16)
    mask = torch.randint(0, 2, (2, 5))
    mt = mask.to("tpu")
    for steps in (14, 2, 10, 20):  # into the bucket of 32; then 32's steps; on into 64
        if steps == 10:
            torchtpu.sync()
            torchtpu.metrics.reset()
        for _ in range(steps):
            mask, want = _mask_step(mask)
            mt, got = _mask_step(mt)
            for g, w in zip(got, want):
                assert_same(g, w)
        if steps == 10:
            torchtpu.sync()
            assert _compilations() == 0, torchtpu.metrics.snapshot()
            assert torchtpu.metrics.snapshot().get("grown_cuts", 0) == 0
    assert type(mt._storage) is GrownStorage and mt._storage.grown.shape[-1] == 64
    assert_same(mt, mask)


def test_growth_can_be_turned_off(monkeypatch, mode):
    monkeypatch.setattr(growth, "ENABLED", False)
    x = torch.randn(2, 1)
    xt = x.to("tpu")
    for _ in range(4):
        x, xt = torch.cat([x, x[:, -1:]], 1), torch.cat([xt, xt[:, -1:]], 1)
    assert type(xt._storage) is not GrownStorage
    assert_same(xt, x)


def test_buckets(monkeypatch):
    monkeypatch.setattr(growth, "GROWTH_MIN", 16)
    assert [growth.bucket(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]
    monkeypatch.setattr(growth, "GROWTH_MIN", 5)
    assert [growth.bucket(n) for n in (1, 5, 6, 11)] == [5, 5, 10, 20]


def test_advisor_names_the_op_line_and_bucket(monkeypatch):
    from torchtpu import advisor
    advisor.S.reset()
    x = torch.randn(2, 3).to("tpu")
    for _ in range(4):
        x = torch.cat([x, torch.randn(2, 1).to("tpu")], 1)
        x.softmax(-1)  # reads the grown tensor whole
    for n in range(10, 10 + advisor.CHURN_KERNELS):
        torch.ones(n, 3, device="tpu").exp()
    text = advisor.summary()
    assert "aten._softmax.default at test_growth.py:" in text and "its bucket is 128" in text
    assert "aten.exp.default" in text and f"dim 0 (10..{9 + advisor.CHURN_KERNELS}), bucket 128" in text
