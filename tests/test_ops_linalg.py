"""Matrix products and linear algebra on tpu vs CPU, forward and backward,
with no CPU fallback."""
import pytest
import torch
import torch.nn.functional as F

import torchtpu

from conftest import assert_same, compare

DEV = "tpu"


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def spd(n, batch=()):
    a = torch.randn(*batch, n, n, dtype=torch.float64)
    return a @ a.mT + n * torch.eye(n, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_products(dtype):
    compare(torch.mm, r(3, 4, dtype=dtype), r(4, 5, dtype=dtype))
    compare(torch.bmm, r(2, 3, 4, dtype=dtype), r(2, 4, 5, dtype=dtype))
    compare(torch.mv, r(3, 4, dtype=dtype), r(4, dtype=dtype))
    compare(torch.dot, r(7, dtype=dtype), r(7, dtype=dtype))
    compare(torch.matmul, r(2, 3, 4, dtype=dtype), r(4, dtype=dtype))
    compare(torch.matmul, r(2, 1, 3, 4, dtype=dtype), r(3, 4, 2, dtype=dtype))
    compare(torch.outer, r(3, dtype=dtype), r(4, dtype=dtype))
    compare(lambda s, a, b: torch.addmm(s, a, b, beta=0.5, alpha=2), r(3, 5, dtype=dtype),
            r(3, 4, dtype=dtype), r(4, 5, dtype=dtype))
    compare(torch.addmm, r(5, dtype=dtype), r(3, 4, dtype=dtype), r(4, 5, dtype=dtype))
    compare(lambda s, a, b: torch.baddbmm(s, a, b, alpha=-1), r(2, 3, 5, dtype=dtype),
            r(2, 3, 4, dtype=dtype), r(2, 4, 5, dtype=dtype))
    compare(lambda s, a, b: torch.addbmm(s, a, b, beta=2), r(3, 5, dtype=dtype),
            r(2, 3, 4, dtype=dtype), r(2, 4, 5, dtype=dtype))
    compare(torch.addmv, r(3, dtype=dtype), r(3, 4, dtype=dtype), r(4, dtype=dtype))
    compare(lambda s, a, b: torch.addr(s, a, b, alpha=3), r(3, 4, dtype=dtype),
            r(3, dtype=dtype), r(4, dtype=dtype))


def test_full_precision_float32():
    # Large-ish inner dimension: reduced precision (bf16 passes) would be off by ~1e-2.
    # The float64 product is the reference: summation order may differ from
    # CPU's by a few ulps, bf16 passes would be off by ~1e-1.
    a, b = r(16, 512), r(512, 16)
    out = (a.to(DEV) @ b.to(DEV)).cpu()
    ref = (a.double() @ b.double()).float()
    torch.testing.assert_close(a @ b, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)


def test_addmm_beta_zero_ignores_nan():
    s = torch.full((3, 5), float("nan"))
    compare(lambda s, a, b: torch.addmm(s, a, b, beta=0), s, r(3, 4), r(4, 5), grad=False)


def test_int_and_low_precision():
    a = torch.randint(-100, 100, (4, 6))
    b = torch.randint(-100, 100, (6, 3))
    out = compare(torch.mm, a, b)
    assert out.dtype == torch.int64
    big = torch.full((2, 2), 2 ** 40)
    compare(torch.mm, big, torch.eye(2, dtype=torch.int64))
    a16, b16 = r(8, 64, dtype=torch.bfloat16), r(64, 8, dtype=torch.bfloat16)
    out = (a16.to(DEV) @ b16.to(DEV))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), a16 @ b16)


def test_complex_vdot():
    a = torch.randn(5, dtype=torch.complex128)
    b = torch.randn(5, dtype=torch.complex128)
    compare(torch.vdot, a, b, grad=False)
    compare(torch.mm, torch.randn(2, 3, dtype=torch.complex64),
            torch.randn(3, 2, dtype=torch.complex64), grad=False)


