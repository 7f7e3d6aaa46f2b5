"""torch.optim's fused=True optimizers on tpu: the same parameters and state
as fused=True on CPU, in every mode, without the CPU fallback."""
import re

import pytest
import torch

import torchtpu
from torchtpu import metrics

from conftest import assert_same, to_cpu

OPT = torch.optim

# (optimizer, keyword arguments): the flag combinations that change the update.
CASES = {
    "adamw": (OPT.AdamW, dict(lr=0.01)),
    "adamw_amsgrad_maximize_wd": (OPT.AdamW, dict(lr=0.01, amsgrad=True, maximize=True,
                                                  weight_decay=0.1)),
    "adam": (OPT.Adam, dict(lr=0.01, betas=(0.8, 0.9))),
    "adam_amsgrad_wd": (OPT.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    "adam_maximize": (OPT.Adam, dict(lr=0.01, maximize=True, eps=1e-6)),
    "sgd": (OPT.SGD, dict(lr=0.05)),
    "sgd_momentum_dampening_maximize": (OPT.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3,
                                                      maximize=True)),
    "sgd_nesterov_wd": (OPT.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "adagrad": (OPT.Adagrad, dict(lr=0.05, lr_decay=0.1, weight_decay=0.1)),
}
TENSOR_LR = ("adamw", "adam_amsgrad_wd", "sgd_nesterov_wd", "adagrad")
STEPS = 3


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3)).to(device)


def _train(device, cls, kwargs, steps=STEPS, scaler=None, inf_at=None, clip=None):
    """steps of cls on the small model; the loss is made inf at step inf_at;
    clip: unscale first and clip the gradients' norm to it."""
    model = _model(device)
    opt = cls(model.parameters(), **kwargs)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(6, 4, generator=g).to(device)
        loss = model(x).pow(2).sum()
        if step == inf_at:
            loss = loss * float("inf")
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return list(model.parameters()), opt.state_dict()["state"]


def _fused_fallbacks():
    return {k: v for k, v in metrics.snapshot()["cpu_fallbacks"].items() if "_fused_" in k}


def _assert_states_same(tpu_state, cpu_state, **tol):
    assert tpu_state.keys() == cpu_state.keys()
    for i in cpu_state:
        assert tpu_state[i].keys() == cpu_state[i].keys()
        for name, value in cpu_state[i].items():
            if isinstance(value, torch.Tensor):
                assert_same(tpu_state[i][name], value, **tol)
            else:
                assert tpu_state[i][name] == value


@pytest.mark.parametrize("case,tensor_lr",
                         [(c, False) for c in CASES] + [(c, True) for c in TENSOR_LR],
                         ids=list(CASES) + [c + "-tensor_lr" for c in TENSOR_LR])
def test_fused_step_matches_cpu_fused(mode, case, tensor_lr):
    cls, kwargs = CASES[case]
    kwargs = dict(kwargs, fused=True)
    before = _fused_fallbacks()

    def run(device):
        kw = dict(kwargs, lr=torch.tensor(kwargs["lr"])) if tensor_lr else kwargs
        return _train(device, cls, kw)
    params, state = run("tpu")
    cpu_params, cpu_state = run("cpu")
    for p, c in zip(params, cpu_params):
        assert_same(p, c)
    _assert_states_same(state, cpu_state)
    # The step counters live on the device, as with fused=True on CUDA.
    if "step" in state.get(0, {}):
        assert state[0]["step"].device.type == "tpu" and state[0]["step"].dtype == torch.float32
    assert _fused_fallbacks() == before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_fused_adamw_other_dtypes_match_cpu_fused(mode, dtype):
    # Computed in float32 (float64 for float64) and rounded once, as CPU does.
    kwargs = dict(lr=0.01, amsgrad=True, weight_decay=0.1, fused=True)

    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8).to(device, dtype)
        opt = OPT.AdamW(model.parameters(), **kwargs)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4, 16, generator=g).to(device, dtype)
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return list(model.parameters()), opt.state_dict()["state"]
    params, state = run("tpu")
    cpu_params, cpu_state = run("cpu")
    for p, c in zip(params, cpu_params):
        assert_same(p, c)
    _assert_states_same(state, cpu_state)


