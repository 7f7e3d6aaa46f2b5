"""Matrix products and dense linear algebra.

Float matmuls run at the precision torch.set_float32_matmul_precision()
asks for (lower(matmul=True)): full float32 by default, so results match
PyTorch on CPU; decompositions always do. Integer products accumulate
exactly in int64; bf16/f16 accumulate in float32.
"""
import math

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import torch
from jax import lax

from .registry import ctx, lower
from .util import ctx_dtype, matmul_precision, rounder

from ..compat import aten
HIGHEST = lax.Precision.HIGHEST


def _acc(dtype):
    """The dtype a product of this dtype accumulates in."""
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.bfloat16, jnp.float16):
        return jnp.dtype(jnp.float32)
    if dtype.kind in "iub":
        return jnp.dtype(jnp.int64)
    return dtype


def _matmul(a, b, out_dtype=None):
    out_dtype = out_dtype or ctx_dtype()
    acc = _acc(a.dtype)
    if acc.kind == "i":
        a, b = a.astype(acc), b.astype(acc)
    r = jnp.matmul(a, b, precision=matmul_precision(), preferred_element_type=acc)
    return r.astype(out_dtype)


def _scaled(x, s):
    """s * x where s is a Scalar argument (a Python default or traced)."""
    if isinstance(s, (int, float)) and s == 1:
        return x
    return x * jnp.asarray(s).astype(x.dtype) if x.dtype != jnp.bool_ else jnp.logical_and(x, s)


def _add_beta(self, prod, beta, alpha, scalars_in_dtype=False, empty=False):
    """beta * self + alpha * prod, in prod's accumulation dtype: bf16/f16
    round once at the end, as CPU's gemm-based kernels do (addmv's also
    first round alpha and beta to the dtype: scalars_in_dtype). An empty
    product (empty: a zero-size inner dimension or batch) is CPU's
    self.mul_(beta), beta rounded to the dtype. beta == 0 ignores self (NaN
    included), as on CPU."""
    dtype = ctx_dtype()
    comp = jnp.dtype(jnp.bool_) if dtype == jnp.bool_ else _acc(dtype)
    if empty and dtype in (jnp.bfloat16, jnp.float16):
        prod, alpha, scalars_in_dtype = jnp.zeros_like(prod), 0, True
    if scalars_in_dtype and comp != dtype:
        rnd = rounder(dtype)
        alpha, beta = (s if isinstance(s, (int, float)) and s in (0, 1) else
                       rnd(jnp.asarray(s, comp)) for s in (alpha, beta))
    prod = _scaled(prod.astype(comp), alpha)
    self = jnp.broadcast_to(self.astype(comp), prod.shape)
    if isinstance(beta, (int, float)):
        if beta == 0:
            return prod
        term = _scaled(self, beta)
    else:
        term = jnp.where(beta == 0, jnp.zeros_like(self), _scaled(self, beta))
    if comp == jnp.bool_:
        return jnp.logical_or(term, prod)
    return term + prod


@lower(aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default,
       aten._int_mm.default, matmul=True)
def mm(a, b):
    return _matmul(a, b)


@lower(aten.mm.dtype, aten.bmm.dtype, matmul=True)
def mm_dtype(a, b, out_dtype):
    return _matmul(a, b)


@lower(aten._grouped_mm.default, matmul=True)
def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """Matmuls of groups (mixture-of-experts layers): offs ends each group
    along a's rows (2-D x 3-D), b's columns (3-D x 2-D) or the shared K
    (2-D x 2-D, one result per group); 3-D x 3-D is bmm. Rows past the last
    group are zeros (CPU leaves them unset). Computed in the accumulation
    dtype: XLA:CPU's ragged dots take no bf16 x bf16 -> f32."""
    if offs is None:
        return _matmul(a, b)
    sizes, dtype = jnp.diff(offs.astype(jnp.int32), prepend=0), a.dtype
    a, b, p = a.astype(_acc(dtype)), b.astype(_acc(dtype)), matmul_precision()
    if a.ndim == 2 and b.ndim == 3:
        out = lax.ragged_dot(a, b, sizes, precision=p)
    elif a.ndim == 3:  # columns of b grouped: the transposed 2-D x 3-D
        out = _mT(lax.ragged_dot(_mT(b), _mT(a), sizes, precision=p))
    else:
        numbers = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [0]), ([], [])),
                                                lhs_ragged_dimensions=[1], rhs_group_dimensions=[])
        out = lax.ragged_dot_general(a, b, sizes, numbers, precision=p)
    return out.astype(dtype)


