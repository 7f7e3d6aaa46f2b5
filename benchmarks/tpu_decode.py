"""benchmarks/tpu.py's generation rows: Hugging Face generate() on tpu
beside the same decode written in plain JAX.

Models, built from their configs with seeded random weights (nothing is
downloaded), float32 as Hugging Face loads them:
- gpt2: GPT2Config(), GPT-2 small, 124M parameters;
- llama: LlamaConfig(hidden 768, 12 layers, 12 heads, intermediate 2048,
  vocab 32000), 134M parameters.

Greedy generate(): a 32-token prompt, 64 new tokens (no end-of-sequence
token, so every run makes all 64), batch 1 and batch 8, each batch after
one warm-up generation of another prompt of the same length.

Paths (rows MODEL:MODE):
- jax: the reference, the same model in plain JAX from the torch model's
  weights: the prefill one jitted call, then one jitted step a token over
  a preallocated KV cache (the position and the cache writes are data:
  lax.dynamic_update_slice, so no step recompiles), the cache donated,
  greedy argmax on the device; float32 matmuls at HIGHEST precision, as
  torchtpu computes float32 (and CPU does).
- cpu: Hugging Face on PyTorch CPU eager, all host cores: the tokens every
  other row is checked against (it runs whenever a model's rows do).
- strict, fused (TORCHTPU_FUSED_COMPILE=sync: the steady figure is of the
  compiled graphs, as the training rows' fused): torchtpu's eager modes,
  with HF's default dynamic cache; strict_static, fused_static: the same
  with cache_implementation="static". These pass disable_compile=True: on
  a "tpu" device, transformers (5.x) compiles a static-cache decode step
  itself (torch.compile, backend "tpu"), which is the compiled rows' path.
- compiled, compiled_static: HF's documented recipe,
  model.forward = torch.compile(model.forward, backend="tpu") (HF's own
  compile switched off so that it is the only one), in strict mode
  (torchtpu's default) for what runs outside the compiled forward;
  fused_compiled_static: the same in fused mode, where generate()'s own
  ops of a token and the compiled forward's call record one graph.

Columns:
- ms per token: (t64 - t1) / 63, where t64 and t1 are the medians of the
  wall times of generate() with 64 and with 1 new tokens (tokens read back
  to the host): a decode step's cost with HF's per-token work included,
  the prompt's prefill and generate()'s set-up cancelled. The plain-JAX
  row is timed the same way (its 1-token run is the prefill alone).
- first generation, s: the warm-up generation's wall time, compilation
  included.
- ops per token, from torchtpu.metrics' ops_dispatched (views included,
  which launch nothing), and for strict rows that times the per_op row's
  cost of a jitted JAX call (the platform's launch cost), in ms: what the
  launches alone would cost.
- graphs per token (fused: flushes) and compilations of the first
  generation (compiled: and Dynamo's graphs); the JSON has the training
  rows' metrics, syncs per token and the timed runs' compilations too.

With --profile DIR every row but cpu writes a device trace of one timed
64-token generation; its device time is per new token, prefill included.
"""
import os
import statistics
import time

# (compiled last: with the dynamic cache it compiles once per cache length)
MODES = ("jax", "cpu", "strict", "strict_static", "fused", "fused_static", "compiled_static",
         "fused_compiled_static", "compiled")
MODELS = ("gpt2", "llama")
SIZES = {
    False: {"gpt2": {},
            "llama": {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
                      "num_hidden_layers": 12, "num_attention_heads": 12},
            "prompt": 32, "new": 64, "batches": (1, 8), "repeats": 3},
    # Tiny (2 layers, d 64; the Llama with grouped KV heads, which the JAX
    # reference then covers), for --smoke on the CPU platform.
    True: {"gpt2": {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4,
                    "n_positions": 64},
           "llama": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 64},
           "prompt": 8, "new": 8, "batches": (1, 2), "repeats": 3},
}
METRICS = ("compilations", "compile_seconds", "graphs_compiled", "fused_ops_mean", "graph_pieces",
           "graphs_split", "ops_dispatched", "run_while_compiling", "donated_inputs")


