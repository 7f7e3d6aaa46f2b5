"""Hugging Face generate() on tpu against PyTorch CPU eager: greedy decoding
of a tiny Llama (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 256) and a
tiny GPT-2 (2 layers, 64, 4 heads, vocab 256), batch 2, a 6-token prompt,
with the dynamic cache and the static one.

Each (model, cache, mode) runs in its own process with an empty compilation
cache: a warm-up of 8 tokens from another prompt, then 48 and 256 new
tokens. "first" is the first timed run of each length, compilation
included; "warm" the median of 3 more, alternating with CPU eager's runs of
the same model in the same process (CPU's figure is the median of 4).
Compilations are the first run's. PyTorch runs with one thread, CPU eager's
fastest for models this small: with its default two, its OpenMP threads
cost about 14 ms a token whenever other work shares the 2 cores (1.1 ms
with one).
"""
import copy
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LENGTHS = (48, 256)


def tiny_model(name):
    """The tiny "llama" or "gpt2" of this benchmark (tests/test_generate.py
    checks the same ones), seeded, in eval mode, on CPU."""
    import torch
    import transformers
    torch.manual_seed(0)
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=512)
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _worker(model_name, cache, mode):
    import torch
    import torchtpu
    from common import print_rows, settle
    torch.set_num_threads(1)  # CPU eager's best here (module docstring)
    model = tiny_model(model_name)
    prompt, warm = torch.randint(0, 256, (2, 6)), torch.randint(0, 256, (2, 6))
    kw = dict(do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"

    def timed(m, ids, n):
        start = time.perf_counter()
        out = m.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        out = out.cpu()
        return (time.perf_counter() - start) / n * 1e3, out

    rows = []
    with torch.no_grad():
        tpu_model = copy.deepcopy(model).to("tpu")
        timed(model, warm, 8)
        with torchtpu.eager_mode(mode):
            timed(tpu_model, warm.to("tpu"), 8)
            for n in LENGTHS:
                cpu_ms, want = timed(model, prompt, n)
                cpu_times = [cpu_ms]
                torchtpu.metrics.reset()
                first, out = timed(tpu_model, prompt.to("tpu"), n)
                snap = torchtpu.metrics.snapshot()
                settle()
                warm_times = []
                for _ in range(3):  # alternating, so both see the same load
                    cpu_times.append(timed(model, prompt, n)[0])
                    warm_times.append(timed(tpu_model, prompt.to("tpu"), n)[0])
                cpu_ms, warm_ms = statistics.median(cpu_times), statistics.median(warm_times)
                rows.append(dict(model=model_name, cache=cache, mode=mode, tokens=n,
                                 equal=bool(torch.equal(out, want)), first=first, warm=warm_ms,
                                 cpu=cpu_ms, first_ratio=first / cpu_ms, warm_ratio=warm_ms / cpu_ms,
                                 compilations=snap["compilations"]))
    print_rows(rows)


def generate():
    from common import worker_rows
    rows = []
    for model_name in ("llama", "gpt2"):
        for cache in ("dynamic", "static"):
            for mode in ("strict", "fused"):
                rows += worker_rows(__file__, (model_name, cache, mode), timeout=1200)
    return rows


generate.title = ("Hugging Face generate(), greedy, batch 2: ms per token on tpu (first run, "
                  "compilation included, and warm) vs PyTorch CPU eager, same process")
generate.columns = [("model", "model", "{}"), ("cache", "cache", "{}"), ("mode", "mode", "{}"),
                    ("tokens", "new tokens", "{}"), ("equal", "tokens equal CPU's", "{}"),
                    ("first", "ms/token first", "{:.1f}"), ("warm", "ms/token warm", "{:.1f}"),
                    ("cpu", "CPU eager ms/token", "{:.1f}"),
                    ("first_ratio", "first / CPU", "{:.2f}x"), ("warm_ratio", "warm / CPU", "{:.2f}x"),
                    ("compilations", "compilations (first)", "{}")]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.path.insert(0, os.path.join(HERE, ".."))
        _worker(*sys.argv[2:5])
    else:
        sys.path.insert(0, HERE)
        from common import table
        print(table(generate, generate()))
