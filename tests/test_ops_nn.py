"""nn ops on tpu vs CPU, forward and backward: convolution, pooling,
normalization (with running stats), softmax, losses, attention, LSTM."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from conftest import assert_same, compare

DEV = "tpu"




def r(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


# ---- convolution ------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(), dict(stride=2, padding=1), dict(padding=2, dilation=2), dict(groups=2, padding="same"),
])
def test_conv2d(kw):
    compare(lambda x, w, b: F.conv2d(x, w, b, **kw), r(2, 4, 7, 6), r(6, 4 // kw.get("groups", 1), 3, 3),
            r(6))


def test_conv1d_3d_unbatched_nobias():
    compare(lambda x, w: F.conv1d(x, w, stride=2, padding=1), r(2, 3, 9), r(4, 3, 3))
    compare(lambda x, w, b: F.conv3d(x, w, b, padding=1), r(1, 2, 4, 5, 4), r(3, 2, 3, 3, 3), r(3))
    compare(lambda x, w: F.conv2d(x, w), r(3, 6, 6), r(2, 3, 3, 3))


@pytest.mark.parametrize("kw", [dict(), dict(stride=2, padding=1, output_padding=1),
                                dict(stride=2, groups=2, dilation=2)])
def test_conv_transpose2d(kw):
    compare(lambda x, w, b: F.conv_transpose2d(x, w, b, **kw), r(2, 4, 5, 4),
            r(4, 6 // kw.get("groups", 1) * 1, 3, 3), r(6 // kw.get("groups", 1) * kw.get("groups", 1)))


def test_conv_transpose1d_and_bf16():
    compare(lambda x, w: F.conv_transpose1d(x, w, stride=3, padding=1), r(2, 3, 6), r(3, 2, 4))
    x, w = r(2, 3, 8, 8, dtype=torch.bfloat16), r(4, 3, 3, 3, dtype=torch.bfloat16)
    out = F.conv2d(x.to(DEV), w.to(DEV))
    assert out.dtype == torch.bfloat16
    ref = F.conv2d(x.float(), w.float()).bfloat16()
    torch.testing.assert_close(out.cpu(), ref)


def test_conv_module_training_step():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 5))
    net_d = torch.nn.Sequential(*[m for m in __import__("copy").deepcopy(net)]).to(DEV)
    x, y = r(2, 3, 8, 8), torch.tensor([1, 4])
    F.cross_entropy(net(x), y).backward()
    F.cross_entropy(net_d(x.to(DEV)), y.to(DEV)).backward()
    for p, q in zip(net.parameters(), net_d.parameters()):
        assert_same(q.grad, p.grad, atol=1e-5, rtol=1e-4)


# ---- pooling ----------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
                                dict(kernel_size=3, stride=2, ceil_mode=True),
                                dict(kernel_size=2, dilation=2, padding=1)])
def test_max_pool2d(kw):
    x = r(2, 3, 7, 8)
    compare(lambda t: F.max_pool2d(t, return_indices=True, **kw), x)


@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
                                dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
                                dict(kernel_size=3, stride=2, ceil_mode=True),
                                dict(kernel_size=3, stride=2, padding=1, ceil_mode=True,
                                     count_include_pad=False),
                                dict(kernel_size=2, divisor_override=3)])
def test_avg_pool2d(kw):
    compare(lambda t: F.avg_pool2d(t, **kw), r(2, 3, 7, 8))
    compare(lambda t: F.avg_pool2d(t, **kw), r(3, 7, 8))


@pytest.mark.parametrize("out", [(1, 1), (3, 4), (5, 3)])
def test_adaptive_avg_pool2d(out):
    compare(lambda t: F.adaptive_avg_pool2d(t, out), r(2, 3, 7, 8))



@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1,
                                                          count_include_pad=False),
                                dict(kernel_size=(2, 3, 2), stride=2, ceil_mode=True),
                                dict(kernel_size=2, divisor_override=3)])
def test_avg_pool3d(kw):
    compare(lambda t: F.avg_pool3d(t, **kw), r(2, 3, 5, 6, 7))


def test_pool3d_adaptive_max_and_avg():
    x = r(2, 3, 5, 6, 7)
    compare(lambda t: F.max_pool3d(t, 3, stride=2, padding=1, dilation=1, return_indices=True), x)
    compare(lambda t: F.adaptive_avg_pool3d(t, (2, 4, 3)), x)
    compare(lambda t: F.adaptive_max_pool3d(t, (2, 4, 3), return_indices=True), x)
    compare(lambda t: F.adaptive_max_pool2d(t, (4, 5), return_indices=True), r(3, 7, 9))
    compare(lambda t: F.adaptive_max_pool1d(t, 4, return_indices=True), r(2, 3, 9))


def test_max_pool_nan_and_inf_ties():
    # CPU keeps the first maximum, but the last NaN of a window; an all -inf
    # window points at its first in-bounds element.
    x = r(1, 2, 6, 6)
    x[0, 0, 1, 1] = x[0, 0, 1, 2] = float("nan")
    x[0, 0, 4, 4] = float("inf")
    x[0, 0, 4, 5] = float("nan")
    x[0, 1, :3, :3] = -float("inf")
    for fn in (lambda t: F.max_pool2d(t, 3, stride=2, padding=1, return_indices=True),
               lambda t: F.adaptive_max_pool2d(t, (2, 3), return_indices=True)):
        got, want = fn(x.to(DEV)), fn(x)
        assert_same(got, want, equal_nan=True)


def test_fractional_max_pool():
    # The samples are an input: given them, the op is deterministic.
    torch.manual_seed(0)
    u, u3, ub = torch.rand(2, 3, 2), torch.rand(2, 2, 3), torch.rand(1, 3, 2, dtype=torch.bfloat16)
    compare(lambda t: F.fractional_max_pool2d(t, (2, 3), output_size=(5, 4), return_indices=True,
                                              _random_samples=u.to(t.device)), r(2, 3, 9, 11))
    compare(lambda t: F.fractional_max_pool3d(t, 2, output_size=(4, 3, 5), return_indices=True,
                                              _random_samples=u3.to(t.device)), r(2, 2, 7, 6, 8))
    compare(lambda t: F.fractional_max_pool2d(t, 2, output_size=(4, 4),
                                              _random_samples=ub.to(t.device)),
            r(3, 8, 8, dtype=torch.bfloat16), grad=False)

# ---- softmax and normalization ---------------------------------------------

@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_log_softmax(dim):
    compare(lambda t: F.softmax(t, dim), r(3, 4, 5))
    compare(lambda t: F.log_softmax(t, dim), r(3, 4, 5))
    compare(lambda t: F.log_softmax(t, dim, dtype=torch.float64), r(3, 4, 5))


@pytest.mark.parametrize("dim", [0, -1])
def test_softmax_log_softmax_of_a_0d_tensor(dim):
    # A 0-d tensor is one element along dim 0 or -1, as on CPU (nn.Softmax's
    # ModuleInfo sample): softmax 1, log_softmax 0, their gradients 0.
    compare(lambda t: F.softmax(t, dim), r(()))
    compare(lambda t: F.log_softmax(t, dim), r(()))
    with torch.inference_mode():
        assert_same(F.softmax(r(()).to(DEV), dim), torch.tensor(1.0))


def test_softmax_half():
    x = r(4, 8, dtype=torch.bfloat16)
    out = F.softmax(x.to(DEV), -1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), F.softmax(x, -1))


def test_layer_norm_group_norm():
    compare(lambda x, w, b: F.layer_norm(x, (4, 5), w, b), r(3, 4, 5), r(4, 5), r(4, 5),
            atol=1e-5, rtol=1e-4)
    compare(lambda x: F.layer_norm(x, (5,)), r(3, 4, 5), atol=1e-5, rtol=1e-4)
    compare(lambda x, w, b: F.group_norm(x, 2, w, b), r(2, 4, 3, 3), r(4), r(4),
            atol=1e-5, rtol=1e-4)
    compare(lambda x: F.group_norm(x, 4), r(2, 4, 5), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_weight_norm_forward_and_backward(dtype):
    # torch._weight_norm (nn.utils.weight_norm and its parametrization, over
    # the first or last dim) runs _weight_norm_interface and its backward on
    # tpu, with CPU's values.
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    before = dict(torchtpu.metrics.M.cpu_fallbacks)
    for shape, dim in (((3, 4), 0), ((3, 4), 1), ((5, 2, 3), 0), ((5, 2, 3), 2)):
        torch.manual_seed(0)
        v = torch.randn(shape, dtype=dtype)
        g = torch.randn([n if i == dim else 1 for i, n in enumerate(shape)], dtype=dtype)
        grad = torch.randn(shape, dtype=dtype)
        results = []
        for device in ("cpu", "tpu"):
            vd = v.detach().to(device).requires_grad_()
            gd = g.detach().to(device).requires_grad_()
            w = torch._weight_norm(vd, gd, dim)
            w.backward(grad.to(device))
            results.append((w, vd.grad, gd.grad))
        for got, want in zip(results[1], results[0]):
            assert_same(got, want.detach(), **tol)
    assert dict(torchtpu.metrics.M.cpu_fallbacks) == before


def test_group_norm_of_an_empty_batch():
    compare(lambda x, w, b: F.group_norm(x, 1, w, b), r(0, 2), r(2), r(2))
    compare(lambda x: F.group_norm(x, 2), r(0, 4, 3))


def test_batch_norm_training_updates_running_stats():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3, momentum=0.3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    bn_d = __import__("copy").deepcopy(bn).to(DEV)
    for _ in range(2):
        x = r(4, 3, 5, 5) * 2 + 1
        xd = x.to(DEV).requires_grad_()
        x.requires_grad_()
        y, yd = bn(x), bn_d(xd)
        assert_same(yd, y, atol=1e-5, rtol=1e-4)
        w = torch.randn(y.shape)
        (y * w).sum().backward()
        (yd * w.to(DEV)).sum().backward()
        assert_same(xd.grad, x.grad, atol=1e-5, rtol=1e-4)
    assert_same(bn_d.running_mean, bn.running_mean)
    assert_same(bn_d.running_var, bn.running_var)
    assert bn_d.num_batches_tracked.item() == 2
    assert_same(bn_d.weight.grad, bn.weight.grad, atol=1e-4, rtol=1e-4)
    assert_same(bn_d.bias.grad, bn.bias.grad, atol=1e-4, rtol=1e-4)
    bn.eval()
    bn_d.eval()
    x = r(2, 3, 4, 4)
    assert_same(bn_d(x.to(DEV)), bn(x), atol=1e-5, rtol=1e-4)


def test_batch_norm_functional_variants():
    x, rm, rv = r(4, 3, 6), r(3), r(3).abs() + 0.5
    compare(lambda t, w, b: F.batch_norm(t, rm.to(t.device), rv.to(t.device), w, b,
                                         training=False), x, r(3), r(3), atol=1e-5, rtol=1e-4)
    compare(lambda t: F.batch_norm(t, None, None, training=True), x, atol=1e-5, rtol=1e-4)
    ops = torch.ops.aten
    for fn in (lambda t, m, v: ops._native_batch_norm_legit_functional(t, None, None, m, v, True, 0.1, 1e-5),
               lambda t, m, v: ops._native_batch_norm_legit_no_training(t, None, None, m, v, 0.1, 1e-5),
               lambda t, m, v: ops._native_batch_norm_legit(t, None, None, True, 0.1, 1e-5)):
        out_d = fn(x.to(DEV), rm.to(DEV), rv.to(DEV))
        out_c = fn(x, rm.clone(), rv.clone())
        assert_same(out_d, out_c, atol=1e-5, rtol=1e-4)
    m, v = rm.to(DEV), rv.to(DEV)
    ops._native_batch_norm_legit(x.to(DEV), None, None, m, v, True, 0.1, 1e-5)
    mc, vc = rm.clone(), rv.clone()
    ops._native_batch_norm_legit(x, None, None, mc, vc, True, 0.1, 1e-5)
    assert_same(m, mc)
    assert_same(v, vc)


# ---- losses -----------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nll_and_cross_entropy(reduction):
    x = F.log_softmax(r(5, 4), -1)
    t = torch.tensor([0, 3, 1, 1, 2])
    w = torch.tensor([1.0, 2.0, 0.5, 1.5])
    compare(lambda a: F.nll_loss(a, t.to(a.device), reduction=reduction), x)
    compare(lambda a: F.nll_loss(a, t.to(a.device), w.to(a.device), reduction=reduction,
                                 ignore_index=1), x)
    compare(lambda a: F.cross_entropy(a, t.to(a.device), reduction=reduction,
                                      label_smoothing=0.1), r(5, 4))
    x2 = F.log_softmax(r(2, 4, 3, 3), 1)
    t2 = torch.randint(0, 4, (2, 3, 3))
    compare(lambda a: F.nll_loss(a, t2.to(a.device), reduction=reduction, ignore_index=2), x2)
    compare(lambda a: F.nll_loss(a, t[0].to(a.device), reduction=reduction), x[0])


def test_pointwise_losses():
    a, b = r(4, 5), r(4, 5)
    p, y = torch.rand(4, 5) * 0.9 + 0.05, torch.rand(4, 5)
    for red in ("mean", "sum", "none"):
        compare(lambda u, v: F.mse_loss(u, v, reduction=red), a, b)
        compare(lambda u, v: F.smooth_l1_loss(u, v, reduction=red, beta=0.5), a, b)
        compare(lambda u, v: F.huber_loss(u, v, reduction=red, delta=0.7), a, b)
        compare(lambda u, v: F.binary_cross_entropy(u, v, reduction=red), p, y)
        pw = torch.rand(5) + 0.5
        compare(lambda u, v: F.binary_cross_entropy_with_logits(
            u, v, reduction=red, pos_weight=pw.to(u.device)), a, y)


# ---- attention, recurrent, resampling -------------------------------------

def test_scaled_dot_product_attention():
    q, k, v = r(2, 3, 5, 8), r(2, 3, 6, 8), r(2, 3, 6, 8)
    compare(F.scaled_dot_product_attention, q, k, v, atol=1e-5, rtol=1e-4)
    mask = torch.rand(5, 6) > 0.3
    mask[:, 0] = True
    compare(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask.to(a.device)),
            q, k, v, atol=1e-5, rtol=1e-4)
    compare(lambda a, b, c, m: F.scaled_dot_product_attention(a, b, c, attn_mask=m), q, k, v,
            r(5, 6), atol=1e-5, rtol=1e-4)
    compare(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=0.3),
            q, r(2, 3, 5, 8), r(2, 3, 5, 8), atol=1e-5, rtol=1e-4)


def _full_row_mask():
    m = torch.rand(5, 6) > 0.3
    m[2] = False                                   # a row with nothing to attend to
    return m


@pytest.mark.parametrize("case", [
    dict(),
    dict(is_causal=True),
    dict(mask=_full_row_mask),
    dict(mask=lambda: torch.randn(2, 1, 5, 6)),    # broadcast over heads
    dict(scale=-0.25),
    dict(dtype=torch.bfloat16, is_causal=True),
    dict(dtype=torch.float64, mask=lambda: torch.randn(5, 6, dtype=torch.float64)),
    dict(shape=(4, 5, 8)),                         # no head dim
    dict(is_causal=True, mask=_full_row_mask),     # both (CPU applies both)
    dict(shape=(2, 4, 5, 8), kv_heads=2),          # grouped-query attention
    dict(kv_heads=1, is_causal=True, mask=_full_row_mask),
])
def test_attention_is_one_op_each_way(mode, case):
    # On tpu, scaled_dot_product_attention is one op forward and one backward
    # (torchtpu::attention), with the values and gradients of CPU's.
    dtype = case.get("dtype", torch.float32)
    shape = case.get("shape", (2, 3, 5, 8))
    kv = shape[:-2] if "kv_heads" not in case else shape[:-3] + (case["kv_heads"],)
    q, k, v = r(*shape, dtype=dtype), r(*kv, 6, 8, dtype=dtype), r(*kv, 6, 8, dtype=dtype)
    mask = case["mask"]() if "mask" in case else None
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)

    def attend(a, b, c):
        m = None if mask is None else mask.to(a.device)
        before = torchtpu.metrics.snapshot()["ops_dispatched"]
        out = F.scaled_dot_product_attention(a, b, c, attn_mask=m, is_causal=case.get("is_causal", False),
                                             scale=case.get("scale"), enable_gqa="kv_heads" in case)
        if a.device.type == "tpu":
            assert torchtpu.metrics.snapshot()["ops_dispatched"] - before == 1
        return out
    compare(attend, q, k, v, **tol)


@pytest.mark.parametrize("mask_shape", [(5, 6), (2, 1, 5, 6), (2, 3, 5, 6)])
def test_attention_mask_gradient_is_one_op_each_way(mode, mask_shape):
    # A trainable mask (a learned bias): its gradient comes from the one
    # backward op, summed over the dims it broadcasts along, as on CPU.
    mask = torch.randn(*mask_shape)
    mask[..., 2, :] = float("-inf")                  # a row with nothing to attend to

    def attend(a, b, c, m):
        before = torchtpu.metrics.snapshot()["ops_dispatched"]
        out = F.scaled_dot_product_attention(a, b, c, attn_mask=m)
        if a.device.type == "tpu":
            assert torchtpu.metrics.snapshot()["ops_dispatched"] - before == 1
        return out
    compare(attend, r(2, 3, 5, 8), r(2, 3, 6, 8), r(2, 3, 6, 8), mask, atol=1e-5, rtol=1e-4)


def test_attention_mask_gradient_with_is_causal_raises_as_on_cpu():
    q, m = torch.randn(2, 3, 5, 8), torch.randn(5, 5, requires_grad=True)
    with pytest.raises(RuntimeError) as cpu_err:
        F.scaled_dot_product_attention(q, q, q, attn_mask=m, is_causal=True)
    with pytest.raises(RuntimeError) as tpu_err:
        F.scaled_dot_product_attention(q.to(DEV), q.to(DEV), q.to(DEV),
                                       attn_mask=m.detach().to(DEV).requires_grad_(), is_causal=True)
    assert str(tpu_err.value) == str(cpu_err.value)


@pytest.mark.parametrize("call,kv_heads", [
    (lambda q, k, v: F.scaled_dot_product_attention(q[:1], k, v), 4),                # broadcast batch
])
def test_attention_other_cases_take_the_composite(mode, call, kv_heads):
    compare(call, r(2, 4, 5, 8), r(2, kv_heads, 6, 8), r(2, kv_heads, 6, 8), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("is_causal,with_mask,kv_heads", [(False, False, 3), (True, False, 3),
                                                         (False, True, 3), (True, False, 1),
                                                         (False, "trainable", 3)])
def test_attention_double_backward(is_causal, with_mask, kv_heads):
    # CPU's flash kernel has no double backward; its math path (the
    # reference here) has, and so has tpu's attention.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = r(2, 3, 5, 8), r(2, kv_heads, 6, 8), r(2, kv_heads, 6, 8)
    mask = torch.rand(5, 6) > 0.3 if with_mask is True else None
    inputs = (q, k, v, r(5, 6)) if with_mask == "trainable" else (q, k, v)

    def grad_of_grad(q, k, v, trainable=None):
        m = trainable if mask is None else mask.to(q.device)
        with sdpa_kernel([SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=is_causal,
                                                 enable_gqa=kv_heads != 3)
        gq, = torch.autograd.grad((out * out).sum(), q, create_graph=True)
        return gq.pow(2).sum()
    compare(grad_of_grad, *inputs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k,gqa", [(torch.randn(2, 3, 6, 8, dtype=torch.float64), False),
                                   (torch.randn(2, 2, 6, 8), True)])   # 3 heads in 2 groups
def test_attention_errors_as_on_cpu(k, gqa):
    q = torch.randn(2, 3, 5, 8)
    with pytest.raises(RuntimeError) as cpu_err:
        F.scaled_dot_product_attention(q, k, k, enable_gqa=gqa)
    with pytest.raises(RuntimeError) as tpu_err:
        F.scaled_dot_product_attention(q.to("tpu"), k.to("tpu"), k.to("tpu"), enable_gqa=gqa)
    assert str(tpu_err.value) == str(cpu_err.value)


def test_attention_dropout_is_random_but_seeded():
    q = torch.randn(2, 3, 5, 8, device="tpu")
    torch.manual_seed(1)
    a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    torch.manual_seed(1)
    b = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert a.shape == (2, 3, 5, 8) and a.dtype == torch.float32
    assert_same(a, b.cpu())


def _dropout_keep(q, k, p, seed):
    """The mask the one attention op draws for q, k under seed: with v the
    identity, its output is the dropped-out attention weights themselves."""
    eye = torch.eye(k.shape[-2]).expand(*k.shape[:-1], k.shape[-2]).to(DEV)
    torch.manual_seed(seed)
    return F.scaled_dot_product_attention(q.to(DEV), k.to(DEV), eye, dropout_p=p).cpu() != 0


def _math_with_mask(q, k, v, keep, p, **kw):
    """CPU's math path with a given dropout mask (a testing aid it warns about)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, p, dropout_mask=keep,
                                                                 **kw)[0]


