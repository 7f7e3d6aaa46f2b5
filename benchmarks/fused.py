"""Training-step benchmarks: the models, the same MLP step written as one
jax.jit function (the compiled limit fused mode aims at), the step captured
once and replayed (torch.tpu.graph), and a replayed greedy decode step.

Each figure is the median of several repeats, measured side by side in one
process: torchtpu fused, torchtpu strict, PyTorch CPU eager, jax.jit, and
for replay_steps the replayed graph, the runs alternating (replay_steps'
training steps in blocks ending with a synchronize: loop_ms).
"""
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import torchtpu
from common import alternating_ms, settle, timings
from workloads import (TinyGPT, gpt_batch, loss_step, mlp, mlp_batch,  # noqa: F401
                       step_reading_loss, torch_step_fn)


def step_fn(make_model, make_batch, mode, device="tpu"):
    """One AdamW training step of a fresh model (seeded) as run(): in an
    eager mode ("fused", "strict", "debug"), or PyTorch's own ("torch") on
    device; it ends reading the loss, as a training loop that logs it does."""
    if mode == "torch":
        return torch_step_fn(make_model, make_batch, device)
    torch.manual_seed(0)
    model = make_model()
    x, y = make_batch()
    with torchtpu.eager_mode(mode):
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = step_reading_loss(model, opt, x.to(device), y.to(device))

    def run():
        with torchtpu.eager_mode(mode):
            return step()
    return run


def training_step(make_model, make_batch, repeats=5, modes=("fused", "strict", "torch_cpu")):
    """Median ms per training step (AdamW) per mode."""
    results = {}
    for mode in modes:
        if mode == "torch_cpu":
            run = step_fn(make_model, make_batch, "torch", "cpu")
            results[mode] = timings(run, repeats)[0] * 1e3
            continue
        run = step_fn(make_model, make_batch, mode)
        results[mode] = timings(run, repeats, warmup=3)[0] * 1e3
    return results


def jax_mlp_step(repeats=5):
    """Median ms of the MLP step as one jax.jit function."""
    return timings(jax_mlp_step_fn(), repeats, warmup=2)[0] * 1e3


def jax_mlp_step_fn(make_model=mlp, make_batch=mlp_batch, device=None):
    """The MLP step as one jax.jit function (forward, backward, AdamW), as
    run(): the compiled limit fused mode aims at. device: a JAX device (its
    default one if None)."""
    torch.manual_seed(0)
    model = make_model()
    params = [jax.device_put(p.detach().numpy(), device) for p in model.parameters()]
    x, y = make_batch()
    x, y = jax.device_put(x.numpy(), device), jax.device_put(y.numpy(), device)

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
    return run


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


# ---- graph replay --------------------------------------------------------------

# Steps per timed block. A step that ends reading its loss waits for its
# forward only: its backward and optimizer step may still run when it
# returns (the jax.jit step's loss comes out of its one computation, so it
# waits for all of it). Timing single steps side by side would bill that
# tail to whichever step runs next; a block of steps ends waiting for all
# the work it issued, as a training loop's steady state does.
BLOCK = 3


def loop_ms(fns, repeats, warmup):
    """{name: median ms per step of fns[name]()}, timed in blocks of BLOCK
    steps ending with torch.tpu.synchronize(), the blocks alternating
    between the functions so that all of them see the same machine load."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
        torch.tpu.synchronize()
    settle()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(BLOCK):
                fn()
            torch.tpu.synchronize()
            times[name].append((time.perf_counter() - start) / BLOCK)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}



def _buffers(tensors):
    """The device buffer each tensor's storage holds now."""
    return [t._storage.array.unsafe_buffer_pointer() for t in tensors]


def replayed_step_fn(make_model, make_batch, mode="strict", device="tpu", warmup=3):
    """The AdamW step captured once after warmup eager steps (as CUDA
    scripts do), as run(): g.replay(), then reading the loss. Adam's step
    counts stay on the device (capturable=True), as CUDA graphs need.
    run.state: the parameters and optimizer state (what replay donates)."""
    torch.manual_seed(0)
    model = make_model()
    x, y = make_batch()
    with torchtpu.eager_mode(mode):
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)
        x, y = x.to(device), y.to(device)
        for _ in range(warmup):
            loss_step(model, opt, x, y)
        g = torch.tpu.TPUGraph()
        with torch.tpu.graph(g):
            loss = loss_step(model, opt, x, y)

    def run():
        with torchtpu.eager_mode(mode):
            g.replay()
            return loss.item()
    run.graph = g
    run.state = list(model.parameters()) + [v for s in opt.state.values() for v in s.values()]
    return run


