"""Bucketed batches give Hugging Face models CPU's results on the unpadded
batch: the loss, the logits at the true positions and every gradient, for
BERT and GPT-2 sequence classification (GPT-2 pools the last token that is
not the pad id), GPT-2 language modelling and T5 (both sides bucketed), from
their collators, in strict and fused mode; and Trainer's and Accelerate's
loaders are bucketed through the same code, with the same switch."""
import copy

import pytest
import torch
from hf_batches import PAD, bert_classifier, examples, tokenizer
from torch.utils.data import DataLoader

import torchtpu
from torchtpu.buckets import _power_bucket
from torchtpu.data import DeviceLoader

transformers = pytest.importorskip("transformers")



@pytest.fixture(params=["strict", "fused"])
def eager(request, monkeypatch):
    """The mode to run in; fused graphs compiled when first met, so that
    the step runs as a graph (not op by op, as tiered compilation runs a
    graph it meets the first time)."""
    if request.param == "fused":
        monkeypatch.setenv("TORCHTPU_FUSED_COMPILE", "sync")
    return request.param
TOL = dict(rtol=1e-4, atol=1e-5)  # tests/test_hf.py's: tpu's kernels against CPU's


def _bert_classifier():
    return bert_classifier(layers=2)


def _gpt2_config():
    return transformers.GPT2Config(
        vocab_size=96, n_positions=128, n_embd=32, n_layer=2, n_head=4, bos_token_id=1,
        eos_token_id=1, pad_token_id=PAD, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="sdpa")


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=PAD, pad_token_id=PAD))


def _parity(make, loader, eager, lengths, true_positions=None, **loader_kw):
    """The loader's one batch through make()'s model on CPU as the loader
    gives it and on tpu through DeviceLoader: the tpu batch's sequence
    lengths are `lengths`; loss, logits (at true_positions(batch), all of
    them where None) and gradients equal CPU's. Returns the tpu logits."""
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref).to("tpu")
    (cpu_batch,) = loader
    with torchtpu.eager_mode(eager):
        (batch,) = DeviceLoader(loader, **loader_kw)
        assert [batch[k].shape[-1] for k in ("input_ids", "labels") if batch[k].dim() > 1] == lengths
        out = model(**batch)
        out.loss.backward()
        loss, logits = out.loss.detach().cpu(), out.logits.detach().cpu()
        grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
    want = ref(**cpu_batch)
    want.loss.backward()
    torch.testing.assert_close(loss, want.loss.detach(), **TOL)
    if true_positions is None:
        torch.testing.assert_close(logits, want.logits.detach(), **TOL)
    else:
        true = true_positions(cpu_batch)
        n = true.shape[-1]
        torch.testing.assert_close(logits[:, :n][true], want.logits.detach()[true], **TOL)
    want_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], **TOL, msg=name)
    return logits


def test_bert_classification_with_data_collator_with_padding(eager):
    collator = transformers.DataCollatorWithPadding(tokenizer())
    loader = DataLoader(examples([19], 4), batch_size=4, collate_fn=collator)
    _parity(_bert_classifier, loader, eager, [32])


def test_gpt2_language_model_with_its_shifted_labels(eager):
    """DataCollatorForLanguageModeling(mlm=False) labels the pads -100;
    GPT-2 shifts the labels, so the last true token's target is a pad,
    -100 padded or not."""
    collator = transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    loader = DataLoader(examples([19], 4, label=False), batch_size=4, collate_fn=collator)
    _parity(lambda: transformers.GPT2LMHeadModel(_gpt2_config()), loader, eager, [32, 32],
            true_positions=lambda b: b["attention_mask"] == 1)


def test_gpt2_classification_pools_the_same_last_token(eager):
    """GPT2ForSequenceClassification pools the last token that is not
    config.pad_token_id: the added pads must carry that id (the collator's
    tokenizer's), or a row pools a pad."""
    collator = transformers.DataCollatorWithPadding(tokenizer())
    loader = DataLoader(examples([19], 4), batch_size=4, collate_fn=collator)
    make = lambda: transformers.GPT2ForSequenceClassification(_gpt2_config())  # noqa: E731
    logits = _parity(make, loader, eager, [32])
    with torchtpu.eager_mode(eager):
        torch.manual_seed(0)
        model = make().to("tpu")
        (wrong,) = DeviceLoader(loader, pad_values={"input_ids": 7})
        assert not torch.allclose(model(**wrong).logits.detach().cpu(), logits, **TOL)


def test_t5_buckets_its_encoder_and_decoder_sides(eager):
    collator = transformers.DataCollatorForSeq2Seq(tokenizer())
    loader = DataLoader(examples([19], 4, label=False, target=[9]), batch_size=4, collate_fn=collator)
    _parity(_t5, loader, eager, [32, 16], true_positions=lambda b: b["labels"] != -100)


# ---- Trainer and Accelerate --------------------------------------------------

def _trainer_run(use_cpu, output_dir):
    """Three steps of Trainer fine-tuning the BERT classifier with dynamic
    padding: (losses, the sequence lengths the model was given)."""
    torch.manual_seed(0)
    model = _bert_classifier()
    lengths = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    args = transformers.TrainingArguments(output_dir=str(output_dir), max_steps=3,
                                          per_device_train_batch_size=4, report_to="none",
                                          logging_steps=1, use_cpu=use_cpu, seed=0,
                                          dataloader_drop_last=True)
    tok = tokenizer()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=examples([19, 40, 70], 4),
                                   data_collator=transformers.DataCollatorWithPadding(tok))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], lengths


def test_trainer_batches_are_bucketed_with_cpus_losses(tmp_path, fresh_accelerate_state):
    tpu_losses, tpu_lengths = _trainer_run(False, tmp_path / "tpu")
    cpu_losses, cpu_lengths = _trainer_run(True, tmp_path / "cpu")
    assert len(tpu_lengths) == 3 and all(n not in (32, 64, 128) for n in cpu_lengths)
    assert tpu_lengths == [_power_bucket(n) for n in cpu_lengths]
    assert len(tpu_losses) == 3
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), **TOL)


def test_accelerate_loaders_are_bucketed_once_with_the_same_switch(monkeypatch, fresh_accelerate_state):
    from accelerate import Accelerator
    monkeypatch.delenv("TORCHTPU_BUCKETS", raising=False)
    loader = DataLoader(examples([19, 40], 2), batch_size=2,
                        collate_fn=transformers.DataCollatorWithPadding(tokenizer()))
    prepared = Accelerator().prepare(loader)

    def lengths(batches):
        out = []
        for b in batches:
            assert b["input_ids"].device.type == "tpu"
            out.append(b["input_ids"].shape[1])
        return out

    assert lengths(prepared) == [32, 64]
    assert lengths(DeviceLoader(prepared)) == [32, 64]  # DeviceLoader's own, from below
    assert lengths(DeviceLoader(prepared, buckets=[48, 96])) == [48, 48]
    assert lengths(DeviceLoader(prepared, buckets=None)) == [19, 40]
    monkeypatch.setenv("TORCHTPU_BUCKETS", "off")
    assert lengths(prepared) == [19, 40]
    monkeypatch.setenv("TORCHTPU_BUCKETS", "40,80")
    assert lengths(prepared) == [40, 40]
    first, plain = next(iter(prepared)), next(iter(loader))  # the loader's values, then padding
    torch.testing.assert_close(first["input_ids"].cpu()[:, :19], plain["input_ids"], rtol=0, atol=0)
    assert (first["input_ids"].cpu()[:, 19:] == PAD).all()
    assert (first["attention_mask"].cpu()[:, 19:] == 0).all()