def test_attention_dropout_is_one_op_each_way(mode):
    # Dropout inside the one op: the mask CPU's math path is given here is the
    # one the op drew; backward draws it again from the call's random state.
    q, k, v, g = r(2, 3, 16, 8), r(2, 3, 16, 8), r(2, 3, 16, 8), r(2, 3, 16, 8)
    keep = _dropout_keep(q, k, 0.3, seed=3)
    assert 0.62 < keep.float().mean().item() < 0.78   # about 70% kept
    qd, kd, vd = [t.to(DEV).requires_grad_() for t in (q, k, v)]
    torch.manual_seed(3)
    before = torchtpu.metrics.snapshot()["ops_dispatched"]
    out = F.scaled_dot_product_attention(qd, kd, vd, dropout_p=0.3)
    assert torchtpu.metrics.snapshot()["ops_dispatched"] - before == 1
    out.backward(g.to(DEV))
    qc, kc, vc = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _math_with_mask(qc, kc, vc, keep, 0.3)
    ref.backward(g)
    tol = dict(atol=1e-5, rtol=1e-4)
    assert_same(out, ref, **tol)
    for d, c in ((qd, qc), (kd, kc), (vd, vc)):
        assert_same(d.grad, c.grad, **tol)


def test_attention_dropout_double_backward():
    q, k, v = r(2, 3, 5, 8), r(2, 3, 6, 8), r(2, 3, 6, 8)
    keep = _dropout_keep(q, k, 0.4, seed=5)

    def grad_of_grad(q, k, v, attend):
        out = attend(q, k, v)
        gq, = torch.autograd.grad((out * out).sum(), q, create_graph=True)
        return gq.pow(2).sum()
    qc = q.clone().requires_grad_()
    qd = q.to(DEV).requires_grad_()
    torch.manual_seed(5)
    got = grad_of_grad(qd, k.to(DEV), v.to(DEV),
                       lambda a, b, c: F.scaled_dot_product_attention(a, b, c, dropout_p=0.4))
    want = grad_of_grad(qc, k, v, lambda a, b, c: _math_with_mask(a, b, c, keep, 0.4))
    assert_same(got, want, atol=1e-4, rtol=1e-4)
    got.backward()
    want.backward()
    assert_same(qd.grad, qc.grad, atol=1e-4, rtol=1e-4)


