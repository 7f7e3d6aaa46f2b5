"""Hugging Face transformers models, built small from their configs (nothing
downloaded), train on tpu as on CPU: losses and parameters after a few AdamW
steps, in every mode. GPT-2, BERT and T5 tie their input embedding to their
output layer; `.to("tpu")` keeps the tie."""
import copy

import pytest
import torch

from conftest import platform_tol

transformers = pytest.importorskip("transformers")


def _llama():
    # Grouped-query attention (4 query heads, 2 key/value heads), RoPE, RMSNorm.
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="sdpa"))


def _gpt2():
    # Tied embedding and output layer; dropout off, so CPU and tpu agree.
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="sdpa"))


def _bert():
    # Tied word embedding and decoder (and the decoder's bias).
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="sdpa"))


def _t5():
    # One embedding shared by the encoder, the decoder and the output layer.
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=True))


def _mixtral():
    # Sparse mixture of experts: top-2 routing over 4 experts, run by
    # transformers' grouped experts path (a sort, histc of the expert ids).
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, attn_implementation="sdpa"))


def _ties(model):
    """The parameter names of the model, grouped by the parameter they name."""
    groups = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(groups.values())


def _train_parity(make, compile_backend=None):
    """Three AdamW steps on tpu (the model compiled with compile_backend, if
    given) and on CPU: losses and parameters compared."""
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref).to("tpu")
    assert _ties(model) == _ties(ref)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    run = model if compile_backend is None else torch.compile(model, backend=compile_backend)
    runs = [(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), ids),
            (run, torch.optim.AdamW(model.parameters(), lr=1e-3), ids.to("tpu"))]
    for _ in range(3):
        losses = []
        for m, opt, x in runs:
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().cpu())
        torch.testing.assert_close(losses[1], losses[0], **platform_tol(1e-4, 1e-5))
    ref_state = ref.state_dict()
    for name, value in model.state_dict().items():
        assert value.is_tpu, name
        torch.testing.assert_close(value.cpu(), ref_state[name], **platform_tol(1e-4, 1e-5),
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("make", [_llama, _gpt2, _bert, _t5, _mixtral], ids=["llama", "gpt2", "bert", "t5", "mixtral"])
def test_training_parity(mode, make):
    _train_parity(make)


def test_compiled_llama_trains_as_on_cpu(mode):
    """torch.compile(backend="tpu"): the model makes tpu tensors in forward
    (positions, the causal mask), which Dynamo captures."""
    torch._dynamo.reset()
    _train_parity(_llama, compile_backend="tpu")


def test_gradient_checkpointing_with_dropout_and_deepcopy(mode):
    # gradient_checkpointing_enable() recomputes each block in backward: its
    # dropout masks must be the forward's (torch.utils.checkpoint restores the
    # device's random state), so the gradients equal the unchecked model's.
    # The checkpointed model is a deepcopy of the tpu model, as HF's own
    # model tests make theirs.
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3,
                                     attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to("tpu").train()
    checked = copy.deepcopy(model)
    checked.gradient_checkpointing_enable()
    assert checked.lm_head.weight is checked.transformer.wte.weight
    ids = torch.randint(0, 64, (2, 12), device="tpu")
    results = []
    for m in (model, checked):
        torch.manual_seed(5)
        loss = m(ids, labels=ids).loss
        loss.backward()
        results.append([loss.detach().cpu()] + [p.grad.cpu() for p in m.parameters()])
    for plain, recomputed in zip(*results):
        torch.testing.assert_close(recomputed, plain)
