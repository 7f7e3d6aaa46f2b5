"""torchtpu on a TPU beside the same models written in plain JAX: one script
sized for a 10-minute run on one chip (a TPU v5e).

Models, each trained with AdamW (float32 parameters and state):
- gpt: a GPT of 118M parameters (d1024, 8 layers, 16 heads, seq 512,
  batch 8, vocab 8192) of nn.Linear, nn.LayerNorm and
  F.scaled_dot_product_attention(is_causal=True), under
  torch.autocast(dtype=torch.bfloat16);
- mlp: the MLP 784-1024-1024-10, batch 128, float32.

Each model is also written in plain JAX (the same shapes, the same mixed
precision: bf16 matmuls and attention through jax.nn.dot_product_attention,
float32 layer norms, loss and AdamW), the whole step one donating jax.jit:
the reference row. torchtpu's rows: strict, fused (steady: its graphs
compiled, TORCHTPU_FUSED_COMPILE=sync), fused as a user runs it (default
tiered compilation: the time to the first steps), replayed
(torch.tpu.graph) and compiled (torch.compile(backend="tpu")). Each row
gives ms per step (median), MFU against the chip's peak, the wall time of
its first steps (compiles included) and its first losses; per_op gives
torchtpu's cost per op beside a jitted JAX add's cost per call, on the
same host.

Warm-start rows (MODEL:jax_warm, fused_warm, compiled_warm, strict_warm;
MODEL:warm for all four; not among the default rows): how soon a second
process on the same disk cache reaches its steady step. Each runs the step
in a process on a fresh cache directory (cold), then in a second process on
the same directory (warm): fused as a user runs it (tiered compilation),
strict, compiled, and plain JAX on JAX's own persistent compilation cache
(the reference). Each process opens the device (jax.devices(), after
importing torch and JAX), builds the model, runs its first steps, waits for
the graphs compiling in the background (so that the cold one's are on disk
when it exits), then runs the later steps. Per process: seconds from its
start to opening the device, from there to its first step done and to its
first steady step (a step within 1.2x of the median of the later steps),
its compilations (torchtpu: metrics "compilations" plus the background
ones, with graphs_compiled beside them; JAX: compiles less cache hits) and
its disk cache hits. The table gives the cold process's seconds to steady
and compilations beside the warm one's figures; a warm row runs two
processes, each with the timeout (a smoke run too).

Generation (benchmarks/tpu_decode.py, whose docstring defines its rows
and columns): rows gpt2:MODE and llama:MODE, Hugging Face generate() of
GPT-2 small and a Llama of the same size on torchtpu (strict, fused,
torch.compile; dynamic and static cache), batch 1 and 8, beside the same
decode in plain JAX (jax) and HF on CPU eager (cpu, whose tokens every
row is checked against: it runs whenever a model's rows do).

Each figure comes from its own process with a timeout (one process holds
the chip at a time; a smoke run's all come from one); a failure or a
timeout is a row saying so. With
--profile DIR, the steady rows also write a device trace of a few steps
(jax.profiler) and the table of their device ops by time.

    python benchmarks/tpu.py                        # the training rows
    python benchmarks/tpu.py --rows gpt:jax,gpt:fused --profile $OUT
    python benchmarks/tpu.py --rows per_op,gpt2     # GPT-2's generation rows
    python benchmarks/tpu.py --rows decode          # per_op and every generation row
    python benchmarks/tpu.py --rows gpt:warm        # the GPT's warm-start rows
    python benchmarks/tpu.py --smoke                # tiny sizes on the CPU platform
"""
import argparse
import collections
import functools
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

