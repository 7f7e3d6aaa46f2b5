"""Factories, copies and dtype conversion on tpu against PyTorch on CPU."""
import pytest
import torch

import torchtpu
from conftest import assert_same

ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
              torch.complex64, torch.complex128]


def both(fn):
    """fn(device) on CPU and tpu agree; nothing ran on the CPU fallback."""
    expected = fn("cpu")
    torchtpu.metrics.reset()
    got = fn("tpu")
    assert_same(got, expected)
    assert not torchtpu.metrics.snapshot()["cpu_fallbacks"]
    return got


@pytest.mark.parametrize("args,kw", [
    ((5,), {}), ((0,), {}), ((2, 9), {}), ((1, 10, 3), {}), ((10, 1, -3), {}),
    ((0, 1, 0.1), {}), ((-1.5, 2.25, 0.5), {}), ((5,), {"dtype": torch.float32}),
    ((1, 4), {"dtype": torch.bfloat16}), ((0.5, 4.5), {"dtype": torch.int64}),
    ((3,), {"dtype": torch.int32}), ((0, 2, 0.3), {"dtype": torch.float64}),
])
def test_arange(args, kw):
    both(lambda d: torch.arange(*args, **kw, device=d))


def test_arange_values_are_not_cached_by_key(mode):
    # Same types, other values: another length and other numbers.
    for n in (3, 7, 4):
        both(lambda d: torch.arange(n, device=d))
        both(lambda d: torch.arange(n, 2 * n, 0.5, device=d))


def test_arange_out_and_errors():
    out = torch.empty(4, dtype=torch.int64, device="tpu")
    torch.arange(2, 6, out=out)
    assert_same(out, torch.arange(2, 6))
    with pytest.raises(RuntimeError):
        torch.arange(0, 5, -1, device="tpu")


@pytest.mark.parametrize("fn", [
    lambda d: torch.linspace(0, 1, 7, device=d),
    lambda d: torch.linspace(-3, 5, 1, device=d),
    lambda d: torch.linspace(-3, 5, 0, device=d),
    lambda d: torch.linspace(2, -7, 10, dtype=torch.float64, device=d),
    lambda d: torch.linspace(0, 10, 4, dtype=torch.int64, device=d),
    lambda d: torch.linspace(-5, 17, 6, dtype=torch.int32, device=d),
    lambda d: torch.logspace(0, 2, 5, device=d),
    lambda d: torch.logspace(-1, 1, 4, base=2.0, dtype=torch.float64, device=d),
    lambda d: torch.eye(3, device=d),
    lambda d: torch.eye(3, 5, dtype=torch.int64, device=d),
    lambda d: torch.eye(4, 2, dtype=torch.bool, device=d),
    lambda d: torch.tril_indices(3, 4, device=d),
    lambda d: torch.tril_indices(4, 3, -1, device=d),
    lambda d: torch.triu_indices(4, 3, 1, device=d),
    lambda d: torch.triu_indices(3, 3, dtype=torch.int32, device=d),
    lambda d: torch.zeros(2, 3, device=d),
    lambda d: torch.ones(2, 3, dtype=torch.int8, device=d),
    lambda d: torch.full((2, 3), 7, device=d),
    lambda d: torch.full((2,), 2.5, device=d),
    lambda d: torch.full((2,), True, device=d),
    lambda d: torch.full((2,), 1 + 2j, device=d),
    lambda d: torch.scalar_tensor(3, device=d),
    lambda d: torch.tensor(3.5, device=d),
    lambda d: torch.zeros(0, 3, device=d),
    lambda d: torch.empty(2, 3, device=d).shape,
    lambda d: torch.empty_strided((2, 3), (1, 2), device=d).shape,
], ids=lambda f: "")
def test_factories(fn):
    both(fn)


def test_linspace_dynamic_endpoints(mode):
    for a, b in ((0, 1), (-2.5, 3.0), (10, 0)):
        both(lambda d: torch.linspace(a, b, 5, device=d))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_tensor_literal_every_dtype(dtype):
    both(lambda d: torch.tensor([1, 0, 2], dtype=dtype, device=d))
    both(lambda d: torch.tensor([[1, 0], [2, 3]], dtype=dtype, device=d))
    both(lambda d: torch.zeros(2, dtype=dtype, device=d))
    both(lambda d: torch.ones(2, dtype=dtype, device=d))


def test_tensor_of_0dim_tensors():
    # torch.tensor() reads each 0-dim tensor at the backend's _local_scalar_dense
    # (Hugging Face's SuppressTokensLogitsProcessor(list(ids))).
    both(lambda d: torch.tensor(list(torch.tensor([3, 1, 4], device=d)), device=d))
    both(lambda d: torch.as_tensor([torch.tensor(2.5, device=d), torch.tensor(-1.0, device=d)],
                                   device=d))
    cpu = torch.tensor(list(torch.tensor([3, 1], device="tpu")))
    assert cpu.device.type == "cpu" and torch.equal(cpu, torch.tensor([3, 1]))


