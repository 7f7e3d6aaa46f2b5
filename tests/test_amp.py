"""Automatic mixed precision: torch.autocast("tpu") with CUDA's op policy, its
weight cache, GradScaler("tpu") and its ops, against PyTorch on CPU."""
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same, make, platform_tol

import torchtpu
from torchtpu import amp, metrics

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def test_policy_covers_the_ops_cuda_autocasts():
    def registered(key):
        return {n.split("::")[1] for n in torch._C._dispatch_get_registrations_for_dispatch_key(key)}

    names = [n if isinstance(n, str) else n[0] for ops in amp.POLICY.values() for n in ops]
    assert len(names) == len(set(names))
    assert set(names) == registered("AutocastCUDA")
    assert registered("AutocastPrivateUse1") == registered("AutocastCUDA")


def _policy(name):
    for policy, ops in amp.POLICY.items():
        if name in [n if isinstance(n, str) else n[0] for n in ops]:
            return policy
    return None


def _float_dtypes(args):
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out += _float_dtypes(a)
        elif isinstance(a, torch.Tensor) and a.is_floating_point():
            out.append(a.dtype)
    return out


def _expected_dtype(policy, args, low):
    if policy == "lower_precision_fp":
        return low
    if policy in ("fp32", "fp32_set_opt_dtype", "fp32_append_dtype"):
        return FP32
    assert policy == "promote"
    return FP32 if FP32 in _float_dtypes(args) else low


def _cast_as_policy(policy, args, low):
    """The inputs as CUDA's policy casts them (float32 for the fp32 ops that
    take a dtype: the result then equals running them with dtype=float32)."""
    dtype = {"lower_precision_fp": low, "fp32": FP32, "fp32_set_opt_dtype": FP32,
             "fp32_append_dtype": FP32}.get(policy) or _expected_dtype(policy, args, low)

    def cast(a):
        if isinstance(a, (list, tuple)):
            return type(a)(cast(v) for v in a)
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.to(dtype)
        return a
    return [cast(a) for a in args]


def _t(*shape, dtype=FP32, seed=0):
    return make(dtype, shape, seed=seed)


def _labels(n, classes):
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(3))


def _sdpa_flash(q, k, v):
    # tpu computes bf16 and fp16 attention as CUDA's and CPU's flash kernels
    # do (float32 scores from the inputs' own products, weights rounded to
    # the inputs' dtype); float32 as the math path.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    low = q.dtype in (torch.bfloat16, torch.float16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION if low else SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v)


