"""Special functions: Bessel and Airy functions and the orthogonal
polynomials of torch.special, as PyTorch computes them on CPU (Cephes
approximations and three-term recurrences)."""
import torch

from . import lower  # noqa: F401

aten = torch.ops.aten
