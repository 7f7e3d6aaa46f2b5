"""The lowering registry: LOWERINGS maps an aten overload to its JAX
function, filled by the @lower decorator of each family module, and ctx
tells the lowering being traced what PyTorch's meta kernel returns."""
import contextlib
import threading

import torch

from ..compat import MissingOp

LOWERINGS = {}


def lower(*ops, random=False):
    """Register fn as the lowering of aten overloads (an OpOverloadPacket
    means all its overloads not registered otherwise).

    random=True: fn also takes key=, a JAX PRNG key that the dispatcher
    derives inside the kernel from the device generator's (seed, offset),
    passed as dynamic inputs so that successive calls never recompile.

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
    Set only by tracing(), for the one lowering being traced."""
    out = None
    contiguous = ()

    @contextlib.contextmanager
    def tracing(self, out, contiguous):
        """Trace one lowering with out and contiguous set, then restore
        what was set before (a lowering that traces another op inside)."""
        before = self.out, self.contiguous
        self.out, self.contiguous = out, contiguous
        try:
            yield
        finally:
            self.out, self.contiguous = before


ctx = TraceContext()
