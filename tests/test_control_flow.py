"""torch.cond, torch.while_loop, map, scan and PyTorch's other control-flow
higher-order ops on tpu tensors, run eagerly, against CPU: PyTorch's own
test data (hop_db) and a model that branches on a value."""
import os
import sys

import pytest
import torch

import torchtpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from opinfo_common import check, op_id  # noqa: E402

from torch.testing._internal.hop_db import hop_db  # noqa: E402

# auto_functionalize's sample is a testlib op with only a CPU kernel: it runs
# on the CPU fallback, as a user's CPU-only custom op does.
HOPS = [op for op in hop_db if op.name != "auto_functionalize"]


@pytest.mark.parametrize("op", HOPS, ids=[op_id(op) for op in HOPS])
def test_hop_db_on_tpu_as_on_cpu(mode, op):
    for kind in ("forward", "backward"):
        result = check(op, torch.float32, kind, samples=5, extras=False)
        assert result.status in ("pass", "skip"), (kind, result.status, result.error, result.fallbacks)


def test_a_model_branching_with_cond_trains_as_on_cpu(mode):
    def step(model, x):
        h = model(x)
        out = torch.cond(h.sum() > 0, lambda h: h.sin() * 2, lambda h: h.cos(), (h,))
        i, acc = torch._higher_order_ops.while_loop(lambda i, acc: i < 3, lambda i, acc: (i + 1, acc * 0.5 + out),
                                                    (torch.zeros((), dtype=torch.long, device=x.device), out))
        loss = acc.pow(2).mean()
        loss.backward()
        return loss.detach(), i

    torch.manual_seed(0)
    cpu = torch.nn.Linear(4, 3)
    tpu = torch.nn.Linear(4, 3).to("tpu")
    tpu.load_state_dict(cpu.state_dict())
    torchtpu.metrics.reset()
    for seed in range(3):  # both branches
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
        want, wi = step(cpu, x)
        got, gi = step(tpu, x.to("tpu"))
        torch.testing.assert_close(got.cpu(), want)
        assert gi.item() == wi.item() == 3
    for p, q in zip(cpu.parameters(), tpu.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad)
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == {}


def test_compiled_graphs_holding_cond_run_eagerly_as_on_cpu():
    # torch.compile(backend="tpu") runs a graph holding a control-flow op op
    # by op (graph_fallbacks says so), forward and backward; export works.
    from torchtpu import compiled

    class Branching(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.linear(x)
            return torch.cond(h.sum() > 0, lambda h: h.sin(), lambda h: h.cos(), (h,))

    torch.manual_seed(0)
    cpu = Branching()
    tpu = Branching().to("tpu")
    tpu.load_state_dict(cpu.state_dict())
    x = torch.randn(3, 4)
    want = cpu(x)
    want.sum().backward()
    before = compiled.graph_fallbacks.get("control flow (cond)", 0)
    got = torch.compile(tpu, backend="tpu")(x.to("tpu"))
    got.sum().backward()
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(tpu.linear.weight.grad.cpu(), cpu.linear.weight.grad)
    assert compiled.graph_fallbacks.get("control flow (cond)", 0) > before
    exported = torch.export.export(tpu, (x.to("tpu"),))
    torch.testing.assert_close(exported.module()(x.to("tpu")).cpu(), want)
