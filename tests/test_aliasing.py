"""Views and mutation keep PyTorch's aliasing: each case runs the same code on
CPU and on tpu and compares every tensor involved."""
import pytest
import torch
from conftest import assert_same


def _both(fn, *cpu_inputs):
    """Run fn on CPU copies and on tpu copies of the inputs; compare what fn
    returns and the inputs afterwards (mutations included)."""
    cpu = [x.clone() for x in cpu_inputs]
    tpu = [x.clone().to("tpu") for x in cpu_inputs]
    out_cpu = fn(*cpu)
    out_tpu = fn(*tpu)
    for t, c in zip(tpu, cpu):
        assert_same(t, c)
    if out_cpu is not None:
        outs_cpu = out_cpu if isinstance(out_cpu, tuple) else (out_cpu,)
        outs_tpu = out_tpu if isinstance(out_tpu, tuple) else (out_tpu,)
        for t, c in zip(outs_tpu, outs_cpu):
            assert_same(t, c)


def test_setitem_through_view(mode):
    def fn(x):
        v = x.view(12)
        v[0] = 5
        return v
    _both(fn, torch.arange(12.0).reshape(3, 4))


def test_inplace_on_transpose(mode):
    def fn(x):
        t = x.t()
        t[1].mul_(0)
        t.mul_(2)
        return t
    _both(fn, torch.arange(12.0).reshape(3, 4))


def test_inplace_on_select(mode):
    def fn(x):
        x[1].add_(1)
        return x[1]
    _both(fn, torch.arange(12.0).reshape(3, 4))


def test_narrow_copy(mode):
    def fn(x, y):
        x.narrow(1, 1, 2).copy_(y)
        return x.narrow(1, 1, 2)
    _both(fn, torch.zeros(3, 4), torch.arange(6.0).reshape(3, 2))


def test_copy_from_cpu_into_view(mode):
    x_cpu, x = torch.zeros(2, 3), torch.zeros(2, 3).to("tpu")
    src = torch.arange(3.0)
    x_cpu[1].copy_(src)
    x[1].copy_(src)
    assert_same(x, x_cpu)


def test_out_argument(mode):
    def fn(a, b, out):
        r = torch.add(a, b, out=out)
        assert r is out
        return out
    _both(fn, torch.randn(3, 4), torch.randn(3, 4), torch.zeros(3, 4))


def test_out_argument_into_view(mode):
    def fn(a, b, buf):
        torch.mul(a, b, out=buf[1])
        return buf
    _both(fn, torch.randn(4), torch.randn(4), torch.zeros(3, 4))


def test_out_argument_resized(mode):
    # An empty out= tensor takes the result's shape, as on CPU.
    def fn(a, out):
        r = torch.linalg.inv(a, out=out)
        assert r is out and out.shape == (4, 4)
        return out
    _both(fn, torch.randn(4, 4) + 4 * torch.eye(4), torch.empty(0))


def test_out_argument_resized_tuple(mode):
    def fn(x, values, indices):
        torch.sort(x, out=(values, indices))
        return values, indices
    _both(fn, torch.randn(7), torch.empty(0), torch.empty(0, dtype=torch.long))


def test_out_argument_reshaped_by_composite(mode):
    # kron writes through an _unsafe_view of its out= tensor.
    def fn(a, b, buf):
        torch.kron(a, b, out=buf[1])
        return buf
    _both(fn, torch.randn(2, 3), torch.randn(3, 2), torch.zeros(2, 6, 6))


def test_resize(mode):
    def fn(x):
        v = x.view(-1)
        x.resize_(2, 3)        # fits: same storage, v still aliases it
        x.mul_(10)
        return x, v
    _both(fn, torch.arange(12.0).reshape(3, 4))


def test_resize_grows_and_keeps_values(mode):
    x = torch.arange(4.0).to("tpu")
    x.resize_(2, 4)
    assert x.shape == (2, 4) and x.stride() == (4, 1)
    assert_same(x[0], torch.arange(4.0))
    y = torch.empty(0, device="tpu").resize_as_(torch.empty(3, 2))
    assert y.shape == (3, 2)