def _grouped_mm_meta_args(args, kwargs):
    """PyTorch's meta kernel checks CUDA's fast path: bf16 only, rows 16-byte
    aligned. CPU's kernel takes every float dtype, as do Hugging Face's MoE
    layers on tpu, and tpu aligns nothing: its stand-ins are bf16, aligned."""
    def stand_in(x):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2):
            return x
        row = -(-max(x.shape[-1], 1) // 8) * 8
        return torch.empty_strided(x.shape, (x.shape[-2] * row, row, 1)[-x.dim():], dtype=torch.bfloat16,
                                   device="meta")
    a, args = args[0], [stand_in(x) for x in args]
    if len(args) > 4 and args[4] == a.dtype:
        args[4] = torch.bfloat16
    if kwargs.get("out_dtype") == a.dtype:
        kwargs = dict(kwargs, out_dtype=torch.bfloat16)
    return args, kwargs


grouped_mm.accepts = lambda a, b, offs=None, bias=None, out_dtype=None, **_: bias is None
grouped_mm.meta_args = _grouped_mm_meta_args
grouped_mm.result_dtypes = lambda dtypes, a, *args, **kwargs: [a.dtype]


@lower(aten.vdot.default, matmul=True)
def vdot(a, b):
    return _matmul(jnp.conj(a), b)


@lower(aten.addmm.default, aten.baddbmm.default, matmul=True)
def addmm(self, m1, m2, *, beta=1, alpha=1):
    return _add_beta(self, _matmul(m1, m2, _acc(m1.dtype)), beta, alpha, empty=m1.shape[-1] == 0)


@lower(aten.linear.default, matmul=True)
def linear(x, weight, bias=None):
    # Reached only through linear.out (autograd decomposes linear itself).
    prod = _matmul(x, jnp.swapaxes(weight, -1, -2), _acc(x.dtype))
    if bias is None:
        return prod.astype(ctx_dtype())
    return _add_beta(bias, prod, 1, 1, empty=x.shape[-1] == 0)


@lower(aten.addmv.default, matmul=True)
def addmv(self, m, v, *, beta=1, alpha=1):
    return _add_beta(self, _matmul(m, v, _acc(m.dtype)), beta, alpha, scalars_in_dtype=True,
                     empty=m.shape[-1] == 0)


@lower(aten.addmm.dtype, aten.baddbmm.dtype, matmul=True)
def addmm_dtype(self, m1, m2, out_dtype, *, beta=1, alpha=1):
    return _add_beta(self, _matmul(m1, m2, _acc(m1.dtype)), beta, alpha)


@lower(aten.addbmm.default, matmul=True)
def addbmm(self, b1, b2, *, beta=1, alpha=1):
    # CPU adds the batch's products one at a time (an addmm each), rounding
    # to bf16/f16 after each.
    prods = _matmul(b1, b2, _acc(b1.dtype))
    empty = 0 in (b1.shape[0], b1.shape[-1])
    if empty or ctx_dtype() not in (jnp.bfloat16, jnp.float16):
        return _add_beta(self, prods.sum(0), beta, alpha, empty=empty)
    rnd = rounder(ctx_dtype())
    out = rnd(_add_beta(self, prods[0], beta, alpha))
    # alpha * P outside the loop: no fused multiply-add in the loop's sum.
    scaled = _scaled(prods, alpha)
    return lax.fori_loop(1, prods.shape[0], lambda i, acc: rnd(acc + scaled[i]), out)


@lower(aten.addr.default)
def addr(self, v1, v2, *, beta=1, alpha=1):
    dtype = ctx_dtype()
    acc = _acc(v1.dtype)
    if acc == dtype or dtype == jnp.bool_:
        prod = v1.astype(acc)[:, None] * v2.astype(acc)[None, :]
        return _add_beta(self, prod, beta, alpha)
    # bf16/f16: CPU's elementwise kernel, beta * self + alpha * v1 * v2, one
    # rounding per operation (alpha and beta in the dtype too).
    rnd = rounder(dtype)
    a = rnd(jnp.asarray(alpha, acc))
    prod = rnd(rnd(a * v1.astype(acc))[:, None] * v2.astype(acc)[None, :])
    if isinstance(beta, (int, float)) and beta == 0:
        return prod
    term = rnd(rnd(jnp.asarray(beta, acc)) * jnp.broadcast_to(self.astype(acc), prod.shape))
    if not isinstance(beta, (int, float)):
        term = jnp.where(beta == 0, jnp.zeros_like(term), term)
    return term + prod


@lower(aten.linalg_cross.default)
def linalg_cross(a, b, *, dim=-1):
    # a1 b2 - a2 b1 with each product rounded to bf16/f16, as CPU's kernel.
    dtype = ctx_dtype()
    comp = _acc(dtype) if dtype in (jnp.bfloat16, jnp.float16) else dtype
    rnd = rounder(dtype)
    a, b = jnp.broadcast_arrays(a.astype(comp), b.astype(comp))
    ax = dim % a.ndim
    i1, i2 = jnp.array([1, 2, 0]), jnp.array([2, 0, 1])
    take = lambda x, i: jnp.take(x, i, axis=ax)  # noqa: E731
    return rnd(take(a, i1) * take(b, i2)) - rnd(take(a, i2) * take(b, i1))


# ---- factorizations ---------------------------------------------------------

def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _lu(a):
    """(LU, 1-based int32 pivots) as LAPACK's getrf returns them."""
    lu, piv, _ = lax.linalg.lu(a)
    return lu, (piv + 1).astype(jnp.int32)


def _perm_sign(piv):
    """Sign of the row permutation described by 1-based pivots."""
    k = piv.shape[-1]
    swaps = jnp.sum(piv != jnp.arange(1, k + 1, dtype=piv.dtype), axis=-1)
    return jnp.where(swaps % 2 == 0, 1, -1)


def _diag(x):
    return jnp.diagonal(x, axis1=-2, axis2=-1)


def _lu_like_cpu(a):
    """LU of A, or of A^T when A is contiguous and real: PyTorch's CPU kernels
    factor A^T then (it is what LAPACK wants), and the backward formulas of
    det and slogdet read the saved LU with that in mind."""
    use_t = bool(ctx.contiguous and ctx.contiguous[0]) and not jnp.iscomplexobj(a)
    lu, piv = _lu(_mT(a) if use_t else a)
    return lu, piv, use_t


@lower(aten._linalg_det.default)
def linalg_det(a):
    lu, piv, _ = _lu_like_cpu(a)
    d = jnp.prod(_diag(lu), axis=-1) * _perm_sign(piv).astype(lu.dtype)
    return d, lu, piv


@lower(aten._linalg_slogdet.default)
def linalg_slogdet(a):
    lu, piv, _ = _lu_like_cpu(a)
    diag = _diag(lu)
    absd = jnp.abs(diag)
    if jnp.iscomplexobj(lu):
        sign = jnp.prod(diag / absd, axis=-1) * _perm_sign(piv)
    else:
        sign = jnp.prod(jnp.sign(diag), axis=-1) * _perm_sign(piv).astype(lu.dtype)
    return sign, jnp.sum(jnp.log(absd), axis=-1), lu, piv


def _lu_info(lu):
    """getrf's info: the 1-based index of U's first zero diagonal element, else 0."""
    zero = _diag(lu) == 0
    if zero.shape[-1] == 0:
        return jnp.zeros(zero.shape[:-1], jnp.int32)
    first = jnp.argmax(zero, axis=-1) + 1
    return jnp.where(jnp.any(zero, axis=-1), first, 0).astype(jnp.int32)


def _no_check_errors(*args, check_errors=False, **kwargs):
    """accepts hook of the *_ex ops: check_errors=True must raise from the info
    values, which a kernel cannot; such calls take the CPU fallback."""
    return not check_errors


@lower(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(a, *, pivot=True, check_errors=False):
    lu, piv = _lu(a)
    return lu, piv, _lu_info(lu)


linalg_lu_factor_ex.accepts = _no_check_errors


def _permutation_matrix(piv, m, dtype):
    """P with A = P @ L @ U from 1-based LAPACK pivots over m rows."""
    perm = lax.linalg.lu_pivots_to_permutation(piv - 1, m)
    # Row i of P @ L @ U is row perm^-1 ... : P[perm[j], j] = 1.
    return jnp.swapaxes(jax.nn.one_hot(perm, m, dtype=dtype), -1, -2)


@lower(aten.linalg_lu.default)
def linalg_lu(a, *, pivot=True):
    m, n = a.shape[-2:]
    k = min(m, n)
    lu, piv = _lu(a)
    L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    U = jnp.triu(lu[..., :k, :])
    return _permutation_matrix(piv, m, a.dtype), L, U


@lower(aten.lu_unpack.default)
def lu_unpack(lu, piv, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2:]
    k = min(m, n)
    P = _permutation_matrix(piv, m, lu.dtype) if unpack_pivots else None
    if unpack_data:
        L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
        U = jnp.triu(lu[..., :k, :])
    else:
        L = U = None
    outs = ctx.out
    empty = lambda i: jnp.zeros(tuple(outs[i].shape), lu.dtype)  # noqa: E731
    return (P if P is not None else empty(0), L if L is not None else empty(1),
            U if U is not None else empty(2))


def _lu_solve(lu, piv, b, adjoint=False):
    return jsl.lu_solve((lu, piv - 1), b, trans=2 if adjoint else 0)


def _broadcast_batch(a, b):
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return (jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:]))


