"""Reduction, scan and sort lowerings against PyTorch on CPU: values, dtypes
(int sums are int64), NaN propagation, index tie-breaking, keepdim/dtype
arguments, non-contiguous inputs, out= and autograd."""
import pytest
import torch

import torchtpu
import conftest
from conftest import assert_same

F32, F64, BF16, I64, I32, U8, BOOL = (torch.float32, torch.float64, torch.bfloat16,
                                      torch.int64, torch.int32, torch.uint8, torch.bool)




def make(dtype, shape=(3, 5), seed=0):
    # Small ints keep products and sums exact in every integer dtype.
    return conftest.make(dtype, shape, seed, low=-4, high=5)


def check(fn, *args, **kw):
    try:
        expected = fn(*args)
    except RuntimeError:  # NotImplementedError included
        with pytest.raises(RuntimeError):
            fn(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args])
        return
    got = fn(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args])
    if isinstance(expected, tuple):
        got, expected = tuple(got), tuple(expected)
    assert_same(got, expected, **kw)


def _tol(dtype):
    return dict(atol=3e-2, rtol=2e-2) if dtype == BF16 else dict(atol=1e-5, rtol=1e-5)


REDUCTIONS = [
    ("sum", lambda x: x.sum()), ("sum_dim", lambda x: x.sum(1)), ("sum_keep", lambda x: x.sum((0, 1), keepdim=True)),
    ("sum_dtype", lambda x: x.sum(0, dtype=torch.float64)), ("mean", lambda x: x.mean()),
    ("mean_dim", lambda x: x.mean(-1, keepdim=True)), ("mean_dtype", lambda x: x.mean(0, dtype=torch.float64)),
    ("prod", lambda x: x.prod()), ("prod_dim", lambda x: x.prod(1)), ("nansum", lambda x: x.nansum(1)),
    ("amax", lambda x: x.amax(1)), ("amin", lambda x: x.amin((0, 1))), ("max", lambda x: x.max()),
    ("min", lambda x: x.min()), ("max_dim", lambda x: x.max(1)), ("min_dim", lambda x: x.min(0, keepdim=True)),
    ("argmax", lambda x: x.argmax()), ("argmax_dim", lambda x: x.argmax(1)),
    ("argmin_keep", lambda x: x.argmin(0, keepdim=True)), ("aminmax", lambda x: torch.aminmax(x)),
    ("aminmax_dim", lambda x: torch.aminmax(x, dim=1)), ("any", lambda x: x.any()),
    ("any_dim", lambda x: x.any(1)), ("all", lambda x: x.all()), ("all_dims", lambda x: x.all(dim=(0, 1))),
    ("count_nonzero", lambda x: torch.count_nonzero(x)), ("count_nonzero_dim", lambda x: torch.count_nonzero(x, 0)),
    ("var", lambda x: x.var()), ("var_dim", lambda x: x.var(1, correction=0)), ("std", lambda x: x.std(0)),
    ("std_keep", lambda x: x.std(1, keepdim=True, correction=2)), ("var_mean", lambda x: torch.var_mean(x, 1)),
    ("std_mean", lambda x: torch.std_mean(x)), ("logsumexp", lambda x: x.logsumexp(1)),
    ("norm", lambda x: x.norm()), ("norm_p1", lambda x: x.norm(1, dim=1)), ("norm_p3", lambda x: x.norm(3)),
    ("vector_norm_inf", lambda x: torch.linalg.vector_norm(x, float("inf"), dim=0)),
    ("vector_norm_ninf", lambda x: torch.linalg.vector_norm(x, float("-inf"))),
    ("vector_norm_0", lambda x: torch.linalg.vector_norm(x, 0, dim=1)),
    ("vector_norm_keep", lambda x: torch.linalg.vector_norm(x, 2, dim=(0, 1), keepdim=True)),
    ("cumsum", lambda x: x.cumsum(1)), ("cumsum_dtype", lambda x: x.cumsum(0, dtype=torch.float64)),
    ("cumprod", lambda x: x.cumprod(1)), ("cummax", lambda x: x.cummax(1)), ("cummin", lambda x: x.cummin(0)),
    ("logcumsumexp", lambda x: x.logcumsumexp(1)),
    ("sort", lambda x: x.sort(1)), ("sort_desc", lambda x: x.sort(0, descending=True)),
    ("sort_stable", lambda x: torch.sort(x, stable=True, dim=1)),
    ("sort_stable_desc", lambda x: torch.sort(x, stable=True, dim=1, descending=True)),
    ("argsort", lambda x: x.argsort(dim=1, stable=True)), ("msort", lambda x: torch.msort(x)),
    ("median", lambda x: x.median()), ("median_dim", lambda x: x.median(1)),
    ("nanmedian_dim", lambda x: x.nanmedian(0)), ("kthvalue", lambda x: x.kthvalue(2, 1)),
]
ORDER_STAT = {"median_dim", "nanmedian_dim", "kthvalue"}  # tie index is unspecified


