"""torch.nn.attention.flex_attention on tpu tensors, called eagerly: outputs,
log-sum-exp and gradients (q, k, v, and a tensor score_mod reads) equal
flex_attention's on CPU, in every mode, with nothing run on the CPU fallback.

CPU's flex_attention refuses inputs that require grad (its compiled CPU
kernel has no backward), but its dense implementation, the one CUDA runs without
torch.compile, differentiates: the `cpu_grads` fixture lifts that one check
for CPU inputs, so CPU's gradients are the reference. test_no_mask also
checks that reference against scaled_dot_product_attention."""
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401  (flex_attention's eager path runs Dynamo)
import torch.nn.attention.flex_attention as fa
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

import torchtpu
from conftest import assert_same, compare, make

# One shape for q, k and v (batch, heads, length, head dim); GQA's q has
# twice the heads.
SHAPE = (2, 2, 16, 8)
GQA_SHAPE = (2, 4, 16, 8)
L = SHAPE[2]

# The document of each position: three packed into one sequence.
DOCS = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)


@pytest.fixture(autouse=True)
def _quiet():
    # flex_attention's one-time advice to use torch.compile, and the
    # deprecation of return_lse (tested on purpose).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


@pytest.fixture
def cpu_grads(monkeypatch):
    validate = fa._validate_device
    monkeypatch.setattr(fa, "_validate_device",
                        lambda q, k, v: None if q.device.type == "cpu" else validate(q, k, v))


def _qkv(q_shape=SHAPE, kv_shape=SHAPE):
    return make(torch.float32, q_shape, seed=1), make(torch.float32, kv_shape, seed=2), \
        make(torch.float32, kv_shape, seed=3)


def test_no_mask(mode, cpu_grads):
    q, k, v = _qkv()
    compare(lambda q, k, v: flex_attention(q, k, v), q, k, v)
    # The CPU reference is attention's: with the same gradients.
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out, expected = flex_attention(*args), torch.nn.functional.scaled_dot_product_attention(*ref)
    torch.testing.assert_close(out, expected)
    w = torch.randn(out.shape)
    torch.testing.assert_close(torch.autograd.grad((out * w).sum(), args),
                               torch.autograd.grad((expected * w).sum(), ref))


def _relative(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.1


def _soft_cap(score, b, h, q_idx, kv_idx):
    return 2.0 * torch.tanh(score / 2.0)


@pytest.mark.parametrize("score_mod", [_relative, _soft_cap], ids=["relative", "soft_cap"])
def test_score_mod(mode, cpu_grads, score_mod):
    compare(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod), *_qkv())


def test_score_mod_reads_a_captured_tensor(mode, cpu_grads):
    # Its gradient too: the bias is a parameter a model learns.
    def attend(q, k, v, bias):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[h, q_idx, kv_idx])
    compare(attend, *_qkv(), make(torch.float32, (SHAPE[1], L, L), seed=4))


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 4)


def _masks(device):
    docs = DOCS.to(device)  # read by the mask: captured, on the inputs' device
    return {"causal": _causal, "sliding_window": _sliding_window,
            "document": lambda b, h, q_idx, kv_idx: docs[q_idx] == docs[kv_idx]}


@pytest.mark.parametrize("mask", ["causal", "sliding_window", "document"])
def test_block_mask(mode, cpu_grads, mask):
    def attend(q, k, v):
        block_mask = create_block_mask(_masks(q.device)[mask], None, None, L, L, device=q.device)
        return flex_attention(q, k, v, block_mask=block_mask)
    compare(attend, *_qkv())


def test_block_mask_with_score_mod_and_batch_heads(mode, cpu_grads):
    # A mask made per batch element and head (B, H given).
    def attend(q, k, v):
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) | (h == b),
                                       SHAPE[0], SHAPE[1], L, L, device=q.device)
        return flex_attention(q, k, v, score_mod=_soft_cap, block_mask=block_mask)
    compare(attend, *_qkv())


def test_gqa_lse_and_scale(mode, cpu_grads):
    # return_lse (deprecated, still served): gradients flow through both outputs.
    def attend(q, k, v):
        block_mask = create_block_mask(_causal, None, None, L, L, device=q.device)
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True, scale=0.5)
    out, lse = compare(attend, *_qkv(GQA_SHAPE, SHAPE))
    assert lse.shape == GQA_SHAPE[:3] and lse.dtype == torch.float32


