"""Where a warm decode token of Hugging Face generate() goes on tpu, and the
floor under it: the tiny Llama of benchmarks/generate.py, batch 2, 48 new
greedy tokens, in strict and fused mode with each cache, beside PyTorch CPU
eager in the same process (medians of 5 runs, the arms alternating).

Timers around torchtpu's entry points (its dispatcher, its device
factories, its compiled graphs' calls) split a token into torchtpu's calls
and the rest: Hugging Face's Python, PyTorch's own dispatch up to the
subclass's __torch_dispatch__, and Dynamo's guards on the compiled forward
(static cache), none of which torchtpu runs. The floor is what the token
would cost if torchtpu's own host work were free: the rest, less what the
timers themselves cost, plus the token's device work, its kernel calls
(strict) or its compiled graphs' runs (fused), replayed back to back over
the same arrays.
"""
import copy
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENS = 48
REPEATS = 5
# benchmarks/generate.py's targets (issue: generation without recompile storms).
TARGETS = {"strict": "1.5x", "fused": "< 1x"}


class _Timers:
    """Timers around torchtpu's entry points, installed and removed."""

    def __init__(self):
        import torchtpu.dispatch as dispatch
        import torchtpu.tensor as tensor
        from torchtpu import compiled
        self.seconds = {"ops": 0.0, "factories": 0.0, "compiled": 0.0}
        self.calls = {"ops": 0, "factories": 0, "compiled": 0}
        self._sites = [(tensor, "_dispatch", "ops"), (dispatch, "dispatch", "factories"),
                       (compiled.CompiledGraph, "__call__", "compiled")]
        self._saved = [getattr(owner, attr) for owner, attr, _ in self._sites]
        self._depth = 0

    def _timed(self, fn, kind):
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self.seconds[kind] += time.perf_counter() - start
                self.calls[kind] += 1
        # Named as torchtpu's own frame, so that fused mode still finds the
        # user's line (its flush site) outside torchtpu, as without timers.
        timed.__code__ = timed.__code__.replace(
            co_filename=os.sep + os.path.join("torchtpu", "benchmark_timers.py"))
        return timed

    def install(self):
        for (owner, attr, kind), fn in zip(self._sites, self._saved):
            setattr(owner, attr, self._timed(fn, kind))

    def remove(self):
        for (owner, attr, _), fn in zip(self._sites, self._saved):
            setattr(owner, attr, fn)

    def reset(self):
        for kind in self.seconds:
            self.seconds[kind], self.calls[kind] = 0.0, 0

    def cost_per_call(self):
        """Seconds one timer adds around a call (timed around a no-op)."""
        bare = lambda: None  # noqa: E731
        wrapped = self._timed(bare, "ops")
        saved = dict(self.seconds), dict(self.calls)
        costs = []
        for fn in (bare, wrapped):
            start = time.perf_counter()
            for _ in range(20000):
                fn()
            costs.append((time.perf_counter() - start) / 20000)
        self.seconds, self.calls = saved
        return max(costs[1] - costs[0], 0.0)


def _kernel_calls(record):
    """Record the strict executor's kernel calls (callable, arrays) into
    record; returns the function that stops recording. A compiled graph's
    donating kernel is recorded as a plain jit of its function over copies
    of its arrays, so that it can be replayed."""
    import jax
    from torchtpu.modes.strict import StrictExecutor
    run, plain = StrictExecutor.run, {}

    def recording(self, kernel, flat, storages):
        if kernel.name and kernel.name.startswith("compiled_graph"):
            record.append((plain.setdefault(kernel.name, jax.jit(kernel.fn)),
                           [jax.numpy.copy(a) if isinstance(a, jax.Array) else a for a in flat], None))
        else:
            record.append((kernel.jitted, list(flat), None))
        return run(self, kernel, flat, storages)

    StrictExecutor.run = recording
    return lambda: setattr(StrictExecutor, "run", run)


def _graph_runs(record):
    """Record fused mode's compiled graphs' runs (run, copies of its inputs,
    scalars) into record; returns the function that stops recording. The
    inputs are copied because a graph donates those it overwrites."""
    import jax
    from torchtpu import cache
    from torchtpu.modes import graph
    lookup = cache.lookup

    def recording(key):
        entry = lookup(key)
        if entry is None or not isinstance(key, graph.GraphKey):
            return entry
        run = entry[0]

        def recorded(inputs, scalars):
            record.append((run, [jax.numpy.copy(a) for a in inputs], list(scalars)))
            return run(inputs, scalars)
        return (recorded,) + tuple(entry[1:])

    cache.lookup = recording
    return lambda: setattr(cache, "lookup", lookup)


