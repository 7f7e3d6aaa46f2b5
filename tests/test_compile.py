"""torch.compile on tpu models: the default backend (ops on tpu tensors are
graph breaks, run in the current eager mode), the `tpu` backend (Dynamo's
graphs run through torchtpu), and Inductor's clear refusal of graphs that
make tpu tensors."""
import copy

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu import metrics
from conftest import assert_same


class _Positions(torch.nn.Module):
    """Makes a tensor on its input's device inside forward, as transformer
    models do for positions: Dynamo puts that factory in its graph."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 6)
        self.proj = torch.nn.Linear(6, 3)

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)
        return self.proj(x + self.embed(pos))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train_both(make_model, backend, steps=2):
    """Compiled training steps on tpu and plain ones on CPU: losses, then
    parameters, compared."""
    torch.manual_seed(0)
    ref = make_model()
    model = copy.deepcopy(ref).to("tpu")
    x = torch.randn(4, 5, 6)
    compiled = torch.compile(model, backend=backend)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for _ in range(steps):
        losses = []
        for m, opt, inp in ((ref, opts[0], x), (compiled, opts[1], x.to("tpu"))):
            loss = F.mse_loss(m(inp), torch.ones(4, 5, 3, device=inp.device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        assert_same(losses[1], losses[0].detach(), rtol=1e-5, atol=1e-6)
    ref_state = ref.state_dict()
    for name, value in model.state_dict().items():
        assert_same(value, ref_state[name], rtol=1e-5, atol=1e-6)


def test_default_backend_trains_a_tpu_model(mode):
    make = lambda: torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(),  # noqa: E731
                                       torch.nn.Linear(8, 3))
    _train_both(make, "inductor")


def test_tpu_backend_trains_a_model_making_tpu_tensors(mode):
    _train_both(_Positions, "tpu")


def test_tpu_backend_in_fused_mode_still_fuses():
    model = _Positions().to("tpu")
    compiled = torch.compile(model, backend="tpu")
    x = torch.randn(4, 5, 6, device="tpu")
    with torchtpu.eager_mode("fused"):
        compiled(x).sum().backward()
        metrics.reset()
        out = compiled(x)
        out.sum().backward()
        model.proj.weight.grad.cpu()
    snap = metrics.snapshot()
    assert snap["flushes"] == {"cpu": 1} and snap["fused_ops_mean"] > 10, snap


def test_inductor_refuses_graphs_making_tpu_tensors_clearly():
    model = _Positions().to("tpu")
    compiled = torch.compile(model)
    with pytest.raises(Exception, match='Inductor cannot generate code for tpu tensors.*'
                                        'backend="tpu"'):
        compiled(torch.randn(4, 5, 6, device="tpu"))


def test_dynamo_does_not_trace_torchtpu_or_jax():
    import jax
    from torch._dynamo import trace_rules

    from torchtpu.modes import fused
    for path in (torchtpu.dispatch.__file__, fused.__file__, jax.numpy.__file__):
        assert trace_rules.check_file(path).skipped, path
    assert not trace_rules.check_file(__file__).skipped  # user code is traced