def hf_model(name, smoke):
    """The Hugging Face model, seeded, in eval mode, on CPU; generation
    never stops at an end-of-sequence token (every run makes its tokens)."""
    import torch
    import transformers
    torch.manual_seed(0)
    size = dict(SIZES[smoke][name])
    if smoke:  # (the configs' default token ids lie outside the tiny vocabularies)
        size.update(bos_token_id=0, eos_token_id=0)
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**size))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**size))
    model.generation_config.eos_token_id = None
    return model.eval()


def prompts(model, batch, smoke):
    """(prompt, warm-up prompt): int64 token ids, the same in every process."""
    import torch
    g = torch.Generator().manual_seed(1000 + batch)
    shape = (batch, SIZES[smoke]["prompt"])
    return tuple(torch.randint(0, model.config.vocab_size, shape, generator=g) for _ in range(2))


# ---- plain JAX --------------------------------------------------------------------

def _jax_forward(name, config):
    """forward(p, ks, vs, tokens, pos) -> (ks, vs, next tokens, pos + t):
    the model on tokens [b, t] at positions pos.., writing their keys and
    values into the caches [layers, b, kv heads, length, head dim] and
    attending to the cache's first pos + t entries; greedy argmax of the
    last position's logits."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    hi = lax.Precision.HIGHEST
    if name == "gpt2":
        layers, heads, d = config.n_layer, config.n_head, config.n_embd
        kv_heads, eps = heads, config.layer_norm_epsilon
    else:
        layers, heads, d = config.num_hidden_layers, config.num_attention_heads, config.hidden_size
        kv_heads, eps = config.num_key_value_heads, config.rms_norm_eps
    hd = d // heads

    def mm(a, w):
        return jnp.matmul(a, w, precision=hi)

    def split(x, n):  # [b, t, n * hd] -> [b, n, t, hd]
        return x.reshape(*x.shape[:2], n, hd).transpose(0, 2, 1, 3)

    def attend(i, ks, vs, q, k, v, pos):
        at = tuple(jnp.asarray(x, pos.dtype) for x in (i, 0, 0, pos, 0))  # (one index type)
        ks = lax.dynamic_update_slice(ks, k[None], at)
        vs = lax.dynamic_update_slice(vs, v[None], at)
        keys = jnp.repeat(ks[i], heads // kv_heads, axis=1)
        values = jnp.repeat(vs[i], heads // kv_heads, axis=1)
        s = jnp.einsum("bhqd,bhkd->bhqk", q, keys, precision=hi) * hd ** -0.5
        t, length = q.shape[2], keys.shape[2]
        seen = jnp.arange(length)[None, :] <= (pos + jnp.arange(t))[:, None]
        w = jax.nn.softmax(jnp.where(seen, s, -jnp.inf), axis=-1)
        o = jnp.einsum("bhqk,bhkd->bhqd", w, values, precision=hi)
        return ks, vs, o.transpose(0, 2, 1, 3).reshape(*q.shape[:1], t, d)

    def layer_norm(p, name, h):
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        return (h - mean) * lax.rsqrt(var + eps) * p[name + ".weight"] + p[name + ".bias"]

    def rms_norm(p, name, h):
        return p[name] * (h * lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + eps))

    def gpt2(p, ks, vs, tokens, pos):
        positions = pos + jnp.arange(tokens.shape[1])
        h = p["transformer.wte.weight"][tokens] + p["transformer.wpe.weight"][positions]
        for i in range(layers):
            pre = f"transformer.h.{i}."
            x = layer_norm(p, pre + "ln_1", h)
            # Conv1D: x @ weight, the weight [in, out]
            q, k, v = jnp.split(mm(x, p[pre + "attn.c_attn.weight"]) + p[pre + "attn.c_attn.bias"], 3, -1)
            ks, vs, o = attend(i, ks, vs, split(q, heads), split(k, heads), split(v, heads), pos)
            h = h + mm(o, p[pre + "attn.c_proj.weight"]) + p[pre + "attn.c_proj.bias"]
            x = layer_norm(p, pre + "ln_2", h)
            x = jax.nn.gelu(mm(x, p[pre + "mlp.c_fc.weight"]) + p[pre + "mlp.c_fc.bias"], approximate=True)
            h = h + mm(x, p[pre + "mlp.c_proj.weight"]) + p[pre + "mlp.c_proj.bias"]
        h = layer_norm(p, "transformer.ln_f", h[:, -1])
        return ks, vs, mm(h, p["lm_head.weight"].T)

    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    def llama(p, ks, vs, tokens, pos):
        positions = (pos + jnp.arange(tokens.shape[1])).astype(jnp.float32)
        freqs = positions[:, None] * p["model.rotary_emb.inv_freq"][None, :]
        emb = jnp.concatenate([freqs, freqs], -1)
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        h = p["model.embed_tokens.weight"][tokens]
        for i in range(layers):
            pre = f"model.layers.{i}."
            x = rms_norm(p, pre + "input_layernorm.weight", h)
            q, k, v = (split(mm(x, p[f"{pre}self_attn.{n}_proj.weight"].T), m)
                       for n, m in (("q", heads), ("k", kv_heads), ("v", kv_heads)))
            ks, vs, o = attend(i, ks, vs, rope(q, cos, sin), rope(k, cos, sin), v, pos)
            h = h + mm(o, p[pre + "self_attn.o_proj.weight"].T)
            x = rms_norm(p, pre + "post_attention_layernorm.weight", h)
            x = jax.nn.silu(mm(x, p[pre + "mlp.gate_proj.weight"].T)) * mm(x, p[pre + "mlp.up_proj.weight"].T)
            h = h + mm(x, p[pre + "mlp.down_proj.weight"].T)
        h = rms_norm(p, "model.norm.weight", h[:, -1])
        return ks, vs, mm(h, p["lm_head.weight"].T)

    body = gpt2 if name == "gpt2" else llama

    def forward(p, ks, vs, tokens, pos):
        ks, vs, logits = body(p, ks, vs, tokens, pos)
        return ks, vs, jnp.argmax(logits, axis=-1).astype(tokens.dtype), pos + tokens.shape[1]
    return forward, (layers, kv_heads, hd)


def jax_generator(model, name, smoke):
    """generate(prompt, n) -> the prompt and n greedy tokens (a CPU int64
    tensor, as HF's): plain JAX from the model's weights."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    forward, (layers, kv_heads, hd) = _jax_forward(name, model.config)
    # The weights and the buffers (Llama's rotary inv_freq is not in the
    # state dict), as the torch model holds them.
    weights = dict(model.state_dict(), **dict(model.named_buffers()))
    p = {k: jnp.asarray(v.detach().numpy()) for k, v in weights.items()}
    # One program for the prefill and one for every decode step: the
    # positions are data, the cache is donated and written in place.
    step = jax.jit(forward, donate_argnums=(1, 2))
    length = SIZES[smoke]["prompt"] + SIZES[smoke]["new"]

    def generate(prompt, n):
        ids = jnp.asarray(prompt.numpy().astype(np.int32))
        shape = (layers, ids.shape[0], kv_heads, length, hd)
        ks, vs = jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)
        ks, vs, token, pos = step(p, ks, vs, ids, jnp.int32(0))
        out = [token]
        for _ in range(n - 1):
            ks, vs, token, pos = step(p, ks, vs, token[:, None], pos)
            out.append(token)
        new = np.asarray(jnp.stack(out, 1)).astype(np.int64)
        return torch.cat([prompt, torch.from_numpy(new)], 1)
    return generate


