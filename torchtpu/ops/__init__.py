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
from .registry import (LOWERINGS, TraceContext, ctx, lower, matmul_setting,  # noqa: F401
                       precision_setting, xla_precision)


def load_all():
    from . import (creation, fft, indexing, ldl, linalg, nn, optim, pointwise, random,  # noqa: F401
                   reduction, shape, special)
