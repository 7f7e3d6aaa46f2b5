"""Indexing lowerings against PyTorch on CPU: advanced indexing, index_put,
gather/scatter (all reduce modes), index_*, masked ops, take/put,
embedding; in-place writes through views and autograd."""
import pytest
import torch
import torch.nn.functional as F

import torchtpu
from conftest import assert_same, compare, make

F32, F64, BF16, I64, I32, BOOL = (torch.float32, torch.float64, torch.bfloat16,
                                  torch.int64, torch.int32, torch.bool)




def tpu(x):
    if isinstance(x, (list, tuple)):
        return type(x)(tpu(v) for v in x)
    return x.to("tpu") if isinstance(x, torch.Tensor) else x


def check(fn, *args, fallback=False):
    expected = fn(*args)
    torchtpu.metrics.reset()
    got = fn(*[tpu(a) for a in args])
    assert_same(got, expected)
    fallbacks = torchtpu.metrics.snapshot()["cpu_fallbacks"]
    if not fallback:
        assert not fallbacks, fallbacks
    return fallbacks


def T(*v):
    return torch.tensor(v)


IDX = T(0, 2, -1)
CASES = [
    ("index", lambda a, i: a[i]),
    ("index_2d", lambda a, i: a[i, T(1, -1, 3).to(a.device)]),
    ("index_broadcast", lambda a, i: a[i[:2], T([1], [3]).to(a.device)]),
    ("index_none_slice", lambda a, i: a[:, None, i]),
    ("index_split_adv", lambda a, i: a[None][:, i, 1:]),
    ("index_nonadjacent", lambda a, i: a[None].expand(2, 3, 4)[T(1, 0).to(a.device), :, T(3, 2).to(a.device)]),
    ("index_put", lambda a, i: a.index_put((i,), torch.tensor(5, dtype=a.dtype, device=a.device))),
    ("index_put_acc", lambda a, i: a.index_put((T(0, 0, -1).to(a.device),), a[:3] * 2, accumulate=True)),
    ("index_put_2d", lambda a, i: a.index_put((i, T(1, 2, 3).to(a.device)), a[0, :3])),
    ("gather", lambda a, i: a.gather(1, T([0, 1], [3, 3], [2, 0]).to(a.device))),
    ("gather_neg_dim", lambda a, i: a.gather(-2, T([0, 1, 2, 2]).to(a.device))),
    ("take", lambda a, i: a.take(T(0, 5, -1, 11).to(a.device))),
    ("take_along_dim", lambda a, i: torch.take_along_dim(a, T([0], [1], [3]).to(a.device), 1)),
    ("index_select", lambda a, i: a.index_select(0, T(2, 0, 2).to(a.device))),
    ("index_add", lambda a, i: a.index_add(0, T(0, 0, 2).to(a.device), a)),
    ("index_copy", lambda a, i: a.index_copy(1, T(3, 0).to(a.device), a[:, :2])),
    ("index_fill", lambda a, i: a.index_fill(1, T(2, 0).to(a.device), 1)),
    ("scatter_src", lambda a, i: a.scatter(1, T([0, 1], [3, 2], [2, 0]).to(a.device), a[:, 2:])),
    ("scatter_value", lambda a, i: a.scatter(0, T([2, 1, 0, 0]).to(a.device), 3)),
    ("scatter_add", lambda a, i: a.scatter_add(1, T([0, 0], [3, 3], [2, 0]).to(a.device), a[:, :2])),
    ("masked_fill", lambda a, i: a.masked_fill(a > 0, 2)),
    ("masked_fill_bcast", lambda a, i: a.masked_fill(T(True, False, True, False).to(a.device), 0)),
    ("masked_fill_tensor", lambda a, i: a.masked_fill(a < 0, torch.tensor(1, device=a.device))),
    ("masked_scatter", lambda a, i: a.masked_scatter(a > 0, a * 3)),
    ("put", lambda a, i: a.put(T(0, 5, -1).to(a.device), a[0, :3])),
    ("put_acc", lambda a, i: a.put(T(0, 0, -1).to(a.device), a[0, :3], accumulate=True)),
]