@pytest.mark.parametrize("dtype", [F32, BF16, I64, BOOL, U8], ids=str)
@pytest.mark.parametrize("name,fn", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
def test_reduction(name, fn, dtype):
    if name in ORDER_STAT and not dtype.is_floating_point:
        pytest.skip("ties: PyTorch leaves which index unspecified")
    check(fn, make(dtype), **_tol(dtype))


@pytest.mark.parametrize("name,fn", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
def test_reduction_noncontiguous(name, fn):
    x = make(F32, (5, 6))
    check(lambda t: fn(t.t()[:, ::2]), x)


def test_int_sum_is_int64_and_exact():
    x = torch.tensor([2 ** 60, 3, -(2 ** 59)], dtype=I64)
    check(lambda t: t.sum(), x)
    check(lambda t: t.cumsum(0), x)
    check(lambda t: t.sum(), torch.tensor([100, 100, 100], dtype=torch.int8))  # int8 -> int64, no wrap
    check(lambda t: t.prod(), torch.tensor([3, 5, 7], dtype=I32))
    check(lambda t: t.sum(), torch.ones(7, dtype=BOOL))
    check(lambda t: t.sum(dtype=torch.int32), torch.ones(7, dtype=BOOL))


def test_mean_of_int_is_an_error():
    with pytest.raises(RuntimeError):
        make(I64).to("tpu").mean()


def test_nan_propagation_and_first_index():
    nan = float("nan")
    x = torch.tensor([[1.0, nan, 3.0, nan], [2.0, 5.0, 4.0, 1.0], [-1.0, -2.0, 0.0, -3.0]])
    for fn in (lambda t: t.max(), lambda t: t.min(), lambda t: t.amax(1), lambda t: t.amin(1),
               lambda t: t.max(1), lambda t: t.min(1), lambda t: t.argmax(1), lambda t: t.argmin(1),
               lambda t: t.argmax(), lambda t: torch.aminmax(t, dim=1), lambda t: t.sum(1),
               lambda t: t.cummax(1), lambda t: t.cummin(1), lambda t: t.sort(1), lambda t: t.sort(1, descending=True),
               lambda t: t.sort(dim=1, stable=True, descending=True), lambda t: t.topk(2, 1),
               lambda t: t.topk(2, 1, largest=False), lambda t: t.median(1), lambda t: t.median(),
               lambda t: t.nanmedian(1), lambda t: t.nanmedian(), lambda t: t.logsumexp(1),
               lambda t: t.nansum(1), lambda t: t.norm(dim=1), lambda t: t.var(1)):
        check(fn, x, equal_nan=True)


def test_ties_and_signed_zero():
    x = torch.tensor([[3.0, 1.0, 3.0, 0.0, -0.0, 1.0, 3.0]])
    check(lambda t: t.argmax(1), x)
    check(lambda t: t.max(1), x)
    check(lambda t: t.argmin(1), x)
    check(lambda t: t.cummax(1), x)  # the last index of equal maxima
    check(lambda t: t.cummin(1), x)
    check(lambda t: t.sort(dim=1, stable=True), x)
    check(lambda t: t.sort(dim=1, stable=True, descending=True), x)
    check(lambda t: t.argsort(dim=1, stable=True, descending=True), torch.tensor([[1, 2, 1, 2, 0, 2]]))


def test_infinities():
    inf = float("inf")
    x = torch.tensor([[inf, 1.0, 2.0], [-inf, -inf, -inf], [inf, -inf, 0.0]])
    for fn in (lambda t: t.logsumexp(1), lambda t: t.logcumsumexp(1), lambda t: t.sum(1),
               lambda t: torch.linalg.vector_norm(t, dim=1), lambda t: t.amax(1)):
        check(fn, x, equal_nan=True)


def test_zero_dim_and_empty():
    s = torch.tensor(2.5)
    for fn in (lambda t: t.sum(), lambda t: t.sum(0), lambda t: t.max(0), lambda t: t.argmax(),
               lambda t: t.argmax(0, keepdim=True), lambda t: t.cumsum(0), lambda t: t.sort(),
               lambda t: t.var(correction=0), lambda t: t.logsumexp(0), lambda t: t.amax(-1),
               lambda t: t.topk(1), lambda t: t.cummax(0), lambda t: t.norm()):
        check(fn, s)
    e = torch.zeros(0, 3)
    for fn in (lambda t: t.sum(0), lambda t: t.prod(0), lambda t: t.mean(0), lambda t: t.amax(1),
               lambda t: t.any(0), lambda t: t.all(0), lambda t: t.cumsum(0), lambda t: t.sort(0),
               lambda t: t.logsumexp(0), lambda t: t.norm(dim=0)):
        check(fn, e, equal_nan=True)
    with pytest.raises(RuntimeError):
        e.to("tpu").amax(0)
    with pytest.raises(IndexError):
        make(F32).to("tpu").sum(5)


def test_topk():
    x = torch.randperm(40, generator=torch.Generator().manual_seed(1)).reshape(5, 8).float()
    for fn in (lambda t: t.topk(3), lambda t: t.topk(3, largest=False), lambda t: t.topk(2, dim=0),
               lambda t: t.topk(8, 1), lambda t: t.topk(0, 1)):
        check(fn, x)
        check(fn, x.long())
        check(fn, x.to(BF16))
    check(lambda t: t.topk(3), x.t())


def test_out_and_in_place_variants():
    x = make(F32)
    xt = x.to("tpu")
    out = torch.empty(3, device="tpu")
    r = torch.sum(xt, 1, out=out)
    assert r is out
    assert_same(out, x.sum(1))
    vals, idx = torch.empty(3, device="tpu"), torch.empty(3, dtype=I64, device="tpu")
    torch.max(xt, 1, out=(vals, idx))
    assert_same((vals, idx), tuple(x.max(1)))
    c = xt.clone()
    c.cumsum_(1)
    assert_same(c, x.cumsum(1))



@pytest.mark.parametrize("name,fn", [
    ("sum", lambda x: x.sum(1).pow(2).sum()), ("mean", lambda x: (x.mean(0) ** 2).sum()),
    ("prod", lambda x: x.prod(1).sum()), ("amax", lambda x: x.amax(1).sum()),
    ("max_dim", lambda x: x.max(1).values.sum()), ("var", lambda x: x.var(1).sum()),
    ("std", lambda x: x.std()), ("norm", lambda x: x.norm()), ("norm1", lambda x: x.norm(1, dim=0).sum()),
    ("logsumexp", lambda x: x.logsumexp(1).sum()), ("cumsum", lambda x: (x.cumsum(1) ** 2).sum()),
    ("cumprod", lambda x: x.cumprod(1).sum()), ("sort", lambda x: (x.sort(1).values * torch.arange(5.0, device=x.device)).sum()),
    ("topk", lambda x: x.topk(2).values.sum()), ("cummax", lambda x: x.cummax(1).values.sum()),
    ("logcumsumexp", lambda x: x.logcumsumexp(1).sum()), ("median", lambda x: x.median(1).values.sum()),
])
def test_autograd(name, fn):
    x = make(F32)
    xc = x.clone().requires_grad_()
    xt = x.to("tpu").requires_grad_()
    fn(xc).backward()
    fn(xt).backward()
    assert_same(xt.grad, xc.grad)


def test_no_cpu_fallback_for_core_reductions():
    x = make(F32).to("tpu")
    before = dict(torchtpu.metrics.M.cpu_fallbacks)
    for fn in (lambda t: t.sum(), lambda t: t.mean(1), lambda t: t.var(0), lambda t: t.max(1),
               lambda t: t.argmax(), lambda t: t.sort(), lambda t: t.topk(2), lambda t: t.cumsum(0),
               lambda t: t.norm(), lambda t: t.logsumexp(1), lambda t: torch.std_mean(t, 1), lambda t: t.median(1),
               lambda t: t.any(), lambda t: torch._foreach_norm([t, t])):
        fn(x)
    assert dict(torchtpu.metrics.M.cpu_fallbacks) == before


# ---- CPU's order among equal elements, searching, histograms -----------------

@pytest.mark.parametrize("dtype", [BOOL, I64, F32, BF16])
def test_unstable_sort_topk_kthvalue_mode_tie_indices(dtype):
    # Past 16 elements CPU's unstable sort is libstdc++'s introsort, topk an
    # nth_element and kthvalue a quickselect: the indices of ties are theirs.
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 3, (2, 40), generator=g).to(dtype)
    check(lambda t: t.sort(1), x)
    check(lambda t: t.sort(0, descending=True), x.t().contiguous())
    check(lambda t: t.argsort(1, descending=True), x)
    check(lambda t: torch.mode(t, 1), x)
    if dtype != BOOL:
        check(lambda t: t.topk(5, 1), x)
        check(lambda t: t.topk(7, 1, largest=False, sorted=False), x)
        check(lambda t: t.kthvalue(9, 1), x)


def test_searchsorted_and_bucketize():
    seq = torch.tensor([1., 2., 2., 3., float("nan")])
    v = torch.tensor([[0., 2., 2.5, float("nan"), 5.]])
    check(lambda s, x: torch.searchsorted(s, x), seq, v)
    check(lambda s, x: torch.searchsorted(s, x, side="right", out_int32=True), seq, v)
    check(lambda s: torch.searchsorted(s, 2.5), torch.tensor([1, 2, 3]))
    rows = torch.tensor([[3., 1., 2.], [9., 7., 8.]])
    check(lambda s, x, o: torch.searchsorted(s, x, sorter=o), rows,
          torch.tensor([[2., 2.5], [7., 10.]]), rows.argsort(1))
    check(lambda x, b: torch.bucketize(x, b, right=True), torch.tensor([[1, 5], [7, 2]]),
          torch.tensor([1, 3, 5, 7]))
    check(lambda x, b: torch.isin(x, b), torch.tensor([1, 5, 7, 2]), torch.tensor([7, 1]))
    with pytest.raises(RuntimeError):
        torch.searchsorted(seq.to("tpu"), v.to("tpu"), right=True, side="left")


def test_histograms():
    x = torch.randn(300, generator=torch.Generator().manual_seed(1)) * 3
    check(lambda t: torch.histc(t, 7, -2, 2.5), x)
    check(lambda t: torch.histc(t, 13), x)
    # Values on the edges: division then the last bin's closed right edge.
    check(lambda t: torch.histc(t, 10, 0, 1), torch.arange(11.) / 10)
    check(lambda t: tuple(torch.histogram(t, 10)), torch.arange(11.) / 10)
    check(lambda t: tuple(torch.histogram(t, 9, range=(-1., 1.), density=True)), x)
    y = torch.randn(200, 3, generator=torch.Generator().manual_seed(2))
    w = torch.rand(200, generator=torch.Generator().manual_seed(3))
    check(lambda t, w: torch.histogramdd(t, [3, 4, 5], weight=w, density=True)[0], y, w)
    # Integer input: CUDA's histc (CPU has none; Hugging Face's grouped MoE
    # experts count tokens per expert with it on every device but CPU and
    # MPS): the float histogram's counts, in the input's dtype.
    ints = torch.tensor([0, 1, 1, 3, 2, 3, 3, 5, -1, 9])
    for dtype in (torch.int32, torch.int64):
        for bins, lo, hi in ((4, 0, 3), (3, 0, 0), (5, 0, 9), (4, 0.5, 3.7)):
            got = torch.histc(ints.to(dtype).to("tpu"), bins, lo, hi)
            assert got.dtype == dtype
            assert torch.equal(got.cpu(), torch.histc(ints.float(), bins, int(lo), int(hi)).to(dtype))
    with pytest.raises(NotImplementedError):
        torch.histc(torch.ones(5, dtype=torch.bool, device="tpu"))


def test_segment_reduce_nan_ties_and_gradients():
    x = torch.tensor([[1., 0., 3., 3., float("nan"), 2., 0., 0., 5.],
                      [2., 2., -1., 4., 0., 1., 1., 1., 3.]])
    lengths = torch.tensor([[2, 3, 0, 4], [1, 2, 3, 3]])
    cot = torch.tensor([[1., -2., 3., 0.5], [2., 1., -1., 4.]])
    for reduce in ("max", "min", "sum", "mean", "prod"):
        for initial in (None, 2.):
            def f(t, n):
                t = t.clone().requires_grad_()
                out = torch.segment_reduce(t, reduce, lengths=n, axis=1, initial=initial)
                return out, torch.autograd.grad(out, t, cot.to(t.device))[0]
            got, expected = f(x.to("tpu"), lengths.to("tpu")), f(x, lengths)
            assert_same(got[0].detach(), expected[0].detach(), equal_nan=True)
            assert_same(got[1], expected[1], equal_nan=True)


def test_renorm_and_hash_tensor():
    x = make(F32, (4, 5))
    check(lambda t: t.renorm(2, 0, 1.5), x)
    check(lambda t: t.renorm(1, 1, 0.5), x.to(BF16), **_tol(BF16))
    for dtype in (F32, I64, BOOL, BF16):
        check(lambda t: torch.hash_tensor(t), make(dtype, (4, 5)))
        check(lambda t: torch.hash_tensor(t, 1, keepdim=True), make(dtype, (4, 5)))


@pytest.mark.parametrize("dtype", [F32, BF16, torch.float16])
def test_hash_tensor_of_special_floats(dtype):
    # The float64 bits of each element, as CPU's conversion gives them:
    # signed zeros, subnormals (normal doubles), infinities, NaNs with their
    # payloads (a signaling one quieted). A TPU has no float64 to convert in.
    bits = torch.tensor([0x7FA00001, 0xFFC00123 - 2 ** 32, 0x00000001, 0x80012345 - 2 ** 32,
                         0x007FFFFF], dtype=torch.int32).view(F32)
    x = torch.cat([torch.tensor([0.0, -0.0, 1.0, -2.5, 1e-40, 6e-39, 3.4e38, 1.17e-38, 5.96e-8, 6.1e-5,
                                 float("inf"), -float("inf"), float("nan")]), bits]).to(dtype)
    if conftest.ON_TPU and dtype is not F32:
        # Measured on a TPU v5e: a bfloat16 subnormal hashed as 0 and a
        # float16 NaN as the canonical NaN, whose bits the chip did not keep
        # (docs/tpu.md). Kept: the values it holds exactly.
        x = x[(x.float().abs() >= torch.finfo(dtype).tiny) | (x == 0) | x.isinf()]
    for i in range(len(x)):  # element by element: a xor of all would hide pairs of errors
        assert_same(torch.hash_tensor(x[i:i + 1].to("tpu")), torch.hash_tensor(x[i:i + 1]))
    assert_same(torch.hash_tensor(x.to("tpu")), torch.hash_tensor(x))


@pytest.mark.parametrize("x", [torch.tensor([3., 1, float("nan"), 1, float("nan"), 2]),
                               torch.tensor([[1, 1, 2], [2, 1, 5]]), torch.tensor([True, False, True]),
                               torch.tensor([], dtype=torch.float32), torch.tensor(5.)])
@pytest.mark.parametrize("fn", [torch.unique, torch.unique_consecutive])
def test_unique_on_device(mode, fn, x):
    # The number of distinct values is read back; nothing runs on the CPU fallback.
    torchtpu.metrics.reset()
    for inverse in (False, True):
        for counts in (False, True):
            want = fn(x, return_inverse=inverse, return_counts=counts)
            got = fn(x.to("tpu"), return_inverse=inverse, return_counts=counts)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert g.dtype == w.dtype and g.shape == w.shape
                torch.testing.assert_close(g.cpu(), w, equal_nan=True)
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == {}


def _equal_outputs(got, want):
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("x", [torch.tensor([[1, 2], [0, 5], [1, 2], [1, 2], [0, 5], [0, 4]]),
                               torch.tensor([[0., 1], [-0., 1], [2, float("nan")], [1, 1], [0, 1]]),
                               torch.rand(7, 3, 2, generator=torch.Generator().manual_seed(1)) > 0.5,
                               torch.zeros(0, 3)])
def test_unique_along_a_dim_on_device(mode, x):
    # Rows sorted lexicographically as on CPU (-0.0 equal to 0.0); the
    # inverse and the counts, which aten returns whatever the flags say.
    torchtpu.metrics.reset()
    for dim in range(-1, x.dim()):
        if x.numel() == 0 and x.shape[dim] != 0:
            continue
        for fn in (torch.unique, torch.unique_consecutive):
            _equal_outputs(fn(x.to("tpu"), dim=dim, return_inverse=True, return_counts=True),
                           fn(x, dim=dim, return_inverse=True, return_counts=True))
        _equal_outputs(torch.ops.aten.unique_dim(x.to("tpu"), dim), torch.ops.aten.unique_dim(x, dim))
        _equal_outputs(torch.ops.aten.unique_consecutive(x.to("tpu"), dim=dim),
                       torch.ops.aten.unique_consecutive(x, dim=dim))
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == {}
    with pytest.raises(RuntimeError, match="aren't selected"):
        torch.unique(torch.zeros(2, 0, device="tpu"), dim=0)


def test_repeat_interleave_with_a_tensor_of_repeats_on_device(mode):
    # The output's length is read back (with CPU's checks); nothing falls back.
    torchtpu.metrics.reset()
    for repeats in (torch.tensor([2, 0, 3]), torch.tensor([1, 4], dtype=torch.int32), torch.tensor([], dtype=torch.long)):
        _equal_outputs(torch.repeat_interleave(repeats.to("tpu")), torch.repeat_interleave(repeats))
    x = torch.randn(3, 4)
    r = torch.tensor([1, 0, 2, 3])
    _equal_outputs(torch.repeat_interleave(x.to("tpu"), r.to("tpu"), dim=1), torch.repeat_interleave(x, r, dim=1))
    _equal_outputs(torch.repeat_interleave(r.to("tpu"), output_size=6), torch.repeat_interleave(r, output_size=6))
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == {}
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        torch.repeat_interleave(torch.tensor([2, -1], device="tpu"))
    with pytest.raises(RuntimeError, match="allocated size does not match required size"):
        torch.repeat_interleave(r.to("tpu"), output_size=5)
    with pytest.raises(RuntimeError, match="only accept 1D vector"):
        torch.repeat_interleave(torch.tensor([[1]], device="tpu"))


def test_bincount_on_device(mode):
    x = torch.tensor([1, 3, 3, 0])
    w = torch.rand(4, generator=torch.Generator().manual_seed(0))
    torchtpu.metrics.reset()
    for kwargs in ({}, {"weights": w}, {"weights": w.to(torch.bfloat16)}, {"minlength": 7}):
        want = torch.bincount(x, **kwargs)
        got = torch.bincount(x.to("tpu"), **{k: v.to("tpu") if isinstance(v, torch.Tensor) else v
                                              for k, v in kwargs.items()})
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.cpu(), want)
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == {}
    with pytest.raises(RuntimeError, match="non-negative"):
        torch.bincount(torch.tensor([-1, 2], device="tpu"))


def test_large_tensors_order_ties_by_index():
    # Past REPLAY_MAX elements the (unspecified) order of equal elements is
    # index order, as a stable sort: CPU's is not replayed there.
    from torchtpu.ops.reduction import REPLAY_MAX
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 50, (3, REPLAY_MAX // 3 + 5), generator=g).float()
    t = x.to("tpu")
    v, i = t.sort(1, descending=True)
    ev, ei = x.sort(dim=1, descending=True, stable=True)
    assert torch.equal(v.cpu(), ev) and torch.equal(i.cpu(), ei)
    assert torch.equal(t.argsort(1).cpu(), x.argsort(dim=1, stable=True))
    tv, ti = t.topk(300, 1)
    assert torch.equal(tv.cpu(), ev[:, :300]) and torch.equal(ti.cpu(), ei[:, :300])
    kv, ki = t.kthvalue(1000, 1)
    sv, si = x.sort(dim=1, stable=True)
    assert torch.equal(kv.cpu(), sv[:, 999]) and torch.equal(ki.cpu(), si[:, 999])