def test_lstm_forward_backward():
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 6, num_layers=2, batch_first=True)
    lstm_d = __import__("copy").deepcopy(lstm).to(DEV)
    x = r(3, 5, 4)
    out, (h, c) = lstm(x)
    out_d, (h_d, c_d) = lstm_d(x.to(DEV))
    assert_same(out_d, out, atol=1e-5, rtol=1e-4)
    assert_same(h_d, h, atol=1e-5, rtol=1e-4)
    assert_same(c_d, c, atol=1e-5, rtol=1e-4)
    (out.sum() + c.sum()).backward()
    (out_d.sum() + c_d.sum()).backward()
    for p, q in zip(lstm.parameters(), lstm_d.parameters()):
        assert_same(q.grad, p.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kw", [dict(scale_factor=2, mode="nearest"), dict(size=(5, 7), mode="nearest"),
                                dict(scale_factor=2, mode="bilinear"),
                                dict(size=(5, 3), mode="bilinear", align_corners=True)])
def test_upsample(kw):
    compare(lambda t: F.interpolate(t, **kw), r(2, 3, 4, 4), atol=1e-5, rtol=1e-4)


def test_upsample_1d_3d_exact():
    compare(lambda t: F.interpolate(t, scale_factor=2.5, mode="linear"), r(2, 3, 5),
            atol=1e-5, rtol=1e-4)
    compare(lambda t: F.interpolate(t, size=7, mode="nearest"), r(2, 3, 5))
    compare(lambda t: F.interpolate(t, size=(3, 7), mode="nearest-exact"), r(1, 2, 4, 5))
    compare(lambda t: F.interpolate(t, size=(3, 4, 5), mode="trilinear"), r(1, 2, 2, 3, 4),
            atol=1e-5, rtol=1e-4)


