"""torch.compile on tpu models: the `tpu` backend (no graph breaks on tpu
tensors; each AOTAutograd graph, forward, backward and optimizer step, one
XLA computation), the default backend (graphs on tpu tensors go to the `tpu`
backend, with one warning), and CPU models still compiled by Inductor."""
import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu import compiled as compiled_graphs, metrics
from models import CNN, Transformer
from conftest import assert_at_line, assert_same


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


def test_tpu_backend_in_fused_mode_records_each_graph_as_one_node():
    """In fused mode a compiled forward and its backward are one node each of
    the pending graph (beside the eager ops around them: the loss's sum,
    gradient accumulation), flushed once: fewer nodes than the same step
    uncompiled records, and the same gradients."""
    model = _Positions().to("tpu")
    compiled = torch.compile(model, backend="tpu")
    x = torch.randn(4, 5, 6, device="tpu")
    recorded, grads = {}, {}
    with torchtpu.eager_mode("fused"):
        for name, run in (("eager", model), ("compiled", compiled), ("again", compiled)):
            model.zero_grad()
            metrics.reset()
            run(x).sum().backward()
            grads[name] = model.proj.weight.grad.cpu()
            recorded[name] = metrics.snapshot()
    snap = recorded["again"]
    assert snap["flushes"] == {"cpu": 1}, snap
    assert snap["fused_ops_mean"] < recorded["eager"]["fused_ops_mean"], recorded
    torch.testing.assert_close(grads["again"], grads["eager"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["compiled"], grads["eager"], rtol=1e-5, atol=1e-6)


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


# model, the shape of a batch, tolerance
MODELS = {"mlp": (_mlp, (4, 6), dict(rtol=1e-5, atol=1e-6)),
          "cnn": (CNN, (4, 2, 6, 6), dict(rtol=1e-4, atol=1e-5)),
          "transformer": (Transformer, (4, 5, 8), dict(rtol=1e-4, atol=1e-5))}
OPTIMIZERS = {
    "sgd": lambda params, tpu: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    # capturable: the step counts stay on the device, in the computation
    # (else they are CPU tensors, and the step runs op by op).
    "adamw": lambda params, tpu: torch.optim.AdamW(params, lr=0.01, capturable=tpu),
}


def test_module_forward_is_one_graph_and_one_computation(mode):
    """Dynamo captures a tpu module's forward whole (no graph breaks), and a
    call after the first runs it as one computation: no op dispatched."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch.manual_seed(0)
    ref = _mlp()
    model = copy.deepcopy(ref).to("tpu")
    x = torch.randn(4, 6)
    explained = torch._dynamo.explain(model)(x.to("tpu"))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("tpu")
    compiled = torch.compile(model, backend=counter)
    assert_same(compiled(x.to("tpu")), ref(x).detach(), rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1
    xt = x.to("tpu") * 2
    metrics.reset()
    out = compiled(xt)
    assert metrics.snapshot()["ops_dispatched"] == 0
    assert_same(out, ref(x * 2).detach(), rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1  # the same guards held: nothing recompiled


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_compiled_training_matches_cpu(mode, model_name, optimizer):
    """Five steps with a compiled forward (its backward compiled by
    AOTAutograd) and a compiled optimizer step, against CPU eager; every
    graph ran as one computation, and the step wrote the parameters and the
    optimizer's state over their old values (donated)."""
    first, last = _check_compiled_training(model_name, optimizer)
    assert first == last


def _check_compiled_training(model_name, optimizer, **compile_kwargs):
    """Five compiled training steps against CPU eager's; returns the device
    buffers of the parameters and optimizer state after the second step and
    the last."""
    make, shape, tol = MODELS[model_name]
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref).to("tpu")
    opts = [OPTIMIZERS[optimizer](ref.parameters(), False),
            OPTIMIZERS[optimizer](model.parameters(), True)]
    compiled = torch.compile(model, backend="tpu", **compile_kwargs)
    step = torch.compile(opts[1].step, backend="tpu", **compile_kwargs)
    before = dict(compiled_graphs.graph_fallbacks)
    g = torch.Generator().manual_seed(1)
    buffers = []
    for i in range(5):
        x, y = torch.randn(*shape, generator=g), torch.randn(shape[0], 3, generator=g)
        loss = F.mse_loss(compiled(x.to("tpu")), y.to("tpu"))
        loss.backward()
        step()
        opts[1].zero_grad()
        want = F.mse_loss(ref(x), y)
        want.backward()
        opts[0].step()
        opts[0].zero_grad()
        assert_same(loss, want.detach(), **tol)
        if i in (1, 4):
            buffers.append(_buffers(model, opts[1]))
    assert compiled_graphs.graph_fallbacks == before
    ref_state = ref.state_dict()
    for name, value in model.state_dict().items():
        assert_same(value, ref_state[name], **tol)
    return buffers