# (aten op in the policy table, call, inputs): inputs mix float32 and bf16.
CASES = [
    ("matmul", torch.matmul, lambda: [_t(4, 8), _t(8, 5, seed=1)]),
    ("linear", F.linear, lambda: [_t(4, 8), _t(5, 8, seed=1), _t(5, seed=2)]),
    ("conv2d", F.conv2d, lambda: [_t(2, 3, 6, 6), _t(4, 3, 3, 3, seed=1), _t(4, seed=2)]),
    ("bmm", torch.bmm, lambda: [_t(2, 3, 4), _t(2, 4, 5, seed=1, dtype=BF16)]),
    ("baddbmm", torch.baddbmm, lambda: [_t(2, 3, 5), _t(2, 3, 4, seed=1), _t(2, 4, 5, seed=2)]),
    ("addmm", torch.addmm, lambda: [_t(5), _t(3, 4, seed=1), _t(4, 5, seed=2)]),
    ("scaled_dot_product_attention", lambda q, k, v: _sdpa_flash(q, k, v),
     lambda: [_t(2, 2, 4, 8), _t(2, 2, 4, 8, seed=1), _t(2, 2, 4, 8, seed=2)]),
    ("softmax.int", lambda x: torch.softmax(x, -1), lambda: [_t(4, 6, dtype=BF16)]),
    ("log_softmax.int", lambda x: F.log_softmax(x, 1), lambda: [_t(4, 6, dtype=BF16)]),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (6,), w, b),
     lambda: [_t(4, 6, dtype=BF16), _t(6, seed=1), _t(6, seed=2)]),
    ("sum", torch.sum, lambda: [_t(4, 6, dtype=BF16)]),
    ("sum.dim_IntList", lambda x: x.sum(1), lambda: [_t(4, 6, dtype=BF16)]),
    ("cumsum", lambda x: x.cumsum(0), lambda: [_t(4, 6, dtype=BF16)]),
    ("exp", torch.exp, lambda: [_t(4, 6, dtype=BF16)]),
    ("pow.Tensor_Scalar", lambda x: x ** 3, lambda: [_t(4, 6, dtype=BF16)]),
    ("norm.Scalar", torch.ops.aten.norm.Scalar, lambda: [_t(4, 6, dtype=BF16)]),
    ("mse_loss", F.mse_loss, lambda: [_t(4, 6, dtype=BF16), _t(4, 6, seed=1)]),
    ("nll_loss", F.nll_loss, lambda: [_t(4, 6, dtype=BF16), _labels(4, 6)]),
    ("binary_cross_entropy_with_logits", F.binary_cross_entropy_with_logits,
     lambda: [_t(4, 6, dtype=BF16), torch.rand(4, 6, generator=torch.Generator().manual_seed(1))]),
    ("group_norm", lambda x: F.group_norm(x, 2), lambda: [_t(2, 4, 3, dtype=BF16)]),
    ("addcmul", torch.addcmul, lambda: [_t(4, 6, dtype=BF16), _t(4, 6, seed=1),
                                        _t(4, 6, seed=2, dtype=BF16)]),
    ("addcmul", torch.addcmul, lambda: [_t(4, 6, dtype=BF16), _t(4, 6, seed=1, dtype=BF16),
                                        _t(4, 6, seed=2, dtype=BF16)]),
    ("atan2", torch.atan2, lambda: [_t(4, 6, dtype=BF16), _t(4, 6, seed=1)]),
    ("dot", torch.dot, lambda: [_t(6, dtype=BF16), _t(6, seed=1)]),
    # cat and stack are not in CUDA's table: they promote by type promotion.
    ("cat", torch.cat, lambda: [[_t(2, 3, dtype=BF16), _t(4, 3, seed=1)]]),
    ("stack", torch.stack, lambda: [[_t(2, 3, dtype=BF16), _t(2, 3, seed=1)]]),
    ("stack", torch.stack, lambda: [[_t(2, 3, dtype=BF16), _t(2, 3, seed=1, dtype=BF16)]]),
]


def _to_tpu(a):
    if isinstance(a, (list, tuple)):
        return type(a)(_to_tpu(v) for v in a)
    return a.to("tpu") if isinstance(a, torch.Tensor) else a


