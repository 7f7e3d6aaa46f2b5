"""Batches of varying length, as Hugging Face's dynamic padding makes them:
a small BERT (2 layers, d 64) fine-tuned for sequence classification, 24
AdamW steps of batch 8 from `DataCollatorWithPadding` through
`torchtpu.data.DeviceLoader`, each batch padded by the collator to its own
longest sequence (24 distinct lengths in 17..128); against the same loop
with every batch padded to 128 by the collator. The varying run once with
DeviceLoader's buckets off (`buckets=None`: a program per length) and once
with its default buckets (powers of two: 32, 64, 128 here). Each run in a
fresh process with an empty compilation cache; time of the 24 steps
(a loss read each step), compilations (kernels + fused graphs) in them.

    python benchmarks/buckets.py [--modes strict fused] [--cases fixed varying bucketed]
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import print_rows, table, worker_rows  # noqa: E402

MODES = ("strict", "fused")
CASES = ("fixed", "varying", "bucketed")
STEPS, BATCH, VOCAB = 24, 8, 1000
# Each batch's longest sequence: 24 distinct lengths in 17..128.
LONGEST = [17 + (i * 47) % 112 for i in range(STEPS)]


def tokenizer():
    """A word-level tokenizer built in memory (nothing downloaded), [PAD] = 0."""
    import transformers
    from tokenizers import Tokenizer, models
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4,
             **{f"w{i}": i + 5 for i in range(VOCAB - 5)}}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]",
        unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
        model_max_length=512)


def examples(longest=LONGEST, batch=BATCH, seed=0):
    """Tokenized examples in batch order: batch b's first example has
    longest[b] tokens, the others fewer ([CLS] ... [SEP], a label each)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in longest:
        for j in range(batch):
            k = n if j == 0 else int(torch.randint(4, n + 1, (), generator=g))
            ids = [2] + torch.randint(5, VOCAB, (k - 2,), generator=g).tolist() + [3]
            out.append({"input_ids": ids, "label": int(torch.randint(0, 2, (), generator=g))})
    return out


def bert():
    import transformers
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=512, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=2, attn_implementation="sdpa"))


def _compilations(torchtpu):
    s = torchtpu.metrics.snapshot()
    return s["compilations"] + s.get("graphs_compiled", 0)


def _worker(mode, case):
    import torch
    import transformers

    import torchtpu
    from torchtpu.data import DeviceLoader
    torchtpu.set_eager_mode(mode)
    torch.manual_seed(0)
    tok = tokenizer()
    collator = transformers.DataCollatorWithPadding(tok) if case != "fixed" else \
        transformers.DataCollatorWithPadding(tok, padding="max_length", max_length=128)
    loader = torch.utils.data.DataLoader(examples(), batch_size=BATCH, collate_fn=collator)
    batches = DeviceLoader(loader, buckets=None if case == "varying" else True)
    model = bert().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _compilations(torchtpu)
    start = time.perf_counter()
    lengths = set()
    for batch in batches:
        lengths.add(batch["input_ids"].shape[1])
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
    took = time.perf_counter() - start
    return [{"mode": mode, "case": case, "lengths": len(lengths), "seconds": took,
             "compilations": _compilations(torchtpu) - before}]


def buckets(modes=MODES, cases=CASES, timeout=900):
    rows = []
    for mode in modes:
        runs = {case: worker_rows(__file__, [mode, case], timeout)[0] for case in cases}
        fixed = runs.get("fixed")
        for case, row in runs.items():
            row["time_x"] = row["seconds"] / fixed["seconds"] if fixed else float("nan")
            row["compile_x"] = row["compilations"] / fixed["compilations"] if fixed else float("nan")
            rows.append(row)
    return rows


buckets.title = ("BERT fine-tuning with dynamic padding through DeviceLoader (24 steps, batch 8, "
                 "lengths 17..128; fresh process, empty cache)")
buckets.columns = [("mode", "mode", "{}"), ("case", "batches", "{}"),
                   ("lengths", "distinct shapes", "{}"), ("seconds", "time (s)", "{:.1f}"),
                   ("time_x", "time / fixed", "{:.2f}x"),
                   ("compilations", "compilations", "{}"),
                   ("compile_x", "compilations / fixed", "{:.2f}x")]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, os.path.join(HERE, ".."))
        print_rows(_worker(*args.worker))
    else:
        print(table(buckets, buckets(args.modes, args.cases)))