def test_out_argument_dtype_cast(mode):
    def fn(a, out):
        torch.add(a, 1, out=out)
        return out
    _both(fn, torch.arange(4), torch.zeros(4, dtype=torch.float64))


def test_data_assignment(mode):
    x = torch.zeros(2, 3).to("tpu")
    alias = x.view(6)
    y = torch.arange(6.0).reshape(2, 3).to("tpu")
    x.data = y
    assert_same(x, torch.arange(6.0).reshape(2, 3))
    x.add_(1)
    assert_same(y, torch.arange(6.0).reshape(2, 3) + 1)  # x now shares y's data
    assert_same(alias, torch.zeros(6))  # the old storage is untouched
    # .data of a parameter: changes to the shape and dtype too
    p = torch.nn.Parameter(torch.zeros(2).to("tpu"))
    p.data = torch.ones(3, dtype=torch.float64).to("tpu")
    assert p.shape == (3,) and p.dtype == torch.float64
    assert_same(p, torch.ones(3, dtype=torch.float64))


def test_data_inplace_is_seen(mode):
    p = torch.nn.Parameter(torch.zeros(3).to("tpu"))
    p.data.add_(2)
    assert_same(p, torch.full((3,), 2.0))


def test_zero_slice(mode):
    def fn(x):
        x[:, 1:3].zero_()
        x[::2].zero_()
        return x
    _both(fn, torch.arange(20.0).reshape(4, 5) + 1)


def test_write_seen_by_every_view(mode):
    def fn(x):
        a = x.view(4, 3)
        b = x.t()
        c = x[1:]
        d = x.unsqueeze(0).expand(2, 3, 4)
        e = x.reshape(12)[::3]
        c.mul_(10)
        b[0].fill_(-1)
        return a, b, c, d, e
    _both(fn, torch.arange(12.0).reshape(3, 4))


def test_view_of_view_write(mode):
    def fn(x):
        y = x.view(2, 6)[:, ::2].t()
        y[1, 0] = 100
        y.add_(1)
        return y
    _both(fn, torch.arange(12.0))


def test_dtype_views_alias_their_storage(mode):
    """x.view(dtype), view_as_real and view_as_complex read the storage's
    bytes as another dtype: writes through either side reach the other."""
    def ints(x):
        v = x.view(torch.uint8)
        v[0] = 9  # the lowest byte of x[0]
        w = v[4:12].view(torch.int32)  # bytes 4..11: x[1:3] again
        w += 100
        x[3] = -1
        return v, w
    _both(ints, torch.arange(4, dtype=torch.int32))

    def floats(x):
        bits = x.view(torch.int32)
        bits.add_(1)  # the next float up
        halves = x[1:].view(torch.bfloat16)
        halves[1::2] = 3.0  # the high halves: x[1:] becomes 3.0 and a bit
        return bits, halves
    _both(floats, torch.linspace(1, 2, 4))

    def complexes(c):
        r = torch.view_as_real(c)
        r[0, 1] = -7  # c[0]'s imaginary part
        back = torch.view_as_complex(r[1:])
        back.mul_(1j)
        c.add_(1)
        return r, back
    _both(complexes, torch.tensor([1 + 2j, 3 + 4j, 5 + 6j]))

    def masks(m):
        b = m.view(torch.bool)
        b[1] = True
        return b
    _both(masks, torch.tensor([1, 0, 0, 1], dtype=torch.uint8))


def test_dtype_view_gradients(mode):
    c_cpu = torch.randn(5, dtype=torch.complex64, requires_grad=True)
    c = c_cpu.detach().to("tpu").requires_grad_()
    for z in (c_cpu, c):
        (torch.view_as_real(z * 2) ** 2).sum().backward()
    assert_same(c.grad, c_cpu.grad)