@pytest.mark.parametrize("low", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, fn, inputs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_op_runs_in_the_policys_dtype(name, fn, inputs, low):
    args = inputs()
    if low is FP16:   # the bf16 inputs as fp16: the policy never mixes the two
        args = [[v.to(FP16) if v.dtype is BF16 else v for v in a] if isinstance(a, list)
                else a.to(FP16) if isinstance(a, torch.Tensor) and a.dtype is BF16 else a for a in args]
    policy = _policy(name) or ("promote" if name in ("cat", "stack") else None)
    assert policy is not None, name
    with torch.autocast("tpu", dtype=low):
        out = fn(*_to_tpu(args))
    assert out.dtype == _expected_dtype(policy, args, low)
    # CPU, with the inputs cast as CUDA's policy says, without autocast.
    assert_same(out, fn(*_cast_as_policy(policy, args, low)))
    if name in ("cat", "stack"):
        assert name not in [n for ops in amp.POLICY.values() for n in ops if isinstance(n, str)]


def test_policy_in_fused_mode():
    # Every case recorded into one graph: the dtypes are known before it
    # runs, the values come from it.
    with torchtpu.eager_mode("fused"):
        metrics.reset()
        results = []
        for name, fn, inputs in CASES:
            args = inputs()
            policy = _policy(name) or "promote"
            with torch.autocast("tpu", dtype=BF16):
                out = fn(*_to_tpu(args))
            assert out.dtype == _expected_dtype(policy, args, BF16), name
            results.append((out, fn(*_cast_as_policy(policy, args, BF16))))
        assert metrics.snapshot()["flushes"] == {}
        torchtpu.sync()
        assert metrics.snapshot()["flushes"] == {"sync": 1}
        for out, ref in results:
            assert_same(out, ref)


def test_ops_outside_the_policy_and_ineligible_inputs_keep_their_dtypes():
    x, h = _t(4, 6), _t(4, 6, seed=1, dtype=BF16)
    with torch.autocast("tpu", dtype=BF16):
        tx, th = x.to("tpu"), h.to("tpu")
        longs = torch.ones(3, 3, dtype=torch.long)
        for out, ref in [(tx + th, x + h), (th.relu(), h.relu()), (tx * 2, x * 2),
                         (th.mean(), h.mean()), (tx.double() @ tx.t().double(), x.double() @ x.t().double()),
                         (longs.to("tpu").sum(), longs.sum())]:
            assert out.dtype == ref.dtype
            assert_same(out, ref)


def _cuda_cross_entropy(logits, y):
    """F.cross_entropy as CUDA's autocast runs it: its log_softmax is given the
    logits' dtype (so keeps it), nll_loss runs in float32. CPU's autocast
    runs all of cross_entropy in float32 instead."""
    return F.nll_loss(logits.log_softmax(1, dtype=logits.dtype), y)


def test_whole_model_forward_matches_cpu_autocast():
    # CPU autocast is the reference (its policy agrees on linear and relu),
    # with the loss computed as CUDA's policy says.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = _t(6, 8), _labels(6, 4)
    with torch.autocast("cpu", dtype=BF16):
        logits = model(x)
        loss = _cuda_cross_entropy(logits, y)
    model.to("tpu")
    with torch.autocast("tpu", dtype=BF16):
        tlogits = model(x.to("tpu"))
        tloss = F.cross_entropy(tlogits, y.to("tpu"))
    assert tlogits.dtype == logits.dtype == BF16 and tloss.dtype == loss.dtype == FP32
    assert_same(tlogits, logits)
    # float32, from bf16 log-probabilities: bf16's tolerance.
    assert_same(tloss, loss, rtol=1.6e-2, atol=1e-5)


def test_set_opt_dtype_respects_an_explicit_dtype_and_ineligible_inputs():
    x = _t(4, 6, dtype=BF16)
    with torch.autocast("tpu", dtype=BF16):
        tx = x.to("tpu")
        out = torch.softmax(tx, 1, dtype=torch.float64)
        assert out.dtype == torch.float64
        assert_same(out, torch.softmax(x, 1, dtype=torch.float64))
        ints = torch.arange(6, device="tpu")
        assert ints.sum().dtype == torch.int64 and ints.cumsum(0).dtype == torch.int64
        assert_same(ints.cumsum(0), torch.arange(6).cumsum(0))


def test_banned_binary_cross_entropy_raises_as_on_cuda():
    p = torch.rand(4, device="tpu")
    with torch.autocast("tpu", dtype=BF16):
        with pytest.raises(RuntimeError, match="BCELoss are unsafe to autocast"):
            F.binary_cross_entropy(p, torch.ones(4, device="tpu"))
    # Outside autocast it runs.
    assert_same(F.binary_cross_entropy(p, torch.ones(4, device="tpu")),
                F.binary_cross_entropy(p.cpu(), torch.ones(4)))


def test_promote_of_float16_under_bfloat16_raises_as_on_cuda():
    a = torch.ones(3, device="tpu", dtype=FP16)
    with torch.autocast("tpu", dtype=BF16):
        with pytest.raises(RuntimeError, match="Unexpected floating ScalarType"):
            torch.addcmul(a, a, a)


def test_nesting_enabled_false_and_dtype_queries():
    a, b = _t(4, 4), _t(4, 4, seed=1)
    ta, tb = a.to("tpu"), b.to("tpu")
    # The default autocast dtype is CUDA's.
    assert torch.get_autocast_dtype("tpu") == torch.get_autocast_dtype("cuda") == FP16
    assert not torch.is_autocast_enabled("tpu")
    with torch.autocast("tpu", dtype=BF16):
        assert torch.is_autocast_enabled("tpu") and torch.get_autocast_dtype("tpu") == BF16
        assert (ta @ tb).dtype == BF16
        with torch.autocast("tpu", enabled=False):
            assert not torch.is_autocast_enabled("tpu")
            out = ta @ tb
            assert out.dtype == FP32
            assert_same(out, a @ b)
        with torch.autocast("tpu", dtype=FP16):
            assert torch.get_autocast_dtype("tpu") == FP16
            assert (ta @ tb).dtype == FP16
            assert_same(ta @ tb, (a.half() @ b.half()))
        assert torch.get_autocast_dtype("tpu") == BF16
        assert (ta @ tb).dtype == BF16
    assert not torch.is_autocast_enabled("tpu") and (ta @ tb).dtype == FP32
    # CPU autocast is its own state: tpu ops ignore it, and the other way round.
    with torch.autocast("cpu", dtype=BF16):
        assert (ta @ tb).dtype == FP32
    with torch.amp.autocast("tpu"):   # torch.amp's spelling, CUDA's default dtype
        assert (ta @ tb).dtype == FP16 and (a @ b).dtype == FP32


def test_decorator():
    @torch.autocast("tpu", dtype=BF16)
    def forward(x, w):
        return F.linear(x, w)

    x, w = _t(3, 5), _t(2, 5, seed=1)
    out = forward(x.to("tpu"), w.to("tpu"))
    assert out.dtype == BF16
    assert_same(out, F.linear(x.bfloat16(), w.bfloat16()))
    assert not torch.is_autocast_enabled("tpu")
    assert (x.to("tpu") @ w.to("tpu").t()).dtype == FP32


def test_backward_inside_the_region_matches_cpu():
    def grads(device):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 3).to(device)
        x = _t(5, 4).to(device).requires_grad_()
        with torch.autocast(device, dtype=BF16):
            y = lin(x)
            (y.float() ** 2).sum().backward()
        return y, x.grad, lin.weight.grad, lin.bias.grad

    for got, ref in zip(grads("tpu"), grads("cpu")):
        assert_same(got, ref)