def test_nearest_upsample_of_an_empty_batch():
    # PyTorch's meta kernel hands torch._check an int for an empty input (a
    # TypeError); CPU's kernel on the empty tensors answers instead: CPU's
    # shapes for a batch of 0, CPU's error for an empty channel dim.
    for shape, size in (((0, 2, 4), 12), ((0, 2, 4, 3), (8, 6)), ((0, 1, 2, 3, 4), (3, 4, 5))):
        for how in ("nearest", "nearest-exact"):
            compare(lambda t: F.interpolate(t, size, mode=how), torch.randn(shape))
    with pytest.raises(RuntimeError, match="Non-empty 3D data tensor expected"):
        F.interpolate(torch.randn(2, 0, 4, device="tpu"), 12, mode="nearest")


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("align", [False, True])
def test_upsample_bicubic_and_antialias(mode, align):
    x = r(2, 3, 11, 9)
    for size in [(5, 4), (17, 3)]:
        compare(lambda t: F.interpolate(t, size=size, mode=mode, align_corners=align,
                                        antialias=True), x, atol=1e-5, rtol=1e-4)
    compare(lambda t: F.interpolate(t, scale_factor=1.7, mode="bicubic", align_corners=align), x,
            atol=1e-5, rtol=1e-4)


def test_softmax_out():
    x = r(3, 4)
    out = torch.empty(3, 4, device=DEV)
    torch.softmax(x.to(DEV), 1, out=out)
    assert_same(out, torch.softmax(x, 1))


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
def test_grid_sample(mode, padding):
    torch.manual_seed(0)
    grid = torch.rand(2, 4, 5, 2) * 2.6 - 1.3
    for align in (False, True):
        compare(lambda t, g: F.grid_sample(t, g, mode=mode, padding_mode=padding,
                                           align_corners=align), r(2, 3, 6, 7), grid,
                atol=1e-5, rtol=1e-4)
    if mode != "bicubic":
        grid3 = torch.rand(2, 3, 4, 2, 3) * 2.6 - 1.3
        compare(lambda t, g: F.grid_sample(t, g, mode=mode, padding_mode=padding,
                                           align_corners=False), r(2, 3, 4, 5, 6),
                grid3, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_margin_losses(reduction):
    x, t, w = r(4, 5), torch.tensor([0, 3, 4, 1]), torch.rand(5)
    for p in (1, 2):
        compare(lambda a: F.multi_margin_loss(a, t.to(a.device), p=p, margin=0.7,
                                              weight=w.to(a.device), reduction=reduction), x,
                atol=1e-5, rtol=1e-4)
    tl = torch.tensor([[3, 0, -1, 1, 2], [1, 2, 3, 4, 0], [-1, 1, 1, 1, 1], [4, 4, -1, 0, 0]])
    compare(lambda a: F.multilabel_margin_loss(a, tl.to(a.device), reduction=reduction), x,
            atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("kw", [dict(), dict(padding_idx=2), dict(scale_grad_by_freq=True),
                                dict(include_last_offset=True)])
def test_embedding_bag(mode, kw):
    if mode == "max" and kw.get("scale_grad_by_freq"):
        return
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 0, 2])
    off = torch.tensor([0, 2, 2, 5, 9] if kw.get("include_last_offset") else [0, 2, 2, 5])
    compare(lambda w: F.embedding_bag(idx.to(w.device), w, off.to(w.device), mode=mode, **kw),
            r(6, 3), atol=1e-5, rtol=1e-4)
    if mode == "sum":
        compare(lambda w, p: F.embedding_bag(idx.to(w.device), w, off.to(w.device), mode=mode,
                                             per_sample_weights=p, **kw), r(6, 3), r(9),
                atol=1e-5, rtol=1e-4)
    compare(lambda w: F.embedding_bag(idx.reshape(3, 3).to(w.device), w, mode=mode), r(6, 3),
            atol=1e-5, rtol=1e-4)


