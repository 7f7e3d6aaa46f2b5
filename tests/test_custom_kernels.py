"""custom_jax_kernel: JAX and Pallas functions as torch ops on tpu tensors,
forward and gradients against the same math in torch ops on CPU, in every
mode; errors at the caller's line; one fused graph per step; traced and
static Python numbers."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl

import torchtpu
from torchtpu import metrics
from torchtpu.tensor import Pending

from conftest import ON_TPU, assert_at_line, assert_same

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- kernels and the same math in torch ops ----------------------------------

@torchtpu.custom_jax_kernel
def rms_norm(x, weight, eps=1e-6):
    variance = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + eps) * weight


def rms_norm_torch(x, weight, eps=1e-6):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _bias_gelu_kernel(x_ref, b_ref, o_ref):
    h = x_ref[...] + b_ref[...]
    o_ref[...] = h * jax.nn.sigmoid(1.702 * h)


def _bias_gelu_grad_kernel(g_ref, x_ref, b_ref, o_ref):
    h = x_ref[...] + b_ref[...]
    s = jax.nn.sigmoid(1.702 * h)
    o_ref[...] = g_ref[...] * (s + 1.702 * h * s * (1 - s))


def _pallas(kernel, like, *args):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(like.shape, like.dtype),
                          interpret=not ON_TPU)(*args)  # compiled by Mosaic on a TPU


def _bias_gelu_vjp(grad, x, b):
    d = _pallas(_bias_gelu_grad_kernel, x, grad, x, b)
    return d, d


@torchtpu.custom_jax_kernel(vjp=_bias_gelu_vjp)
def bias_gelu(x, b):
    """Pallas (interpreted off a TPU); pallas_call has no reverse-mode rule, so vjp= gives one."""
    return _pallas(_bias_gelu_kernel, x, x, b)


def bias_gelu_torch(x, b):
    h = x + b
    return h * torch.sigmoid(1.702 * h)


def _inputs(*shapes):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(s, generator=g) for s in shapes]


def _forward_backward(fn, cpu_inputs, *extra, device):
    """fn's output and every input's gradient through a random weighting."""
    xs = [x.detach().to(device).requires_grad_() for x in cpu_inputs]
    out = fn(*xs, *extra)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(device)
    (out * weight).sum().backward()
    return out, [x.grad for x in xs]


def _compare(kernel, reference, inputs, *extra):
    out, grads = _forward_backward(kernel, inputs, *extra, device="tpu")
    ref, ref_grads = _forward_backward(reference, inputs, *extra, device="cpu")
    assert_same(out, ref.detach())
    for g, r in zip(grads, ref_grads):
        assert_same(g, r)


# ---- forward and gradients -------------------------------------------------------

def test_jax_kernel_forward_and_gradients(mode):
    x, w = _inputs((4, 16), (16,))
    before = dict(metrics.M.cpu_fallbacks)
    _compare(rms_norm, rms_norm_torch, [x, w])
    _compare(rms_norm, rms_norm_torch, [x, w], 1e-2)
    assert dict(metrics.M.cpu_fallbacks) == before


def test_jax_kernel_float64_and_bfloat16(mode):
    x, w = _inputs((3, 8), (8,))
    _compare(rms_norm, rms_norm_torch, [x.double(), w.double()])
    out = rms_norm(x.bfloat16().to("tpu"), w.bfloat16().to("tpu"))
    assert out.dtype == torch.bfloat16
    # The kernel computes in bfloat16: within its rounding of the float32 math.
    torch.testing.assert_close(out.cpu().float(), rms_norm_torch(x, w), atol=0.05, rtol=0.02)


def test_pallas_kernel_forward_and_gradients(mode):
    x, b = _inputs((8, 16), (8, 16))
    _compare(bias_gelu, bias_gelu_torch, [x, b])


def test_pallas_kernel_without_vjp_says_what_to_give(mode):
    plain = torchtpu.custom_jax_kernel(bias_gelu.__wrapped__, name="bias_gelu_no_vjp")
    x = torch.randn(4, 8, device="tpu", requires_grad=True)
    b = torch.randn(4, 8, device="tpu")
    assert_same(plain(x, b), bias_gelu_torch(x.detach().cpu(), b.cpu()))
    with pytest.raises(ValueError, match=r"vjp="):
        plain(x, b).sum().backward()


def test_double_backward(mode):
    x, w = _inputs((3, 8), (8,))
    grads = {}
    for device, fn in (("tpu", rms_norm), ("cpu", rms_norm_torch)):
        xd = x.to(device).requires_grad_()
        wd = w.to(device).requires_grad_()
        gx, = torch.autograd.grad(fn(xd, wd).sum(), xd, create_graph=True)
        (gx * gx).sum().backward()
        grads[device] = (gx.detach(), xd.grad, wd.grad)
    for got, want in zip(grads["tpu"], grads["cpu"]):
        assert_same(got, want)


def test_user_vjp_is_used(mode):
    @torchtpu.custom_jax_kernel(vjp=lambda grad, x, s: (grad * 3 * s,))
    def scaled(x, s):
        return x * s
    x = torch.randn(5, device="tpu", requires_grad=True)
    scaled(x, 2.0).sum().backward()
    assert_same(x.grad, torch.full((5,), 6.0))


def test_several_outputs_integer_ones_without_gradient(mode):
    @torchtpu.custom_jax_kernel
    def doubled_and_argmax(x):
        return x * 2, jnp.argmax(x, axis=-1)
    x = torch.randn(3, 5)
    xd = x.to("tpu").requires_grad_()
    y, i = doubled_and_argmax(xd)
    assert_same(i, x.argmax(-1))
    assert_same(y, x * 2)
    (y * y).sum().backward()
    assert_same(xd.grad, 8 * x)


def test_none_and_static_list_arguments(mode):
    @torchtpu.custom_jax_kernel
    def summed(x, bias, axes):
        assert isinstance(axes, tuple)
        out = jnp.sum(x, axis=axes)
        return out if bias is None else out + bias
    x, b = _inputs((2, 3, 4), (3,))
    assert_same(summed(x.to("tpu"), None, (0, 2)), x.sum((0, 2)))
    assert_same(summed(x.to("tpu"), b.to("tpu"), [0, 2]), x.sum((0, 2)) + b)


def test_in_module_forward_and_autocast_keeps_dtypes(mode):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x, norm):
            return norm(self.linear(x), self.weight)
    cpu = Block()
    tpu = Block().to("tpu")
    tpu.load_state_dict(cpu.state_dict())
    x, = _inputs((4, 8))
    assert_same(tpu(x.to("tpu"), rms_norm), cpu(x, rms_norm_torch).detach())
    with torch.autocast("tpu", dtype=torch.bfloat16):
        h = tpu.linear(x.to("tpu"))
        assert h.dtype == torch.bfloat16
        # The kernel is not in autocast's policy: it gets the dtypes given.
        assert rms_norm(h, tpu.weight).dtype == torch.float32
        assert rms_norm(h, tpu.weight.bfloat16()).dtype == torch.bfloat16


# ---- a real torch op ------------------------------------------------------------

def test_registered_as_a_torch_library_op_with_a_meta_kernel():
    x = torch.empty(4, 16, device="meta")
    w = torch.empty(16, dtype=torch.float64, device="meta")
    rms_norm(torch.ones(4, 16, device="tpu"), torch.ones(16, device="tpu"))
    out = torch.ops.torchtpu_kernels.rms_norm.default(x, w, 1e-6)
    assert out.device.type == "meta" and out.shape == (4, 16) and out.dtype == torch.float64
    assert "torchtpu_kernels::rms_norm" in repr(rms_norm)
    with pytest.raises(RuntimeError, match="torchtpu_kernels::rms_norm runs on tpu tensors"):
        rms_norm(torch.ones(2, 16), torch.ones(16))


def test_same_name_twice_gets_a_new_op():
    first = torchtpu.custom_jax_kernel(lambda x: x + 1, name="plus_one")
    second = torchtpu.custom_jax_kernel(lambda x: x + 2, name="plus_one")
    x = torch.zeros(3, device="tpu")
    assert_same(first(x), torch.ones(3))
    assert_same(second(x), torch.full((3,), 2.0))


def test_bad_declarations():
    with pytest.raises(ValueError, match="nope"):
        torchtpu.custom_jax_kernel(lambda x: x, static_argnames=("nope",))
    with pytest.raises(TypeError):
        torchtpu.custom_jax_kernel(lambda *xs: xs[0])
    kernel = torchtpu.custom_jax_kernel(lambda x, obj: x, name="takes_object")
    with pytest.raises(TypeError, match="'obj' is a dict"):
        kernel(torch.ones(2, device="tpu"), {})


# ---- errors at the caller's line ---------------------------------------------------

@torchtpu.custom_jax_kernel
def matmul(a, b):
    return a @ b


@torchtpu.custom_jax_kernel
def exact_add(a, b):
    return jax.lax.add(a, b)


@torchtpu.custom_jax_kernel
def needs_three_rows(x):
    if x.shape[0] != 3:
        raise ValueError(f"needs 3 rows, got {x.shape[0]}")
    return x * 2


def test_shape_error_at_callers_line(mode):
    a, b = torch.ones(2, 3, device="tpu"), torch.ones(4, 5, device="tpu")
    # Once at the op's first call, once through the dispatcher's Meta kernel.
    for b in (b, torch.ones(2, 5, device="tpu")):
        with pytest.raises(RuntimeError, match=r"torchtpu_kernels.matmul.*float32\[2, 3\].*contracting") as err:
            matmul(a, b)
        assert_at_line(err, "matmul(a, b)", __file__)
    assert_same(matmul(a, torch.ones(3, 2, device="tpu")), torch.full((2, 2), 3.0))


def test_dtype_error_at_callers_line(mode):
    a = torch.ones(3, device="tpu")
    for b in (torch.ones(3, device="tpu", dtype=torch.int32), torch.ones(3, device="tpu").double()):
        with pytest.raises(RuntimeError, match="exact_add.*same dtypes") as err:
            exact_add(a, b)
        assert_at_line(err, "exact_add(a, b)", __file__)


def test_kernel_raising_inside_jax_at_callers_line(mode):
    with pytest.raises(ValueError, match="needs_three_rows.*needs 3 rows, got 2") as err:
        needs_three_rows(torch.ones(2, device="tpu"))
    assert_at_line(err, "needs_three_rows(torch.ones(2", __file__)
    assert_same(needs_three_rows(torch.ones(3, device="tpu")), torch.full((3,), 2.0))
    with pytest.raises(ValueError, match="needs 3 rows, got 4") as err:
        needs_three_rows(torch.ones(4, device="tpu"))
    assert_at_line(err, "needs_three_rows(torch.ones(4", __file__)


def test_traced_int_used_as_a_shape_says_to_make_it_static(mode):
    def split_rows(x, rows):
        return x.reshape(rows, -1)
    traced = torchtpu.custom_jax_kernel(split_rows, name="split_rows_traced")
    with pytest.raises(RuntimeError, match="static_argnames") as err:
        traced(torch.ones(6, device="tpu"), 2)
    assert_at_line(err, "traced(torch.ones(6", __file__)
    static = torchtpu.custom_jax_kernel(split_rows, static_argnames="rows")
    assert_same(static(torch.arange(6.0, device="tpu"), 2), torch.arange(6.0).reshape(2, 3))
    assert_same(static(torch.arange(6.0, device="tpu"), 3), torch.arange(6.0).reshape(3, 2))


# ---- fused mode, static and dynamic arguments ------------------------------------

def _train_steps(steps, eps_of_step):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).to("tpu")
    weight = torch.nn.Parameter(torch.ones(16, device="tpu"))
    opt = torch.optim.SGD(list(model.parameters()) + [weight], lr=0.1)
    x, = _inputs((8, 16))
    x = x.to("tpu")
    torchtpu.sync()
    losses = []
    for step in range(steps):
        if step == steps - 1:
            metrics.reset()
        opt.zero_grad()
        h = rms_norm(model(x), weight, eps_of_step(step))
        out = bias_gelu(h, x)
        if torchtpu.get_eager_mode() == "fused":
            assert type(out._storage.array) is Pending  # recorded, not run
        loss = out.square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_fused_training_step_is_one_graph(fresh_kernels):
    with torchtpu.eager_mode("fused"):
        losses = _train_steps(4, lambda step: 1e-6)
        snap = metrics.snapshot()
    # The last step: one flush (its loss.item()), the graph already compiled.
    assert snap["flushes"] == {"item": 1}
    assert snap["graphs_compiled"] == 0 and snap["graph_cache_hits"] == 1
    assert snap["cpu_fallbacks"] == {}
    with torchtpu.eager_mode("strict"):
        reference = _train_steps(4, lambda step: 1e-6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference))


@pytest.mark.parametrize("eager", ["strict", "fused"])
def test_changing_python_float_does_not_recompile(eager):
    with torchtpu.eager_mode(eager):
        _train_steps(2, lambda step: 1e-6)
        # The last step with another eps: the same kernels (strict) or graph (fused).
        _train_steps(3, lambda step: 10.0 ** -(step + 1))
        assert metrics.snapshot()["compilations"] == 0
    x, w = _inputs((4, 16), (16,))
    for eps in (1e-1, 1.0, 3.0):  # each value is used, not the first one compiled
        assert_same(rms_norm(x.to("tpu"), w.to("tpu"), eps), rms_norm_torch(x, w, eps))


@pytest.mark.parametrize("eager", ["debug", "strict"])
def test_static_float_compiles_per_value(eager):
    # (Per kernel: fused mode compiles graphs, and runs changing ones op by op.)
    static_norm = torchtpu.custom_jax_kernel(rms_norm.__wrapped__, name="rms_norm_static",
                                             static_argnames=("eps",))
    x, w = _inputs((4, 16), (16,))
    xd, wd = x.to("tpu"), w.to("tpu")
    compiled = []
    with torchtpu.eager_mode(eager):
        for eps in (1e-1, 1.0, 1e-1):
            before = metrics.snapshot()["compilations"]
            assert_same(static_norm(xd, wd, eps), rms_norm_torch(x, w, eps))
            compiled.append(metrics.snapshot()["compilations"] - before)
    assert compiled[0] >= 1 and compiled[1] >= 1 and compiled[2] == 0


# ---- the disk cache ----------------------------------------------------------------

_EDITED_KERNEL = """
import sys, torch, torchtpu
from torchtpu import cache
torchtpu.set_eager_mode("fused")
@torchtpu.custom_jax_kernel
def shifted(x):
    return x + {shift}