def _cast_nodes(y):
    """The ToCopyBackward nodes in y's graph (autocast's casts)."""
    seen, out, todo = set(), [], [y.grad_fn]
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if type(n).__name__ == "ToCopyBackward0":
            out.append(n)
        todo.extend(f for f, _ in n.next_functions)
    return out


def _cache_structure(device):
    """Checks the casts autocast makes of a weight; returns its gradients."""
    x = _t(3, 5).to(device)
    w = _t(2, 5, seed=1).to(device).requires_grad_()
    with torch.autocast(device, dtype=BF16):
        y1, y2 = F.linear(x, w), F.linear(x, w)
        (c1,), (c2,) = _cast_nodes(y1), _cast_nodes(y2)
        assert c1 is c2   # w cast once
        with torch.autocast(device, dtype=BF16):   # nested: the same cache
            (c3,) = _cast_nodes(F.linear(x, w))
            assert c3 is c1
    with torch.autocast(device, dtype=BF16):   # a new outermost region casts again
        (c4,) = _cast_nodes(F.linear(x, w))
        assert c4 is not c1
    with torch.autocast(device, dtype=BF16, cache_enabled=False):
        (c5,), (c6,) = _cast_nodes(F.linear(x, w)), _cast_nodes(F.linear(x, w))
        assert c5 is not c6
    # Inputs that are not leaves needing grad are never cached.
    with torch.autocast(device, dtype=BF16):
        h = w * 1
        (d1,), (d2,) = _cast_nodes(F.linear(x, h)), _cast_nodes(F.linear(x, h))
        assert d1 is not d2
    (y1 * 2 + y2).float().sum().backward()   # both uses reach w through one cast
    grads = [w.grad.clone()]
    # A cast cached under no_grad serves a later use that needs the gradient.
    w.grad = None
    with torch.autocast(device, dtype=BF16):
        with torch.no_grad():
            assert not F.linear(x, w).requires_grad
        y = F.linear(x, w)
        (c7,), (c8,) = _cast_nodes(y), _cast_nodes(F.linear(x, w))
        assert c7 is c8
    y.float().sum().backward()
    grads.append(w.grad)
    # Inference mode caches nothing (its tensors could not serve autograd).
    with torch.autocast(device, dtype=BF16):
        with torch.inference_mode():
            assert F.linear(x, w).dtype == BF16
        assert F.linear(x, w).requires_grad
    return grads


def test_weight_cache():
    # PyTorch's own cache on CPU has the same structure.
    for got, ref in zip(_cache_structure("tpu"), _cache_structure("cpu")):
        assert_same(got, ref)


def test_weight_changed_in_place_is_cast_again():
    x = _t(3, 5)
    w = _t(2, 5, seed=1).requires_grad_()
    tw = w.detach().to("tpu").requires_grad_()
    with torch.autocast("tpu", dtype=BF16):
        F.linear(x.to("tpu"), tw)
        with torch.no_grad():
            tw.mul_(2)   # an optimizer step inside the region
        out = F.linear(x.to("tpu"), tw)
    assert_same(out, F.linear(x.bfloat16(), (w.detach() * 2).bfloat16()))