# ---- Hugging Face generate() ------------------------------------------------------

def eager_mode(mode):
    """The eager mode a torchtpu row runs in: the row's first word, strict
    for the compiled rows that do not name one."""
    return "fused" if mode.startswith("fused") else "strict"


def is_compiled(mode):
    return "compiled" in mode


def hf_generator(model, mode):
    """generate(prompt, n) -> HF's greedy tokens (on CPU) of the row's path."""
    import torch
    kw = {"do_sample": False}
    if mode.endswith("_static"):
        kw["cache_implementation"] = "static"
    device = "cpu"
    if mode != "cpu":
        import torchtpu
        torchtpu.set_eager_mode(eager_mode(mode))
        model = model.to("tpu")
        device = "tpu"
        # The eager rows measure the eager modes; the compiled rows' one
        # compile is theirs (see the module's docstring).
        kw["disable_compile"] = True
        if is_compiled(mode):
            model.forward = torch.compile(model.forward, backend="tpu")

    def generate(prompt, n):
        return model.generate(prompt.to(device), max_new_tokens=n, **kw).cpu()
    return generate


# ---- measuring (in tpu.py's child process) ---------------------------------------------

def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def _measure_batch(generate, mode, batch, model, smoke, profile, profile_dir):
    import torch
    from common import settle
    size = SIZES[smoke]
    # CPU's figure is context, its tokens the reference: one timed pair
    # (seconds each at full size).
    new, repeats = size["new"], 1 if mode == "cpu" and not smoke else size["repeats"]
    prompt, warm = prompts(model, batch, smoke)
    compiled = is_compiled(mode)
    if compiled:
        from torch._dynamo.utils import counters
        torch._dynamo.reset()  # each batch's own graphs (and recompile limit)
        graphs_before = counters["stats"]["unique_graphs"]  # (a count reset() keeps)
    metrics = None
    if mode not in ("jax", "cpu"):
        import torchtpu
        metrics = torchtpu.metrics
    if metrics:
        metrics.reset()
    first, _ = _timed(generate, warm, new)
    if compiled:
        # Dynamo runs the call it compiles a graph at as eager code: with
        # the dynamic cache, the cache length met there compiles its
        # program when met again.
        generate(warm, new)
    generate(warm, 1)  # (transformers before 5 size a static cache by the call's length)
    settle()
    row = {"first_generation_s": first}
    if metrics:
        snap = metrics.snapshot()
        row["metrics"] = {k: snap.get(k) for k in METRICS}
        if compiled:
            row["metrics"]["dynamo_graphs"] = counters["stats"]["unique_graphs"] - graphs_before
    long_times, short_times, counts = [], [], []
    for _ in range(repeats):
        for n, times in ((new, long_times), (1, short_times)):
            if metrics:
                metrics.reset()
            seconds, out = _timed(generate, prompt, n)
            times.append(seconds)
            if n == new and "tokens" not in row:
                row["tokens"] = out.tolist()
            if metrics:
                snap = metrics.snapshot()
                counts.append((n, snap["ops_dispatched"], snap["syncs"], snap["compilations"],
                               sum(snap.get("flushes", {}).values())))
    t_long, t_short = statistics.median(long_times), statistics.median(short_times)
    row.update(ms=(t_long - t_short) / (new - 1) * 1e3, generation_s=t_long, prefill_s=t_short)
    if metrics:
        (_, ops_l, syncs_l, _, flushes_l), (_, ops_s, syncs_s, _, flushes_s) = counts[:2]
        row.update(ops_per_token=(ops_l - ops_s) / (new - 1), syncs_per_token=(syncs_l - syncs_s) / (new - 1),
                   graphs_per_token=(flushes_l - flushes_s) / (new - 1),
                   steady_compilations=sum(c[3] for c in counts))
    if profile_dir:
        directory = os.path.join(profile_dir, f"{model.config.model_type}-{mode}-b{batch}")
        row["profile"] = profile(lambda: generate(prompt, new), directory, warm=0, calls=1, per=new)
    return row


