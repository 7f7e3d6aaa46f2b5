"""Per-op dispatch cost: `c = c + y` on 128x128 float32, 1000 ops then one
sync, in each eager mode, beside PyTorch CPU eager and the floor that any
Python backend pays (an empty `__torch_dispatch__` subclass)."""
import torch

import torchtpu
from common import timings


class _NullTensor(torch.Tensor):
    """A tensor subclass whose every op returns a new, empty wrapper."""
    @staticmethod
    def __new__(cls, shape, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="tpu")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return cls(args[0].shape, args[0].dtype)


def per_op(n_ops=1000, size=128, repeats=9):
    """Per-op cost of `c = c + y` on size x size float32: n_ops ops, then one sync."""
    rows = []
    y_cpu = torch.randn(size, size)

    def loop(y, sync):
        def run():
            c = torch.zeros_like(y)
            for _ in range(n_ops):
                c = c + y
            sync(c)
        return run

    def row(name, fn):
        median, best = timings(fn, repeats)
        return {"mode": name, "median": median / n_ops * 1e6, "best": best / n_ops * 1e6}

    rows.append(row("PyTorch CPU eager", loop(y_cpu, lambda c: None)))
    # What PyTorch itself costs a Python backend per op: entering
    # __torch_dispatch__ and making the result's wrapper tensor, nothing else.
    floor = _NullTensor(y_cpu.shape, y_cpu.dtype)
    rows.append(row("floor: empty __torch_dispatch__ subclass", loop(floor, lambda c: None)))
    y = y_cpu.to("tpu")
    for mode in ("fused", "strict", "debug"):
        with torchtpu.eager_mode(mode):
            rows.append(row(f"torchtpu {mode}", loop(y, lambda c: torchtpu.sync())))
    return rows


per_op.title = "Per-op dispatch cost: `c = c + y`, 128x128 float32, 1000 ops then one sync"
per_op.columns = [("mode", "mode", "{}"), ("median", "µs per op (median)", "{:.1f}"),
                  ("best", "µs per op (best)", "{:.1f}")]