@pytest.mark.parametrize("name,fn", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [F32, I64])
def test_indexing_ops(name, fn, dtype):
    check(fn, make(dtype), IDX)


@pytest.mark.parametrize("name,fn", CASES[:10], ids=[c[0] for c in CASES[:10]])
def test_indexing_ops_noncontiguous(name, fn):
    x = make(F32, (4, 3)).t()
    xt = make(F32, (4, 3)).to("tpu").t()
    assert not xt.is_contiguous()
    assert_same(fn(xt, IDX.to("tpu")), fn(x, IDX))


@pytest.mark.parametrize("dtype", [BF16, BOOL, I32])
def test_more_dtypes(dtype, mode):
    x = make(dtype)
    for fn in (lambda a: a[T(2, 0).to(a.device)],
               lambda a: a.gather(1, T([1], [0], [3]).to(a.device)),
               lambda a: a.index_put((T(1).to(a.device),), a[0]),
               lambda a: a.masked_fill(T(True, False, False, True).to(a.device), 1),
               lambda a: a.scatter(1, T([1], [0], [3]).to(a.device), a[:, :1])):
        check(fn, x)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dtype", [F32, I64])
def test_scatter_reduce(reduce, include_self, dtype):
    x, src = make(dtype, (3, 5)), make(dtype, (3, 4), seed=1)
    index = T([0, 0, 4, 1], [3, 3, 3, 3], [2, 0, 2, 0])
    check(lambda a, i, s: a.scatter_reduce(1, i, s, reduce, include_self=include_self), x, index, src)


@pytest.mark.parametrize("reduce", ["add", "multiply"])
def test_scatter_legacy_reduce(reduce):
    x, src = make(F32, (3, 5)), make(F32, (3, 4), seed=1)
    index = T([0, 0, 4, 1], [3, 3, 3, 3], [2, 0, 2, 0])
    check(lambda a, i, s: a.scatter(1, i, s, reduce=reduce), x, index, src)
    check(lambda a, i: a.scatter(1, i, 2.0, reduce=reduce), x, index)


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
def test_index_reduce(reduce):
    x, src = make(F32, (4, 3)), make(F32, (5, 3), seed=1)
    check(lambda a, s: a.index_reduce(0, T(0, 2, 0, 3, 2).to(a.device), s, reduce), x, src)
    check(lambda a, s: a.index_reduce(0, T(0, 2, 0, 3, 2).to(a.device), s, reduce,
                                      include_self=False), x, src)


def test_boolean_masks():
    x = make(F32, (4, 5))
    m = x[:, 0] > 0
    # value-dependent result shapes: the mask's count is read back, then
    # fixed-shape kernels run (no CPU fallback)
    check(lambda a, mm: a[mm], x, m)
    check(lambda a: a[a > 0], x)
    # x[mask] = v with one value, or values that do not vary along the
    # masked dim, is an elementwise select
    check(lambda a, mm: a.index_put((mm,), torch.tensor(7., device=a.device)), x, m)
    check(lambda a, mm: a.index_put((mm,), a[0]), x, m)
    check(lambda a, mm: a.index_put((mm,), a[0], accumulate=True), x, m)
    check(lambda a: a.index_put((a > 0,), torch.tensor(0., device=a.device)), x)

    def set_cols(a, mm):
        a = a.clone()
        a[:, mm] = a[:, :1]
        return a
    check(set_cols, x, x[0] > 0)
    # values, one per selected row: the mask becomes the rows' indices
    rows = int(m.sum())
    check(lambda a, mm: a.index_put((mm,), torch.ones(rows, 5, device=a.device)), x, m)


