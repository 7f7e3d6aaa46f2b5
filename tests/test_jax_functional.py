"""A torch module as a pure JAX function (torchtpu.jax.functionalize) and
exported as StableHLO (torchtpu.export): outputs and jax.grad gradients
against PyTorch CPU on an MLP, a CNN with BatchNorm and a small
transformer; jax.jit, vmap and lax.scan; BatchNorm's running statistics as a
new state; random ops from a key; the exported program run by a process
that imports JAX alone."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchtpu
from torchtpu.jax import functionalize


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def _cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))


def _transformer():
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)


MODELS = {"mlp": (_mlp, (5, 6)), "cnn": (_cnn, (2, 3, 8, 8)), "transformer": (_transformer, (2, 7, 16))}


def _loss(out):
    return (out.float() ** 2).mean()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_outputs_and_gradients_equal_torchs(name):
    make, shape = MODELS[name]
    model = make()
    x = torch.randn(shape)
    params, fn = functionalize(model)
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    assert set(params) == names
    assert all(isinstance(a, jax.Array) for a in params.values())

    # Differentiated with respect to the parameters, the buffers held (an
    # integer buffer, such as BatchNorm's step count, has no gradient).
    trainable = {n: params[n] for n, _ in model.named_parameters()}

    def loss(p, x):
        out, _ = fn({**params, **p}, x)
        return (out ** 2).mean(), out

    (value, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(trainable, jnp.asarray(x.numpy()))
    expected = model(x)
    _loss(expected).backward()
    np.testing.assert_allclose(np.asarray(out), expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(value), float(_loss(expected)), rtol=1e-5)
    for n, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[n]), p.grad.numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=n)
    # Mapped over two batches: each is the module's forward on that batch.
    xs = torch.stack([x, torch.randn(shape)])
    mapped = jax.jit(jax.vmap(lambda b: fn(params, b)[0]))(jnp.asarray(xs.numpy()))
    for i in range(2):
        np.testing.assert_allclose(np.asarray(mapped[i]), model(xs[i]).detach().numpy(),
                                   rtol=1e-5, atol=1e-5)


def test_batchnorm_statistics_come_back_as_state():
    model = _cnn()
    x = torch.randn(2, 3, 8, 8)
    params, fn = functionalize(model)
    before = {n: b.clone() for n, b in model.named_buffers()}
    out, updated = jax.jit(fn)(params, jnp.asarray(x.numpy()))
    # The module's own buffers are untouched; the new ones are returned.
    for n, b in model.named_buffers():
        torch.testing.assert_close(b, before[n])
    expected = model(x)  # train mode: updates the CPU model's statistics
    np.testing.assert_allclose(np.asarray(out), expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    assert sorted(updated) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    for n, b in model.named_buffers():
        np.testing.assert_allclose(np.asarray(updated[n]), b.numpy(), rtol=1e-5, atol=1e-7)
    # In eval mode the forward reads the statistics and writes none.
    model.eval()
    params, fn = functionalize(model)
    out, updated = fn(params, jnp.asarray(x.numpy()))
    assert updated == {}
    np.testing.assert_allclose(np.asarray(out), model(x).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_vmap_and_scan():
    model = _mlp()
    x = torch.randn(4, 5, 6)
    params, fn = functionalize(model)
    xs = jnp.asarray(x.numpy())
    per_batch = jax.vmap(lambda b: fn(params, b)[0])(xs)
    np.testing.assert_allclose(np.asarray(per_batch), model(x).detach().numpy(), rtol=1e-5, atol=1e-6)

    def body(carry, b):
        out, _ = fn(params, b)
        return carry + out.sum(), out

    total, outs = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
    np.testing.assert_allclose(np.asarray(outs), model(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(total), float(model(x).sum()), rtol=1e-4)


def test_sgd_steps_through_jit_grad_equal_torchs():
    model = _mlp()
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    params, fn = functionalize(model)

    @jax.jit
    def step(p, x, y):
        def loss(p):
            return ((fn(p, x)[0] - y) ** 2).mean()
        value, g = jax.value_and_grad(loss)(p)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), value

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    jx, jy = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    for _ in range(3):
        params, value = step(params, jx, jy)
        opt.zero_grad()
        expected = torch.nn.functional.mse_loss(model(x), y)
        expected.backward()
        opt.step()
        np.testing.assert_allclose(float(value), float(expected), rtol=1e-5)
    for n, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(params[n]), p.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_tpu_model_and_nested_outputs():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x, scale=1.0):
            y = self.lin(x) * scale
            return {"y": y, "parts": (y.sum(), [y.relu()])}

    torch.manual_seed(0)
    model = Two().to("tpu")
    x = torch.randn(4, 3)
    params, fn = functionalize(model)
    out, _ = fn(params, jnp.asarray(x.numpy()), scale=2.0)
    expected = model.to("cpu")(x, scale=2.0)
    np.testing.assert_allclose(np.asarray(out["y"]), expected["y"].detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(float(out["parts"][0]), float(expected["parts"][0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out["parts"][1][0]), expected["parts"][1][0].detach().numpy(),
                               rtol=1e-6)


def test_random_ops_draw_from_the_key():
    model = torch.nn.Dropout(0.5)
    params, fn = functionalize(model)
    x = jnp.ones(1000, jnp.float32)
    with pytest.raises(RuntimeError, match="rng_key="):
        fn(params, x)
    step = jax.jit(fn)
    a, _ = step(params, x, rng_key=jax.random.key(1))
    b, _ = step(params, x, rng_key=jax.random.key(1))
    c, _ = step(params, x, rng_key=jax.random.key(2))
    a, b, c = np.asarray(a), np.asarray(b), np.asarray(c)
    np.testing.assert_array_equal(a, b)        # one key, one mask
    assert not np.array_equal(a, c)            # another key, another mask
    assert set(np.unique(a)) <= {0.0, 2.0} and 400 < (a == 0).sum() < 600
    # The process's own generator is where it was.
    torch.manual_seed(5)
    first = torch.rand(3, device="tpu").cpu()
    torch.manual_seed(5)
    fn(params, x, rng_key=jax.random.key(0))
    torch.testing.assert_close(torch.rand(3, device="tpu").cpu(), first)


def test_an_exported_program_runs_in_a_process_without_torch(tmp_path):
    model = _transformer().eval()
    x = torch.randn(2, 7, 16)
    exported = torchtpu.export(model, (x,))
    exported.save(tmp_path)
    np.save(tmp_path / "x.npy", x.numpy())
    # The same program, here and from its own process.
    np.testing.assert_allclose(np.asarray(exported.call(jnp.asarray(x.numpy()))),
                               model(x).detach().numpy(), rtol=1e-5, atol=1e-5)
    script = textwrap.dedent(f"""
        import sys
        import jax, numpy as np
        jax.config.update("jax_enable_x64", True)
        exported = jax.export.deserialize(open({str(tmp_path / 'program.bin')!r}, "rb").read())
        params = dict(np.load({str(tmp_path / 'params.npz')!r}))
        out = exported.call(params, np.load({str(tmp_path / 'x.npy')!r}))
        np.save({str(tmp_path / 'out.npy')!r}, np.asarray(out))
        assert "torch" not in sys.modules and "torchtpu" not in sys.modules
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTPU")}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, env=env)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), model(x).detach().numpy(),
                               rtol=1e-5, atol=1e-5)


