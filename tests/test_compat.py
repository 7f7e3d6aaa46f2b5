"""torchtpu.compat: the ops an older torch lacks are MissingOp, which
registers nothing and equals no op, so the package imports on torch
2.11-2.13 alike."""
import torch

from torchtpu import compat
from torchtpu.ops.registry import LOWERINGS, lower


def test_an_op_this_torch_lacks_is_missing_and_registers_nothing():
    op = compat.aten.no_such_op_in_any_torch.default
    assert isinstance(op, compat.MissingOp) and not compat.has_op(op)
    assert "no_such_op_in_any_torch.default" in repr(op)
    before = dict(LOWERINGS)

    @lower(op, compat.aten.no_such_op_in_any_torch)
    def fn(x):
        return x

    assert LOWERINGS == before
    assert op != torch.ops.aten.add.Tensor
    assert op not in {torch.ops.aten.add.Tensor: 1}


def test_an_op_this_torch_has_is_torchs_own():
    assert compat.aten.add is torch.ops.aten.add
    assert compat.aten.add.Tensor is torch.ops.aten.add.Tensor
    assert compat.has_op(compat.aten.add.Tensor)
    assert compat.c10d_functional.all_reduce.default is torch.ops._c10d_functional.all_reduce.default
    assert compat.aten.__and__ is torch.ops.aten.__and__