def test_return_aux(mode, cpu_grads):
    def attend(q, k, v):
        out, aux = flex_attention(q, k, v, score_mod=_relative, return_aux=AuxRequest(lse=True))
        assert aux.max_scores is None
        return out, aux.lse
    compare(attend, *_qkv())


def test_max_scores(mode):
    # CPU cannot return them (CUDA can): the reference is their definition,
    # the largest modified score of each query.
    q, k, v = _qkv()
    out, aux = flex_attention(q.to("tpu"), k.to("tpu"), v.to("tpu"), score_mod=_relative,
                              return_aux=AuxRequest(lse=True, max_scores=True))
    scores = q @ k.transpose(-2, -1) / SHAPE[-1] ** 0.5
    scores = scores + (torch.arange(L)[:, None] - torch.arange(L)) * 0.1
    assert_same(aux.max_scores, scores.amax(-1))
    assert_same(aux.lse, scores.logsumexp(-1))
    assert_same(out, scores.softmax(-1) @ v)


def test_no_grad_forward(mode):
    # Inference: no log-sum-exp is kept; CPU's own flex_attention, unpatched.
    q, k, v = _qkv()
    block_mask = create_block_mask(_causal, None, None, L, L, device="tpu")
    with torch.no_grad():
        out = flex_attention(q.to("tpu"), k.to("tpu"), v.to("tpu"), block_mask=block_mask)
    cpu_mask = create_block_mask(_causal, None, None, L, L, device="cpu")
    assert_same(out, flex_attention(q, k, v, block_mask=cpu_mask))


def test_block_mask_on_another_device(mode):
    # As CPU and CUDA: a RuntimeError, whichever side is on tpu.
    q = make(torch.float32, SHAPE)
    for q_device, mask_device in (("tpu", "cpu"), ("cpu", "tpu")):
        block_mask = create_block_mask(_causal, None, None, L, L, device=mask_device)
        x = q.to(q_device)
        with pytest.raises(RuntimeError, match="Expect q/k/v and block_mask to be on the same device"):
            flex_attention(x, x, x, block_mask=block_mask)


def test_other_devices_keep_their_checks(mode):
    # CPU still refuses inputs that require grad.
    q = make(torch.float32, SHAPE).requires_grad_()
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, q, q)


def test_backward_error_is_raised_not_fatal(mode):
    # Lower-precision k and v: forward as CPU's; backward refuses with the
    # error PyTorch gives on CUDA, raised at backward(), and the process
    # goes on.
    q, k, v = _qkv()
    k, v = k.bfloat16(), v.bfloat16()
    tq = q.to("tpu").requires_grad_()
    out = flex_attention(tq, k.to("tpu"), v.to("tpu"))
    assert_same(out, flex_attention(q, k, v))
    with pytest.raises(ValueError, match="mixed query, key, and value dtype"):
        out.sum().backward()
    compare(lambda q, k, v: flex_attention(q, k, v, score_mod=_relative), *_qkv(), grad=False)


def test_autocast(mode, cpu_grads):
    # q, k and v cast to bfloat16 as CUDA's autocast casts them; gradients
    # reach the float32 inputs.
    def attend(q, k, v):
        with torch.autocast(q.device.type, dtype=torch.bfloat16):
            out = flex_attention(q, k, v, score_mod=_soft_cap)
        assert out.dtype == torch.bfloat16
        return out
    compare(attend, *_qkv())


def test_untraced_score_mod_capturing_a_tensor_says_why(mode, monkeypatch):
    # torch's debugging switch: score_mod runs as plain Python. Forward
    # works; backward cannot trace a captured tpu tensor, and says so.
    monkeypatch.setattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    q = make(torch.float32, SHAPE)
    bias = make(torch.float32, (SHAPE[1], L, L), seed=4)
    x, tbias = q.to("tpu"), bias.to("tpu")

    def biased(bias):
        return lambda s, b, h, q_idx, kv_idx: s + bias[h, q_idx, kv_idx]
    assert_same(flex_attention(x, x, x, score_mod=biased(tbias)),
                flex_attention(q, q, q, score_mod=biased(bias)))
    x.requires_grad_()
    with pytest.raises(NotImplementedError, match="_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"):
        flex_attention(x, x, x, score_mod=biased(tbias))