def test_det_slogdet_inv():
    a = r(3, 4, 4, dtype=torch.float64)
    compare(torch.linalg.det, a)
    compare(torch.linalg.slogdet, a)
    compare(torch.linalg.inv, a)
    compare(torch.logdet, spd(4))
    compare(lambda x: torch.linalg.inv_ex(x).inverse, r(4, 4))


def test_solve_and_lu():
    a = r(2, 4, 4, dtype=torch.float64)
    compare(torch.linalg.solve, a, r(2, 4, 3, dtype=torch.float64))
    compare(torch.linalg.solve, a, r(2, 4, dtype=torch.float64))
    compare(torch.linalg.solve, a[0], r(4, dtype=torch.float64))
    compare(lambda x, y: torch.linalg.solve(x, y, left=False), a, r(2, 3, 4, dtype=torch.float64))
    compare(torch.linalg.lu_factor, a)
    compare(torch.linalg.lu, r(5, 3, dtype=torch.float64))
    compare(torch.linalg.lu, r(3, 5, dtype=torch.float64))
    LU, piv = torch.linalg.lu_factor(a)
    compare(lambda lu, b: torch.linalg.lu_solve(lu, piv.to(lu.device), b), LU,
            r(2, 4, 2, dtype=torch.float64))
    compare(lambda lu, b: torch.linalg.lu_solve(lu, piv.to(lu.device), b, adjoint=True),
            LU, r(2, 4, 2, dtype=torch.float64))
    compare(lambda lu: torch.lu_unpack(lu, piv.to(lu.device)), LU)


def test_cholesky_family():
    a = spd(4, (2,))
    compare(torch.linalg.cholesky, a)
    compare(lambda x: torch.linalg.cholesky(x, upper=True), a)
    L = torch.linalg.cholesky(a)
    compare(torch.cholesky_solve, r(2, 4, 3, dtype=torch.float64), L)
    compare(lambda b, u: torch.cholesky_solve(b, u, upper=True), r(2, 4, 3, dtype=torch.float64),
            L.mT.contiguous())
    compare(torch.cholesky_inverse, L[0])
    info = torch.linalg.cholesky_ex(-torch.eye(3).to(DEV)).info
    assert info.item() == 1
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.cholesky(-torch.eye(3).to(DEV))
    for empty in (torch.zeros(0, 0), torch.zeros(2, 0, 0)):  # OpInfo's third sample
        for upper in (False, True):
            L, info = torch.linalg.cholesky_ex(empty.to(DEV), upper=upper)
            want_L, want_info = torch.linalg.cholesky_ex(empty, upper=upper)
            assert_same(L, want_L)
            assert_same(info, want_info)


def test_decompositions():
    a = r(5, 3, dtype=torch.float64)
    q, rr = torch.linalg.qr(a.to(DEV))
    qc, rc = torch.linalg.qr(a)
    torch.testing.assert_close(q.cpu().abs(), qc.abs())
    torch.testing.assert_close((q @ rr).cpu(), a)
    torch.testing.assert_close(torch.linalg.qr(a.to(DEV), mode="r").R.cpu().abs(), rc.abs())
    assert torch.linalg.qr(a.to(DEV), mode="complete").Q.shape == (5, 5)
    compare(torch.linalg.svdvals, a)
    u, s, vh = torch.linalg.svd(a.to(DEV), full_matrices=False)
    torch.testing.assert_close((u * s[None]) @ vh, a.to(DEV))
    h = spd(4)
    compare(torch.linalg.eigvalsh, h)
    w, v = torch.linalg.eigh(h.to(DEV))
    torch.testing.assert_close(((v * w[None]) @ v.mT).cpu(), h)
    # Gradients of the invariant parts agree.
    compare(lambda x: torch.linalg.eigh(x).eigenvalues, h)
    compare(lambda x: torch.linalg.svd(x, full_matrices=False).S, a)


