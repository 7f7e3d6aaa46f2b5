"""The _foreach_ ops: each runs the lowering of its per-tensor op at every
list position. The generic ones are found in LOWERINGS, so every other
pointwise module registers first."""
import jax.numpy as jnp
import torch

from ..registry import LOWERINGS, lower
from . import activation, gamma, logic, unary  # noqa: F401  (registered before the lookup)
from .binary import addcdiv, addcmul, pow_

from ...compat import aten


def _foreach(elem, per_item=()):
    """A _foreach_ lowering: list arguments (Tensor[], Scalar[]) are zipped,
    the rest passed to every call; `per_item` names tensor arguments whose
    i-th element goes to the i-th call (addcmul.Tensor's scalars)."""
    def lowering(*args, **kwargs):
        n = len(next(x for x in args if isinstance(x, list)))
        out = []
        for i in range(n):
            a = [x[i] if isinstance(x, list) else x for x in args]
            k = {key: (v[i] if isinstance(v, list) or key in per_item else v)
                 for key, v in kwargs.items()}
            out.append(elem(*a, **k))
        return out
    return lowering


def _elementwise(name):
    """The lowering of the functional op that _foreach_<name> maps over."""
    packet = getattr(aten, name)
    for ov in ("Tensor", "default", "Tensor_Tensor", "Scalar"):
        if ov in packet.overloads() and getattr(packet, ov) in LOWERINGS:
            return LOWERINGS[getattr(packet, ov)]
    return None


def _register_foreach():
    # dir(aten) lists only the packets loaded so far; ask the dispatcher.
    names = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("aten::_foreach_")}
    for name in sorted(names):
        if name.endswith("_"):
            continue
        base = name[len("_foreach_"):]
        if base in ("norm", "copy", "zero", "max", "pow", "addcmul", "addcdiv"):
            continue
        elem = _elementwise(base) if hasattr(aten, base) else None
        if elem is None:
            continue
        packet = getattr(aten, name)
        for ov in packet.overloads():
            op = getattr(packet, ov)
            if op not in LOWERINGS:
                lower(op)(_foreach(elem))


_register_foreach()
lower(aten._foreach_pow.List, aten._foreach_pow.Scalar, aten._foreach_pow.ScalarList,
      aten._foreach_pow.ScalarAndTensor)(_foreach(pow_))


def _foreach_addc(elem):
    def lowering(self, t1, t2, value=1):
        if isinstance(value, list):
            return [elem(a, b, c, v) for a, b, c, v in zip(self, t1, t2, value)]
        if hasattr(value, "ndim") and value.ndim == 1:
            # The Tensor overload: one scalar per list position.
            return [elem(a, b, c, value[i]) for i, (a, b, c) in enumerate(zip(self, t1, t2))]
        return [elem(a, b, c, value) for a, b, c in zip(self, t1, t2)]
    return lowering


lower(aten._foreach_addcmul.Scalar, aten._foreach_addcmul.ScalarList,
      aten._foreach_addcmul.Tensor)(_foreach_addc(addcmul))
lower(aten._foreach_addcdiv.Scalar, aten._foreach_addcdiv.ScalarList,
      aten._foreach_addcdiv.Tensor)(_foreach_addc(addcdiv))


@lower(aten._foreach_zero.default)
def foreach_zero(self):
    return [jnp.zeros_like(x) for x in self]


@lower(aten._foreach_clone.default)
def foreach_clone(self):
    return list(self)


@lower(aten._foreach_copy.default)
def foreach_copy(self, src, non_blocking=False):
    return [jnp.broadcast_to(s.astype(d.dtype), d.shape) for d, s in zip(self, src)]