# The backward runs on CPU from the tpu forward's nll and log_alpha (ops/nn/loss.py says why).
CTC_BACKWARD = ("aten._ctc_loss_backward.default", "aten._ctc_loss_backward.Tensor")


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_loss(zero_infinity):
    torch.manual_seed(0)
    T, N, C = 12, 3, 5
    lp = torch.randn(T, N, C).log_softmax(2)
    tg = torch.randint(1, C, (N, 4))
    il, tl = torch.tensor([12, 9, 7]), torch.tensor([4, 2, 3])
    for lengths in ((il, tl), (il.tolist(), tl.tolist())):
        compare(lambda x, t: F.ctc_loss(x, t.to(x.device), *[v.to(x.device) if torch.is_tensor(v)
                                                            else v for v in lengths],
                                        reduction="none", zero_infinity=zero_infinity), lp, tg,
                atol=1e-5, rtol=1e-4, allowed_fallbacks=CTC_BACKWARD)
    # Concatenated targets, an impossible alignment (inf loss), a blank-only target.
    flat = torch.tensor([1, 2, 2, 3, 1, 1, 1, 1, 4])
    compare(lambda x: F.ctc_loss(x, flat.to(x.device), [12, 3, 7], [3, 6, 0],
                                 reduction="sum", zero_infinity=zero_infinity),
            lp, atol=1e-5, rtol=1e-4, grad=zero_infinity, allowed_fallbacks=CTC_BACKWARD)