def test_triangular():
    a = torch.triu(r(4, 4, dtype=torch.float64)) + 4 * torch.eye(4, dtype=torch.float64)
    b = r(2, 4, 3, dtype=torch.float64)
    compare(lambda x, y: torch.linalg.solve_triangular(x, y, upper=True), a, b)
    compare(lambda x, y: torch.linalg.solve_triangular(x, y, upper=True, left=False),
            a, r(3, 4, dtype=torch.float64))
    compare(lambda x, y: torch.linalg.solve_triangular(x.mT, y, upper=False, unitriangular=True),
            a, b)
    compare(lambda y, x: torch.triangular_solve(y, x, upper=True, transpose=True), b, a)


def test_matrix_exp_cross_norm():
    compare(torch.linalg.matrix_exp, r(2, 3, 3, dtype=torch.float64) * 0.3)
    compare(torch.linalg.cross, r(4, 3), r(4, 3))
    compare(torch.linalg.vector_norm, r(4, 3))


def test_pinv():
    compare(torch.linalg.pinv, r(2, 5, 3, dtype=torch.float64))
    h = spd(4)
    compare(lambda x: torch.linalg.pinv(x, hermitian=True), h)
    sing = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)
    compare(torch.linalg.pinv, sing, grad=False)
    compare(lambda x: torch.linalg.pinv(x, atol=0.5), r(4, 3, dtype=torch.float64), grad=False)


def _raises_like_cpu(fn, *args):
    """fn raises on tpu the exception (type and message) it raises on CPU."""
    with pytest.raises(Exception) as cpu:
        fn(*args)
    with pytest.raises(type(cpu.value)) as got:
        fn(*[a.to(DEV) for a in args])
    assert str(got.value) == str(cpu.value)


def test_singular_errors_and_info():
    sing = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 0.0, 1.0]])
    batch = torch.stack([torch.eye(3), sing])
    not_pd = torch.diag(torch.tensor([1.0, 2.0, -1.0, 4.0]))
    ones = torch.ones(3)
    _raises_like_cpu(torch.linalg.inv, sing)
    _raises_like_cpu(torch.linalg.inv, batch)
    _raises_like_cpu(lambda a: torch.linalg.inv_ex(a, check_errors=True), sing)
    _raises_like_cpu(lambda a, b: torch.linalg.solve(a, b), sing, ones)
    _raises_like_cpu(torch.linalg.lu_factor, batch)
    _raises_like_cpu(lambda a: torch.linalg.tensorinv(a, ind=1), sing)
    _raises_like_cpu(torch.linalg.cholesky, not_pd)
    _raises_like_cpu(torch.linalg.cholesky, torch.stack([torch.eye(4), not_pd]))
    # info: LAPACK's (the first zero pivot; the order of the first leading
    # minor that is not positive-definite).
    compare(lambda a: torch.linalg.inv_ex(a).info, batch, grad=False)
    compare(lambda a, b: torch.linalg.solve_ex(a, b).info, sing, ones, grad=False)
    compare(lambda a: torch.linalg.cholesky_ex(a).info, torch.stack([torch.eye(4), not_pd, -not_pd]),
            grad=False)
    compare(lambda a: torch.linalg.cholesky_ex(a, upper=True).info,
            torch.tensor([[4.0, 2.0, 1.0], [2.0, 1.0, 0.0], [1.0, 0.0, 3.0]]), grad=False)


def test_cholesky_upper_reads_upper_triangle():
    a = torch.triu(r(4, 4, dtype=torch.float64)) + 5 * torch.eye(4, dtype=torch.float64)
    compare(lambda x: torch.linalg.cholesky(x, upper=True), a, grad=False)
    compare(lambda x: torch.cholesky(x, upper=True), a, grad=False)


