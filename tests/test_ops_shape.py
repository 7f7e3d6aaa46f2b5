"""Shape lowerings (cat, flip, roll, repeat, pads, triangles, scatters into
views, dtype reinterpretation) against PyTorch on CPU: values, dtypes,
shapes, non-contiguous inputs, out=/in-place variants and autograd."""
import pytest
import torch
import torch.nn.functional as F

import torchtpu
from conftest import assert_same, make

F32, F64, BF16, I64, I32, BOOL, C64 = (torch.float32, torch.float64, torch.bfloat16,
                                       torch.int64, torch.int32, torch.bool, torch.complex64)




def tpu(x):
    return x.to("tpu") if isinstance(x, torch.Tensor) else x


def check(fn, *args, fallback=False):
    """fn on CPU and on tpu copies of args agree (values, dtype, shape), and
    nothing ran on the CPU fallback unless allowed."""
    expected = fn(*args)
    torchtpu.metrics.reset()
    got = fn(*[tpu(a) for a in args])
    assert_same(got, expected)
    if not fallback:
        assert not torchtpu.metrics.snapshot()["cpu_fallbacks"]
    return got


def noncontig(x):
    """x's values in a transposed tpu tensor (a view with non-unit strides)."""
    return x.t().contiguous().to("tpu").t() if x.dim() == 2 else x.to("tpu")


CASES = [
    ("cat0", lambda a: torch.cat([a, a * 2], 0)),
    ("cat1", lambda a: torch.cat([a, a[:, :1]], -1)),
    ("stack", lambda a: torch.stack([a, a + 1], 1)),
    ("hstack", lambda a: torch.hstack([a, a])),
    ("clone", lambda a: a.clone()),
    ("contiguous", lambda a: a.t().contiguous()),
    ("flip", lambda a: a.flip(0, 1)),
    ("flip_neg", lambda a: a.flip(-1)),
    ("fliplr", torch.fliplr),
    ("rot90", lambda a: torch.rot90(a, 1, (0, 1))),
    ("roll", lambda a: a.roll(1, 0)),
    ("roll2", lambda a: a.roll((1, -2), (0, 1))),
    ("roll_flat", lambda a: a.roll(5)),
    ("repeat", lambda a: a.repeat(2, 1, 3)),
    ("tile", lambda a: a.tile((2,))),
    ("tril", lambda a: a.tril()),
    ("tril1", lambda a: a.tril(1)),
    ("triu_neg", lambda a: a.triu(-1)),
    ("reshape", lambda a: a.t().reshape(-1)),
    ("flatten", lambda a: a.t().flatten()),
    ("diag_embed", lambda a: torch.diag_embed(a)),
    ("diag_embed_off", lambda a: torch.diag_embed(a, -1, 0, 2)),
    ("index_select", lambda a: a.index_select(1, torch.tensor([3, 0, 0], device=a.device))),
    ("narrow_copy", lambda a: torch.narrow_copy(a, 1, 1, 2)),
    ("expand_copy", lambda a: torch.expand_copy(a[:1], (3, 4))),
    ("permute_copy", lambda a: torch.permute_copy(a, (1, 0))),
    ("split_copy", lambda a: torch.split_with_sizes_copy(a, [1, 2])),
    ("unfold_copy", lambda a: torch.unfold_copy(a, 1, 2, 1)),
    ("movedim", lambda a: torch.movedim(a[None], 0, 2).contiguous()),
    ("pad_const", lambda a: F.pad(a, (1, 2, 0, 1), value=3)),
    ("pad_crop", lambda a: F.pad(a, (-1, 2))),
    ("slice_scatter", lambda a: torch.slice_scatter(a, a[:, ::2] * 2, 1, 0, None, 2)),
    ("select_scatter", lambda a: torch.select_scatter(a, a[1] * 3, 0, -1)),
    ("diagonal_scatter", lambda a: torch.diagonal_scatter(a, a.diagonal(1) + 5, 1)),
    ("select_backward", lambda a: torch.ops.aten.select_backward(a[1] * 2, [3, 4], 0, -2)),
    ("slice_backward", lambda a: torch.ops.aten.slice_backward(a[:, 1:4:2] * 2, [3, 4], 1, 1, 4, 2)),
    ("slice_backward_end", lambda a: torch.ops.aten.slice_backward(a[1:] * 2, [3, 4], 0, -2,
                                                                   2 ** 63 - 1, 1)),
]