def test_setitem_and_inplace_through_views(mode):
    base = make(F32, (4, 6))
    tb = base.to("tpu")
    for b in (base, tb):
        v = b[1:, ::2]  # a strided view
        v[T(0, 2).to(b.device)] = 9.0
        v.index_put_((T(1).to(b.device), T(0).to(b.device)), torch.tensor(-1.0, device=b.device),
                     accumulate=True)
        b.t()[1:3].scatter_(1, T([0, 2], [1, 3]).to(b.device), 4.0)
        b[:, 4:].masked_fill_(b[:, 4:] > 0.5, -7.0)
        b[0].index_fill_(0, T(1, 3).to(b.device), 2.0)
        b[2:, :3].index_add_(1, T(0, 0, 2).to(b.device), torch.ones(2, 3, device=b.device))
        b[T(3, 0).to(b.device), 1:3] = torch.tensor([[5.0, 6.0], [7.0, 8.0]], device=b.device)
        b[b < -1.5] = 0.5
    assert_same(tb, base)


def test_out_variants():
    x, i = make(F32), T([0, 1], [3, 3], [2, 0])
    out = torch.empty(3, 2, device="tpu")
    r = torch.gather(x.to("tpu"), 1, i.to("tpu"), out=out)
    assert r is out
    assert_same(out, torch.gather(x, 1, i))
    out = torch.empty(2, 4, device="tpu")
    torch.index_select(x.to("tpu"), 0, T(2, 0).to("tpu"), out=out)
    assert_same(out, torch.index_select(x, 0, T(2, 0)))


def _grads(fn, *args):
    """Gradients of (fn(*args) * w).sum() w.r.t. the float args, CPU and tpu."""
    cpu = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    dev = [a.to("tpu").requires_grad_() if a.is_floating_point() else a.to("tpu") for a in args]
    out_c = fn(*cpu)
    w = torch.randn(out_c.shape, generator=torch.Generator().manual_seed(5))
    (out_c * w).sum().backward()
    (fn(*dev) * w.to("tpu")).sum().backward()
    for c, d in zip(cpu, dev):
        if c.is_floating_point():
            assert_same(d.grad, c.grad)


def test_backward():
    x = make(F32, (4, 5))
    _grads(lambda a: a[T(0, 2, 0, -1).to(a.device)], x)
    _grads(lambda a: a[:, T([1, 1], [3, 0]).to(a.device)], x)
    _grads(lambda a: a.gather(1, T([0, 0, 4], [1, 2, 1], [3, 3, 3], [0, 4, 4]).to(a.device)), x)
    _grads(lambda a: a.index_select(1, T(4, 4, 0).to(a.device)), x)
    _grads(lambda a: a.take(T(0, 19, 0).to(a.device)), x)
    _grads(lambda a, s: a.scatter(1, T([0, 2], [1, 3]).to(a.device), s), x, make(F32, (2, 2), 1))
    _grads(lambda a, s: a.scatter_add(1, T([0, 0], [1, 3]).to(a.device), s), x, make(F32, (2, 2), 1))
    _grads(lambda a, s: a.index_put((T(1, 1, 3).to(a.device),), s, accumulate=True), x,
           make(F32, (3, 5), 1))
    _grads(lambda a, s: a.masked_scatter(a > 0, s), x, make(F32, (4, 5), 1))
    _grads(lambda a: a.masked_fill(a > 0, 1.0), x)


@pytest.mark.parametrize("padding_idx", [None, 0, -1])
@pytest.mark.parametrize("scale", [False, True])
def test_embedding(padding_idx, scale):
    w = make(F32, (6, 3))
    idx = T([0, 2, 2], [5, 0, 2])
    check(lambda ww, ii: F.embedding(ii, ww, padding_idx=padding_idx), w, idx)
    _grads(lambda ww: F.embedding(idx.to(ww.device), ww, padding_idx=padding_idx,
                                  scale_grad_by_freq=scale), w)