import tpu_decode  # this script's generation rows (its folder is sys.path[0])

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SIZES = {
    False: {"gpt": {"vocab": 8192, "d": 1024, "heads": 16, "layers": 8, "seq": 512, "batch": 8},
            "mlp": {"sizes": (784, 1024, 1024, 10), "batch": 128},
            "per_op": {"n_ops": 1000, "size": 128, "repeats": 7},
            "steps": {"gpt": (10, 10), "mlp": (10, 30)},   # (first steps, timed steps)
            "warm_steps": {"gpt": (10, 10), "mlp": (10, 30)}},  # (first steps, later steps)
    True: {"gpt": {"vocab": 64, "d": 32, "heads": 2, "layers": 2, "seq": 16, "batch": 2},
           "mlp": {"sizes": (16, 32, 32, 4), "batch": 8},
           "per_op": {"n_ops": 20, "size": 8, "repeats": 2},
           "steps": {"gpt": (3, 2), "mlp": (3, 2)},
           "warm_steps": {"gpt": (3, 7), "mlp": (3, 7)}},
}
# bf16 matmul peak, FLOP/s, by JAX's device_kind.
PEAK = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12, "TPU v5p": 459e12,
        "TPU v6 lite": 918e12}
MODES = ("jax", "fused", "fused_default", "replayed", "compiled", "strict")
# Warm-start rows, MODEL:MODE_warm (MODEL:warm: all four): fused as a user
# runs it (tiered compilation), strict, compiled; jax on JAX's own cache.
WARM_MODES = ("jax", "fused", "compiled", "strict")
SETUP_STAMPS = ("torchtpu_imported", "built", "uploaded", "optimizer_made")
STEADY = 1.2  # a steady step: within this of the median of the later steps
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 1e-2


# ---- the models ----------------------------------------------------------------

def torch_gpt(vocab, d, heads, layers, seq):
    import torch
    import torch.nn.functional as F
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, h):
            b, t, _ = h.shape
            q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens):
            h = self.embed(tokens) + self.pos
            for block in self.blocks:
                h = block(h)
            return self.head(self.ln(h))
    return GPT()


def gpt_flops(vocab, d, heads, layers, seq, batch):
    """Matmul FLOPs of a training step (forward and backward: 3x forward)."""
    tokens = batch * seq
    linear = 2 * tokens * (12 * d * d * layers + d * vocab)
    attention = 2 * 2 * batch * seq * seq * d * layers
    return 3 * (linear + attention)


def mlp_flops(sizes, batch):
    return 3 * 2 * batch * sum(a * b for a, b in zip(sizes, sizes[1:]))