def measure(spec, profile):
    """{"batches": {batch: row}} of the spec's model and mode; each batch
    after the other in this process (a batch's error is its row). Outside
    a smoke run each finished batch is also printed as a PARTIAL line, so
    that a child killed at its timeout still gives the batches it did."""
    import json
    import torch
    name, mode, smoke = spec["model"], spec["mode"], spec["smoke"]
    if mode.startswith("fused"):
        os.environ["TORCHTPU_FUSED_COMPILE"] = "sync"
    if mode == "cpu":
        torch.set_num_threads(1 if smoke else os.cpu_count())  # (smoke: the fastest for tiny models)
    model = hf_model(name, smoke)
    generate = jax_generator(model, name, smoke) if mode == "jax" else hf_generator(model, mode)
    result = {"batches": {}}
    for batch in spec.get("batches") or SIZES[smoke]["batches"]:
        try:
            row = _measure_batch(generate, mode, batch, model, smoke, profile, spec.get("profile"))
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {e}"[:400]}
        result["batches"][str(batch)] = row
        if not smoke:
            print("PARTIAL " + json.dumps(result), flush=True)
    return result


# ---- the parent: checks and the table ------------------------------------------------------

def check_tokens(decode, smoke):
    """Each row's tokens_equal: its tokens against CPU eager's, per batch:
    True, or the index of the first new token that differs (None without
    CPU's)."""
    prompt = SIZES[smoke]["prompt"]
    for model, rows in decode.items():
        cpu = rows.get("cpu", {}).get("batches", {})
        for mode, result in rows.items():
            for batch, row in result.get("batches", {}).items():
                want = cpu.get(batch, {}).get("tokens")
                if mode == "cpu" or "tokens" not in row:
                    continue
                if want is None:
                    row["tokens_equal"] = None
                elif row["tokens"] == want:
                    row["tokens_equal"] = True
                else:
                    row["tokens_equal"] = max(first_difference(row["tokens"], want) - prompt, 0)