def _mlp_steps(device, steps, autocast=True):
    """AdamW steps of an MLP regression under bf16 autocast (linear in bf16,
    mse_loss in float32 under both CUDA's and CPU's policies)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _t(8, 16).to(device), _t(8, 4, seed=5).to(device)
    losses = []
    metrics.reset()
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(device, dtype=BF16, enabled=autocast):
            out = model(x)
            loss = F.mse_loss(out, y)
        assert out.dtype == (BF16 if autocast else FP32) and loss.dtype == FP32
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()], metrics.snapshot()


def test_mlp_training_step_matches_cpu_autocast(mode, fresh_kernels):
    steps = 4
    losses, params, snap = _mlp_steps("tpu", steps)
    ref_losses, ref_params, _ = _mlp_steps("cpu", steps)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1.6e-2, atol=1e-5)
    for p, r in zip(params, ref_params):
        assert p.dtype == FP32
        torch.testing.assert_close(p, r, rtol=1.6e-2, atol=1e-5)
    assert snap["cpu_fallbacks"] == {}
    if mode == "fused":
        # One graph per step (the loss read is the only sync); steps 1 and 2
        # (no optimizer state yet, then its creation) may differ, later ones
        # reuse a graph.
        assert snap["flushes"] == {"item": steps}
        assert snap["graphs_compiled"] <= 2 and snap["graph_cache_hits"] >= steps - 2
    # Autocast changed the computation: float32 training differs.
    f32_losses, _, _ = _mlp_steps("cpu", steps, autocast=False)
    assert losses != f32_losses


def _scaler_run(device, steps=5):
    """float16 autocast with a GradScaler; step 2 sees an inf input, so its
    gradients are inf/NaN: the step is skipped and the scale halved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    g = torch.Generator().manual_seed(1)
    history = []
    for i in range(steps):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        if i == 1:
            x[0, 0] = float("inf")
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=FP16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        history.append((scaler.get_scale(), scaler._get_growth_tracker(),
                        [p.detach().cpu().clone() for p in model.parameters()]))
    return history


def test_grad_scaler_skips_inf_steps_as_on_cpu(mode):
    before = dict(metrics.M.cpu_fallbacks)
    tpu, cpu = _scaler_run("tpu"), _scaler_run("cpu")
    assert dict(metrics.M.cpu_fallbacks) == before   # GradScaler's ops ran on tpu
    scales = [s for s, _, _ in cpu]
    assert scales[1] == scales[0] / 2   # the inf step lowered the scale ...
    assert all(torch.equal(a, b) for a, b in zip(cpu[0][2], cpu[1][2]))   # ... and was skipped
    assert scales[-1] > scales[1]   # later steps grew it again
    for (s, t, ps), (rs, rt, rps) in zip(tpu, cpu):
        assert (s, t) == (rs, rt)
        for p, r in zip(ps, rps):
            torch.testing.assert_close(p, r, **platform_tol(1.3e-6, 1e-5))
    assert all(torch.equal(a, b) for a, b in zip(tpu[0][2], tpu[1][2]))


@pytest.mark.parametrize("dtype", [FP16, BF16, FP32])
@pytest.mark.parametrize("bad, inv", [(None, 0.25), (float("inf"), 0.25), (float("nan"), 1.0),
                                      (None, 1.0)])
def test_non_finite_check_and_unscale(mode, dtype, bad, inv):
    grads = [make(dtype, (3, 4)) * 8, make(dtype, (5,), seed=1)]
    if bad is not None:
        grads[1][2] = bad
    for start in (0.0, 1.0):
        ref = [g.clone() for g in grads]
        found, inv_scale = torch.full((), start), torch.full((), inv)
        dev = [g.to("tpu") for g in grads]
        tfound, tinv = found.to("tpu"), inv_scale.to("tpu")
        torch._amp_foreach_non_finite_check_and_unscale_(ref, found, inv_scale)
        torch._amp_foreach_non_finite_check_and_unscale_(dev, tfound, tinv)
        assert_same(tfound, found)
        for d, r in zip(dev, ref):
            assert_same(d, r, equal_nan=True, rtol=0, atol=0)