@pytest.mark.parametrize("name,fn", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [F32, I64])
def test_shape_ops(name, fn, dtype):
    check(fn, make(dtype))


@pytest.mark.parametrize("name,fn", CASES[:16], ids=[c[0] for c in CASES[:16]])
def test_shape_ops_noncontiguous(name, fn):
    x = make(F32)
    assert_same(fn(noncontig(x)), fn(x))


@pytest.mark.parametrize("dtype", [BF16, BOOL, C64])
def test_more_dtypes(dtype, mode):
    x = make(dtype)
    for fn in (lambda a: torch.cat([a, a]), lambda a: a.flip(1), lambda a: a.roll(2, 1),
               lambda a: a.repeat(2, 2), lambda a: a.tril(), lambda a: F.pad(a, (1, 1))):
        check(fn, x)


def test_cat_promotes_and_skips_legacy_empty():
    f, i, b = make(F32), make(I64), make(BOOL)
    check(lambda x, y: torch.cat([x, y]), f, i)
    check(lambda x, y: torch.cat([x, y], 1), i, b)
    check(lambda x, y: torch.cat([x, y]), f.to(BF16), f.to(F64))
    check(lambda x, y: torch.cat([x, y]), f, torch.empty(0, dtype=I64))
    check(lambda x, y: torch.cat([x, y]), torch.empty(0), torch.empty(0, dtype=I64))
    check(lambda x, y: torch.cat([x, y]), make(F32, (0, 4)), f)


def test_cat_out_and_backward():
    a, b = make(F32), make(F32, (2, 4), seed=1)
    out = torch.empty(5, 4, device="tpu")
    res = torch.cat([a.to("tpu"), b.to("tpu")], out=out)
    assert res is out
    assert_same(out, torch.cat([a, b]))
    ta, tb = a.to("tpu").requires_grad_(), b.to("tpu").requires_grad_()
    ca, cb = a.clone().requires_grad_(), b.clone().requires_grad_()
    w = torch.arange(20.).reshape(5, 4)
    (torch.cat([ta, tb]) * w.to("tpu")).sum().backward()
    (torch.cat([ca, cb]) * w).sum().backward()
    assert_same(ta.grad, ca.grad)
    assert_same(tb.grad, cb.grad)


@pytest.mark.parametrize("mode_,shape,pad", [
    ("reflect", (2, 5), (2, 1)), ("reflect", (1, 2, 4, 5), (2, 1, 1, 2)),
    ("reflect", (1, 1, 3, 4, 5), (1, 1, 1, 2, 2, 1)),
    ("replicate", (2, 5), (2, 1)), ("replicate", (1, 2, 4, 5), (2, 1, 0, 3)),
    ("replicate", (1, 1, 3, 4, 5), (1, 0, 2, 1, 1, 1)), ("replicate", (2, 5), (-1, 2)),
    ("circular", (2, 5), (2, 1)), ("constant", (2, 3, 5), (1, 2, -1, 1)),
    # Negative reflect pads crop; the other side reflects about the whole
    # input's edge, into the cropped part (OpInfo's last pad.reflect sample).
    ("reflect", (1, 3, 4, 4), (-1, 1, -2, 1)), ("reflect", (1, 3, 5, 6), (-2, 3, -2, 3)),
    ("reflect", (2, 7), (3, -2)), ("reflect", (1, 1, 4, 5, 6), (-1, 3, 3, -1, -1, -1)),
])
def test_pad_forward_backward(mode_, shape, pad):
    x = make(F32, shape)
    fn = (lambda a: F.pad(a, pad, mode=mode_)) if mode_ != "constant" else (
        lambda a: F.pad(a, pad, value=1.5))
    check(fn, x)
    tx, cx = x.to("tpu").requires_grad_(), x.clone().requires_grad_()
    out_c = fn(cx)
    w = torch.randn(out_c.shape)
    (fn(tx) * w.to("tpu")).sum().backward()
    (out_c * w).sum().backward()
    assert_same(tx.grad, cx.grad)


