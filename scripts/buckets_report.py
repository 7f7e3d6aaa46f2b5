#!/usr/bin/env python
"""Survey which Hugging Face architectures give the same results on a batch
bucketed as torchtpu's loaders bucket it (torchtpu/buckets.py) as on the
batch the collator made: each model built small from its config (nothing
downloaded), run on CPU in eval mode on two batches from
DataCollatorWithPadding (longest 19 and 40, bucketed to 32 and 64), and the
largest difference of its logits at the true positions and of its loss.
This checks the padding itself, on PyTorch CPU alone; tests/test_buckets_hf.py
checks tpu against CPU for some of the same models.

  .venv/bin/python scripts/buckets_report.py                 # every model, right padding
  .venv/bin/python scripts/buckets_report.py --left          # left padding, position_ids given
  .venv/bin/python scripts/buckets_report.py Bert GPT2       # some
"""
import argparse
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def models():
    """name -> (model class, config), each small."""
    import transformers as T
    small = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=128)
    # RoBERTa-style positions start past the pad id: two more.
    offset = {**small, "max_position_embeddings": 130}
    decoder = dict(small, num_key_value_heads=2, pad_token_id=0)
    return {
        "Bert": (T.BertForSequenceClassification, T.BertConfig(**small)),
        "Roberta": (T.RobertaForSequenceClassification, T.RobertaConfig(**offset, pad_token_id=0)),
        "DistilBert": (T.DistilBertForSequenceClassification, T.DistilBertConfig(
            vocab_size=96, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=128)),
        "Albert": (T.AlbertForSequenceClassification, T.AlbertConfig(**small, embedding_size=16)),
        "Electra": (T.ElectraForSequenceClassification, T.ElectraConfig(**small, embedding_size=16)),
        "DebertaV2": (T.DebertaV2ForSequenceClassification, T.DebertaV2Config(**small)),
        "ConvBert": (T.ConvBertForSequenceClassification, T.ConvBertConfig(**small, embedding_size=32)),
        "MPNet": (T.MPNetForSequenceClassification, T.MPNetConfig(**offset, pad_token_id=0)),
        "Funnel": (T.FunnelForSequenceClassification, T.FunnelConfig(
            vocab_size=96, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=64)),
        "BigBird": (T.BigBirdForSequenceClassification, T.BigBirdConfig(
            **small, block_size=4, num_random_blocks=2)),
        "Longformer": (T.LongformerForSequenceClassification, T.LongformerConfig(
            **offset, attention_window=8, pad_token_id=0)),
        "SqueezeBert": (T.SqueezeBertForSequenceClassification, T.SqueezeBertConfig(
            **small, embedding_size=32, q_groups=1, k_groups=1, v_groups=1, post_attention_groups=1,
            intermediate_groups=1, output_groups=1)),
        "ModernBert": (T.ModernBertForSequenceClassification, T.ModernBertConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=128, pad_token_id=0, local_attention=8)),
        "XLNet": (T.XLNetForSequenceClassification, T.XLNetConfig(
            vocab_size=96, d_model=32, n_layer=2, n_head=4, d_inner=64, pad_token_id=0)),
        "GPT2": (T.GPT2ForSequenceClassification, T.GPT2Config(
            vocab_size=96, n_positions=128, n_embd=32, n_layer=2, n_head=4, pad_token_id=0)),
        "Llama": (T.LlamaForSequenceClassification, T.LlamaConfig(**decoder)),
        "Qwen2": (T.Qwen2ForSequenceClassification, T.Qwen2Config(**decoder)),
        "Mistral": (T.MistralForSequenceClassification, T.MistralConfig(**decoder)),
        "Gemma": (T.GemmaForSequenceClassification, T.GemmaConfig(**decoder, head_dim=8)),
        "OPT": (T.OPTForSequenceClassification, T.OPTConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
            max_position_embeddings=128, pad_token_id=0, word_embed_proj_dim=32)),
        "Bloom": (T.BloomForSequenceClassification, T.BloomConfig(
            vocab_size=96, hidden_size=32, n_layer=2, n_head=4, pad_token_id=0)),
        "GPTNeoX": (T.GPTNeoXForSequenceClassification, T.GPTNeoXConfig(**small, pad_token_id=0)),
        "Mamba": (T.MambaForCausalLM, T.MambaConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=2, pad_token_id=0)),
        "Bart": (T.BartForSequenceClassification, T.BartConfig(
            vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_position_embeddings=128, pad_token_id=0, eos_token_id=3, bos_token_id=2)),
    }


def difference(cls, config, left):
    """The largest |difference| of logits at the true positions and of the
    loss, bucketed against as collated; a str where the model raised."""
    import inspect

    import torch
    import transformers
    from hf_batches import examples, tokenizer
    from torch.utils.data import DataLoader

    from torchtpu.buckets import Bucketer
    tok = tokenizer(padding_side="left" if left else "right")
    loader = DataLoader(examples([19, 40], 4), batch_size=4,
                        collate_fn=transformers.DataCollatorWithPadding(tok))
    torch.manual_seed(0)
    model = cls(config).eval()
    takes = inspect.signature(model.forward).parameters
    bucketer = Bucketer(True, loader=loader)
    worst = 0.0
    for batch in loader:
        batch = dict(batch)
        if left:
            if "position_ids" not in takes:
                return "takes no position_ids"
            batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        if cls.__name__.endswith("CausalLM"):
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        (padded,) = bucketer.padded(iter([batch]))
        n, m = batch["input_ids"].shape[1], padded["input_ids"].shape[1]
        assert m > n, (n, m)
        with torch.no_grad():
            want, got = model(**batch), model(**padded)
        a, b = want.logits, got.logits
        if a.dim() == 3:
            true = batch["attention_mask"] == 1
            b = b[:, m - n:] if left else b[:, :n]
            a, b = a[true], b[true]
        worst = max(worst, (a - b).abs().max().item())
        if want.loss is not None:
            worst = max(worst, (want.loss - got.loss).abs().item())
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--left", action="store_true", help="left padding, with position_ids")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    for name, (cls, config) in models().items():
        if args.names and name not in args.names:
            continue
        try:
            d = difference(cls, config, args.left)
        except Exception as e:  # a model that cannot run the batch says why
            d = f"{type(e).__name__}: {str(e)[:160]}"
        verdict = d if isinstance(d, str) else f"{d:.1e} " + ("same" if d < 1e-5 else "DIFFERS")
        print(f"{name:12s} {verdict}", flush=True)


if __name__ == "__main__":
    main()