@pytest.mark.parametrize("eager_mode", ["debug", "strict", "fused"])
def test_compiled(eager_mode, cpu_grads):
    # torch.compile(flex_attention): the `tpu` backend runs the same kernels
    # inside one computation per graph (none of them op by op).
    from torchtpu import compile as tpu_compile, compiled as compiled_graphs
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return tpu_compile.tpu_backend(gm, example_inputs)
    compiled = torch.compile(flex_attention, backend=backend)

    def attend(q, k, v):
        block_mask = create_block_mask(_causal, None, None, L, L, device=q.device)
        run = compiled if q.device.type == "tpu" else flex_attention
        return run(q, k, v, score_mod=_soft_cap, block_mask=block_mask)
    fallbacks = dict(compiled_graphs.graph_fallbacks)
    with torchtpu.eager_mode(eager_mode):
        compare(attend, *_qkv())
        torchtpu.sync()
    assert any(node.target is torch.ops.higher_order.flex_attention
               for gm in graphs for node in gm.graph.nodes)
    assert compiled_graphs.graph_fallbacks == fallbacks



# ---- what Hugging Face's models give flex_attention --------------------------
# transformers calls torch.compile(flex_attention) (Inductor, which sends tpu
# graphs to the `tpu` backend), with a mask_mod reading a padding mask per
# batch element and a score_mod reading a bias (T5's relative position bias,
# batch size 1). CPU's reference is its dense implementation, uncompiled
# (Inductor's CPU kernel has no backward).

_hf_compiled = torch.compile(flex_attention)
LENGTHS = (L, L - 5)  # the keys each batch element attends to: the second is padded


@pytest.fixture
def fresh_dynamo():
    # Each test compiles afresh, as a new process does: a compiled graph's
    # kernel is traced where the mode first runs it (fused mode: at a flush,
    # which can come from inside another op), not reused from another mode.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _hf_attend(q, k, v, bias, lengths=LENGTHS):
    """flex_attention as transformers calls it: on tpu through torch.compile,
    with a padding mask and a bias that has one row for every batch element,
    which score_mod reads per batch element once broadcast as PyTorch
    broadcasts (expand; its gradient is the sum over the batch)."""
    n = q.shape[-2]
    valid = torch.tensor(lengths, device=q.device)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < valid[b],
                                   q.shape[0], None, n, n, device=q.device)
    full = bias.expand(q.shape[0], -1, -1, -1)
    run = _hf_compiled if q.device.type == "tpu" else flex_attention
    return run(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + full[b, h, q_idx, kv_idx],
               block_mask=block_mask)


def _bias_grad(device, q, k, v, bias):
    x = [t.to(device).requires_grad_() for t in (q, k, v, bias)]
    _hf_attend(*x).sum().backward()
    return x[3].grad


def test_padding_mask_and_a_bias_broadcast_along_the_batch(mode, cpu_grads, fresh_dynamo):
    # Forward and backward as on CPU in every mode (fused mode had failed at
    # the flush: "NYI: querying is_contiguous inside of vmap").
    q, k, v = _qkv()
    bias = make(torch.float32, (1, SHAPE[1], L, L), seed=4)
    compare(_hf_attend, q, k, v, bias)
    # The bias's gradient reaches it (compare() takes a missing tpu gradient
    # for one as accurate as CPU's): the `tpu` backend's backward graph had
    # returned none for a tensor score_mod reads.
    assert_same(_bias_grad("tpu", q, k, v, bias), _bias_grad("cpu", q, k, v, bias))


def _hf_layout(x):
    # q, k and v as transformers makes them: (batch, length, heads, dim)
    # projections, transposed.
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def test_compiled_at_new_lengths(mode, cpu_grads, fresh_dynamo):
    # A second length makes Dynamo compile flex_attention again with
    # symbolic sizes (a decoder after its encoder): the output, laid out as
    # q is, had symbolic strides, which a tpu tensor cannot carry. At the
    # third length the bias's gradient had been None: the forward graph
    # copied the inputs it saves for backward, which lost requires_grad
    # (test_compile's test_dynamic_shapes_return_saved_inputs_as_they_came_at_every_size).
    for n in (L, L + 8, L + 4):
        q, k, v = (_hf_layout(make(torch.float32, (2, 2, n, 8), seed=s)) for s in (1, 2, 3))
        compare(lambda q, k, v, bias: _hf_attend(q, k, v, bias, (n, n - 5)),
                q, k, v, make(torch.float32, (1, 2, n, n), seed=4))


