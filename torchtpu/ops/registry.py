"""The lowering registry: LOWERINGS maps an aten overload to its JAX
function, filled by the @lower decorator of each family module, and ctx
tells the lowering being traced what PyTorch's meta kernel returns."""
import contextlib
import threading

import torch
from jax import lax

from ..compat import MissingOp

LOWERINGS = {}


def lower(*ops, random=False, matmul=False):
    """Register fn as the lowering of aten overloads (an OpOverloadPacket
    means all its overloads not registered otherwise).

    random=True: fn also takes key=, a JAX PRNG key that the dispatcher
    derives inside the kernel from the device generator's (seed, offset),
    passed as dynamic inputs so that successive calls never recompile.

    matmul=True: fn multiplies float matrices (a matmul, a convolution,
    attention) at the precision torch.set_float32_matmul_precision() asks
    for, which it reads as matmul_precision() while traced; the setting is
    part of its kernels' keys.

    Python numbers arrive traced unless fn.static_args names them (a tuple of
    argument names): then each value compiles its own kernel (an arange's
    bounds, a norm's ord); fn.dynamic_args names float arguments that are
    traced all the same (an optimizer's learning rate).

    fn.process_local = True: its code is not torchtpu's (a user's kernel), so
    its kernels get no cross-process key and fused graphs holding them are
    not stored on disk.

    fn.result_dtypes(meta_dtypes, *args, **kwargs) -> dtypes, where set,
    corrects the result dtypes PyTorch's meta kernel reports to what its CPU
    kernel returns (args are the op's, tensors still torch tensors)."""
    def deco(fn):
        fn.random = random
        fn.matmul = matmul
        for op in ops:
            if isinstance(op, MissingOp):
                continue  # an op this torch does not have
            if isinstance(op, torch._ops.OpOverloadPacket):
                for name in op.overloads():
                    LOWERINGS.setdefault(getattr(op, name), fn)
            else:
                LOWERINGS[op] = fn
        return fn
    return deco


class TraceContext(threading.local):
    """Per thread (fused graphs are traced on the compile thread too): what
    the op being traced returns, per PyTorch's meta kernel: a list of
    (shape, torch dtype) for its tensor outputs, or None if unknown.
    contiguous: per positional argument, whether that tensor is contiguous
    (None for non-tensors); some CPU kernels pick their algorithm by it and
    their backward formulas rely on that choice (linalg's LU of A^T).
    precision: the lax.Precision of float matrix products (lower(matmul=True)),
    given to tracing() as its matmul_setting().
    Set only by tracing(), for the one lowering being traced."""
    out = None
    contiguous = ()
    precision = lax.Precision.HIGHEST

    @contextlib.contextmanager
    def tracing(self, out, contiguous, precision=None):
        """Trace one lowering with these set, then restore what was set
        before (a lowering that traces another op inside)."""
        before = self.out, self.contiguous, self.precision
        self.out, self.contiguous = out, contiguous
        self.precision = xla_precision(precision)
        try:
            yield
        finally:
            self.out, self.contiguous, self.precision = before


ctx = TraceContext()

# torch.get_float32_matmul_precision() -> how XLA multiplies float32
# matrices: "highest" (PyTorch's default, and CPU's results) in full float32;
# "high" in bf16_3x passes on TPU, TF32 on GPU; "medium" at the platform's
# default (one bf16 pass on TPU).
_PRECISIONS = {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH,
               "medium": lax.Precision.DEFAULT}


# PyTorch's newer spelling (torch.backends.cuda.matmul.fp32_precision, and
# torch.backends.fp32_precision above it): once used, the legacy getter raises.
_NEW_SPELLING = {"tf32": "high", "bf16": "medium", "ieee": "highest"}


def _newer_setting():
    matmul = getattr(getattr(torch.backends, "cuda", None), "matmul", None)
    value = getattr(matmul, "fp32_precision", "none")
    if value == "none":
        value = getattr(torch.backends, "fp32_precision", "none")
    return _NEW_SPELLING.get(value, "highest")


# torch.get_float32_matmul_precision without its Python wrapper (read by
# every float matrix product).
_get_matmul_precision = getattr(torch._C, "_get_float32_matmul_precision",
                                torch.get_float32_matmul_precision)


def matmul_setting():
    """The user's float32 matmul precision as PyTorch names it ("highest",
    "high" or "medium"), read per call (changing it takes effect at the next
    op) and set either way PyTorch offers: torch.set_float32_matmul_precision
    ("high") or torch.backends.cuda.matmul.fp32_precision = "tf32". Kernel
    keys hold the name: a str hashes in C, a lax.Precision in Python."""
    try:
        return _get_matmul_precision()
    except RuntimeError:  # the two spellings mixed: PyTorch refuses to answer
        return _newer_setting()


def xla_precision(setting):
    """The lax.Precision of a matmul_setting() (None: PyTorch's default)."""
    return _PRECISIONS.get(setting, lax.Precision.HIGHEST)


def precision_setting():
    """The lax.Precision the user's float32 matmul precision asks for."""
    return xla_precision(matmul_setting())
