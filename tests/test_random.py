"""Random ops on tpu: shapes, dtypes, ranges, rough moments, reproducibility
under torch.manual_seed, RNG state round trip, no recompilation per call."""
import pytest
import torch

import torchtpu

DEV = "tpu"
N = 20000  # moments of N samples: standard error ~0.007 for unit variance


def moments(t):
    t = t.cpu().double()
    return t.mean().item(), t.std().item()


def test_randn_rand_randint_factories():
    x = torch.randn(N, device=DEV)
    assert x.device.type == "tpu" and x.dtype == torch.float32 and x.shape == (N,)
    m, s = moments(x)
    assert abs(m) < 0.05 and abs(s - 1) < 0.05

    u = torch.rand(4, N // 4, device=DEV, dtype=torch.float64)
    assert u.dtype == torch.float64 and u.shape == (4, N // 4)
    uc = u.cpu()
    assert uc.min() >= 0 and uc.max() < 1
    m, s = moments(u)
    assert abs(m - 0.5) < 0.02 and abs(s - (1 / 12) ** 0.5) < 0.02

    r = torch.randint(3, 9, (N,), device=DEV)
    assert r.dtype == torch.int64
    rc = r.cpu()
    assert rc.min() == 3 and rc.max() == 8
    assert torch.bincount(rc - 3).min() > N / 6 * 0.8

    h = torch.randn(64, device=DEV, dtype=torch.bfloat16)
    assert h.dtype == torch.bfloat16 and torch.isfinite(h.cpu()).all()


def test_manual_seed_reproducible_and_stream_advances():
    torch.manual_seed(1234)
    a = torch.randn(8, device=DEV).cpu()
    b = torch.randn(8, device=DEV).cpu()
    torch.manual_seed(1234)
    a2 = torch.randn(8, device=DEV).cpu()
    b2 = torch.randn(8, device=DEV).cpu()
    torch.testing.assert_close(a, a2, rtol=0, atol=0)
    torch.testing.assert_close(b, b2, rtol=0, atol=0)
    assert not torch.equal(a, b)
    torch.manual_seed(4321)
    assert not torch.equal(torch.randn(8, device=DEV).cpu(), a)
    # Seeds over 2**63 and negative seeds are valid, as on CPU.
    torch.manual_seed(2 ** 64 - 1)
    c = torch.rand(4, device=DEV).cpu()
    torch.manual_seed(-1)
    torch.testing.assert_close(torch.rand(4, device=DEV).cpu(), c, rtol=0, atol=0)


def test_a_draw_fills_its_elements_in_order_whatever_its_shape():
    """As on CPU, a draw of shape (2, 3, 4) under a seed holds the elements
    a draw of 24 holds under that seed, in row-major order."""
    for draw in (torch.randn, torch.rand, lambda *s, device: torch.randint(0, 1000, s, device=device)):
        torch.manual_seed(7)
        flat = draw(24, device=DEV).cpu()
        torch.manual_seed(7)
        shaped = draw(2, 3, 4, device=DEV).cpu()
        assert shaped.shape == (2, 3, 4)
        torch.testing.assert_close(shaped.reshape(-1), flat, rtol=0, atol=0)
        assert shaped.dtype == draw(2, 3, 4, device="cpu").dtype


def test_rng_state_round_trip():
    torch.manual_seed(7)
    torch.randn(3, device=DEV)
    state = torch.tpu.get_rng_state()
    assert state.dtype == torch.uint8
    a = torch.rand(5, device=DEV).cpu()
    torch.randn(3, device=DEV)
    torch.tpu.set_rng_state(state)
    torch.testing.assert_close(torch.rand(5, device=DEV).cpu(), a, rtol=0, atol=0)
    torch.tpu.manual_seed(2 ** 63 + 5)
    assert torch.tpu.initial_seed() == 2 ** 63 + 5
    state = torch.tpu.get_rng_state()
    b = torch.rand(5, device=DEV).cpu()
    torch.tpu.set_rng_state(state)
    torch.testing.assert_close(torch.rand(5, device=DEV).cpu(), b, rtol=0, atol=0)


def test_device_generator_as_cpus():
    """torch.Generator(device="tpu") (what Hugging Face's watermarking
    processors make, a Python backend's C++ hooks cannot): as a CPU generator
    on CPU, its seed repeats its draws, its state round-trips, and neither it
    nor the default generator moves the other; new generators compile nothing."""
    import copy
    import pickle
    draws = (lambda g, d: torch.rand(5, generator=g, device=d),
             lambda g, d: torch.randperm(9, generator=g, device=d),
             lambda g, d: torch.randint(0, 7, (6,), generator=g, device=d),
             lambda g, d: torch.empty(4, device=d).normal_(generator=g),
             lambda g, d: torch.multinomial(torch.ones(8, device=d), 3, generator=g))
    for dev in ("cpu", DEV):
        g = torch.Generator(device=dev)
        assert isinstance(g, torch.Generator) and g.device.type == dev
        g.manual_seed(11)
        first = [f(g, dev).cpu() for f in draws]
        assert g.manual_seed(11) is g and g.initial_seed() == 11
        torch.manual_seed(0)
        global_draw = torch.rand(5, device=dev).cpu()
        state = g.get_state()
        assert all(torch.equal(f(g, dev).cpu(), a) for f, a in zip(draws, first))
        torch.manual_seed(0)
        torch.testing.assert_close(torch.rand(5, device=dev).cpu(), global_draw, rtol=0, atol=0)
        g.set_state(state)
        again = draws[0](g, dev).cpu()
        for h in (pickle.loads(pickle.dumps(g.set_state(state))), copy.deepcopy(g.set_state(state)),
                  g.set_state(state).clone_state()):
            assert h.device == g.device
            torch.testing.assert_close(draws[0](h, dev).cpu(), again, rtol=0, atol=0)
    # The default generator's stream under torch.manual_seed(seed), as CUDA's.
    torch.manual_seed(11)
    torch.testing.assert_close(torch.rand(5, device=DEV).cpu(), first[0], rtol=0, atol=0)
    assert type(torch.Generator()) is torch._C.Generator
    assert isinstance(torch._C.Generator(), torch.Generator)
    torchtpu.sync()
    before = torchtpu.metrics.M.compilations
    for seed in range(3):
        torch.rand(5, generator=torch.Generator(DEV).manual_seed(seed), device=DEV).cpu()
    assert torchtpu.metrics.M.compilations == before
    with pytest.raises(RuntimeError, match="torch.Generator of its own inside"):
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            torch.rand(5, generator=g, device=DEV)


@pytest.mark.parametrize("draw", [lambda g: torch.rand(5, generator=g, device=DEV),
                                  lambda g: torch.empty(4, device=DEV).normal_(generator=g),
                                  lambda g: torch.randperm(9, generator=g, device=DEV)],
                         ids=["rand", "normal_", "randperm"])
def test_another_devices_generator_raises_as_on_cuda(draw):
    # CUDA's kernels refuse a CPU generator ("Expected a 'cuda' device type
    # for generator but found 'cpu'"): its seed cannot drive the device's draws.
    with pytest.raises(RuntimeError, match="Expected a 'tpu' device type for generator but found 'cpu'"):
        draw(torch.Generator().manual_seed(0))
        torchtpu.sync()


def test_no_recompile_per_call():
    x = torch.empty(16, device=DEV)
    x.normal_()
    torch.rand(16, device=DEV)
    torchtpu.sync()
    before = torchtpu.metrics.M.compilations
    outs = [torch.rand(16, device=DEV).cpu() for _ in range(3)] + [x.normal_().cpu() for _ in range(3)]
    assert torchtpu.metrics.M.compilations == before
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[3], outs[4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_inplace_distributions(dtype):
    x = torch.empty(N, device=DEV, dtype=dtype)
    tol = 0.1 if dtype == torch.bfloat16 else 0.05

    x.uniform_(-2, 3)
    c = x.cpu().double()
    assert x.dtype == dtype and c.min() >= -2 and c.max() < 3
    assert abs(c.mean() - 0.5) < tol * 3

    m, s = moments(x.normal_(2.0, 3.0))
    assert abs(m - 2) < tol * 3 and abs(s - 3) < tol * 3

    c = x.exponential_(2.0).cpu().double()
    assert c.min() >= 0 and abs(c.mean() - 0.5) < tol

    c = x.geometric_(0.25).cpu().double()
    assert c.min() >= 1 and (c == c.round()).all() and abs(c.mean() - 4) < tol * 8

    c = x.log_normal_(0.0, 0.5).cpu().double()
    assert c.min() > 0 and abs(c.log().mean()) < tol and abs(c.log().std() - 0.5) < tol

    c = x.cauchy_(1.0, 2.0).cpu().double()
    assert abs(c.median() - 1) < tol * 4

    c = x.bernoulli_(0.3).cpu().double()
    assert set(c.unique().tolist()) <= {0.0, 1.0} and abs(c.mean() - 0.3) < tol / 2


def test_random_integers():
    x = torch.empty(N, device=DEV, dtype=torch.int64)
    c = x.random_(5).cpu()
    assert c.min() == 0 and c.max() == 4
    c = x.random_(-3, 3).cpu()
    assert c.min() == -3 and c.max() == 2
    b = torch.empty(1000, device=DEV, dtype=torch.uint8).random_().cpu()
    assert b.dtype == torch.uint8 and b.max() > 200
    f = torch.empty(1000, device=DEV).random_().cpu()
    assert (f == f.round()).all() and f.min() >= 0 and f.max() <= 2 ** 24
    bo = torch.empty(1000, device=DEV, dtype=torch.bool).random_().cpu()
    assert 300 < bo.sum() < 700


def test_bernoulli_tensor_p_and_normal_tensor_args():
    p = torch.tensor([0.0, 1.0, 0.5], device=DEV).expand(N // 10, 3)
    c = torch.bernoulli(p).cpu()
    assert c.dtype == torch.float32 and c.shape == (N // 10, 3)
    assert (c[:, 0] == 0).all() and (c[:, 1] == 1).all() and abs(c[:, 2].mean() - 0.5) < 0.1
    c = torch.empty(N // 10, 3, device=DEV).bernoulli_(p).cpu()
    assert (c[:, 0] == 0).all() and (c[:, 1] == 1).all()

    mean = torch.tensor([0.0, 10.0], device=DEV).repeat(N // 2)
    out = torch.normal(mean, 2.0).cpu().view(-1, 2)
    assert out.shape == (N // 2, 2)
    assert abs(out[:, 1].mean() - 10) < 0.2 and abs(out[:, 0].std() - 2) < 0.2
    std = torch.tensor([1.0, 0.0], device=DEV)
    out = torch.normal(torch.zeros(2, device=DEV), std).cpu()
    assert out[1] == 0
    out = torch.normal(3.0, torch.full((N,), 0.5, device=DEV))
    m, s = moments(out)
    assert abs(m - 3) < 0.05 and abs(s - 0.5) < 0.05


def test_like_factories_and_randperm():
    x = torch.zeros(3, 1000, device=DEV, dtype=torch.float64)
    u = torch.rand_like(x)
    assert u.dtype == torch.float64 and u.shape == x.shape and u.device.type == "tpu"
    assert 0 <= u.cpu().min() and u.cpu().max() < 1
    z = torch.randn_like(x)
    assert abs(z.cpu().mean()) < 0.1
    r = torch.randint_like(x, 2, 5).cpu()
    assert r.dtype == torch.float64 and r.min() == 2 and r.max() == 4
    p = torch.randperm(50, device=DEV)
    assert p.dtype == torch.int64
    assert sorted(p.cpu().tolist()) == list(range(50))
    assert p.cpu().tolist() != list(range(50))


def test_multinomial():
    probs = torch.tensor([[0.0, 1.0, 3.0, 0.0], [1.0, 1.0, 1.0, 1.0]], device=DEV)
    s = torch.multinomial(probs, 2).cpu()
    assert s.dtype == torch.int64 and s.shape == (2, 2)
    assert sorted(s[0].tolist()) == [1, 2]
    assert len(set(s[1].tolist())) == 2
    s = torch.multinomial(probs, 4000, replacement=True).cpu()
    assert s.shape == (2, 4000)
    counts = torch.bincount(s[0], minlength=4)
    assert counts[0] == 0 and counts[3] == 0 and abs(counts[2] / 4000 - 0.75) < 0.05
    v = torch.multinomial(torch.tensor([0.2, 0.8], device=DEV), 1000, replacement=True).cpu()
    assert v.shape == (1000,) and abs(v.double().mean() - 0.8) < 0.06


def test_dropout_train_eval_backward():
    x = torch.ones(N, device=DEV, requires_grad=True)
    y = torch.nn.functional.dropout(x, 0.25, training=True)
    yc = y.detach().cpu()
    assert set(yc.unique().tolist()) <= {0.0, torch.tensor(4 / 3).item()}
    assert abs((yc == 0).double().mean() - 0.25) < 0.02
    y.sum().backward()
    torch.testing.assert_close(x.grad.cpu(), yc)
    e = torch.nn.functional.dropout(x, 0.25, training=False)
    torch.testing.assert_close(e.detach().cpu(), torch.ones(N))
    torch.manual_seed(3)
    d1 = torch.nn.Dropout(0.5)(torch.ones(64, device=DEV)).cpu()
    torch.manual_seed(3)
    d2 = torch.nn.Dropout(0.5)(torch.ones(64, device=DEV)).cpu()
    torch.testing.assert_close(d1, d2, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float16, torch.float32])
def test_native_dropout_backward_dtypes_as_on_cpu(dtype):
    # An integer or bool gradient gives float32, scaled, as on CPU (OpInfo's
    # bool sample: it gave 1 where CPU gives the scale).
    grad = torch.tensor([[True, False, True], [True, True, False]]).to(dtype)
    mask = torch.tensor([[True, True, False], [False, True, True]])
    want = torch.ops.aten.native_dropout_backward(grad, mask, 2.0)
    got = torch.ops.aten.native_dropout_backward(grad.to(DEV), mask.to(DEV), 2.0)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_distribution_samplers_on_the_device(dtype):
    """torch.distributions' samplers (Gamma, Beta, Dirichlet, Poisson,
    Binomial) and argument checks run on the device, not through the CPU,
    with the right dtypes, shapes and moments."""
    from torch import distributions as D
    before = torchtpu.metrics.snapshot()["cpu_fallbacks"]
    full = lambda v: torch.full((N,), v, device=DEV, dtype=dtype)  # noqa: E731
    tol = 0.1 if dtype == torch.bfloat16 else 0.05

    g = D.Gamma(full(2.0), full(1.0)).sample()
    assert g.dtype == dtype and g.shape == (N,)
    m, s = moments(g)
    assert abs(m - 2.0) < 2 * tol and abs(s - 2 ** 0.5) < 2 * tol and g.cpu().min() > 0

    b = D.Beta(full(2.0), full(3.0)).sample()
    m, s = moments(b)
    assert b.dtype == dtype and abs(m - 0.4) < tol / 2 and abs(s - 0.2) < tol / 2

    dr = D.Dirichlet(torch.tensor([1.0, 2.0, 5.0], device=DEV, dtype=dtype)).sample((N // 4,))
    assert dr.dtype == dtype and dr.shape == (N // 4, 3)
    torch.testing.assert_close(dr.cpu().double().sum(-1), torch.ones(N // 4, dtype=torch.float64),
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    assert abs(dr.cpu().double()[:, 2].mean().item() - 5 / 8) < tol / 2

    p = D.Poisson(full(3.0)).sample()
    m, s = moments(p)
    assert p.dtype == dtype and bool((p.cpu() == p.cpu().round()).all())
    assert abs(m - 3.0) < 2 * tol and abs(s - 3 ** 0.5) < 2 * tol

    n = D.Binomial(full(10.0), full(0.3)).sample()
    m, s = moments(n)
    assert n.dtype == dtype and n.cpu().min() >= 0 and n.cpu().max() <= 10
    assert abs(m - 3.0) < 2 * tol and abs(s - 2.1 ** 0.5) < 2 * tol

    # (Argument checks call _is_all_true; torch.compile's first use turns their default off.)
    c = D.Categorical(logits=torch.zeros(4, 5, device=DEV, dtype=dtype), validate_args=True)
    assert c.sample().shape == (4,)
    torchtpu.sync()
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == before


def test_gamma_rsample_gradient_matches_cpu():
    """Gamma.rsample's gradient (aten._standard_gamma_grad) for the same
    draws is CPU's, and exact; a bad argument raises as on CPU."""
    from torch import distributions as D
    alpha = torch.tensor([0.3, 1.0, 2.5, 7.0], dtype=torch.float64)
    draws = torch.tensor([0.05, 0.8, 2.0, 6.5], dtype=torch.float64)
    import mpmath

    def assert_exact(alphas, xs, got):
        # -(dP/da)/(dP/dx) of the regularized incomplete gamma P(a, x)
        mpmath.mp.dps = 30
        for a, x, g in zip(alphas.tolist(), xs.tolist(), got.tolist()):
            exact = -mpmath.diff(lambda b: mpmath.gammainc(b, 0, x, regularized=True), a) / (
                mpmath.mpf(x) ** (a - 1) * mpmath.exp(-x) / mpmath.gamma(a))
            assert abs(g - float(exact)) <= 1e-10 * abs(float(exact)), (a, x, g, exact)

    got = torch._standard_gamma_grad(alpha.to(DEV), draws.to(DEV)).cpu()
    assert_exact(alpha, draws, got)
    # CPU's kernel approximates (2.2e-5 relative off the exact value here).
    torch.testing.assert_close(got, torch._standard_gamma_grad(alpha, draws), rtol=3e-5, atol=0)
    a = alpha.to(DEV).requires_grad_()
    x = D.Gamma(a, torch.ones(4, device=DEV, dtype=torch.float64)).rsample()
    x.sum().backward()
    assert_exact(alpha, x.detach().cpu(), a.grad.cpu())
    with pytest.raises(ValueError, match="concentration"):
        D.Gamma(torch.tensor([-1.0], device=DEV), torch.ones(1, device=DEV), validate_args=True)