def test_unscale_writes_through_views(mode):
    # Gradients that are views of one buffer (DDP's gradient_as_bucket_view).
    def run(device):
        flat = torch.arange(10.0).to(device) * 1000
        flat[7] = float("inf")
        found = torch.zeros((), device=device)
        torch._amp_foreach_non_finite_check_and_unscale_([flat[:6].view(2, 3), flat[6:]], found,
                                                         torch.full((), 0.5, device=device))
        return flat, found

    for got, ref in zip(run("tpu"), run("cpu")):
        assert_same(got, ref)


@pytest.mark.parametrize("found_inf, tracker, scale", [
    (0.0, 0, 1024.0), (0.0, 2, 1024.0), (1.0, 2, 1024.0), (0.0, 2, 3.0e38), (1.0, 0, 1e-30)])
def test_update_scale(mode, found_inf, tracker, scale):
    ref = (torch.full((), scale), torch.full((), tracker, dtype=torch.int32))
    dev = tuple(t.to("tpu") for t in ref)
    for s, t in (ref, dev):
        out = torch._amp_update_scale_(s, t, torch.full((), found_inf, device=s.device), 2.0, 0.3, 3)
        assert out is s
    assert_same(dev[0], ref[0], rtol=0, atol=0)
    assert_same(dev[1], ref[1])


# Scales across float32's range, and products that fall at (or a double's
# last bit from) a float32 rounding midpoint: 1.1 and 0.3 times an integer
# land halfway between two float32s one time in ten. (Not subnormals: XLA
# flushes them to zero, on CPU as on TPU.)
_SCALES = [1e-30, 3.0e38, 1.0, 65536.0, 4.68e-38, 2.0 ** -100, 0.012549679,
           8.586437e23, 16777215.0, 12345.678, 0.0, float("inf")] + [
    (1 + i / 37) * 2.0 ** e for i, e in zip(range(36), range(-120, 127, 7))]


@pytest.mark.parametrize("factor", [0.3, 1.1, 1e-2, 3e10])
def test_update_scale_rounds_as_cpu(factor):
    # The scale times a factor float32 does not hold: CPU's kernel takes it
    # in double and rounds to float32; no float64 (a TPU emulates it).
    scales = torch.tensor(_SCALES)
    want = torch.stack([torch.ops.aten._amp_update_scale(s, torch.zeros((), dtype=_I), torch.ones(()), 2.0,
                                                          factor, 3)[0] for s in scales])
    dev = scales.to("tpu")
    got = torch.stack([torch.ops.aten._amp_update_scale(dev[i], torch.zeros((), dtype=_I, device="tpu"),
                                                         torch.ones((), device="tpu"), 2.0, factor, 3)[0]
                       for i in range(len(scales))])
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))


_I = torch.int32
BAD_SCALER_ARGS = [
    (torch._amp_update_scale_, lambda: (torch.ones(()), torch.zeros(()), torch.zeros(()), 2.0, 0.5, 2)),
    (torch._amp_update_scale_, lambda: (torch.ones((), dtype=torch.float64), torch.zeros((), dtype=_I),
                                        torch.zeros(()), 2.0, 0.5, 2)),
    (torch._amp_update_scale_, lambda: (torch.ones(2), torch.zeros((), dtype=_I), torch.zeros(()),
                                        2.0, 0.5, 2)),
    (torch._amp_update_scale_, lambda: (torch.ones(()), torch.zeros((), dtype=_I),
                                        torch.zeros((), dtype=torch.float64), 2.0, 0.5, 2)),
    (torch._amp_foreach_non_finite_check_and_unscale_,
     lambda: ([torch.ones(2)], torch.zeros((), dtype=torch.float64), torch.ones(()))),
    (torch._amp_foreach_non_finite_check_and_unscale_,
     lambda: ([torch.ones(2)], torch.zeros(()), torch.ones((), dtype=torch.float64))),
    (torch._amp_foreach_non_finite_check_and_unscale_,
     lambda: ([torch.ones(2, dtype=torch.long)], torch.zeros(()), torch.ones(()))),
    (torch._amp_foreach_non_finite_check_and_unscale_,
     lambda: ([torch.ones(2)], torch.zeros(2), torch.ones(()))),
]


@pytest.mark.parametrize("op, make_args", BAD_SCALER_ARGS)
def test_grad_scaler_ops_reject_what_cpu_rejects(mode, op, make_args):
    with pytest.raises(Exception) as cpu:
        op(*make_args())
    with pytest.raises(type(cpu.value)) as tpu:
        op(*_to_tpu(make_args()))
    assert str(tpu.value) == str(cpu.value).replace("_cpu", "_tpu")