def _vector_rhs(a, b):
    """torch.linalg.solve's rule: B is a (batch of) vector(s) when it has one
    dim, or one dim fewer than A with matching batch dims."""
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])


@lower(aten.linalg_lu_solve.default)
def linalg_lu_solve(lu, piv, b, *, left=True, adjoint=False):
    if not left:
        # X A = B  <=>  A^H X^H = B^H
        x = linalg_lu_solve(lu, piv, jnp.conj(_mT(b)), left=True, adjoint=not adjoint)
        return jnp.conj(_mT(x))
    lu_b, b_b = _broadcast_batch(lu, b)
    piv_b = jnp.broadcast_to(piv, lu_b.shape[:-2] + piv.shape[-1:])
    return _lu_solve(lu_b, piv_b, b_b, adjoint)


@lower(aten._linalg_solve_ex.default)
def linalg_solve_ex(a, b, *, left=True, check_errors=False):
    # Unlike det, PyTorch's solve factors A itself (its backward relies on it).
    lu, piv = _lu(a)
    vec = _vector_rhs(a, b)
    bm = (b[..., None] if left else b[..., None, :]) if vec else b
    x = linalg_lu_solve(lu, piv, bm, left=left)
    if vec:
        x = x[..., 0] if left else x[..., 0, :]
    return x, lu, piv, _lu_info(lu)