@pytest.mark.parametrize("case", ["adamw_amsgrad_maximize_wd", "adam_amsgrad_wd",
                                  "sgd_nesterov_wd", "adagrad"])
def test_fused_matches_foreach(case):
    cls, kwargs = CASES[case]
    params, state = _train("tpu", cls, dict(kwargs, fused=True))
    ref_params, ref_state = _train("tpu", cls, dict(kwargs, foreach=True))
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(to_cpu(p), to_cpu(r), rtol=1e-5, atol=1e-6)
    # foreach keeps its step counters on the host.
    for i, entries in ref_state.items():
        for name, ref in entries.items():
            torch.testing.assert_close(to_cpu(state[i][name]), to_cpu(ref), rtol=1e-5, atol=1e-6)


def _lists(device, n_state):
    g = torch.Generator().manual_seed(2)
    shapes = [(3, 4), (5,)]

    def make():
        return [torch.randn(s, generator=g).to(device) for s in shapes]
    params, grads = make(), make()
    state = [[torch.rand(s, generator=g).to(device) for s in shapes] for _ in range(n_state)]
    steps = [torch.tensor(3.0).to(device) for _ in shapes]
    return params, grads, state, steps


def _call(device, op, found_inf_value):
    """One direct call of a fused op with a grad_scale and found_inf; returns
    every list it may write, after the call and as they were before it."""
    scale = dict(grad_scale=torch.tensor(4.0).to(device),
                 found_inf=torch.tensor(found_inf_value).to(device))
    n_state = {"adamw": 3, "adam": 3, "sgd": 1, "adagrad": 1}[op]
    params, grads, state, steps = _lists(device, n_state)
    lists = [params, grads, *state] + ([] if op == "sgd" else [steps])
    before = [[t.clone() for t in ts] for ts in lists]
    if op in ("adamw", "adam"):
        fn = torch._fused_adamw_ if op == "adamw" else torch._fused_adam_
        fn(params, grads, *state, steps, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.1,
           eps=1e-8, amsgrad=True, maximize=True, **scale)
    elif op == "sgd":
        torch._fused_sgd_(params, grads, *state, weight_decay=0.1, momentum=0.9, lr=0.1,
                          dampening=0.2, nesterov=False, maximize=True, is_first_step=False,
                          **scale)
    else:
        torch._fused_adagrad_(params, grads, *state, steps, lr=0.1, lr_decay=0.01,
                              weight_decay=0.1, eps=1e-10, maximize=True, **scale)
    return lists, before


@pytest.mark.parametrize("found_inf", [0.0, 1.0], ids=["finite", "found_inf"])
@pytest.mark.parametrize("op", ["adamw", "adam", "sgd", "adagrad"])
def test_grad_scale_and_found_inf_as_cpu(mode, op, found_inf):
    # Gradients are unscaled in place; with found_inf set nothing changes.
    got, _ = _call("tpu", op, found_inf)
    want, before = _call("cpu", op, found_inf)
    for g, w in zip(got, want):
        assert_same(g, w)
    changed = any(not torch.equal(a, b) for ts, bs in zip(want, before) for a, b in zip(ts, bs))
    assert changed == (not found_inf)


