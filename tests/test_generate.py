"""Hugging Face generate() on tpu: greedy tokens equal CPU's, and a 256-token
run compiles at most 16 kernels or graphs after a short warm-up, in every
mode, with the dynamic cache (grown by torch.cat each step) and the static
one (token ids still grow; strict mode compiles a static cache of a new
length's kernels again, 19 in all: an expected failure)."""
import copy
import importlib.util
import os

import jax
import pytest
import torch

import torchtpu
from torchtpu.dispatch import growth

transformers = pytest.importorskip("transformers")


def _benchmark():
    """benchmarks/generate.py, by its path (its directory on sys.path would
    let its siblings, common.py, fused.py, ..., shadow other imports)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "benchmarks", "generate.py")
    spec = importlib.util.spec_from_file_location("torchtpu_benchmark_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The benchmark's tiny models, the workload timed there.
_tiny = _benchmark().tiny_model

# Generation grows its cache into two new buckets of growth's, as 256 tokens
# do with the default smallest bucket (128): with the smallest at 32, in 64.
NEW_TOKENS = 64
GROWTH_MIN = 32


@pytest.mark.parametrize("model_name,cache,mode", [
    ("llama", "dynamic", "strict"), ("llama", "dynamic", "fused"), ("llama", "dynamic", "debug"),
    ("llama", "static", "strict"),
    ("llama", "static", "fused"),
    ("gpt2", "dynamic", "strict"), ("gpt2", "dynamic", "fused"),
])
def test_generate_gives_cpu_tokens_with_few_compilations(model_name, cache, mode, monkeypatch):
    monkeypatch.setattr(growth, "GROWTH_MIN", GROWTH_MIN)
    # Each case starts with no kernel compiled, as a fresh process does (else
    # those earlier cases compiled would not count). An earlier case's
    # background compile finishes first: JAX's caches cleared under a trace
    # on another thread leak its tracers.
    torchtpu.wait_for_compiles()
    torchtpu.cache.clear()
    jax.clear_caches()
    model = _tiny(model_name)
    prompt = torch.randint(0, 256, (2, 6))
    warm = torch.randint(0, 256, (2, 6))
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        # (On a copy: Hugging Face keeps a static cache on the model and
        # reuses it, so the tpu runs would start with CPU's full-length one.)
        want = copy.deepcopy(model).generate(prompt, **kw)
    model.to("tpu")
    with torchtpu.eager_mode(mode), torch.no_grad():
        model.generate(warm.to("tpu"), **dict(kw, max_new_tokens=8, min_new_tokens=8))
        torchtpu.metrics.reset()
        got = model.generate(prompt.to("tpu"), **kw).cpu()
    snap = torchtpu.metrics.snapshot()
    assert got.shape == want.shape == (2, 6 + NEW_TOKENS)
    assert torch.equal(got, want)
    assert snap["compilations"] <= 16, snap


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_sampling_is_reproducible_under_manual_seed_with_one_sync_a_token(mode):
    model = _tiny("llama").to("tpu")
    prompt = torch.randint(0, 256, (2, 6)).to("tpu")
    n = 24
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=0.8, top_k=50,
              top_p=0.9, pad_token_id=0)
    runs = []
    with torchtpu.eager_mode(mode), torch.no_grad():
        for seed in (123, 123, 7):
            torch.manual_seed(seed)
            torchtpu.metrics.reset()
            runs.append(model.generate(prompt, **kw).cpu())
            # Hugging Face reads whether all sequences finished once a token;
            # sampling itself adds no read.
            assert torchtpu.metrics.snapshot()["syncs"] <= n + 8
    assert runs[0].shape == (2, 6 + n)
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    assert int(runs[0].min()) >= 0 and int(runs[0].max()) < 256


@pytest.mark.parametrize("elements,test_elements", [
    (torch.tensor([[5, 2, 7], [0, 3, 2]]), torch.tensor([2, 0])),   # the stopping criteria's ids
    (torch.arange(256), torch.tensor([2])),                         # a logits processor's vocabulary
    (torch.tensor([1.5, float("nan"), 3.0]), torch.tensor([float("nan"), 3])),  # NaN matches nothing
    (torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([2.5, 3.0])),     # compared promoted
    (torch.tensor([1, 2, 3]), 2),
    (2, torch.tensor([1, 2])),
])
@pytest.mark.parametrize("invert", [False, True])
def test_isin_as_generation_calls_it_is_one_kernel(elements, test_elements, invert):
    # Hugging Face calls isin three times a token; its decomposition would be
    # several kernels.
    want = torch.isin(elements, test_elements, invert=invert)
    on_tpu = [x.to("tpu") if isinstance(x, torch.Tensor) else x for x in (elements, test_elements)]
    torchtpu.metrics.reset()
    got = torch.isin(*on_tpu, invert=invert)
    assert torchtpu.metrics.snapshot()["ops_dispatched"] == 1
    assert got.device.type == "tpu" and got.dtype == want.dtype
    assert torch.equal(got.cpu(), want)


def test_logits_processors_with_device_generators_and_token_lists():
    """transformers' watermarking processors draw from torch.Generator(device=...)
    and SuppressTokensLogitsProcessor builds its ids with torch.tensor(list(ids)):
    on tpu they give CPU's scores from the same tables (the tables' draws
    themselves are tpu's stream, not CPU's)."""
    import numpy as np
    from transformers.generation import (SuppressTokensLogitsProcessor,
                                         SynthIDTextWatermarkLogitsProcessor, WatermarkLogitsProcessor)
    ids = torch.randint(0, 50, (3, 6), generator=torch.Generator().manual_seed(0))
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    cfg = dict(ngram_len=3, keys=np.array([17, 4242]), sampling_table_size=256, sampling_table_seed=0,
               context_history_size=16)
    out = {}
    for dev in ("cpu", "tpu"):
        synthid = SynthIDTextWatermarkLogitsProcessor(**cfg, device=dev)
        synthid.sampling_table = SynthIDTextWatermarkLogitsProcessor(**cfg, device="cpu").sampling_table.to(dev)
        suppress = SuppressTokensLogitsProcessor(list(torch.tensor([3, 7], device=dev)), device=dev)
        out[dev] = [p(ids.to(dev), scores.to(dev)).cpu() for p in (synthid, suppress)]
        watermark = WatermarkLogitsProcessor(vocab_size=50, device=dev)
        biased = (watermark(ids.to(dev), scores.to(dev)) - scores.to(dev)).cpu()
        green = (biased - watermark.bias).abs() < 1e-5  # 12 ids a row (a quarter), drawn per row
        assert (green | (biased.abs() < 1e-5)).all() and (green.sum(1) == 12).all()
    for got, want in zip(out["tpu"], out["cpu"]):
        torch.testing.assert_close(got, want)
