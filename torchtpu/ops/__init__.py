"""Lowerings: one JAX function per aten op, registered by decorator.

A lowering takes the op's arguments with every tensor replaced by a JAX
array (already materialized from its view) and returns JAX arrays in the
structure of the op's returns. Dynamic scalars (Python numbers given where
the schema takes a Tensor or Scalar) arrive as traced 0-d weakly-typed
arrays, so a changing learning rate never recompiles. The dispatcher casts
results to the dtype PyTorch's meta kernel reports, so a lowering may
compute in a wider type.

In-place and out= variants are not lowered: the dispatcher runs the
functional op and writes the results back through the views.
"""
import torch

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

    fn.result_dtypes(meta_dtypes, *args, **kwargs) -> dtypes, where set,
    corrects the result dtypes PyTorch's meta kernel reports to what its CPU
    kernel returns (args are the op's, tensors still torch tensors)."""
    def deco(fn):
        fn.random = random
        for op in ops:
            if isinstance(op, torch._ops.OpOverloadPacket):
                for name in op.overloads():
                    LOWERINGS.setdefault(getattr(op, name), fn)
            else:
                LOWERINGS[op] = fn
        return fn
    return deco


class TraceContext:
    """What the op being traced returns, per PyTorch's meta kernel: a list of
    (shape, torch dtype) for its tensor outputs, or None if unknown.
    contiguous: per positional argument, whether that tensor is contiguous
    (None for non-tensors); some CPU kernels pick their algorithm by it and
    their backward formulas rely on that choice (linalg's LU of A^T)."""
    out = None
    contiguous = ()


ctx = TraceContext()


def load_all():
    from . import (creation, fft, indexing, linalg, nn, optim, pointwise, random,  # noqa: F401
                   reduction, shape, special)