def test_a_torch_export_program_is_accepted():
    model = _mlp()
    x = torch.randn(5, 6)
    program = torch.export.export(model, (x,))
    params, fn = functionalize(program)
    out, _ = jax.jit(fn)(params, jnp.asarray(x.numpy()))
    np.testing.assert_allclose(np.asarray(out), model(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    exported = torchtpu.export(program, (x,))
    np.testing.assert_allclose(np.asarray(exported.call(jnp.asarray(x.numpy()))),
                               model(x).detach().numpy(), rtol=1e-5, atol=1e-6)


_SERVE = """
import sys
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
folder = sys.argv[1]
for name in sys.argv[2:]:
    program = jax.export.deserialize(open(f"{folder}/{name}/program.bin", "rb").read())
    params = dict(np.load(f"{folder}/{name}/params.npz"))
    inputs = np.load(f"{folder}/{name}/inputs.npz")
    out = program.call(params, *[inputs[f"arg{i}"] for i in range(len(inputs.files))])
    out = out["logits"] if isinstance(out, dict) else out
    np.save(f"{folder}/{name}/out.npy", np.asarray(out))
assert "torch" not in sys.modules and "torchtpu" not in sys.modules
"""


def _serve(folder, names):
    """Each exported program in folder/NAME run by a process that imports JAX
    alone, on folder/NAME/inputs.npz: its outputs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTPU")}
    subprocess.run([sys.executable, "-c", _SERVE, str(folder), *names], check=True, timeout=180, env=env)
    return {n: np.load(folder / n / "out.npy") for n in names}


def test_a_symbolic_batch_runs_at_other_sizes_without_torch(tmp_path):
    served, expected = [], {}
    for name in sorted(MODELS):
        make, shape = MODELS[name]
        model = make().eval()
        exported = torchtpu.export(model, (torch.randn(shape),), dynamic_shapes=({0: "batch"},))
        for batch in (3, 5):
            x = torch.randn(batch, *shape[1:])
            folder = tmp_path / f"{name}{batch}"
            exported.save(folder)
            np.savez(folder / "inputs.npz", arg0=x.numpy())
            served.append(folder.name)
            expected[folder.name] = model(x).detach().numpy()
    for name, out in _serve(tmp_path, served).items():
        np.testing.assert_allclose(out, expected[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_batch_whose_examples_mix_is_refused():
    model = _cnn()  # training: batch norm's statistics mix the examples
    with pytest.raises(ValueError, match="not independent along the batch"):
        torchtpu.export(model, (torch.randn(3, 3, 8, 8),), dynamic_shapes={"input": {0: "batch"}})
    with pytest.raises(NotImplementedError, match="only dimension 0"):
        torchtpu.export(_mlp(), (torch.randn(2, 6),), dynamic_shapes=({1: "width"},))
    with pytest.raises(TypeError, match="give tensor inputs in args"):
        torchtpu.export(_mlp(), (), kwargs={"input": torch.randn(2, 6)})


def test_a_hugging_face_llama_exports_and_serves_its_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=100,
                                      attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded sequence
    exported = torchtpu.export(model, (ids, mask), kwargs={"use_cache": False},
                               dynamic_shapes=({0: "batch"}, {0: "batch"}))
    exported.save(tmp_path / "llama")
    ids3, mask3 = torch.randint(0, 100, (3, 12)), torch.ones(3, 12, dtype=torch.int64)
    mask3[2, :5] = 0
    np.savez(tmp_path / "llama" / "inputs.npz", arg0=ids3.numpy(), arg1=mask3.numpy())
    out = _serve(tmp_path, ["llama"])["llama"]
    expected = model(ids3, attention_mask=mask3, use_cache=False).logits.detach().numpy()
    keep = mask3.numpy().astype(bool)  # logits at padding positions are not defined alike
    np.testing.assert_allclose(out[keep], expected[keep], rtol=1e-5, atol=1e-5)


def test_bfloat16_parameters_are_not_saved_as_bytes(tmp_path):
    model = _mlp().to(torch.bfloat16)
    exported = torchtpu.export(model, (torch.randn(5, 6, dtype=torch.bfloat16),))
    np.testing.assert_allclose(
        np.asarray(exported.call(jnp.ones((5, 6), jnp.bfloat16)), np.float32),
        model(torch.ones(5, 6, dtype=torch.bfloat16)).float().detach().numpy(), rtol=2e-2, atol=2e-2)
    with pytest.raises(TypeError, match="numpy cannot store the bfloat16"):
        exported.save(tmp_path)
    assert not list(tmp_path.iterdir())


def test_the_example_trains_exports_and_serves():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(root, "examples", "jax_interop.py")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0] / 10
    served = [line for line in done.stdout.splitlines() if line.startswith("served:")]
    assert served, done.stdout