def _back_to_back(calls, copies):
    """ms per token of calls run back to back, then waited for; copies:
    whether each call's arrays are copied first (outside the timing), for
    calls that donate them."""
    import jax
    if copies:
        calls = [(fn, [jax.numpy.copy(a) for a in arrays], scalars) for fn, arrays, scalars in calls]
        jax.block_until_ready([arrays for _, arrays, _ in calls])
    start = time.perf_counter()
    outs = [fn(arrays, scalars) if copies else fn(*arrays) for fn, arrays, scalars in calls]
    jax.block_until_ready(outs)
    return (time.perf_counter() - start) / TOKENS * 1e3


def _worker(cache, mode):
    import torch
    import torchtpu
    from generate import tiny_model
    torch.set_num_threads(1)  # CPU eager's best here (benchmarks/generate.py)
    model = tiny_model("llama")
    prompt = torch.randint(0, 256, (2, 6))
    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=TOKENS, min_new_tokens=TOKENS)
    if cache == "static":
        kw["cache_implementation"] = "static"
    tpu_model = copy.deepcopy(model).to("tpu")
    timers = _Timers()

    def ms_per_token(m, ids):
        start = time.perf_counter()
        m.generate(ids, **kw).cpu()
        return (time.perf_counter() - start) / TOKENS * 1e3

    runs = {"plain": [], "cpu": [], "torchtpu": [], "rest": [], "back_to_back": []}
    with torch.no_grad(), torchtpu.eager_mode(mode):
        for _ in range(2):
            ms_per_token(tpu_model, prompt.to("tpu"))
        ms_per_token(model, prompt)
        for _ in range(REPEATS):
            runs["plain"].append(ms_per_token(tpu_model, prompt.to("tpu")))
            runs["cpu"].append(ms_per_token(model, prompt))
            timers.install()
            timers.reset()
            try:
                total = ms_per_token(tpu_model, prompt.to("tpu"))
            finally:
                timers.remove()
            own = sum(timers.seconds.values()) / TOKENS * 1e3
            timer_cost = sum(timers.calls.values()) * timers.cost_per_call() / TOKENS * 1e3
            runs["torchtpu"].append(own)
            runs["rest"].append(total - own - timer_cost)
        calls = []
        stop = (_kernel_calls if mode == "strict" else _graph_runs)(calls)
        try:
            tpu_model.generate(prompt.to("tpu"), **kw).cpu()
        finally:
            stop()
        for _ in range(REPEATS):
            runs["back_to_back"].append(_back_to_back(calls, copies=mode == "fused"))
    m = {k: statistics.median(v) for k, v in runs.items()}
    floor = m["rest"] + m["back_to_back"]
    row = dict(cache=cache, mode=mode, tpu=m["plain"], cpu=m["cpu"], torchtpu=m["torchtpu"],
               rest=m["rest"], back_to_back=m["back_to_back"], runs=len(calls) / TOKENS,
               floor=floor, ratio=m["plain"] / m["cpu"], floor_ratio=floor / m["cpu"],
               target=TARGETS[mode], dispatches=timers.calls["ops"] / TOKENS)
    from common import print_rows
    print_rows([row])


def generate_floor():
    from common import worker_rows
    rows = []
    for cache in ("dynamic", "static"):
        for mode in ("strict", "fused"):
            rows += worker_rows(__file__, (cache, mode), timeout=900)
    return rows


generate_floor.title = ("A warm decode token of the tiny Llama (48 tokens, greedy, batch 2), ms: "
                        "torchtpu's calls, the rest, and the floor if torchtpu's host work were free")
generate_floor.columns = [
    ("cache", "cache", "{}"), ("mode", "mode", "{}"), ("tpu", "tpu ms/token", "{:.2f}"),
    ("cpu", "CPU eager ms/token", "{:.2f}"), ("torchtpu", "in torchtpu's calls", "{:.2f}"),
    ("rest", "the rest (HF, PyTorch, Dynamo)", "{:.2f}"),
    ("back_to_back", "its kernels or graphs back to back", "{:.2f}"), ("floor", "floor", "{:.2f}"),
    ("ratio", "tpu / CPU", "{:.2f}x"), ("floor_ratio", "floor / CPU", "{:.2f}x"),
    ("target", "target", "{}"), ("dispatches", "dispatches a token", "{:.0f}"),
    ("runs", "kernels or graphs a token", "{:.1f}")]


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    if sys.argv[1:2] == ["--worker"]:
        sys.path.insert(0, os.path.join(HERE, ".."))
        _worker(*sys.argv[2:4])
    else:
        from common import table
        print(table(generate_floor, generate_floor()))
