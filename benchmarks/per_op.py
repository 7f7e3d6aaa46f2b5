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


def host_cost(repeats=9, steps=5, n_ops=1000, size=16):
    """The host's cost of recording ops, where device time is negligible:
    fused ms per training step of benchmarks/tpu.py's GPT at tiny widths (8
    layers, d32, seq 16, batch 2, vocab 64; bf16 autocast, AdamW, steady
    state: its graphs compiled), and µs per op of `c = c + y` on size x size
    float32 in fused and strict mode. Medians over repeats (each of `steps`
    steps, or n_ops ops, then a sync), with PyTorch CPU eager's step beside."""
    import torch.nn.functional as F
    from tpu import torch_gpt

    def gpt_step(device, autocast_device):
        torch.manual_seed(0)
        net = torch_gpt(vocab=64, d=32, heads=2, layers=8, seq=16).to(device)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 64, (2, 17), generator=g)
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].reshape(-1).to(device)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(autocast_device, dtype=torch.bfloat16):
                out = net(x)
            loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y)
            loss.backward()
            opt.step()
            return loss.item()

        def run():
            for _ in range(steps):
                step()
        return run

    def row(what, unit, fn, per, ops=None):
        median, best = timings(fn, repeats, warmup=3)
        return {"what": what, "unit": unit, "median": median / per, "best": best / per,
                "ops": "" if ops is None else str(ops)}

    rows = [row("tiny GPT training step, PyTorch CPU eager", "ms per step",
                gpt_step("cpu", "cpu"), steps / 1e3)]
    with torchtpu.eager_mode("fused"):
        run = gpt_step("tpu", "tpu")
        run()
        before = torchtpu.metrics.M.ops_dispatched
        run()
        ops = (torchtpu.metrics.M.ops_dispatched - before) // steps
        rows.append(row("tiny GPT training step, torchtpu fused", "ms per step", run, steps / 1e3, ops))
    y = torch.randn(size, size).to("tpu")

    def chain():
        c = torch.zeros_like(y)
        for _ in range(n_ops):
            c = c + y
        torchtpu.sync()
    for mode in ("fused", "strict"):
        with torchtpu.eager_mode(mode):
            rows.append(row(f"`c = c + y` {size}x{size}, torchtpu {mode}", "µs per op",
                            chain, n_ops / 1e6))
    return rows


host_cost.title = ("Host cost of recording: tiny GPT training step (8 layers, d32, bf16 autocast, "
                   "AdamW) and a small elementwise chain")
host_cost.columns = [("what", "measure", "{}"), ("unit", "unit", "{}"),
                     ("median", "median", "{:.2f}"), ("best", "best", "{:.2f}"),
                     ("ops", "ops per step", "{}")]