def test_an_index_past_a_size_one_dim_raises_as_on_cpu(mode, fresh_dynamo):
    # T5's score_mod reads its bias of batch size 1 at each batch index.
    # CPU raises (eagerly this IndexError; compiled by Inductor, its bounds
    # assert): flex_attention does not broadcast a tensor score_mod reads.
    # (Inductor's CUDA kernel reads element 0 with its asserts compiled out:
    # pytorch/pytorch#172225.) The tpu error is CPU's, at the next sync.
    q = make(torch.float32, SHAPE)
    bias = make(torch.float32, (1, SHAPE[1], L, L), seed=4)

    def per_batch(bias):
        return lambda s, b, h, q_idx, kv_idx: s + bias[b, h, q_idx, kv_idx]
    with pytest.raises(IndexError) as cpu_error:
        flex_attention(q, q, q, score_mod=per_batch(bias))
    x = q.to("tpu")
    with pytest.raises(IndexError, match=str(cpu_error.value)):
        _hf_compiled(x, x, x, score_mod=per_batch(bias.to("tpu"))).cpu()


def test_an_unread_call_leaves_nothing_for_the_next(mode, cpu_grads, fresh_dynamo, monkeypatch):
    # Two calls in one process: the first's result not read, as in a test
    # that only calls the model; the second reads a value of its own inside
    # an op (transformers' masking reads padding_mask.all() so), where fused
    # mode runs the first call's graph, new, op by op (as it runs a model's
    # long forward: here any graph), tracing the compiled call's kernel
    # there: it had failed, in the second call. Each gets CPU's values.
    monkeypatch.setenv("TORCHTPU_FUSED_BACKGROUND_OPS", "1")
    q, k, v = _qkv()
    bias = make(torch.float32, (1, SHAPE[1], L, L), seed=4)
    first = _hf_attend(q.to("tpu"), k.to("tpu"), v.to("tpu"), bias.to("tpu"))
    mask = torch.tensor([True, False, True])
    assert bool(mask.to("tpu").all()) is bool(mask.all())
    assert_same(first, _hf_attend(q, k, v, bias))


# A T5 model of transformers with attn_implementation="flex_attention"
# (relative position bias read by score_mod, padding and causal masks,
# cross-attention, a decoder of another length), forward and backward, in
# each mode, against the same model on CPU with its eager attention (Inductor's
# CPU kernel, which transformers would call there, has no backward). One
# batch element: T5's score_mod reads its bias of batch size 1 at each batch
# index, which CPU refuses for more (test above). In a process of its own:
# transformers asks once, of the host's accelerator (tpu after `import
# torchtpu`, a device it takes for torch_xla's), whether it offers
# flex_attention; torchtpu primes that answer, so a user's script imports
# torchtpu first, as this one does.
T5_WORKER = """
import warnings
warnings.simplefilter("ignore")
import torch, torchtpu
from transformers.utils.import_utils import is_torch_flex_attn_available
assert is_torch_flex_attn_available()
from transformers import T5Config, T5Model

def t5(attention):
    return T5Model(T5Config(d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=37, vocab_size=99,
                            dropout_rate=0.0, attn_implementation=attention))

def run(model, device, ids, mask, decoder_ids):
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                decoder_input_ids=decoder_ids.to(device))
    (out.last_hidden_state.sum() + out.encoder_last_hidden_state.square().sum()).backward()
    return out.last_hidden_state.detach().cpu(), out.encoder_last_hidden_state.detach().cpu()

torch.manual_seed(0)
cpu = t5("eager")
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 99, (1, 7), generator=g)
decoder_ids = torch.randint(0, 99, (1, 5), generator=g)
mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
want = run(cpu, "cpu", ids, mask, decoder_ids)
for mode in ("strict", "fused"):  # (debug runs strict's kernels; the other tests cover it)
    torch._dynamo.reset()  # each mode compiles its graphs afresh
    with torchtpu.eager_mode(mode):
        model = t5("flex_attention")
        model.load_state_dict(cpu.state_dict())
        model.to("tpu")
        got = run(model, "tpu", ids, mask, decoder_ids)
        torch.testing.assert_close(got, want, msg=lambda m: f"{mode}: {m}")
        for (name, p), q in zip(model.named_parameters(), cpu.parameters()):
            assert p.grad is not None, f"{mode}: {name} has no gradient"
            torch.testing.assert_close(p.grad.cpu(), q.grad, msg=lambda m: f"{mode}: {name}: {m}")
print("same as CPU")
"""


def test_t5_as_on_cpu():
    import os
    import subprocess
    import sys
    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, "-c", T5_WORKER], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, TORCHTPU_CACHE_DIR="off"))
    assert done.returncode == 0 and done.stdout.strip() == "same as CPU", done.stdout + done.stderr
