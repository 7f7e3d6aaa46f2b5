"""Training-step benchmarks: the models, and the same MLP step written as one
jax.jit function (the compiled limit fused mode aims at).

Each figure is the median of several repeats, measured side by side in one
process: torchtpu fused, torchtpu strict, PyTorch CPU eager, jax.jit.
"""
import functools

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

import torchtpu
from common import timings


# ---- models ----------------------------------------------------------------

def mlp():
    return torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 10))


def mlp_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(128, 784, generator=g), torch.randint(0, 10, (128,), generator=g)


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=512, d=256, heads=4, layers=4, seq=128):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(seq, d))
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def gpt_batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (8, 129), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous()


def _torch_step(model, opt, x, y):
    def step():
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def training_step(make_model, make_batch, repeats=5, modes=("fused", "strict", "torch_cpu")):
    """Median ms per training step (AdamW) per mode."""
    results = {}
    for mode in modes:
        torch.manual_seed(0)
        model = make_model()
        x, y = make_batch()
        if mode == "torch_cpu":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            results[mode] = timings(_torch_step(model, opt, x, y), repeats)[0] * 1e3
            continue
        with torchtpu.eager_mode(mode):
            model = model.to("tpu")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            x, y = x.to("tpu"), y.to("tpu")
            results[mode] = timings(_torch_step(model, opt, x, y), repeats, warmup=3)[0] * 1e3
    return results


def jax_mlp_step(repeats=5):
    """The MLP step as one jax.jit function (forward, backward, AdamW): the
    compiled limit fused mode aims at."""
    torch.manual_seed(0)
    model = mlp()
    params = [jnp.asarray(p.detach().numpy()) for p in model.parameters()]
    x, y = mlp_batch()
    x, y = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())

    def loss_fn(ps):
        w1, b1, w2, b2, w3, b3 = ps
        h = jax.nn.relu(x @ w1.T + b1)
        h = jax.nn.relu(h @ w2.T + b2)
        logits = h @ w3.T + b3
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(y.shape[0]), y])

    # Parameters and optimizer state donated: updated in place, as a
    # hand-written JAX training step does.
    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(ps, m, v, t):
        loss, grads = jax.value_and_grad(loss_fn)(ps)
        lr, b1, b2, eps, wd = 1e-4, 0.9, 0.999, 1e-8, 1e-2
        t = t + 1
        new_p, new_m, new_v = [], [], []
        for p, g, mi, vi in zip(ps, grads, m, v):
            p = p * (1 - lr * wd)
            mi = b1 * mi + (1 - b1) * g
            vi = b2 * vi + (1 - b2) * g * g
            mhat = mi / (1 - b1 ** t)
            vhat = vi / (1 - b2 ** t)
            new_p.append(p - lr * mhat / (jnp.sqrt(vhat) + eps))
            new_m.append(mi)
            new_v.append(vi)
        return new_p, new_m, new_v, t, loss

    state = [params, [jnp.zeros_like(p) for p in params], [jnp.zeros_like(p) for p in params], 0.0]

    def run():
        out = step(*state)
        state[:] = out[:4]
        float(out[4])
    return timings(run, repeats, warmup=2)[0] * 1e3


def training_steps(repeats=5):
    """ms per AdamW training step: MLP and small GPT, each mode side by side."""
    mlp_ms = training_step(mlp, mlp_batch, repeats=repeats)
    mlp_ms["jax_jit"] = jax_mlp_step(repeats=repeats)
    gpt_ms = training_step(TinyGPT, gpt_batch, repeats=repeats)
    gpt_ms["jax_jit"] = float("nan")
    rows = []
    for name, r in (("MLP 784-1024-1024-10, batch 128", mlp_ms),
                    ("GPT 4 layers d256 h4, seq 128, batch 8, vocab 512", gpt_ms)):
        rows.append(dict(r, model=name, speedup=r["strict"] / r["fused"],
                         of_jit=r["fused"] / r["jax_jit"], of_cpu=r["torch_cpu"] / r["fused"]))
    return rows


training_steps.title = ("Training step (AdamW), ms per step, median; fused vs strict vs "
                        "PyTorch CPU eager vs one jax.jit function")
training_steps.columns = [
    ("model", "model", "{}"), ("fused", "fused", "{:.1f}"), ("strict", "strict", "{:.1f}"),
    ("torch_cpu", "PyTorch CPU eager", "{:.1f}"), ("jax_jit", "jax.jit step", "{:.1f}"),
    ("speedup", "strict / fused", "{:.2f}x"), ("of_jit", "fused / jax.jit", "{:.2f}x"),
    ("of_cpu", "CPU eager / fused", "{:.2f}x"),
]