@pytest.mark.parametrize("clip", [None, 1.0], ids=["scaled", "unscale_clip"])
@pytest.mark.parametrize("case", ["adamw", "sgd_nesterov_wd"])
def test_grad_scaler_with_an_inf_step(mode, case, clip):
    # GradScaler hands fused optimizers grad_scale and found_inf (after
    # unscale_, found_inf alone); step 1's inf loss is skipped and the scale
    # backs off, as on CPU.
    cls, kwargs = CASES[case]
    kwargs = dict(kwargs, fused=True)
    scaler = torch.amp.GradScaler("tpu", init_scale=2.0 ** 8)
    params, state = _train("tpu", cls, kwargs, steps=4, scaler=scaler, inf_at=1, clip=clip)
    cpu_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    cpu_params, cpu_state = _train("cpu", cls, kwargs, steps=4, scaler=cpu_scaler, inf_at=1,
                                   clip=clip)
    for p, c in zip(params, cpu_params):
        assert_same(p, c)
    _assert_states_same(state, cpu_state)
    if "step" in state[0]:
        assert state[0]["step"].item() == 3
    assert scaler.get_scale() == cpu_scaler.get_scale() == 2.0 ** 7
    assert _fused_fallbacks() == {}


def test_changing_lr_compiles_nothing_new():
    # A scheduler changes the float lr every step; the kernel traces it.
    def run(device, record=None):
        model = _model(device)
        opt = OPT.AdamW(model.parameters(), lr=0.01, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).to(device)
        for step in range(4):
            model(x).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            if record is not None:
                record.append(metrics.snapshot()["compilations"])
        return list(model.parameters())
    compilations = []
    with torchtpu.eager_mode("strict"):
        params = run("tpu", compilations)
    assert compilations[1] == compilations[2] == compilations[3]
    for p, c in zip(params, run("cpu")):
        assert_same(p, c)


def test_fused_mode_step_is_one_graph(fresh_kernels):
    from torchtpu.modes.fused import STATS
    with torchtpu.eager_mode("fused"):
        model = _model("tpu")
        opt = OPT.AdamW(model.parameters(), lr=0.01, fused=True)
        x = torch.randn(6, 4).to("tpu")
        for step in range(5):
            loss = model(x).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
            if step == 2:
                compiled, flushes = STATS.graphs_compiled, sum(STATS.flushes.values())
                hits = STATS.graph_cache_hits
        # Each later step: one flush (the loss read), one cached graph.
        assert STATS.graphs_compiled == compiled
        assert sum(STATS.flushes.values()) == flushes + 2
        assert STATS.graph_cache_hits == hits + 2
    assert _fused_fallbacks() == {}


def _bad_call(device, wrong):
    def t(*shape):
        return torch.randn(shape).to(device)
    params = [t(3), t(2)]
    grads = [t(3), t(3) if wrong == "shape" else t(2)][:1 if wrong == "length" else 2]
    state = [[t(3), t(2)] for _ in range(3)]
    steps = [torch.ones(()).to(device) for _ in params]
    if wrong == "unused_momentum_buffers":
        torch._fused_sgd_(params, grads, state[0], weight_decay=0.0, momentum=0.0, lr=0.1,
                          dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
    else:
        # amsgrad=False takes no max_exp_avg_sqs.
        maxima = state[2] if wrong == "unused_max_exp_avg_sqs" else []
        torch._fused_adamw_(params, grads, state[0], state[1], maxima, steps, lr=0.1, beta1=0.9,
                            beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False,
                            maximize=False)


@pytest.mark.parametrize("wrong", ["length", "unused_max_exp_avg_sqs",
                                   "unused_momentum_buffers"])
def test_bad_lists_raise_as_on_cpu(wrong):
    with pytest.raises(RuntimeError) as cpu_error:
        _bad_call("cpu", wrong)
    expected = str(cpu_error.value).split("  (Could")[0]
    with pytest.raises(RuntimeError, match=re.escape(expected)) as tpu_error:
        _bad_call("tpu", wrong)
    assert "torchtpu bug" not in str(tpu_error.value)


def test_mismatched_shapes_raise():
    # CUDA's kernel refuses them; tpu too (CPU's reads out of bounds).
    with pytest.raises(RuntimeError, match=r"grads\[1\] has shape \[3\]"):
        _bad_call("tpu", "shape")