def test_eig():
    a = r(2, 4, 4, dtype=torch.float64)
    compare(lambda x: torch.view_as_real(torch.linalg.eigvals(x)), a)
    w, v = torch.linalg.eig(a.to(DEV))
    wc, vc = torch.linalg.eig(a)
    assert w.dtype == wc.dtype and v.dtype == vc.dtype
    torch.testing.assert_close(w.cpu(), wc)
    # Eigenvectors are defined up to a phase: compare magnitudes and A V = V diag(w).
    torch.testing.assert_close(v.cpu().abs(), vc.abs())
    torch.testing.assert_close((a.to(v.dtype) @ v.cpu()), v.cpu() * w.cpu()[..., None, :])
    out = torch.empty(2, 4, dtype=torch.complex128).to(DEV)
    torch.linalg.eigvals(a.to(DEV), out=out)
    torch.testing.assert_close(out.cpu(), wc)


@pytest.mark.parametrize("driver", [None, "gels", "gelsy", "gelsd", "gelss"])
def test_lstsq(driver):
    cases = [((5, 3), (5, 2)), ((3, 5), (3, 2)), ((2, 5, 3), (2, 5)), ((1, 5, 3), (2, 5, 2)),
             ((5, 0), (5, 2))]
    for sa, sb in cases:
        fn = lambda a, b: tuple(torch.linalg.lstsq(a, b, driver=driver))  # noqa: E731
        compare(fn, r(*sa, dtype=torch.float64), r(*sb, dtype=torch.float64), grad=False)
    compare(lambda a, b: torch.linalg.lstsq(a, b, driver=driver).solution,
            r(2, 4, 4, dtype=torch.float64), r(2, 4, 2, dtype=torch.float64))


def test_householder_family():
    a = r(2, 5, 3, dtype=torch.float64)
    compare(torch.geqrf, a, grad=False)
    h, tau = torch.geqrf(a)
    compare(torch.linalg.householder_product, h, tau)
    compare(lambda x, t, c: torch.ormqr(x, t, c), h, tau, r(2, 5, 2, dtype=torch.float64))
    compare(lambda x, t, c: torch.ormqr(x, t, c, left=False, transpose=True), h, tau,
            r(2, 4, 5, dtype=torch.float64))


def test_matrix_exp_degrees():
    # Each Taylor degree PyTorch picks by the 1-norm, a batch (always degree
    # 18, scaled per matrix), and the trivial sizes.
    for scale in (1e-9, 1e-5, 1e-3, 0.05, 0.2, 1.0, 4.0):
        compare(torch.linalg.matrix_exp, r(4, 4, dtype=torch.float64) * scale)
    batch = r(3, 4, 4, dtype=torch.float64) * torch.tensor([0.01, 1.0, 5.0], dtype=torch.float64)[:, None, None]
    compare(torch.linalg.matrix_exp, batch)
    compare(torch.linalg.matrix_exp, r(2, 1, 1))
    compare(torch.linalg.matrix_exp, r(2, 0, 0), grad=False)
    # bf16 computes in float32 (CPU's bf16 kernel reads its coefficients wrongly).
    a = r(4, 4) * 0.5
    out = torch.linalg.matrix_exp(a.to(torch.bfloat16).to(DEV))
    assert out.dtype == torch.bfloat16
    ref = torch.linalg.matrix_exp(a.to(torch.bfloat16).float()).to(torch.bfloat16)
    torch.testing.assert_close(out.cpu(), ref)