linalg_solve_ex.accepts = _no_check_errors


@lower(aten.linalg_inv_ex.default)
def linalg_inv_ex(a, *, check_errors=False):
    # As on CPU: solve A X = I through the LU of A, whose info is reported.
    lu, piv = _lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return _lu_solve(lu, piv, eye), _lu_info(lu)


linalg_inv_ex.accepts = _no_check_errors


def _cholesky_info(a):
    """potrf's info for the lower triangle of a: the order of the first leading
    minor that is not positive-definite, else 0. An unblocked Cholesky, column
    by column (the factorization itself comes back all NaN on failure)."""
    n = a.shape[-1]
    rows = jnp.arange(n)

    def step(k, state):
        L, info = state
        lk = jnp.where(rows < k, L[..., k, :], 0)  # row k of L, first k columns
        d = jnp.real(a[..., k, k]) - jnp.sum(jnp.abs(lk) ** 2, axis=-1)
        ok = d > 0  # False for NaN, as in potrf
        info = jnp.where((info == 0) & ~ok, k + 1, info)
        col = (a[..., :, k] - jnp.einsum("...ij,...j->...i", L, jnp.conj(lk),
                                         precision=HIGHEST)) / jnp.sqrt(jnp.where(ok, d, 1))[..., None]
        col = jnp.where(rows > k, col, 0)
        L = L.at[..., :, k].set(col)
        return L, info

    info = jnp.zeros(a.shape[:-2], jnp.int32)
    if n == 0:  # (traced still, under lax.cond: its step cannot index a 0x0 matrix)
        return info
    return lax.fori_loop(0, n, step, (jnp.zeros_like(a), info))[1]


def _cholesky(a, upper):
    """The factor of the triangle LAPACK reads: A's upper one when upper."""
    if upper:
        a = jnp.conj(_mT(a))
    L = lax.linalg.cholesky(a, symmetrize_input=False)
    return L, a


