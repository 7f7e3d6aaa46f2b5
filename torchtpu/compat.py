"""What differs between the torch and JAX releases torchtpu supports
(torch 2.11-2.13, JAX 0.10-0.12), in one place.

`aten` stands for torch.ops.aten everywhere in the package. An op or overload
that this torch lacks is a `MissingOp`: registering a lowering for it does
nothing and comparing an op with it is False, so the families can name the
newest ops without an attribute error at import on an older torch.
"""
import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


class MissingOp:
    """An aten op (or one of its overloads) that this torch does not have."""
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return MissingOp(f"{self.name}.{attr}")

    def overloads(self):
        return []

    def __repr__(self):
        return f"<{self.name}: not in torch {torch.__version__}>"


class OpNamespace:
    """A torch.ops namespace (torch.ops.aten), with MissingOp for what this
    torch lacks. Each name is looked up once, then read as a plain attribute."""

    def __init__(self, namespace):
        self._namespace = namespace

    def __getattr__(self, name):
        try:
            value = getattr(getattr(torch.ops, self._namespace), name)
        except AttributeError:
            if name.startswith("__") and name.endswith("__"):
                raise
            value = MissingOp(f"{self._namespace}.{name}")
        setattr(self, name, value)
        return value


aten = OpNamespace("aten")
c10d_functional = OpNamespace("_c10d_functional")


def has_op(op):
    """Whether op (from `aten`) exists in this torch."""
    return not isinstance(op, MissingOp)