def first_difference(got, want):
    """The first column (token position) where two [batch][length] token
    lists differ."""
    for j in range(max(len(g) for g in got + want)):
        if len(got) != len(want) or any(g[j:j + 1] != w[j:j + 1] for g, w in zip(got, want)):
            return j
    return len(got[0])


def table(decode, per_op, smoke):
    launch_us = (per_op or {}).get("jax_call")
    size = SIZES[smoke]
    lines = [f"Greedy generate(): prompts of {size['prompt']} tokens, {size['new']} new tokens.", "",
             "| model | batch | path | ms per token | × plain JAX | first generation, s | tokens equal CPU's "
             "| ops per token | launch × ops, ms | graphs per token | compilations (first) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, rows in decode.items():
        ref = {b: r.get("ms") for b, r in rows.get("jax", {}).get("batches", {}).items()}
        batches = sorted({b for r in rows.values() for b in r.get("batches", {})}, key=int)
        for batch in batches:
            for mode, result in rows.items():
                if "error" in result:
                    if batch == batches[0]:
                        lines.append(f"| {model} | — | {mode} | error: {result['error'][:200]} |")
                    continue
                r = result["batches"].get(batch)
                if r is None:
                    continue
                if "error" in r:
                    lines.append(f"| {model} | {batch} | {mode} | error: {r['error'][:200]} |")
                    continue
                equal = r.get("tokens_equal")
                equal = ("(reference)" if mode == "cpu" else "—" if equal is None
                         else "yes" if equal is True else f"no, from new token {equal}")
                ops = r.get("ops_per_token")
                launches = (f"{launch_us * ops / 1e3:.2f}" if launch_us and ops is not None
                            and mode.startswith("strict") else "—")
                metrics = r.get("metrics") or {}
                graphs = f"{r['graphs_per_token']:.1f}" if mode.startswith("fused") else "—"
                compilations = f"{metrics['compilations']}" if "compilations" in metrics else "—"
                if "dynamo_graphs" in metrics:
                    compilations += f" ({metrics['dynamo_graphs']} Dynamo graphs)"
                ratio = f"{r['ms'] / ref[batch]:.2f}x" if ref.get(batch) else "—"
                lines.append(
                    f"| {model} | {batch} | {mode} | {r['ms']:.2f} | {ratio} | {r['first_generation_s']:.1f} "
                    f"| {equal} | " + (f"{ops:.0f}" if ops is not None else "—")
                    + f" | {launches} | {graphs} | {compilations} |")
    return lines