def test_embedding_module_step():
    torch.manual_seed(0)
    emb_c = torch.nn.Embedding(10, 4, padding_idx=1)
    emb_t = torch.nn.Embedding(10, 4, padding_idx=1).to("tpu")
    emb_t.load_state_dict(emb_c.state_dict())
    idx = T([1, 3, 3, 9])
    for emb, i in ((emb_c, idx), (emb_t, idx.to("tpu"))):
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        emb(i).pow(2).sum().backward()
        opt.step()
    assert_same(emb_t.weight, emb_c.weight.detach())


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_embedding_max_norm_renormalizes_the_rows_it_reads(norm_type):
    # nn.Embedding(max_norm=) rescales, in place, each row it reads whose
    # norm is above max_norm (aten.embedding_renorm_), on tpu: no fallback.
    before = dict(torchtpu.metrics.M.cpu_fallbacks)
    torch.manual_seed(0)
    emb_c = torch.nn.Embedding(10, 4, max_norm=1.0, norm_type=norm_type)
    emb_t = torch.nn.Embedding(10, 4, max_norm=1.0, norm_type=norm_type)
    emb_t.load_state_dict(emb_c.state_dict())
    emb_t = emb_t.to("tpu")
    idx = T([1, 2, 2, 7], [0, 1, 9, 9])
    outs = [emb(i) for emb, i in ((emb_c, idx), (emb_t, idx.to("tpu")))]
    for out in outs:
        out.square().sum().backward()
    assert_same(outs[1], outs[0].detach(), atol=1e-6, rtol=1e-6)
    assert_same(emb_t.weight, emb_c.weight.detach(), atol=1e-6, rtol=1e-6)
    assert_same(emb_t.weight.grad, emb_c.weight.grad, atol=1e-6, rtol=1e-6)
    assert dict(torchtpu.metrics.M.cpu_fallbacks) == before


def test_zero_dim():
    s = torch.tensor(3.5)
    for mask in (True, False):  # masked_select of 0-d tensors is 1-d
        check(lambda a: torch.masked_select(a, torch.tensor(mask, device=a.device)), s)
    check(lambda a: a.gather(0, torch.tensor(0, device=a.device)), s)
    check(lambda a: a.index_select(0, torch.tensor([0], device=a.device)), s)
    check(lambda a: a.scatter(0, torch.tensor(0, device=a.device), 1.0), s)
    check(lambda a: a.index_fill(0, torch.tensor([0], device=a.device), -1.0), s)
    check(lambda a: a.take(torch.tensor([0, 0], device=a.device)), s)


def test_empty_indices():
    x = make(F32)
    empty = torch.empty(0, dtype=I64)
    check(lambda a, i: a[i], x, empty)
    check(lambda a, i: a.index_select(1, i), x, empty)
    check(lambda a, i: a.gather(1, i.reshape(3, 0)), x, empty)
    check(lambda a, i: a.scatter_add(1, i.reshape(3, 0), a[:, :0]), x, empty)
    check(lambda a, i: a.index_put((i,), torch.tensor(1.0, device=a.device)), x, empty)


@pytest.mark.parametrize("fn", [
    lambda x: x[x > 0],
    lambda x: x[:, x[0] > 0] * 2,
    lambda x: x[(x > 0).to(torch.uint8).bool()],
    lambda x: torch.masked_select(x, x[0] > 0),
    lambda x: torch.nonzero(x > 0.5),
    lambda x: torch.argwhere(x < 0),
])
def test_value_dependent_sizes_on_device(mode, fn):
    # The size is read back (one scalar); nothing runs on the CPU fallback.
    compare(fn, make(torch.float32, (4, 5)))


def test_mask_assignment_with_varying_values(mode):
    def fn(x):
        x = x.clone()
        m = x > 0
        x[m] = torch.arange(int(m.sum().item()), dtype=x.dtype, device=x.device)
        return x
    compare(fn, make(torch.float32, (4, 5)), grad=False)
