"""torch.compile on tpu models: the default backend (ops on tpu tensors are
graph breaks, run in the current eager mode; graphs that make tpu tensors go
to the `tpu` backend, with one warning), the `tpu` backend (Dynamo's graphs
run through torchtpu), and CPU models still compiled by Inductor."""
import copy
import os
import subprocess
import sys
import warnings

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


def _train_both(make_model, **compile_kwargs):
    """Compiled training steps on tpu and plain ones on CPU: losses, then
    parameters, compared."""
    steps = 2
    torch.manual_seed(0)
    ref = make_model()
    model = copy.deepcopy(ref).to("tpu")
    x = torch.randn(4, 5, 6)
    compiled = torch.compile(model, **compile_kwargs)
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
    _train_both(make, backend="inductor")


def test_tpu_backend_trains_a_model_making_tpu_tensors(mode):
    _train_both(_Positions, backend="tpu")


_ROUTED = 'Inductor .*cannot generate code for tpu tensors.*backend="tpu"'


@pytest.fixture
def routing_not_warned_yet(monkeypatch):
    """As in a fresh process: the routing warning not given yet."""
    monkeypatch.setattr(torchtpu.compile, "_routing_warned", False)


def test_default_backend_trains_a_model_making_tpu_tensors(mode, routing_not_warned_yet):
    with pytest.warns(UserWarning, match=_ROUTED):
        _train_both(_Positions)


def test_default_backend_warns_once_per_process(routing_not_warned_yet):
    x = torch.randn(4, 5, 6, device="tpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # Python's own once-per-place filter off
        for _ in range(2):  # two models, two compilations
            torch.compile(_Positions().to("tpu"))(x)
        torch.compile(_Positions().to("tpu"), backend="inductor")(x[:, :3])
    routed = [w for w in caught if "cannot generate code for tpu" in str(w.message)]
    assert len(routed) == 1, [str(w.message) for w in caught]
    assert routed[0].category is UserWarning
    assert routed[0].filename == __file__  # the compiled code's line, not torch's


def test_default_backend_still_compiles_cpu_models_with_inductor():
    from torch._inductor.utils import run_and_get_code
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(_Positions().to("tpu"))(torch.randn(4, 5, 6, device="tpu"))  # routed first
    model = _Positions()
    x = torch.randn(4, 5, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, code = run_and_get_code(torch.compile(model), x)
    assert code, "Inductor generated no code for a CPU model"
    assert not [w for w in caught if "torchtpu" in str(w.message)]
    assert out.device.type == "cpu" and type(out) is torch.Tensor
    torch.testing.assert_close(out, model(x))


def test_default_backend_trains_a_hugging_face_gpt2(routing_not_warned_yet):
    """GPT-2 makes tpu tensors in forward (positions, the causal mask) and ties
    its embedding to its output layer: forward and an AdamW step, compiled
    with the default backend, against CPU eager."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model = copy.deepcopy(ref).to("tpu")
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match=_ROUTED):
        compiled = torch.compile(model)
        logits = compiled(ids.to("tpu")).logits
    assert_same(logits, ref(ids).logits.detach(), rtol=1e-4, atol=1e-5)
    runs = [(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), ids),
            (compiled, torch.optim.AdamW(model.parameters(), lr=1e-3), ids.to("tpu"))]
    losses = []
    for m, opt, x in runs:
        loss = m(x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(loss)
    assert_same(losses[1], losses[0].detach(), rtol=1e-4, atol=1e-5)
    assert model.lm_head.weight is model.transformer.wte.weight
    ref_state = ref.state_dict()
    for name, value in model.state_dict().items():
        assert_same(value, ref_state[name], rtol=1e-4, atol=1e-5)


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


def test_other_ways_into_inductor_refuse_tpu_graphs_clearly():
    """Inductor's code generation reached past torch.compile's entry
    (torch._dynamo.optimize("inductor")) refuses, naming the tpu backend."""
    compiled = torch._dynamo.optimize("inductor")(_Positions().to("tpu"))
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


def test_import_torchtpu_leaves_dynamo_unimported_until_used():
    """Dynamo and Inductor are told about tpu when first imported, not at
    `import torchtpu`: the skip list, the tpu backend and Inductor's refusal
    are all in place once a compile imports them."""
    script = "\n".join([
        "import sys, torch, torchtpu",
        "assert 'torch._dynamo' not in sys.modules and 'torch._inductor' not in sys.modules",
        "m = torch.nn.Linear(3, 2)",
        "x = torch.randn(4, 3)",
        "out = torch.compile(m.to('tpu'), backend='tpu')(x.to('tpu'))",
        "from torch._dynamo import trace_rules",
        "from torch._inductor.codegen.common import get_scheduling_for_device",
        "assert trace_rules.check_file(torchtpu.dispatch.__file__).skipped",
        "assert get_scheduling_for_device('tpu') is torchtpu.compile._NoInductorCode",
        "torch.testing.assert_close(out.cpu(), torch.nn.functional.linear(",
        "    x, m.weight.detach().cpu(), m.bias.detach().cpu()))",
        "print('ok')"])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TORCHTPU_CACHE_DIR="off"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