def _buffers(model, opt):
    """The device buffer of each parameter and optimizer state tensor now."""
    torchtpu.sync()
    tensors = list(model.parameters()) + [v for s in opt.state.values() for v in s.values()]
    return [t._storage.array.unsafe_buffer_pointer() for t in tensors]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", ["mlp", "transformer"])
def test_reduce_overhead_replays_and_trains_as_cpu(model_name, optimizer):
    """mode="reduce-overhead": each compiled graph (forward, backward, the
    optimizer step) is captured once and replayed on every later call,
    against CPU eager; the step writes the parameters and the optimizer's
    state into their own buffers (donated), as a replayed capture does
    (from the second step: the first replay after a capture copies them)."""
    metrics.reset()
    graphs_before = compiled_graphs._counter[0]
    first, last = _check_compiled_training(model_name, optimizer, mode="reduce-overhead")
    # Every call a replay (forward, backward, step: 3 a step), each graph
    # AOTAutograd compiled captured once (SGD's first step, which makes its
    # momentum buffers, is a graph of its own).
    assert metrics.M.extra["graph_replays"] == 15
    assert metrics.M.extra["graphs_captured"] == compiled_graphs._counter[0] - graphs_before
    assert first == last


def test_reduce_overhead_replays_in_each_mode(mode):
    """The replayed graphs in each eager mode: CPU's values; a forward's
    replay dispatches no op."""
    _check_compiled_training("mlp", "adamw", mode="reduce-overhead")
    torch.manual_seed(0)
    ref = _mlp()
    compiled = torch.compile(copy.deepcopy(ref).to("tpu"), backend="tpu", mode="reduce-overhead")
    x = torch.randn(4, 6)
    with torch.no_grad():
        compiled(x.to("tpu"))
        xt = x.to("tpu")
        metrics.reset()
        out = compiled(xt)
        assert metrics.snapshot()["ops_dispatched"] == 0
        assert metrics.M.extra["graph_replays"] == 1
        assert_same(out, ref(x).detach(), rtol=1e-5, atol=1e-6)


def test_default_backend_reduce_overhead_replays(routing_not_warned_yet):
    """torch.compile(model, mode="reduce-overhead") with the default backend:
    the "triton.cudagraphs" option it sets for Inductor reaches the tpu
    backend, which replays."""
    torch.manual_seed(0)
    ref = _mlp()
    x = torch.randn(4, 6)
    with pytest.warns(UserWarning, match=_ROUTED):
        compiled = torch.compile(copy.deepcopy(ref).to("tpu"), mode="reduce-overhead")
        compiled(x.to("tpu"))
    metrics.reset()
    out = compiled(x.to("tpu") * 2)
    assert metrics.M.extra.get("graph_replays") == 1
    assert_same(out, ref(x * 2).detach(), rtol=1e-5, atol=1e-6)


def _sine_logging_its_sum(x, log):
    h = x.sin()
    log.append(h.sum().item())  # the sync
    return h * 2


