"""Hugging Face batches without downloads, for the bucketing tests: a
word-level tokenizer built in memory and tokenized examples of chosen
lengths, and the small BERT classifier they fine-tune."""
import torch

VOCAB = 96
PAD, UNK, CLS, SEP, MASK = range(5)


def tokenizer(**kw):
    """A fast tokenizer over VOCAB ids, [PAD] = 0; kw as
    PreTrainedTokenizerFast takes them (padding_side, model_max_length)."""
    import transformers
    from tokenizers import Tokenizer, models
    vocab = {"[PAD]": PAD, "[UNK]": UNK, "[CLS]": CLS, "[SEP]": SEP, "[MASK]": MASK,
             **{f"w{i}": i for i in range(5, VOCAB)}}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]",
        unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", **kw)


def examples(longest, batch, seed=0, label=True, target=None):
    """Examples in batch order: batch b's first example has longest[b] ids,
    the others fewer; each with a class label (label=True), or with target
    labels of target[b] ids at most (a seq2seq target; target=None: none)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b, n in enumerate(longest):
        for j in range(batch):
            k = n if j == 0 else int(torch.randint(3, n + 1, (), generator=g))
            ex = {"input_ids": [CLS] + torch.randint(5, VOCAB, (k - 2,), generator=g).tolist() + [SEP]}
            if label:
                ex["labels"] = int(torch.randint(0, 2, (), generator=g))
            if target is not None:
                t = target[b] if j == 1 else int(torch.randint(2, target[b] + 1, (), generator=g))
                ex["labels"] = torch.randint(5, VOCAB, (t,), generator=g).tolist()
            out.append(ex)
    return out


def bert_classifier(layers):
    """A small BertForSequenceClassification over VOCAB ids, no dropout,
    positions up to 128 (the longest bucket the tests use)."""
    import transformers
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="sdpa"))