def test_detach_shares_storage(mode):
    def fn(x):
        d = x.detach()
        d.sub_(3)
        return d
    _both(fn, torch.arange(5.0))


def test_int_inplace(mode):
    def fn(x):
        x[2:].add_(2 ** 40)
        return x
    _both(fn, torch.arange(5))


@pytest.mark.parametrize("opt_name", ["SGD", "Adam", "AdamW"])
def test_optimizer_updates_params_in_place(mode, opt_name):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    tpu_model = torch.nn.Linear(4, 3).to("tpu")
    tpu_model.load_state_dict(model.state_dict())
    kw = {"lr": 0.1, "momentum": 0.9} if opt_name == "SGD" else {"lr": 0.1}
    opts = [getattr(torch.optim, opt_name)(m.parameters(), **kw) for m in (model, tpu_model)]
    views = [m.weight[0] for m in (model, tpu_model)]  # a view taken before the steps
    ids = [id(p) for p in tpu_model.parameters()]
    x = torch.randn(5, 4)
    for _ in range(2):
        for m, opt, inp in ((model, opts[0], x), (tpu_model, opts[1], x.to("tpu"))):
            opt.zero_grad()
            m(inp).pow(2).sum().backward()
            opt.step()
    assert [id(p) for p in tpu_model.parameters()] == ids
    for p_tpu, p_cpu in zip(tpu_model.parameters(), model.parameters()):
        assert_same(p_tpu, p_cpu.detach(), rtol=1e-5, atol=1e-6)
    assert_same(views[1], views[0].detach(), rtol=1e-5, atol=1e-6)


def test_inplace_view_ops_change_the_tensor_itself(mode):
    """t_, transpose_, unsqueeze_, squeeze_, as_strided_ change a tensor's
    shape and strides in place; it still aliases its base."""
    results = []
    for dev in ("cpu", "tpu"):
        x = torch.arange(12.0).view(3, 4).to(dev)
        v = x[1:]
        v.t_()
        v.unsqueeze_(0)
        v.squeeze_(0)
        v.transpose_(0, 1)
        v.mul_(-1)
        y = torch.arange(6.0).to(dev)
        y.as_strided_((2, 2), (1, 2), 1)
        w = torch.arange(6.0).to(dev)[2:]
        w.as_strided_((2,), (1,), 0)   # the offset is absolute: w now starts at 0
        results.append((x, v, y, v.shape, v.stride(), y.shape, y.stride(), w.cpu(), w.storage_offset()))
    (x, v, y, *meta), (tx, tv, ty, *tmeta) = results
    assert all(not isinstance(m, torch.Tensor) or torch.equal(m, tm) for m, tm in zip(meta, tmeta))
    assert [m for m in meta if not isinstance(m, torch.Tensor)] == \
        [m for m in tmeta if not isinstance(m, torch.Tensor)]
    assert_same(tx, x)
    assert_same(tv, v)
    assert_same(ty, y)


def test_strided_views_of_a_storage_read_as_on_cpu():
    """Every (shape, strides, offset) view of a storage reads CPU's elements,
    through as_strided on tpu: overlapping, broadcast (stride 0), permuted,
    and sub-blocks at an offset (an attention's q, k and v in one qkv
    projection), whether or not the view's rows reach the storage's end."""
    import random
    rng = random.Random(0)
    base = torch.arange(120, dtype=torch.float32).reshape(10, 12)
    tpu = base.to("tpu")
    checked = 0
    while checked < 300:
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
        stride = tuple(rng.choice([0, 1, 2, 3, 4, 5, 6, 12, 24, 60]) for _ in shape)
        offset = rng.randint(0, 40)
        if offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride)) > base.numel():
            continue
        assert_same(tpu.as_strided(shape, stride, offset), base.as_strided(shape, stride, offset))
        checked += 1
    qkv = torch.randn(2, 5, 3 * 8)
    for part in range(3):
        view = qkv.view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)[part]
        assert_same(qkv.to("tpu").view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)[part] * 1, view * 1)