def test_inplace_through_view():
    base = make(F32, (4, 5))
    tb = base.to("tpu")
    tb[1:3].tril_(1)
    base[1:3].tril_(1)
    assert_same(tb, base)
    big_c = torch.zeros(5, 6)
    big_t = big_c.to("tpu")
    torch.triu(tb[:3, 1:4].t(), out=big_t[1:4, 2:5])  # out= into a view
    torch.triu(base[:3, 1:4].t(), out=big_c[1:4, 2:5])
    assert_same(big_t, big_c)
    out_t = torch.empty(4, 3, device="tpu")
    torch.ops.aten.flip.out(
        tb[:, 1:4], [0], out=out_t)
    assert_same(out_t, torch.flip(base[:, 1:4], (0,)))


def test_view_dtype():
    x = make(F32)
    check(lambda a: a.view(torch.int32), x)
    check(lambda a: a.view(torch.int16), x)
    check(lambda a: a.view(torch.uint8), x)
    check(lambda a: a.view(F64), x)
    check(lambda a: a.view(BF16), x)
    check(lambda a: a.view(C64), x)
    check(lambda a: a.view(torch.int8), make(BOOL))
    check(lambda a: a.view(BOOL), torch.tensor([[0, 1, 1, 0]], dtype=torch.uint8))
    check(lambda a: a.view(F32), make(C64))
    check(lambda a: a.view(F32), make(F32, ()))


def test_view_as_real_complex_and_parts():
    z = make(C64, (3, 2))
    check(torch.view_as_real, z)
    check(lambda a: a.real, z)
    check(lambda a: a.imag, z)
    check(torch.view_as_complex, make(F32, (3, 2)))
    check(torch.view_as_complex, make(F64, (2, 3, 2)))
    r = make(F32)
    assert_same(r.to("tpu").real, r)  # a real tensor's .real is itself


def test_view_copy_ops_and_the_negative_bit(mode):
    # The X_copy ops (functionalized programs and torch.func's map emit them)
    # copy X's view out contiguous; _neg_view's bit is materialized, as _conj's.
    aten = torch.ops.aten
    x = make(torch.float32, (4, 6, 2))
    c = torch.view_as_complex(make(torch.float32, (3, 2), seed=1))
    cases = [(aten.select_copy.int, (x, 1, 2)), (aten.slice_copy.Tensor, (x, 1, 1, 5, 2)),
             (aten.split_copy.Tensor, (x, 4, 1)), (aten.detach_copy.default, (x,)),
             (aten.view_as_real_copy.default, (c,)), (aten.view_as_complex_copy.default, (torch.view_as_real(c),)),
             (aten._conj_copy.default, (c,)), (aten._neg_view_copy.default, (x,)), (aten._neg_view.default, (x,))]
    torchtpu.metrics.reset()
    for op, args in cases:
        want = op(*args)
        got = op(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args])
        for g, w in zip(got if isinstance(got, (list, tuple)) else [got], want if isinstance(want, (list, tuple)) else [want]):
            assert g.shape == w.shape and g.dtype == w.dtype, op
            assert torch.equal(g.cpu(), w.resolve_neg()), op
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == {}


def test_as_strided_scatter():
    x = make(F32, (4, 4))
    src = make(F32, (2, 2), seed=3)
    check(lambda a, s: torch.as_strided_scatter(a, s, (2, 2), (1, 2), 1), x, src)
    # The strides index the input's own layout (a transposed input stays so).
    xt = x.t().contiguous().t()
    got = torch.as_strided_scatter(x.t().contiguous().to("tpu").t(), src.to("tpu"), (2, 2), (1, 2), 1)
    assert_same(got, torch.as_strided_scatter(xt, src, (2, 2), (1, 2), 1))
    # An offset, strided input: the offset is absolute in a copy of its whole
    # storage, and the result keeps the input's strides and offset.
    base = make(F32, (16,), seed=4)
    want = torch.as_strided_scatter(base[1::2], src, (2, 2), (2, 1), 0)
    got = torch.as_strided_scatter(base.to("tpu")[1::2], src.to("tpu"), (2, 2), (2, 1), 0)
    assert_same(got, want)
    assert (got.stride(), got.storage_offset()) == (want.stride(), want.storage_offset())


def test_repeat_zero_and_scalar():
    check(lambda a: a.repeat(0, 2), make(F32))
    check(lambda a: a.repeat(3), make(F32, ()))
    check(lambda a: a.flip(()), make(F32, ()))
    check(lambda a: a.roll(1), make(F32, (5,)))