x = torch.arange(4.0).to("tpu")
torchtpu.sync()
before = cache.stats()["disk_programs"]
print("RESULT", (shifted(x) * 2).cpu().tolist(), "NEW PROGRAMS", cache.stats()["disk_programs"] - before)
"""


def _run_shifted(tmp_path, shift):
    script = tmp_path / f"shifted_{shift}.py"
    script.write_text(_EDITED_KERNEL.format(shift=shift))
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(li for li in done.stdout.splitlines() if li.startswith("RESULT"))
    return line


def test_edited_kernel_is_not_served_from_a_stored_fused_program(tmp_path):
    """Fused graphs with a kernel in them are not stored across processes:
    the same name with another body, in the next process, runs the new body."""
    expected = [(v + 1.0) * 2 for v in range(4)]
    assert _run_shifted(tmp_path, 1) == f"RESULT {expected} NEW PROGRAMS 0"
    expected = [(v + 5.0) * 2 for v in range(4)]
    assert _run_shifted(tmp_path, 5) == f"RESULT {expected} NEW PROGRAMS 0"


# ---- the example ------------------------------------------------------------------

def test_example_runs(tmp_path):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "custom_kernel.py")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "matches the torch-ops model" in done.stdout


def test_under_torch_compile(mode):
    def step(x):
        return rms_norm(x + 1, torch.ones(4, device=x.device), 1e-3).square().sum()
    compiled = torch.compile(step, backend="tpu")
    x, = _inputs((3, 4))
    xd = x.to("tpu").requires_grad_()
    xc = x.clone().requires_grad_()
    loss = compiled(xd)
    loss.backward()
    ref = rms_norm_torch(xc + 1, torch.ones(4), 1e-3).square().sum()
    ref.backward()
    assert_same(loss, ref.detach())
    assert_same(xd.grad, xc.grad)


def test_kernel_in_a_captured_and_replayed_training_step(mode):
    """A custom kernel's forward and backward are ops of a captured graph:
    each replay on new data matches the same SGD step in torch ops on CPU."""
    torch.manual_seed(0)
    w_cpu = torch.randn(8, requires_grad=True)
    w = w_cpu.detach().to("tpu").requires_grad_()
    x = torch.randn(4, 8, device="tpu")
    opts = [torch.optim.SGD([p], lr=0.1) for p in (w, w_cpu)]

    def step():
        opts[0].zero_grad(set_to_none=False)
        loss = rms_norm(x, w).pow(2).sum()
        loss.backward()
        opts[0].step()
        return loss

    for _ in range(2):  # warm-up, as before a CUDA capture
        step()
    for _ in range(2):
        opts[1].zero_grad()
        rms_norm_torch(x.cpu(), w_cpu).pow(2).sum().backward()
        opts[1].step()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        loss = step()
    for _ in range(3):
        batch = torch.randn(4, 8)
        x.copy_(batch)
        g.replay()
        opts[1].zero_grad()
        want = rms_norm_torch(batch, w_cpu).pow(2).sum()
        want.backward()
        opts[1].step()
        torch.testing.assert_close(loss.detach().cpu(), want.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w.detach().cpu(), w_cpu.detach(), rtol=1e-5, atol=1e-6)