def test_low_precision_rounding_like_cpu():
    # bf16: where CPU rounds (once for addmm/baddbmm/addmv, after each batch
    # for addbmm, after each product for cross and addr, beta * self only for
    # an empty product) decides the last bit: compare exactly.
    def exact(fn, *args):
        torch.testing.assert_close(fn(*[a.to(DEV) for a in args]).cpu(), fn(*args), rtol=0, atol=0)

    bf = torch.bfloat16
    g = torch.Generator().manual_seed(1)
    m = lambda *s: (torch.randn(*s, generator=g) * 3).to(bf)  # noqa: E731
    exact(lambda s, a, b: torch.baddbmm(s, a, b, beta=0.2, alpha=0.6), m(4, 5, 10), m(4, 5, 7), m(4, 7, 10))
    exact(lambda s, a, b: torch.addbmm(s, a, b, beta=0.6, alpha=0.2), m(5, 10), m(6, 5, 7), m(6, 7, 10))
    exact(lambda s, a, b: torch.addmm(s, a, b, beta=0.2, alpha=0.6), m(5, 10), m(5, 7), m(7, 10))
    exact(lambda s, a, b: torch.addmm(s, a, b, beta=0.2, alpha=0.6), m(5, 10), m(5, 0), m(0, 10))
    exact(lambda s, a, b: torch.addbmm(s, a, b, beta=0.2), m(5, 10), m(3, 5, 0), m(3, 0, 10))
    exact(lambda s, a, b: torch.addmv(s, a, b, beta=0.2, alpha=0.6), m(5), m(5, 9), m(9))
    exact(lambda s, a, b: torch.addr(s, a, b, beta=0.6, alpha=0.2), m(5, 10), m(5), m(10))
    exact(torch.linalg.cross, m(20, 3), m(20, 3))


def test_grouped_mm_as_on_cpu(mode):
    # Mixture-of-experts matmuls: groups along a's rows (2-D x 3-D), b's
    # columns (3-D x 2-D), the shared K (2-D x 2-D), and bmm; float32 and
    # bf16, with gradients; rows past the last group are unset on CPU.
    g = torch.Generator().manual_seed(0)
    offs = lambda *ends: torch.tensor(ends, dtype=torch.int32)  # noqa: E731
    cases = [((6, 8), (2, 8, 8), offs(2, 4)), ((2, 5, 8), (8, 8), offs(4, 8)),
             ((4, 16), (16, 8), offs(8, 16)), ((2, 5, 8), (2, 8, 8), None), ((6, 8), (2, 8, 8), offs(0, 6))]
    torchtpu.metrics.reset()
    for dtype in (torch.float32, torch.bfloat16):
        tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
        for sa, sb, ends in cases:
            a = torch.randn(sa, generator=g).to(dtype).requires_grad_()
            b = torch.randn(sb, generator=g).to(dtype).requires_grad_()
            at, bt = (x.detach().to("tpu").requires_grad_() for x in (a, b))
            want = torch._grouped_mm(a, b, ends)
            got = torch._grouped_mm(at, bt, None if ends is None else ends.to("tpu"))
            assert got.dtype == want.dtype and got.shape == want.shape
            rows = slice(0, int(ends[-1]) if ends is not None and len(sa) == 2 and len(sb) == 3 else None)
            torch.testing.assert_close(got.detach().cpu()[rows], want.detach()[rows], **tol)
            cot = torch.randn(want.shape, generator=g).to(dtype)
            if rows.stop is not None:
                cot[rows.stop:] = 0
            want.backward(cot)
            got.backward(cot.to("tpu"))
            torch.testing.assert_close(at.grad.cpu()[rows], a.grad[rows], **tol)
            torch.testing.assert_close(bt.grad.cpu(), b.grad, **tol)
    # Sizes CPU's kernel refuses (rows not 16-byte aligned) run on tpu.
    a, b = torch.randn(5, 3, generator=g), torch.randn(2, 3, 7, generator=g)
    got = torch._grouped_mm(a.to("tpu"), b.to("tpu"), offs(2, 5).to("tpu")).cpu()
    torch.testing.assert_close(got, torch.cat([a[:2] @ b[0], a[2:] @ b[1]]))
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == {}


def test_lstsq_residuals_only_at_full_rank(mode):
    # gelsd and gelss give residuals (m > n) only when every matrix has full
    # rank, as on CPU: the ranks are read back; nothing falls back.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 6, 3, dtype=torch.float64, generator=g)
    b = torch.randn(2, 6, 2, dtype=torch.float64, generator=g)
    deficient = a.clone()
    deficient[0, :, 2] = deficient[0, :, 1]
    torchtpu.metrics.reset()
    for driver in ("gelsd", "gelss"):
        for x in (a, deficient, a.to(torch.complex128)):
            want = torch.linalg.lstsq(x, b.to(x.dtype), driver=driver)
            got = torch.linalg.lstsq(x.to("tpu"), b.to(x.dtype).to("tpu"), driver=driver)
            for w, t in zip(want, got):
                assert t.shape == w.shape and t.dtype == w.dtype
                torch.testing.assert_close(t.cpu(), w)
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == {}