def test_like_and_new():
    x = torch.randn(3, 4)
    t = x.to("tpu")
    for fn in (torch.zeros_like, torch.ones_like, lambda a: torch.full_like(a, 3),
               lambda a: torch.ones_like(a, dtype=torch.int64),
               lambda a: torch.full_like(a, 2.5, dtype=torch.int32),
               lambda a: a.new_full((2,), 4), lambda a: a.new_zeros((2, 1)),
               lambda a: a.new_ones(3), lambda a: a.new_tensor([1, 2])):
        assert_same(fn(t), fn(x))
    e = torch.empty_like(t)
    assert e.shape == x.shape and e.dtype == x.dtype and e.device.type == "tpu"
    e = t.new_empty((5,), dtype=torch.int16)
    assert e.shape == (5,) and e.dtype == torch.int16


def test_fill_zero_copy_through_views(mode):
    base = torch.randn(4, 5)
    tb = base.to("tpu")
    for b in (base, tb):
        b[1:3, ::2].fill_(2.5)
        b.t()[0].zero_()
        b[3].copy_(torch.arange(5))  # from a CPU tensor, int -> float
        b[:, 4].fill_(torch.tensor(-1.0, device=b.device))
    assert_same(tb, base)


CONVERSIONS = [
    (torch.float32, torch.int32), (torch.float32, torch.int64), (torch.float64, torch.int8),
    (torch.float32, torch.uint8), (torch.float32, torch.bool), (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16), (torch.float32, torch.complex64), (torch.complex64, torch.float32),
    (torch.complex128, torch.int64), (torch.complex64, torch.bool), (torch.bfloat16, torch.int32),
    (torch.int64, torch.float32), (torch.int64, torch.bool), (torch.bool, torch.float32),
    (torch.bool, torch.int64), (torch.int32, torch.int8), (torch.int64, torch.float64),
    (torch.float16, torch.bfloat16),
]


@pytest.mark.parametrize("src,dst", CONVERSIONS, ids=[f"{a}->{b}" for a, b in CONVERSIONS])
def test_to_dtype(src, dst):
    g = torch.Generator().manual_seed(0)
    vals = torch.tensor([-2.7, -1.5, -0.5, 0.0, 0.4, 1.5, 2.9, 100.2], dtype=torch.float64)
    if src.is_complex:
        x = (vals + 1j * torch.randn(8, generator=g, dtype=torch.float64)).to(src)
    elif src == torch.bool:
        x = vals > 0
    elif src.is_floating_point:
        x = vals.to(src)
    else:
        x = torch.tensor([-3, -1, 0, 1, 2, 7, 100, -100]).to(src)
    if dst == torch.uint8 and src.is_floating_point:
        x = x.abs()  # negative float -> uint8 is undefined in C++
    if dst in (torch.int8,) and src.is_floating_point:
        x = x.clamp(-100, 100)
    assert_same(x.to("tpu").to(dst), x.to(dst))
    assert_same(x.to("tpu", dst), x.to(dst))


def test_clone_and_lift():
    x = torch.randn(3, 4)
    t = x.to("tpu")
    c = t.t().clone()
    assert_same(c, x.t().clone())
    c.fill_(0)
    assert_same(t, x)  # clone does not alias
    c = t.clone(memory_format=torch.contiguous_format)
    assert_same(c, x)
    assert_same(torch.ops.aten.lift_fresh_copy(t), x)


@pytest.mark.parametrize("copy", [
    lambda a: a.transpose(0, 2).clone(),
    lambda a: a.permute(1, 2, 0).to(torch.float64),
    lambda a: a[:, :2].clone(),                                   # not dense: contiguous
    lambda a: a.transpose(0, 2).clone(memory_format=torch.contiguous_format),
    lambda a: a.unsqueeze(0).to(memory_format=torch.channels_last),
    lambda a: a.unsqueeze(0).to(memory_format=torch.channels_last).contiguous(),
    lambda a: torch.empty_like(a.transpose(0, 2)).fill_(3),
    lambda a: torch.zeros_like(a.permute(2, 0, 1)).add_(a.permute(2, 0, 1)),
    lambda a: torch.full_like(a.transpose(1, 2), 2.0),
    lambda a: torch.empty(1, 2, 3, 4, memory_format=torch.channels_last, device=a.device).fill_(1),
])
def test_copies_keep_strides(copy):
    # preserve_format keeps a dense tensor's strides, as on CPU: what
    # view()/resize_() of the copy see depends on them.
    x = torch.arange(24.).reshape(2, 3, 4)
    want, got = copy(x), copy(x.to("tpu"))
    assert got.stride() == want.stride()
    assert_same(got, want)
    assert_same(got.resize_(7), want.resize_(7))


@pytest.mark.parametrize("layout", [lambda a: a.transpose(0, 2), lambda a: a.permute(1, 2, 0),
                                    lambda a: a[:, ::2], lambda a: a.unsqueeze(0).to(memory_format=torch.channels_last)])
def test_transfer_keeps_strides(layout):
    # CPU -> tpu allocates with the source's strides where dense, as CUDA does.
    x = layout(torch.arange(24.).reshape(2, 3, 4))
    t = x.to("tpu")
    assert t.stride() == x.clone().stride()
    assert_same(t, x)
    assert_same(t.view(-1) if t.is_contiguous() else t.reshape(-1), x.reshape(-1))


def test_requires_grad_factories():
    a = torch.arange(4.0, device="tpu", requires_grad=True)
    (a * a).sum().backward()
    assert_same(a.grad, 2 * torch.arange(4.0))
    z = torch.zeros(3, device="tpu", requires_grad=True)
    (z + 1).sum().backward()
    assert_same(z.grad, torch.ones(3))