def _model_and_batch(model, smoke):
    import torch
    sys.path[:0] = [ROOT, HERE]
    import workloads
    size = dict(SIZES[smoke][model])
    batch = size.pop("batch")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if model == "mlp":
        net = workloads.mlp(size["sizes"])
        x, y = workloads.mlp_batch(batch, size["sizes"][0], size["sizes"][-1])
        return net, x, y, mlp_flops(size["sizes"], batch), False
    net = torch_gpt(**size)
    tokens = torch.randint(0, size["vocab"], (batch, size["seq"] + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous()
    return net, x, y, gpt_flops(batch=batch, **size), True


# ---- plain JAX ------------------------------------------------------------------

def _jax_params(net):
    import jax.numpy as jnp
    return {k: jnp.asarray(v.detach().numpy()) for k, v in net.state_dict().items()}


def _jax_loss_fn(model, smoke):
    """loss(params, x, y) of the model in plain JAX, the mixed precision
    autocast gives the torch model (bf16 matmuls, float32 norms and loss)."""
    import jax
    import jax.numpy as jnp
    bf16, f32 = jnp.bfloat16, jnp.float32

    def cross_entropy(logits, y):
        logp = jax.nn.log_softmax(logits.astype(f32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))

    if model == "mlp":
        def loss(p, x, y):
            h = jax.nn.relu(x @ p["0.weight"].T + p["0.bias"])
            h = jax.nn.relu(h @ p["2.weight"].T + p["2.bias"])
            return cross_entropy(h @ p["4.weight"].T + p["4.bias"], y)
        return loss
    size = SIZES[smoke]["gpt"]
    d, heads = size["d"], size["heads"]

    def dense(p, name, a):
        return (jnp.matmul(a.astype(bf16), p[name + ".weight"].astype(bf16).T,
                           preferred_element_type=f32).astype(bf16) + p[name + ".bias"].astype(bf16))

    def norm(p, name, h):
        h = h.astype(f32)
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + 1e-5) * p[name + ".weight"] + p[name + ".bias"]

    def loss(p, x, y):
        b, t = x.shape
        h = p["embed.weight"][x] + p["pos"]
        for i in range(size["layers"]):
            pre = f"blocks.{i}."
            qkv = dense(p, pre + "qkv", norm(p, pre + "ln1", h)).reshape(b, t, 3, heads, d // heads)
            a = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
            h = h + dense(p, pre + "proj", a.reshape(b, t, d))
            f = jax.nn.gelu(dense(p, pre + "fc1", norm(p, pre + "ln2", h)), approximate=False)
            h = h + dense(p, pre + "fc2", f)
        return cross_entropy(dense(p, "head", norm(p, "ln", h)).reshape(b * t, -1), y)
    return loss


def _jax_step_fn(model, smoke):
    """run() -> loss: the step as one donating jax.jit (AdamW as torch's)."""
    import jax
    import jax.numpy as jnp
    net, x, y, flops, _ = _model_and_batch(model, smoke)
    params = _jax_params(net)
    x, y = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    loss_fn = _jax_loss_fn(model, smoke)
    b1, b2 = BETAS

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(p, m, v, t, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        t = t + 1
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        m = jax.tree.map(lambda mi, gi: b1 * mi + (1 - b1) * gi, m, g)
        v = jax.tree.map(lambda vi, gi: b2 * vi + (1 - b2) * gi * gi, v, g)
        p = jax.tree.map(lambda pi, mi, vi: pi * (1 - LR * WD) - (LR / c1) * mi / (jnp.sqrt(vi) / jnp.sqrt(c2) + EPS),
                         p, m, v)
        return p, m, v, t, loss

    zeros = functools.partial(jax.tree.map, jnp.zeros_like)
    state = [params, zeros(params), zeros(params), jnp.float32(0)]

    def run():
        *new, loss = step(*state, x, y)
        state[:] = new
        return float(loss)
    return run, flops


# ---- torchtpu -------------------------------------------------------------------

def _tpu_step_fn(model, mode, smoke, stamps=None):
    """run() -> loss of a torchtpu row: an eager mode's step, the step
    captured once and replayed, or torch.compile's. stamps: a dict given
    the wall clock as each part of the set-up ends (torchtpu imported, the
    model built on the host, uploaded, the optimizer made)."""
    import torch
    import torch.nn.functional as F
    import torchtpu
    stamps = {} if stamps is None else stamps
    stamps["torchtpu_imported"] = time.time()
    net, x, y, flops, autocast = _model_and_batch(model, smoke)
    stamps["built"] = time.time()
    # The mode for the whole process, as a script sets it (leaving a
    # `with torchtpu.eager_mode(...)` block each step would be a sync point).
    torchtpu.set_eager_mode("strict" if mode in ("replayed", "compiled") else mode)
    net = net.to("tpu")
    x, y = x.to("tpu"), y.to("tpu")
    torchtpu.sync()
    stamps["uploaded"] = time.time()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            capturable=mode in ("replayed", "compiled"))
    stamps["optimizer_made"] = time.time()

    def loss_of(x, y):
        with torch.autocast("tpu", dtype=torch.bfloat16, enabled=autocast):
            out = net(x)
        return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y)

    if mode == "compiled":
        loss_of = torch.compile(loss_of, backend="tpu", dynamic=False)
        opt_step = torch.compile(opt.step, backend="tpu", dynamic=False)
    else:
        opt_step = opt.step

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_of(x, y)
        loss.backward()
        opt_step()
        return loss

    if mode == "replayed":
        graph, captured = [], []

        def run():
            if graph:
                graph[0].replay()
                return captured[0].item()
            loss = step().item()
            if run.steps == 2:  # captured after two eager steps, as CUDA scripts do
                graph.append(torch.tpu.TPUGraph())
                with torch.tpu.graph(graph[0]):
                    captured.append(step())
            run.steps += 1
            return loss
        run.steps = 0
        return run, flops

    def run():
        return step().item()
    return run, flops


# ---- measuring (in a child process) ------------------------------------------------

def _measure_step(model, mode, smoke, profile):
    import jax
    from common import timings
    first_n, timed = SIZES[smoke]["steps"][model]
    if mode == "fused":
        os.environ["TORCHTPU_FUSED_COMPILE"] = "sync"
    if mode == "jax":
        run, flops = _jax_step_fn(model, smoke)
    else:
        run, flops = _tpu_step_fn(model, "fused" if mode == "fused_default" else mode, smoke)
    start = time.perf_counter()
    losses, first = [], []
    for _ in range(first_n):
        losses.append(run())
        first.append(time.perf_counter() - start)
    median, best = timings(run, timed, warmup=0)  # (after the graphs compiling in the background)
    ms = median * 1e3
    kind = jax.devices()[0].device_kind
    result = {"ms": ms, "best_ms": best * 1e3, "first_steps_s": first, "losses": losses,
              "gflop": flops / 1e9, "mfu": flops / (ms / 1e3) / PEAK[kind] if kind in PEAK else None}
    if mode != "jax":
        import torchtpu
        snap = torchtpu.metrics.snapshot()
        result["metrics"] = {k: snap.get(k) for k in (
            "compilations", "compile_seconds", "graphs_compiled", "fused_ops_mean", "graph_pieces",
            "graphs_split", "ops_dispatched", "run_while_compiling", "donated_inputs")}
    if profile:
        result["profile"] = _profile(run, os.path.join(profile, f"{model}-{mode}"))
    return result


def _profile(run, directory, warm=2, calls=3, per=3):
    """A device trace of `calls` runs after `warm` more, and its device ops
    by time, per `per` (a step; a generation's tokens)."""
    import jax
    for _ in range(warm):
        run()
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(calls):
            run()
    found = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
    if not found:
        return {"error": "no perfetto trace written"}
    return device_ops(found[0], steps=per)


def device_ops(path, steps=1, top=25):
    """{lane: ms per step}, and the top device ops (by name less its
    numbering) by ms per step, from a perfetto trace JAX wrote."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    devices = {pid for pid, name in processes.items() if "TPU:" in name or "GPU:" in name}
    lanes, ops, counts = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in devices:
            continue
        lane = threads.get((e["pid"], e.get("tid")), "?")
        lanes[lane] += e.get("dur", 0) / 1e3 / steps
        if "Ops" in lane:
            name = e["name"].rstrip("0123456789").rstrip(".")
            ops[name] += e.get("dur", 0) / 1e3 / steps
            counts[name] += 1
    return {"lanes": {k: round(v, 3) for k, v in lanes.items()},
            "ops": [[name, round(ms, 3), counts[name] // steps] for name, ms in ops.most_common(top)],
            "modules": [[e["name"], round(e.get("dur", 0) / 1e3, 3)] for e in events
                        if e.get("ph") == "X" and e.get("pid") in devices
                        and "Modules" in threads.get((e["pid"], e.get("tid")), "")][:40]}


def _measure_start(model, mode, smoke):
    """One process of a warm-start row: open the device, build the model,
    run its steps (the first ones; once the graphs compiling in the
    background are done, the later ones), with the wall clock at each
    milestone and what was compiled or loaded from the disk cache
    (TORCHTPU_CACHE_DIR; the jax row: JAX's own persistent cache in it)."""
    import jax
    import torch  # noqa: F401
    stamps = {"imported": time.time()}
    jax.devices()  # (opens the device: torchtpu's import would)
    stamps["opened"] = time.time()
    counts = collections.Counter()
    if mode == "jax":
        jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ["TORCHTPU_CACHE_DIR"], "jax"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        # JAX times each compile-or-load; a cache hit loaded one.
        jax.monitoring.register_event_listener(lambda event, **_: counts.update([event]))
        jax.monitoring.register_event_duration_secs_listener(lambda event, _, **__: counts.update([event]))
        run, _ = _jax_step_fn(model, smoke)
    else:
        run, _ = _tpu_step_fn(model, mode, smoke, stamps)
    first_n, later = SIZES[smoke]["warm_steps"][model]
    step_s, done, losses = [], [], []
    for i in range(first_n + later):
        if i == first_n and mode != "jax":
            import torchtpu
            torchtpu.wait_for_compiles()  # (a cold run's graphs on disk before it exits)
        start = time.perf_counter()
        losses.append(run())
        step_s.append(time.perf_counter() - start)
        done.append(time.time())
    steady, median = first_steady(step_s, later)
    result = {**stamps, "done": done, "step_s": step_s, "steady_step": steady, "ms": median * 1e3,
              "losses": losses}
    if mode == "jax":
        hits = counts["/jax/compilation_cache/cache_hits"]
        result.update(compilations=counts["/jax/core/compile/backend_compile_duration"] - hits,
                      disk_hits=hits)
    else:
        import torchtpu
        snap, stats = torchtpu.metrics.snapshot(), torchtpu.cache.stats()
        result.update(compilations=snap["compilations"], background_compiles=snap["background_compiles"],
                      graphs_compiled=snap.get("graphs_compiled", 0), graph_pieces=snap.get("graph_pieces", 0),
                      disk_hits=stats["disk_hits"],
                      programs_loaded=stats["programs_loaded"], kernels_loaded=stats["kernels_loaded"])
    return result


def first_steady(step_s, later):
    """(the index of the first steady step, the median of the later steps):
    a step is steady within STEADY times the median of the last `later`."""
    import statistics
    median = statistics.median(step_s[-later:])
    return next(i for i, s in enumerate(step_s) if s <= STEADY * median), median


def _warm_start(spec, timeout):
    """A warm-start row: the step in a process on a fresh cache directory
    (cold), then in a second one on the same directory (warm); each
    process's seconds from its start to opening the device, from there to
    its first step done and to its first steady step, its compilations and
    disk hits."""
    mode = spec["mode"][:-len("_warm")]
    row = {}
    with tempfile.TemporaryDirectory(prefix="torchtpu-tpu-bench-warm-") as cache_dir:
        for state in ("cold", "warm"):
            launched = time.time()
            r = run_child(dict(spec, what="start", mode=mode), timeout, cache_dir)
            if "error" in r:
                return dict(row, error=f"{state} process: {r['error']}", stderr=r.get("stderr", ""))
            opened = r.pop("opened")
            done = r["done_s"] = [t - opened for t in r.pop("done")]
            # The set-up's parts, as seconds from opening the device (torchtpu rows).
            r["setup_s"] = {k: r.pop(k) - opened for k in SETUP_STAMPS if k in r}
            r.update(to_device_s=opened - launched, import_s=r.pop("imported") - launched,
                     first_step_s=done[0], steady_s=done[r["steady_step"]],
                     compiled=r["compilations"] + r.get("background_compiles", 0))
            row[state] = r
    row["ms"], row["losses"] = row["warm"]["ms"], row["warm"]["losses"]
    return row


def _measure_per_op(smoke):
    """µs per op of `c = c + y` in torchtpu's modes; a jitted JAX add's µs
    per call (the platform's launch floor) and per add inside one jit."""
    import jax
    import jax.numpy as jnp
    import torch
    import torchtpu
    from common import timings
    size = SIZES[smoke]["per_op"]
    n, repeats = size["n_ops"], size["repeats"]

    def per(fn):
        return timings(fn, repeats)[0] / n * 1e6

    y = jnp.ones((size["size"],) * 2, jnp.float32)
    add = jax.jit(lambda c, y: c + y)

    def jax_calls():
        c = jnp.zeros_like(y)
        for _ in range(n):
            c = add(c, y)
        c.block_until_ready()

    @jax.jit
    def adds(c, y):
        for _ in range(n):
            c = c + y
        return c
    rows = {"jax_call": per(jax_calls), "jax_in_jit": per(lambda: adds(y * 0, y).block_until_ready())}
    yt = torch.ones(size["size"], size["size"]).to("tpu")
    for mode in ("strict", "fused", "debug"):
        def loop():
            with torchtpu.eager_mode(mode):
                c = torch.zeros_like(yt)
                for _ in range(n):
                    c = c + yt
                torchtpu.sync()
                torch.tpu.synchronize()
        rows[mode] = per(loop)
    return rows


def _environment():
    import jax
    import torch
    import torchtpu
    try:
        import transformers
        hf = transformers.__version__
    except ImportError:
        hf = None
    return {"torch": torch.__version__, "jax": jax.__version__, "transformers": hf,
            "platform": torchtpu.runtime.PLATFORM,
            "device_kind": jax.devices()[0].device_kind, "host_cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d")}


def _cpu_losses(model, smoke):
    """The first steps' losses of the torch model on CPU (autocast bf16 for the GPT)."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(os.cpu_count())
    net, x, y, _, autocast = _model_and_batch(model, smoke)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for _ in range(SIZES[smoke]["steps"][model][0]):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = net(x)
        loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses}


def child(spec):
    sys.path[:0] = [ROOT, HERE]
    if isinstance(spec, list):
        return _children_in_one(spec)
    what = spec["what"]
    if what == "env":
        return _environment()
    if what == "per_op":
        return _measure_per_op(spec["smoke"])
    if what == "cpu":
        return _cpu_losses(spec["model"], spec["smoke"])
    if what == "decode":
        return tpu_decode.measure(spec, _profile)
    if what == "start":
        return _measure_start(spec["model"], spec["mode"], spec["smoke"])
    return _measure_step(spec["model"], spec["mode"], spec["smoke"], spec.get("profile"))


def _children_in_one(specs):
    """A smoke run's figures, one after another in this process."""
    import torchtpu
    from common import in_one_process

    def reset():
        os.environ.pop("TORCHTPU_FUSED_COMPILE", None)  # (the fused row's setting)
        torchtpu.set_eager_mode("strict")
    return in_one_process(child, specs, reset)


# ---- the parent ---------------------------------------------------------------------

def run_child(spec, timeout, cache_dir):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    env = dict(os.environ, TORCHTPU_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    first = spec[0] if isinstance(spec, list) else spec
    if first["smoke"] or first["what"] == "cpu" or first.get("mode") == "cpu":
        env["TORCHTPU_PLATFORM"] = env["JAX_PLATFORMS"] = "cpu"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        # A generation child's finished batches (its PARTIAL lines), the
        # rest of them timed out.
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        partial = [x for x in out.splitlines() if x.startswith("PARTIAL ")]
        error = {"error": f"timed out after {timeout:.0f} s"}
        if not partial:
            return error
        result = json.loads(partial[-1][len("PARTIAL "):])
        for batch in first.get("batches") or tpu_decode.SIZES[first["smoke"]]["batches"]:
            result["batches"].setdefault(str(batch), error)
        return result
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return {"error": (lines[-1] if lines else f"exit status {proc.returncode}")[:400],
            "stderr": proc.stderr[-3000:]}


def plan(rows, batches=None):
    specs = []
    if "decode" in rows:
        rows = [r for r in rows if r != "decode"]
        rows += [r for r in ("per_op",) + tpu_decode.MODELS if r not in rows]
    for row in rows:
        model, _, mode = row.partition(":")
        if model in tpu_decode.MODELS:
            modes = [mode] if mode else list(tpu_decode.MODES)
            if "cpu" not in modes and not any(s.get("model") == model and s.get("mode") == "cpu"
                                              for s in specs):
                modes.insert(0, "cpu")  # (the tokens every row is checked against)
            specs += [{"what": "decode", "model": model, "mode": m, "batches": batches} for m in modes]
        elif model in ("per_op", "env"):
            specs.append({"what": model})
        elif mode == "cpu":
            specs.append({"what": "cpu", "model": model})
        elif mode.endswith("warm"):
            modes = [m + "_warm" for m in WARM_MODES] if mode == "warm" else [mode]
            if mode != "warm" and mode[:-len("_warm")] not in WARM_MODES:
                raise SystemExit(f"tpu.py: no warm-start row {row} (modes: "
                                 + ", ".join(m + "_warm" for m in WARM_MODES) + ", warm)")
            specs += [{"what": "warm", "model": model, "mode": m} for m in modes]
        else:
            specs += [{"what": "step", "model": model, "mode": m} for m in ([mode] if mode else MODES)]
    return specs


def tables(results):
    env = results.get("env", {})
    lines = [f"torchtpu on JAX {env.get('jax')} {env.get('platform')} ({env.get('device_kind')}), "
             f"torch {env.get('torch')}, {env.get('date')}", ""]
    per_op = results.get("per_op")
    if per_op:
        lines += ["| per op, µs | jitted JAX add, a call | JAX add inside one jit | strict | fused | debug | strict / JAX call |",
                  "|---|---|---|---|---|---|---|"]
        if "error" in per_op:
            lines.append(f"| error: {per_op['error']} |")
        else:
            lines.append("| `c = c + y`, 128x128 | " + " | ".join(
                f"{per_op[k]:.1f}" for k in ("jax_call", "jax_in_jit", "strict", "fused", "debug"))
                + f" | {per_op['strict'] / per_op['jax_call']:.2f}x |")
        lines.append("")
    steps = {model: {mode: r for mode, r in rows.items() if not mode.endswith("_warm")}
             for model, rows in results.get("steps", {}).items()}
    if any(steps.values()):
        lines += ["| model | path | ms per step | × plain JAX | MFU | first step, s | 10 steps, s | first loss | last loss |",
                  "|---|---|---|---|---|---|---|---|---|"]
    for model, rows in steps.items():
        ref = rows.get("jax", {}).get("ms")
        for mode, r in rows.items():
            if "error" in r:
                lines.append(f"| {model} | {mode} | error: {r['error'][:200]} |")
                continue
            if mode == "cpu":
                lines.append(f"| {model} | CPU eager | — | — | — | — | — | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} |")
                continue
            first = r["first_steps_s"]
            lines.append(f"| {model} | {mode} | {r['ms']:.2f} | "
                         + (f"{r['ms'] / ref:.2f}x" if ref else "—") + " | "
                         + (f"{r['mfu'] * 100:.0f}%" if r.get("mfu") else "—")
                         + f" | {first[0]:.1f} | {first[-1]:.1f} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} |")
    warm = [(model, mode, r) for model, rows in results.get("steps", {}).items()
            for mode, r in rows.items() if mode.endswith("_warm")]
    if warm:
        if any(steps.values()):
            lines.append("")
        lines += warm_table(warm)
    if results.get("decode"):
        if results.get("steps"):
            lines.append("")
        lines += tpu_decode.table(results["decode"], per_op, results.get("smoke", False))
    return "\n".join(lines)


def warm_table(rows):
    """The warm-start rows: the cold process's seconds to its steady step
    and compilations beside the warm one's figures."""
    lines = ["| model | path | cold: s to steady | cold: compilations | warm: s to device | "
             "warm: device to first step, s | warm: set-up, s (torchtpu / model / upload / optimizer) | "
             "warm: device to steady, s | warm: compilations | warm: disk hits | steady ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, mode, r in rows:
        if "error" in r:
            lines.append(f"| {model} | {mode} | error: {r['error'][:200]} |")
            continue
        cold, warm = r["cold"], r["warm"]
        ends = [warm.get("setup_s", {}).get(k) for k in SETUP_STAMPS]
        # Each part's seconds: from the previous part's end (the first: from opening the device).
        setup = (" / ".join(f"{b - a:.2f}" for a, b in zip([0.0] + ends, ends))
                 if None not in ends else "—")
        lines.append(f"| {model} | {mode} | {cold['steady_s']:.1f} | {cold['compiled']} | "
                     f"{warm['to_device_s']:.1f} | {warm['first_step_s']:.2f} | {setup} | {warm['steady_s']:.2f} | "
                     f"{warm['compiled']} | {warm['disk_hits']} | {warm['ms']:.2f} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on JAX's CPU platform")
    parser.add_argument("--rows", default="per_op,mlp,gpt,gpt:cpu",
                        help="comma-separated: per_op, MODEL, MODEL:MODE (modes: "
                             + ", ".join(MODES) + ", cpu; warm-start: "
                             + ", ".join(m + "_warm" for m in WARM_MODES) + ", warm: all four); generation: decode (per_op and "
                             "every row below), " + ", ".join(tpu_decode.MODELS) + ", MODEL:MODE "
                             "(modes: " + ", ".join(tpu_decode.MODES) + ")")
    parser.add_argument("--batches", help="generation rows' batch sizes, comma-separated "
                                          "(default 1,8; smoke 1,2)")
    parser.add_argument("--budget", type=float, default=560.0, help="seconds for the whole run")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per child")
    parser.add_argument("--profile", help="a folder for device traces of the steady rows")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    start = time.perf_counter()
    results = {"steps": {}, "decode": {}, "smoke": args.smoke}
    batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    specs = [{"what": "env"}] + plan(args.rows.split(","), batches)
    for spec in specs:
        spec["smoke"] = args.smoke
        profiled = (spec.get("mode") != "cpu" if spec["what"] == "decode"
                    else spec.get("mode") in ("jax", "fused", "replayed", "compiled"))
        if args.profile and profiled:
            spec["profile"] = os.path.abspath(args.profile)
    with tempfile.TemporaryDirectory(prefix="torchtpu-tpu-bench-") as cache_dir:
        from common import measured

        def measure(spec, timeout):
            if isinstance(spec, list):
                # A smoke run: its figures from one child, a warm-start
                # row's from two processes of its own.
                together = [s for s in spec if s["what"] != "warm"]
                got = run_child(together, timeout, cache_dir) if together else []
                got = iter(got if isinstance(got, list) else [got] * len(together))
                return [_warm_start(s, args.timeout) if s["what"] == "warm" else next(got) for s in spec]
            if spec["what"] == "warm":
                return _warm_start(spec, timeout)
            return run_child(spec, timeout, cache_dir)
        for spec, result in measured(specs, measure, args.smoke, args.budget, args.timeout, start):
            if spec["what"] in ("env", "per_op"):
                results[spec["what"]] = result
            elif spec["what"] == "decode":
                results["decode"].setdefault(spec["model"], {})[spec["mode"]] = result
            else:
                results["steps"].setdefault(spec["model"], {})[spec.get("mode", "cpu")] = result
            print(f"[tpu.py {time.perf_counter() - start:.0f} s] {spec.get('model', spec['what'])} "
                  f"{spec.get('mode', '')}: " + json.dumps(result)[:1500], file=sys.stderr, flush=True)
    tpu_decode.check_tokens(results["decode"], args.smoke)
    text = tables(results)
    print(text)
    out = os.environ.get("OUT")
    if out:
        results["markdown"] = text
        with open(os.path.join(out, "tpu.json"), "w") as f:
            json.dump(results, f, indent=1)
    # The plain-JAX decode is the reference only if it makes HF's tokens:
    # a smoke run (CI) fails where it does not.
    wrong = [m for m, rows in results["decode"].items() if "jax" in rows
             for r in rows["jax"].get("batches", {"?": rows["jax"]}).values()
             if r.get("tokens_equal") is not True]
    if args.smoke and wrong:
        sys.exit(f"tpu.py: the plain-JAX decode's tokens differ from CPU eager's: {sorted(set(wrong))}")


if __name__ == "__main__":
    main()