def test_rrelu_training_noise():
    # Random slopes: check the rule, the noise written in place and the gradient.
    x = r(4, 50)
    xd = x.to(DEV).requires_grad_()
    noise = torch.empty(4, 50, device=DEV)
    out = torch.ops.aten.rrelu_with_noise(xd, noise, 0.1, 0.3, True)
    n = noise.cpu()
    assert ((n >= 0.1) & (n <= 0.3) | (x > 0)).all() and (n[x > 0] == 1).all()
    assert (n[x <= 0] != n[x <= 0][0]).any()
    torch.testing.assert_close(out.detach().cpu(), x * n)
    out.sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), n)
    y = F.rrelu(x.to(DEV), 0.1, 0.3, training=True)
    assert ((y.cpu() == x) | ((y.cpu() / x >= 0.1 - 1e-6) & (y.cpu() / x <= 0.3 + 1e-6))).all()
    compare(lambda t: F.rrelu(t, 0.1, 0.3), x)


def test_bilinear():
    compare(lambda a, b, w, bias: F.bilinear(a, b, w, bias), r(6, 3), r(6, 4), r(5, 3, 4), r(5),
            atol=1e-5, rtol=1e-4)
    compare(lambda a, b, w: F.bilinear(a, b, w), r(2, 6, 3), r(2, 6, 4), r(5, 3, 4),
            atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_transformer_encoder_inference_runs_on_tpu_as_on_cpu(mode, no_grad):
    # In eval mode without autograd PyTorch takes its fast path for the
    # devices it lists (tpu too): fused CPU kernels, and a nested tensor for
    # a padding mask. On tpu the ordinary path runs instead, with no CPU
    # fallback: CPU's fast path values at unpadded positions, CPU's
    # ordinary path values everywhere.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    cpu = torch.nn.TransformerEncoder(layer, 2).eval()
    tpu = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2)
    tpu.load_state_dict(cpu.state_dict())
    tpu = tpu.to("tpu").eval()
    mha_cpu = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    mha_tpu = copy.deepcopy(mha_cpu).to("tpu")
    x = torch.randn(2, 5, 8)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    before = dict(torchtpu.metrics.M.cpu_fallbacks)
    with no_grad():
        for mask in (None, pad):
            fast = cpu(x, src_key_padding_mask=mask)
            torch.backends.mha.set_fastpath_enabled(False)
            try:
                ordinary = cpu(x, src_key_padding_mask=mask)
                ordinary_mha = mha_cpu(x, x, x, key_padding_mask=mask)
            finally:
                torch.backends.mha.set_fastpath_enabled(True)
            got = tpu(x.to("tpu"), src_key_padding_mask=None if mask is None else mask.to("tpu"))
            assert torch.backends.mha.get_fastpath_enabled()
            assert_same(got, ordinary, atol=1e-5, rtol=1e-5)
            kept = ~pad[..., None] if mask is not None else torch.ones(1, dtype=torch.bool)
            assert_same(got * kept.to("tpu"), fast * kept, atol=1e-5, rtol=1e-5)
            out, weights = mha_tpu(*(x.to("tpu"),) * 3,
                                   key_padding_mask=None if mask is None else mask.to("tpu"))
            assert_same(out, ordinary_mha[0], atol=1e-5, rtol=1e-5)
            assert_same(weights, ordinary_mha[1], atol=1e-5, rtol=1e-5)
    assert dict(torchtpu.metrics.M.cpu_fallbacks) == before