@lower(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(a, *, upper=False, check_errors=False):
    L, low = _cholesky(a, upper)
    bad = jnp.any(~jnp.isfinite(_diag(L)))
    # The info loop runs only when some factorization failed.
    info = lax.cond(bad, _cholesky_info, lambda x: jnp.zeros(x.shape[:-2], jnp.int32), low)
    return (jnp.conj(_mT(L)) if upper else L), info


linalg_cholesky_ex.accepts = _no_check_errors


@lower(aten.cholesky.default)
def cholesky(a, upper=False):
    L, _ = _cholesky(a, upper)
    return jnp.conj(_mT(L)) if upper else L


@lower(aten.cholesky_solve.default)
def cholesky_solve(b, L, upper=False):
    L, b = _broadcast_batch(L, b)
    if upper:
        L = jnp.conj(_mT(L))
    y = lax.linalg.triangular_solve(L, b, left_side=True, lower=True)
    return lax.linalg.triangular_solve(L, y, left_side=True, lower=True, transpose_a=True,
                                       conjugate_a=True)


@lower(aten.cholesky_inverse.default)
def cholesky_inverse(L, upper=False):
    eye = jnp.broadcast_to(jnp.eye(L.shape[-1], dtype=L.dtype), L.shape)
    return cholesky_solve(eye, L, upper)


@lower(aten.linalg_qr.default)
def linalg_qr(a, mode="reduced"):
    if mode == "r":
        r = jnp.linalg.qr(a, mode="r")
        return jnp.zeros((0,), a.dtype), r
    q, r = jnp.linalg.qr(a, mode="complete" if mode == "complete" else "reduced")
    return q, r


@lower(aten._linalg_svd.default)
def linalg_svd(a, full_matrices=False, compute_uv=True, *, driver=None):
    if not compute_uv:
        s = jnp.linalg.svd(a, compute_uv=False)
        return jnp.zeros((0,), a.dtype), s, jnp.zeros((0,), a.dtype)
    u, s, vh = jnp.linalg.svd(a, full_matrices=full_matrices)
    return u, s, vh


@lower(aten._linalg_eigh.default)
def linalg_eigh(a, UPLO="L", compute_v=True):
    w, v = jnp.linalg.eigh(a, UPLO=UPLO, symmetrize_input=False)
    if not compute_v:
        return w, jnp.zeros((0,), a.dtype)
    return w, v


@lower(aten.triangular_solve.default)
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    a_b, b_b = _broadcast_batch(a, b)
    x = lax.linalg.triangular_solve(a_b, b_b, left_side=True, lower=not upper,
                                    transpose_a=transpose, unit_diagonal=unitriangular)
    return x, a_b


@lower(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    a_b, b_b = _broadcast_batch(a, b)
    return lax.linalg.triangular_solve(a_b, b_b, left_side=left, lower=not upper,
                                       unit_diagonal=unitriangular)


# ---- matrix exponential: PyTorch's optimized Taylor polynomials ------------
# (Bader, Blanes, Casas 2019), with its degree choice and its scaling, so that
# rounding errors (absolute, of the order of the result's norm) match CPU's.

_MEXP_THETAS = {
    4: (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02,
        5.800524627688768e-01, 1.461661507209034e+00, 3.010066362817634e+00),
    8: (2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04,
        4.991228871115323e-02, 2.996158913811580e-01, 1.090863719290036e+00),
}

_T12_B = ((9.0198e-16, 0.46932117595418237389, -0.20099424927047284052, -0.04623946134063071740),
          (5.31597895759871264183, 1.19926790417132231573, 0.01179296240992997031,
           0.01108844528519167989),
          (0.18188869982170434744, 0.05502798439925399070, 0.09351590770535414968,
           0.00610700528898058230),
          (-2.0861320e-13, -0.13181061013830184015, -0.02027855540589259079,
           -0.00675951846863086359))

_T18_B = ((0., -1.00365581030144618291e-01, -8.02924648241156932449e-03,
           -8.92138498045729985177e-04, 0.),
          (0., 3.97849749499645077844e-01, 1.36783778460411720168e+00,
           4.98289622525382669416e-01, -6.37898194594723280150e-04),
          (-1.09676396052962061844e+01, 1.68015813878906206114e+00, 5.71779846478865511061e-02,
           -6.98210122488052056106e-03, 3.34975017086070470649e-05),
          (-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
           2.95552570429315521194e-02, -1.39180257516060693404e-05),
          (0., 0., -9.23364619367118555360e-02, -1.69364939002081722752e-02,
           -1.40086798182036094347e-05))


def _mm(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def _comb(mats, coeffs):
    """sum_j coeffs[j] * mats[j], accumulated in order as CPU does."""
    real = jnp.finfo(mats[0].dtype).dtype
    out = jnp.zeros_like(mats[0])
    for m, c in zip(mats, coeffs):
        out = out + m * jnp.asarray(c, real)
    return out


def _powers(a, k):
    """The first k of I, A, A^2, A^3, A^6."""
    out = [jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape), a]
    if k > 2:
        out.append(_mm(a, a))
    if k > 3:
        out.append(_mm(a, out[2]))
    if k > 4:
        out.append(_mm(out[3], out[3]))
    return out[:k]


def _mexp_t1(a):
    i, a1 = _powers(a, 2)
    return i + a1


def _mexp_t2(a):
    i, a1, a2 = _powers(a, 3)
    return i + a1 + a2 / 2


def _mexp_t4(a):
    p = _powers(a, 3)
    p.append(_mm(p[2], _comb(p, (1 / 2.0, 1 / 6.0, 1 / 24.0))))
    return _comb(p, (1.0, 1.0, 0.0, 1.0))


def _mexp_t8(a):
    sqrt_177 = 0.1330413469565007072504e+2
    x3 = 2. / 3.
    x1 = x3 * ((1. + sqrt_177) / 88.)
    x2 = x3 * ((1. + sqrt_177) / 352.)
    x4 = (-271. + 29. * sqrt_177) / (315. * x3)
    x5 = (-11. + 11. * sqrt_177) / (1260. * x3)
    x6 = (-99. + 11. * sqrt_177) / (5040. * x3)
    x7 = (89. - sqrt_177) / (5040. * x3)
    y2 = (857. - 58. * sqrt_177) / 630.
    p = _powers(a, 3)
    p.append(_mm(p[2], _comb(p[1:3], (x1, x2))))                            # A4
    p.append(_mm(_comb(p[2:4], (x3, 1.0)), _comb(p[0:4], (x4, x5, x6, x7))))  # A8
    return _comb(p, (1.0, 1.0, y2, 0.0, 1.0))


def _mexp_t12(a):
    p = _powers(a, 4)
    b = [_comb(p, row) for row in _T12_B]
    b[2] = b[2] + _mm(b[3], b[3])
    return b[0] + _mm(b[1] + b[2], b[2])


def _mexp_t18(a):
    p = _powers(a, 5)
    b = [_comb(p, row) for row in _T18_B]
    b[3] = b[3] + _mm(b[0], b[4])
    return b[1] + _mm(b[2] + b[3], b[3])


def _mexp_scale_square(a, norm, theta):
    s = jnp.maximum(jnp.ceil(jnp.log2(norm / theta)), 0)
    s = jnp.where(jnp.isfinite(s), s, 0)
    x = _mexp_t18(a * jnp.power(2, -s).astype(a.dtype)[..., None, None])
    steps = s.astype(jnp.int32)
    return lax.fori_loop(0, jnp.max(steps, initial=0), lambda i, x: jnp.where(
        (i < steps)[..., None, None], _mm(x, x), x), x)


@lower(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(a):
    n = a.shape[-1]
    if n == 0:
        return a
    if n == 1:
        return jnp.exp(a)
    dtype = a.dtype
    if dtype in (jnp.bfloat16, jnp.float16):
        a = a.astype(jnp.float32)
    thetas = _MEXP_THETAS[4 if jnp.finfo(a.dtype).bits == 32 else 8]
    x = a.reshape((-1, n, n))
    norm = jnp.max(jnp.sum(jnp.abs(x), axis=-2), axis=-1)
    if x.shape[0] != 1:
        # Batches: always degree 18, scaled by each matrix's norm.
        out = _mexp_scale_square(x, norm, thetas[5])
    else:
        # One matrix: the lowest degree accurate for its norm (NaN: NaN).
        nrm = norm[0]
        idx = jnp.select([nrm <= t for t in thetas[:5]] + [nrm > thetas[4]], list(range(6)), 6)
        branches = [_mexp_t1, _mexp_t2, _mexp_t4, _mexp_t8, _mexp_t12,
                    lambda y: _mexp_scale_square(y, norm, thetas[5]),
                    lambda y: jnp.full_like(y, jnp.nan)]
        out = lax.switch(idx, branches, x)
    return out.reshape(a.shape).astype(dtype)


@lower(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(a, *, atol=None, rtol=None, hermitian=False):
    real = jnp.finfo(a.dtype).dtype
    m, n = a.shape[-2:]
    # PyTorch's default: rtol = eps * max(m, n) unless a positive atol is given.
    if rtol is None:
        rtol = jnp.where(atol > 0, 0.0, jnp.finfo(real).eps * max(m, n)) if atol is not None \
            else jnp.finfo(real).eps * max(m, n)
    atol = 0.0 if atol is None else atol
    if hermitian:
        w, v = jnp.linalg.eigh(a, symmetrize_input=False)
        mag = jnp.abs(w)
    else:
        u, w, vh = jnp.linalg.svd(a, full_matrices=False)
        mag = w
    smax = jnp.max(mag, axis=-1, keepdims=True) if mag.shape[-1] else mag
    tol = jnp.maximum(jnp.asarray(atol, real)[..., None], jnp.asarray(rtol, real)[..., None] * smax)
    inv = jnp.where(mag > tol, 1 / jnp.where(mag > tol, w, 1), 0).astype(a.dtype)
    if hermitian:
        return jnp.matmul(v * inv[..., None, :], jnp.conj(_mT(v)), precision=HIGHEST)
    return jnp.matmul(jnp.conj(_mT(vh)) * inv[..., None, :], jnp.conj(_mT(u)), precision=HIGHEST)


@lower(aten.linalg_eig.default)
def linalg_eig(a):
    # LAPACK's geev, as on CPU: unit-norm eigenvectors, largest component real.
    w, v = lax.linalg.eig(a, compute_left_eigenvectors=False)
    return w, v


@lower(aten.linalg_eigvals.default)
def linalg_eigvals(a):
    # Reached through linalg_eigvals.out (the op itself is composite).
    return lax.linalg.eig(a, compute_left_eigenvectors=False, compute_right_eigenvectors=False)[0]


@lower(aten.linalg_lstsq.default)
def linalg_lstsq(a, b, rcond=None, *, driver=None):
    """Through the SVD of A: for full-rank A every LAPACK driver's solution
    (the least-squares one, minimum-norm when m < n). The outputs are shaped
    as on CPU: residuals when m > n and the driver is not gelsy (gelsd and
    gelss drop them unless every matrix has full rank, which
    dispatch/dynamic_shapes.py reads back), rank unless gels, singular
    values for gelsd and gelss (rank and singular values over A's batch
    dims, not the broadcast ones)."""
    driver = driver or "gelsy"
    m, n = a.shape[-2:]
    real = jnp.finfo(a.dtype).dtype
    vec = _vector_rhs(a, b)
    bm = b[..., None] if vec else b
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    if rcond is None:
        rcond = jnp.finfo(real).eps * max(m, n)
    smax = s[..., :1] if s.shape[-1] else s
    keep = s > rcond * smax if driver != "gels" else jnp.ones(s.shape, bool)
    inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(a.dtype)
    ub = jnp.matmul(jnp.conj(_mT(u)), bm, precision=HIGHEST)
    x = jnp.matmul(jnp.conj(_mT(vh)), inv[..., None] * ub, precision=HIGHEST)
    empty = jnp.zeros((0,), real)
    residuals = empty
    if m > n and driver != "gelsy":
        res = jnp.matmul(a, x, precision=HIGHEST) - bm
        residuals = jnp.sum(jnp.real(res * jnp.conj(res)), axis=-2)
        if n == 0 and driver == "gels":
            residuals = jnp.zeros_like(residuals)  # LAPACK's gels zeroes B and returns
    rank = jnp.zeros((0,), jnp.int64) if driver == "gels" else jnp.sum(keep, axis=-1).astype(jnp.int64)
    sv = s if driver in ("gelsd", "gelss") else empty
    return (x[..., 0] if vec else x), residuals, rank, sv


@lower(aten.geqrf.default)
def geqrf(a):
    # LAPACK's geqrf (NumPy's "raw" QR returns its output transposed).
    h, tau = jnp.linalg.qr(a, mode="raw")
    return _mT(h), tau


@lower(aten.linalg_householder_product.default)
def linalg_householder_product(a, tau):
    return lax.linalg.householder_product(a, tau)


@lower(aten.ormqr.default)
def ormqr(a, tau, c, left=True, transpose=False):
    return lax.linalg.ormqr(a, tau, c, left=left, transpose=transpose)


# ---- distances ---------------------------------------------------------------
# p is static: each norm has its own formula (and CPU's special cases).

def _pnorm_dist(x1, x2, p):
    """CPU's direct p-norm distances between the rows of x1 (.., P, M) and
    x2 (.., R, M): (.., P, R)."""
    diff = jnp.abs(x1[..., :, None, :] - x2[..., None, :, :])
    if p == 0:
        return jnp.sum((diff != 0).astype(diff.dtype), axis=-1)
    if p == 1:
        return jnp.sum(diff, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, axis=-1))
    if math.isinf(p):
        return jnp.max(diff, axis=-1) if diff.shape[-1] else jnp.zeros(diff.shape[:-1], diff.dtype)
    return jnp.sum(diff ** p, axis=-1) ** (1.0 / p)


def _euclid_by_mm(x1, x2):
    # CPU's matmul form of the p=2 distance (for more than 25 rows).
    n1 = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    n2 = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    a = jnp.concatenate([x1 * -2, n1, jnp.ones_like(n1)], axis=-1)
    b = jnp.concatenate([x2, jnp.ones_like(n2), n2], axis=-1)
    r = jnp.matmul(a, jnp.swapaxes(b, -1, -2), precision=HIGHEST)
    return jnp.sqrt(jnp.maximum(r, 0))


@lower(aten._cdist_forward.default)
def cdist_forward(x1, x2, p, compute_mode=None):
    use_mm = p == 2 and (compute_mode == 1 or (compute_mode in (None, 0)
                                               and (x1.shape[-2] > 25 or x2.shape[-2] > 25)))
    if use_mm:
        return _euclid_by_mm(x1, x2)
    return _pnorm_dist(x1, x2, p)


cdist_forward.static_args = ("p", "compute_mode")


def _dist_grad(grad, x1, x2, p, dist):
    """d/dx1 of the p-norm distances, by CPU's formulas (0 where a distance
    is 0): grad (.., P, R), dist (.., P, R) -> (.., P, M)."""
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    g, d = grad[..., None], dist[..., None]
    zero = jnp.zeros_like(diff)
    if p == 0:
        term = zero
    elif p == 1:
        term = jnp.sign(diff) * g
    elif p == 2:
        term = jnp.where(d == 0, zero, g * diff / jnp.where(d == 0, 1, d))
    elif math.isinf(p):
        term = g * jnp.sign(diff) * (jnp.abs(diff) == d)
    elif p < 2:
        bad = (d == 0) | ((diff == 0) & (p < 1))
        safe_d = jnp.where(d == 0, 1, d)
        term = jnp.where(bad, zero, jnp.sign(diff) * jnp.abs(diff) ** (p - 1) * g / safe_d ** (p - 1))
    else:
        safe_d = jnp.where(d == 0, 1, d)
        term = jnp.where(d == 0, zero, diff * jnp.abs(diff) ** (p - 2) * g / safe_d ** (p - 1))
    return jnp.sum(term, axis=-2)


@lower(aten._cdist_backward.default)
def cdist_backward(grad, x1, x2, p, dist):
    return _dist_grad(grad, x1, x2, p, dist)


cdist_backward.static_args = ("p",)


@lower(aten._pdist_forward.default)
def pdist_forward(x, p=2.0):
    n = x.shape[0]
    i, j = np.triu_indices(n, 1)
    return _pnorm_dist(x, x, p)[i, j]


pdist_forward.static_args = ("p",)


@lower(aten._pdist_backward.default)
def pdist_backward(grad, x, p, pdist):
    n = x.shape[0]
    i, j = np.triu_indices(n, 1)
    full_grad = jnp.zeros((n, n), grad.dtype).at[i, j].set(grad).at[j, i].set(grad)
    full_dist = jnp.zeros((n, n), pdist.dtype).at[i, j].set(pdist).at[j, i].set(pdist)
    return _dist_grad(full_grad, x, x, p, full_dist)


pdist_backward.static_args = ("p",)
