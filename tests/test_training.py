"""Training parity: the same model, data and optimizer on CPU and on tpu reach
the same parameters after a few steps (float32, rtol 1e-4)."""
import copy

import pytest
import torch
from torch import nn

from torchtpu.ops import LOWERINGS

from conftest import platform_tol

STEPS = 5


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(),
                                 nn.LayerNorm(16), nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before BatchNorm: its gradient is zero up to rounding, which
        # Adam's normalization turns into full-size steps of arbitrary sign.
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn(self.conv1(x))))
        x = torch.relu(self.conv2(x))
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.lstm = nn.LSTM(6, 8, batch_first=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, tokens):
        out, _ = self.lstm(self.emb(tokens))
        return self.fc(out[:, -1])


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        # bias=False: attention's key bias has a zero gradient up to rounding,
        # which Adam would turn into full-size steps of arbitrary sign.
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                           batch_first=True, bias=False)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.fc = nn.Linear(16, 4)

    def forward(self, tokens):
        return self.fc(self.enc(self.emb(tokens)).mean(1))


def _data(kind):
    g = torch.Generator().manual_seed(1)
    target = torch.randint(0, 4, (6,), generator=g)
    if kind == "mlp":
        return torch.randn(6, 8, generator=g), target
    if kind == "cnn":
        return torch.randn(6, 3, 8, 8, generator=g), target
    return torch.randint(0, 10, (6, 5), generator=g), target


MODELS = {"mlp": MLP, "cnn": CNN, "lstm": LSTMNet, "transformer": Transformer}


def _train(model, make_opt, x, y, device, steps=STEPS):
    model = model.to(device)
    x, y = x.to(device), y.to(device)
    opt = make_opt(model.parameters())
    losses = []
    for _ in range(steps):
        def closure():
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss
        losses.append(opt.step(closure).detach().cpu())
    return model, torch.stack(losses)


def _check_parity(kind, make_opt, rtol=1e-4, atol=1e-5, dtype=torch.float32):
    torch.manual_seed(0)
    ref = MODELS[kind]().to(dtype)
    model = copy.deepcopy(ref)
    x, y = _data(kind)
    if x.is_floating_point():
        x = x.to(dtype)
    ref, ref_losses = _train(ref, make_opt, x, y, "cpu")
    model, losses = _train(model, make_opt, x, y, "tpu")
    if dtype == torch.float32:
        rtol, atol = platform_tol(rtol, atol).values()
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=atol)
    ref_state = ref.state_dict()
    for name, value in model.state_dict().items():
        assert value.is_tpu, name
        torch.testing.assert_close(value.cpu(), ref_state[name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


_NO_LSTM_CELL = pytest.mark.skipif(
    torch.ops.aten._thnn_fused_lstm_cell.default not in LOWERINGS,
    reason="missing: lowerings of aten._thnn_fused_lstm_cell and its backward "
           "(nn.LSTM off the CPU calls them; they have no CPU kernel to fall back to)")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=_NO_LSTM_CELL) if k == "lstm" else k
                                  for k in MODELS])
def test_adamw_parity(mode, kind):
    _check_parity(kind, lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True))


def test_adamw_forloop_parity(mode):
    _check_parity("mlp", lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False))


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "forloop"])
def test_sgd_momentum(mode, foreach):
    _check_parity("mlp", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                                   weight_decay=1e-3, foreach=foreach))


def test_adam(mode):
    _check_parity("cnn", lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True))


def test_lbfgs(mode):
    # LBFGS divides by curvature estimates, which magnifies float32 rounding
    # differences between kernels; float64 keeps the comparison meaningful.
    _check_parity("mlp", lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4, history_size=3),
                  rtol=1e-7, atol=1e-9, dtype=torch.float64)


def test_gradients_match(mode):
    torch.manual_seed(0)
    ref = Transformer()
    model = copy.deepcopy(ref).to("tpu")
    x, y = _data("transformer")
    nn.functional.cross_entropy(ref(x), y).backward()
    nn.functional.cross_entropy(model(x.to("tpu")), y.to("tpu")).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.is_tpu, name
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)


def test_optimizers_take_their_foreach_path_on_tpu():
    # As for CUDA tensors: torch.optim's default is the multi-tensor path.
    from torch.optim.optimizer import _default_to_fused_or_foreach
    params = list(torch.nn.Linear(3, 2).to("tpu").parameters())
    assert _default_to_fused_or_foreach(params, differentiable=False, use_fused=False) == (False, True)
    cpu_params = list(torch.nn.Linear(3, 2).parameters())
    assert _default_to_fused_or_foreach(cpu_params, differentiable=False, use_fused=False) == (False, False)