def test_cpu_fallback_keeps_lazy_conjugation():
    # Complex LDL runs on the CPU fallback; a lazily conjugated input must
    # still resolve when its CPU kernel is called from inside the dispatcher.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 4, 4, dtype=torch.complex64, generator=g)
    a = (a + a.mH).conj()
    assert a.is_conj()
    want = torch.linalg.ldl_factor(a, hermitian=True)
    got = torch.linalg.ldl_factor(a.to("tpu"), hermitian=True)
    torch.testing.assert_close(got.LD.cpu(), want.LD)
    assert torch.equal(got.pivots.cpu(), want.pivots)


def test_ldl_factor_and_solve_as_on_cpu(mode):
    # LAPACK's Bunch-Kaufman pivoting (sytf2, lower): the same pivots and info
    # as CPU, 1x1 and 2x2 blocks, a singular batch member; then solves.
    g = torch.Generator().manual_seed(0)
    torchtpu.metrics.reset()
    for n in (1, 2, 5, 12):
        a = torch.randn(3, n, n, dtype=torch.float64, generator=g)
        a = a + a.mT
        a[1].diagonal().mul_(0.01)  # small pivots: 2x2 blocks and interchanges
        a[2, :, 0] = a[2, 0, :] = 0  # a zero column: info > 0
        want = torch.linalg.ldl_factor_ex(a)
        got = torch.linalg.ldl_factor_ex(a.to("tpu"))
        for w, t in zip(want, got):
            assert t.dtype == w.dtype and t.shape == w.shape
            torch.testing.assert_close(t.cpu(), w, rtol=1e-12, atol=1e-12)
        b = torch.randn(2, n, 3, dtype=torch.float64, generator=g)
        ld, piv = want.LD[:2], want.pivots[:2]
        torch.testing.assert_close(torch.linalg.ldl_solve(ld.to("tpu"), piv.to("tpu"), b.to("tpu")).cpu(),
                                   torch.linalg.ldl_solve(ld, piv, b))
    assert (got.pivots < 0).any() and got.info[2].item() > 0
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == {}
    with pytest.raises(RuntimeError, match="ldl_factor"):
        torch.linalg.ldl_factor(torch.zeros(2, 2, dtype=torch.float64, device="tpu"))


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("rows", [4, 30])   # 30: CPU's matmul form of p=2
def test_cdist_pdist(p, rows):
    g = torch.Generator().manual_seed(1)
    x1 = torch.randn(2, rows, 3, generator=g)
    x2 = torch.randn(2, 5, 3, generator=g)
    x2[:, 0] = x1[:, 0]    # a zero distance: CPU's gradient is 0 there
    compare(lambda a, b: torch.cdist(a, b, p=p), x1, x2)
    compare(lambda a: F.pdist(a, p=p), x1[0])


@pytest.mark.parametrize("kw", [{}, {"atol": 0.5}, {"tol": 0.5}, {"hermitian": True},
                                {"atol": torch.tensor(0.5), "rtol": torch.tensor(0.1)}])
def test_matrix_rank_out_through_a_view(kw):
    # PyTorch's composite out= kernel returns a new tensor for subclasses
    # instead of writing out=; tpu writes it, as CPU does.
    a = torch.randn(2, 3, 3)
    a[0, 2] = a[0, 1]
    want = torch.linalg.matrix_rank(a, **kw)
    base = torch.zeros(2, 2, dtype=torch.int64, device=DEV)
    tkw = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    got = torch.linalg.matrix_rank(a.to(DEV), **tkw, out=base[1])
    assert torch.equal(base.cpu(), torch.stack([torch.zeros_like(want), want]))
    assert torch.equal(got.cpu(), want)