def test_reduce_overhead_sync_splits_the_graph_and_raises_inside_capture():
    """A sync in a reduce-overhead function splits it (Dynamo's graph
    break): the graphs on either side replay and the read runs between them,
    giving eager's values; inside a torch.tpu.graph capture the read raises
    as any sync in a capture does, naming its line."""
    compiled = torch.compile(_sine_logging_its_sum, backend="tpu", mode="reduce-overhead")
    x = torch.randn(4, 6)
    metrics.reset()
    for k in range(3):
        got, want = [], []
        out = compiled(x.to("tpu") + k, got)
        assert_same(out, _sine_logging_its_sum(x + k, want), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert metrics.M.extra["graph_replays"] == 6  # two graphs, three calls
    static_x = x.to("tpu")
    g = torch.tpu.TPUGraph()
    with pytest.raises(RuntimeError, match="capturing") as excinfo:
        with torch.tpu.graph(g):
            compiled(static_x, [])
    assert_at_line(excinfo, "# the sync", __file__)
    assert not torch.tpu.is_current_stream_capturing()


def test_compiled_index_out_of_range_raises_naming_the_call(mode):
    emb = torch.compile(torch.nn.Embedding(5, 3).to("tpu"), backend="tpu")
    emb(torch.tensor([1, 2], device="tpu")).cpu()
    with pytest.raises(IndexError, match=f"index 7 is out of bounds.*{os.path.basename(__file__)}"):
        emb(torch.tensor([1, 7], device="tpu")).cpu()


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


def test_compiled_shape_error_names_the_users_line():
    """A shape error in compiled code raises RuntimeError, as the same
    compiled code on CPU tensors does, naming the line that made it."""
    def matmul_after_sin(x, w):
        h = x.sin()
        return h @ w  # the bad line
    errors = {}
    for device in ("cpu", "tpu"):
        torch._dynamo.reset()
        compiled = torch.compile(matmul_after_sin, backend="tpu")
        with pytest.raises(RuntimeError) as caught:
            compiled(torch.randn(3, 4, device=device), torch.randn(5, 2, device=device))
        errors[device] = str(caught.value)
    assert errors["tpu"].split("\n")[0] == errors["cpu"].split("\n")[0]
    assert "must have same reduction dim" in errors["tpu"] or "shapes cannot be multiplied" in errors["tpu"]
    assert f'File "{__file__}"' in errors["tpu"] and "return h @ w  # the bad line" in errors["tpu"]


def test_dynamic_shapes_compile_per_size():
    """After a second batch size Dynamo makes its graph symbolic; each size
    is still one computation, with CPU's values and gradients."""
    torch.manual_seed(0)
    ref = _mlp()
    model = copy.deepcopy(ref).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    before = dict(compiled_graphs.graph_fallbacks)
    for batch in (4, 6, 7):
        x = torch.randn(batch, 6)
        out = compiled(x.to("tpu"))
        out.sum().backward()
        want = ref(x)
        want.sum().backward()
        assert_same(out, want.detach(), rtol=1e-5, atol=1e-6)
    assert compiled_graphs.graph_fallbacks == before
    assert_same(model[0].weight.grad, ref[0].weight.grad, rtol=1e-5, atol=1e-6)


def test_dynamic_shapes_return_saved_inputs_as_they_came_at_every_size(monkeypatch):
    """A graph Dynamo made symbolic returns the inputs backward saves as they
    came (not copies: they keep their requires_grad, which flex_attention's
    backward reads) at every size, not only the one it was traced at: its
    traced layouts are evaluated at each call's sizes, never compared as
    SymInts, which had guarded Dynamo's ShapeEnv into fixing each symbol to
    the second size."""
    traces = []
    trace = compiled_graphs._trace

    def recording(gm, *rest):
        traced = trace(gm, *rest)
        if not any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes):
            traces.append((gm, traced))
        return traced
    monkeypatch.setattr(compiled_graphs, "_trace", recording)
    compiled = torch.compile(lambda x, w: (x * w).sum(), backend="tpu")
    for n in (4, 6, 7, 5):
        x, w = (torch.randn(n, 3).to("tpu").requires_grad_() for _ in range(2))
        compiled(x, w).backward()
        assert_same(x.grad, w.detach().cpu())
    assert [sum(type(o) is compiled_graphs.ReturnedInput for o in traced.outputs)
            for _, traced in traces] == [2, 2, 2, 2]
    (symbol, *_) = [m for n in traces[-1][0].graph.nodes
                    if isinstance(m := n.meta.get("val"), torch.SymInt)]
    assert not any(v.is_number for v in symbol.node.shape_env.replacements.values())


@pytest.mark.parametrize("compile_mode", [None, "reduce-overhead"])
def test_compiled_under_autocast_computes_in_autocasts_dtypes(mode, compile_mode):
    """torch.compile of a step under torch.autocast(bfloat16) keeps autocast's
    casts: its matmuls multiply bfloat16 (a linear's output is bfloat16, as
    in eager mode), and its loss and gradients are CPU autocast's."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    model = copy.deepcopy(ref).to("tpu")
    x = torch.randn(8, 16)

    def step(m, inp):
        with torch.autocast(inp.device.type, dtype=torch.bfloat16):
            out = m(inp)
            return out, out.float().square().mean()

    compiled = torch.compile(step, backend="tpu", mode=compile_mode)
    for _ in range(2):  # the second call runs the compiled graphs (or replays them)
        out, loss = compiled(model, x.to("tpu"))
        loss.backward()
    want_out, want = step(ref, x)
    want.backward()
    want_out, want = step(ref, x)
    want.backward()
    assert out.dtype == want_out.dtype == torch.bfloat16
    assert_same(out, want_out.detach(), rtol=1e-2, atol=1e-2)
    assert_same(loss, want.detach(), rtol=1e-2, atol=1e-3)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        assert_same(p.grad, q.grad, rtol=2e-2, atol=2e-3)
