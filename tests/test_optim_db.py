"""PyTorch's own optimizer test data (torch.testing._internal's optim_db):
every optimizer, with each of its OptimizerInfo's argument sets and each
implementation it supports (for-loop, foreach, fused), trained 3 steps on
tpu gives CPU's parameters, state and losses."""
import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

import torchtpu  # noqa: F401

SHAPES = [(4, 3), (3,), (2, 2, 2)]
MATRICES = [(4, 3), (3, 5)]  # Muon's: it takes 2-D parameters only
STEPS = 3


def _on(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_on(v, device) for v in value)
    return value


def _train(cls, kwargs, device, dtype):
    g = torch.Generator().manual_seed(0)
    shapes = MATRICES if cls.__name__ == "Muon" else SHAPES
    params = [torch.randn(s, generator=g, dtype=dtype).to(device).requires_grad_() for s in shapes]
    targets = [torch.randn(s, generator=g, dtype=dtype).to(device) for s in shapes]
    opt = cls(params, **{k: _on(v, device) for k, v in kwargs.items()})

    def closure():
        opt.zero_grad()
        loss = sum(((p - t) ** 2).sum() + 0.1 * (p.sin() * t).sum() for p, t in zip(params, targets))
        loss.backward()
        return loss

    losses = [opt.step(closure).item() for _ in range(STEPS)]
    state = [(k, v.detach().cpu()) for p in params for k, v in sorted(opt.state[p].items())
             if isinstance(v, torch.Tensor)]
    return [p.detach().cpu() for p in params], state, losses


def _cases(info):
    impls = [None] + [i for i in ("foreach", "fused") if i in info.supported_impls]
    for given in info.optim_inputs_func(device="cpu"):
        for impl in impls:
            kwargs = dict(given.kwargs)
            if impl is not None:
                if impl in kwargs or (impl == "fused" and (kwargs.get("differentiable")
                                                           or kwargs.get("capturable"))):
                    continue
                kwargs[impl] = True
            yield f"{given.desc}, impl={impl}", kwargs


@pytest.mark.parametrize("info", optim_db, ids=[i.optim_cls.__name__ for i in optim_db])
def test_optimizer_matches_cpu_on_its_optim_db_inputs(info):
    if info.optim_cls is torch.optim.SparseAdam:
        pytest.skip("SparseAdam needs sparse gradients, and tpu has no sparse tensors")
    # LBFGS in float64: its line search and two-loop recursion amplify
    # float32 rounding from step to step (float32 losses agree to 1e-7, its
    # direction 'd' drifts past 1e-5); in float64 it matches CPU to 1e-16.
    dtype = torch.float64 if info.optim_cls is torch.optim.LBFGS else torch.float32
    failures, ran = [], 0
    for name, kwargs in _cases(info):
        try:
            want = _train(info.optim_cls, kwargs, "cpu", dtype)
        except (RuntimeError, ValueError, TypeError):
            continue  # an argument set CPU refuses too (a CUDA-only one)
        ran += 1
        try:
            got = _train(info.optim_cls, kwargs, "tpu", dtype)
            torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
            for a, b in zip(got[0], want[0], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            assert [k for k, _ in got[1]] == [k for k, _ in want[1]]
            for (key, a), (_, b) in zip(got[1], want[1]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
        except Exception as e:  # every argument set is reported, not only the first
            failures.append(f"{name}: {type(e).__name__}: {str(e).strip()[:300]}")
    assert ran > 0
    assert failures == [], "\n".join(failures)