def in_place(run):
    """(how many of run.state a replay of run.graph left in their own device
    buffers, how many there are): donation at work, no copy of them."""
    run.graph.replay()
    before = _buffers(run.state)
    run.graph.replay()
    torchtpu.sync()
    return sum(a == b for a, b in zip(before, _buffers(run.state))), len(run.state)


def tiny_llama():
    """The tiny Llama of the tests (grouped-query attention, RoPE, RMSNorm)."""
    import transformers
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="sdpa")).eval()


DECODE_TOKENS = 16


def decode_fn(device, mode="strict", replay=False):
    """Greedy decoding of DECODE_TOKENS tokens of tiny_llama() with a static
    key/value cache, from position 0, as run() -> the tokens (each read on
    the host after its step, as a loop that checks for the end does). With
    replay, one step is captured (after an eager step that builds the cache:
    made inside the capture it would be made again, empty, by every replay,
    as on CUDA) and each token is one g.replay()."""
    import transformers
    model = tiny_llama().to(device)
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    token = torch.tensor([[3]], device=device)
    pos = torch.tensor([0], device=device)

    def step():
        logits = model(input_ids=token, cache_position=pos, past_key_values=cache).logits
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        token.copy_(next_token)
        pos.add_(1)
        return next_token

    def restart():
        # The cache writes where its own position tensor says (reset zeroes it).
        cache.reset()
        token.fill_(3)
        pos.zero_()

    g = None
    with torch.no_grad(), torchtpu.eager_mode(mode):
        if replay:
            step()
            restart()
            g = torch.tpu.TPUGraph()
            with torch.tpu.graph(g):
                static_next = step()
            step = lambda: (g.replay(), static_next)[1]  # noqa: E731

    def run():
        with torch.no_grad(), torchtpu.eager_mode(mode):
            restart()
            return [int(step()) for _ in range(DECODE_TOKENS)]
    run.graph = g
    run.state = [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]
    return run


def replay_steps(repeats=9):
    """ms per step of the replayed graph beside the eager modes, PyTorch CPU
    eager and the jax.jit MLP step, alternating; and how many parameters and
    optimizer-state tensors (cache tensors for decode) stay in their buffers."""
    rows = []
    for name, make_model, make_batch, n in (
            ("MLP 784-1024-1024-10, batch 128, AdamW", mlp, mlp_batch, 2 * repeats),
            ("GPT 4 layers d256 h4, seq 128, batch 8, AdamW", TinyGPT, gpt_batch, repeats)):
        fns = {"replayed": replayed_step_fn(make_model, make_batch),
               "fused": step_fn(make_model, make_batch, "fused"),
               "strict": step_fn(make_model, make_batch, "strict"),
               "torch_cpu": step_fn(make_model, make_batch, "torch", "cpu")}
        if make_model is mlp:
            fns["jax_jit"] = jax_mlp_step_fn()
        kept = in_place(fns["replayed"])
        ms = loop_ms(fns, n, warmup=3)
        rows.append(dict(ms, step=name, kept=kept))
    fns = {"replayed": decode_fn("tpu", replay=True), "fused": decode_fn("tpu", "fused"),
           "strict": decode_fn("tpu", "strict"), "torch_cpu": decode_fn("cpu")}
    tokens = {name: fn() for name, fn in fns.items()}
    if len({tuple(t) for t in tokens.values()}) != 1:
        raise AssertionError(f"decoded tokens differ: {tokens}")
    kept = in_place(fns["replayed"])
    ms = alternating_ms(fns, repeats, warmup=2)
    rows.append(dict({k: v / DECODE_TOKENS for k, v in ms.items()}, kept=kept,
                     step=f"tiny Llama greedy decode, static cache (per token of {DECODE_TOKENS})"))
    for r in rows:
        r.setdefault("jax_jit", float("nan"))
        r.update(of_jit=r["replayed"] / r["jax_jit"], of_fused=r["fused"] / r["replayed"],
                 of_cpu=r["torch_cpu"] / r["replayed"], kept="%d of %d" % r["kept"])
    return rows


replay_steps.title = ("Graph replay (torch.tpu.graph), ms per step, median (training steps: of "
                      f"blocks of {BLOCK} steps each ending with a synchronize), side by side: "
                      "replayed vs fused vs strict vs PyTorch CPU eager vs one jax.jit function")
replay_steps.columns = [
    ("step", "step", "{}"), ("replayed", "replayed", "{:.2f}"), ("fused", "fused", "{:.2f}"),
    ("strict", "strict", "{:.2f}"), ("torch_cpu", "PyTorch CPU eager", "{:.2f}"),
    ("jax_jit", "jax.jit step", "{:.2f}"), ("of_jit", "replayed / jax.jit", "{:.2f}x"),
    ("of_fused", "fused / replayed", "{:.2f}x"), ("of_cpu", "CPU eager / replayed", "{:.2f}x"),
    ("kept", "state in place", "{}"),
]
