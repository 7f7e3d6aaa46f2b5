"""Pointwise lowerings, by sub-family:

- common: dtype predicates, guard (the "not implemented for" errors of
  PyTorch's CPU kernels), the factories of plain unary and binary lowerings
- gamma: digamma, polygamma, mvlgamma, Hurwitz zeta, incomplete gamma
- unary: unary math, frexp, classification (isnan, signbit, nan_to_num)
- binary: arithmetic, pow, maximum/minimum, xlogy, gcd/lcm, lerp, addcmul/addcdiv
- logic: comparisons, logical and bitwise ops, shifts, where, clamp
- activation: activations and their backward ops
- foreach: the _foreach_ ops, over the per-tensor lowerings of the others

Arguments are promoted with PyTorch's rules (util.promote): reduced floats
(bf16/fp16) compute in float32 and round once at the end, as PyTorch's
opmath does; integers stay exact.
"""
from . import gamma, unary, binary, logic, activation  # noqa: F401
from . import foreach  # noqa: F401  (last: it maps the lowerings registered above)
from .common import _TORCH_NAMES, guard  # noqa: F401
