"""Activation checkpointing (torch.utils.checkpoint) in fused mode: the
forward a backward pass recomputes lands in the same XLA computation as the
original forward, so fused mode fences its inputs with optimization barriers
(tied to a value of the backward pass) that keep XLA from merging the two,
which would keep the activations alive and undo the checkpoint."""
import functools
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import torchtpu

_MODEL = """
import torch
from torch.utils.checkpoint import checkpoint

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.ff1, self.ff2 = torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.ff2(torch.nn.functional.gelu(self.ff1(self.ln(x))))

class Stack(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
        self.how = how

    def forward(self, x):
        for block in self.blocks:
            x = (block(x) if self.how is None
                 else checkpoint(block, x, use_reentrant=self.how == "reentrant"))
        return x.pow(2).mean()
"""
exec(_MODEL)


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_checkpointed_steps_give_cpu_losses_and_gradients(how, mode):
    torch.manual_seed(0)
    cpu = Stack(how)  # noqa: F821 (defined by _MODEL)
    tpu = Stack(how).to("tpu")  # noqa: F821
    tpu.load_state_dict(cpu.state_dict())
    opt_cpu = torch.optim.SGD(cpu.parameters(), lr=0.1)
    opt_tpu = torch.optim.SGD(tpu.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 5, 16, requires_grad=how == "reentrant")
        losses = []
        for model, opt, xs in ((cpu, opt_cpu, x), (tpu, opt_tpu, x.detach().to("tpu").requires_grad_(x.requires_grad))):
            opt.zero_grad()
            loss = model(xs)
            loss.backward()
            losses.append(loss)
            grads = [p.grad for p in model.parameters()]
            if model is cpu:
                cpu_grads = grads
            else:
                for got, want in zip(grads, cpu_grads):
                    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
            opt.step()
        torch.testing.assert_close(losses[1].cpu(), losses[0].detach(), rtol=1e-5, atol=1e-6)


_CHILD = _MODEL + textwrap.dedent("""
    import sys
    import jax
    import torchtpu

    torchtpu.set_eager_mode("fused")
    for how in (None, "non-reentrant", "reentrant"):
        torch.manual_seed(0)
        model = Stack(how).to("tpu")
        x = torch.randn(4, 5, 16).to("tpu").requires_grad_(how == "reentrant")
        torchtpu.sync()
        jax.config.update("jax_dump_ir_to", f"{sys.argv[1]}/{how}")
        model(x).backward()  # forward and backward: one fused graph
        torchtpu.sync()
""")


def _runs(text, op):
    """How often a run of the program runs op: in its main function, and in
    each call of its private functions (fused graphs call one per kernel)."""
    bodies, name = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*func\.func (?:public|private) @(\w+)", line)
        if m:
            name = m.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)

    @functools.cache
    def count(fn):
        return sum(line.count(op) + sum(count(c) for c in re.findall(r"call @(\w+)", line))
                   for line in bodies[fn])
    return count("main")


def _step_program(folder):
    """The text of the largest program dumped into folder (the step's graph)."""
    texts = [open(os.path.join(folder, n)).read() for n in os.listdir(folder)]
    return max(texts, key=lambda t: _runs(t, "stablehlo.dot_general"))


def test_the_recomputed_forward_is_fenced_in_the_fused_graph(tmp_path):
    env = dict(os.environ, TORCHTPU_CACHE_DIR="off", TORCHTPU_FUSED_COMPILE="sync",
               TORCHTPU_FUSE_MAX_OPS="100000")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], env=env, timeout=600,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    plain = _step_program(tmp_path / "None")
    assert "optimization_barrier" not in plain
    # Each block's first linear runs again in the backward pass (the second's
    # output is not needed: non-reentrant checkpointing stops before it, and
    # fused mode drops it as dead), its inputs read through barriers.
    for how in ("non-reentrant", "reentrant"):
        fenced = _step_program(tmp_path / how)
        assert (_runs(fenced, "stablehlo.dot_general")
                == _runs(plain, "stablehlo.dot_general") + 3), how
        assert _runs(fenced, "stablehlo.optimization_barrier") >= 3 * 5, how


def test_no_fence_outside_recomputation(mode):
    """A backward pass that recomputes nothing, and double backward, give
    CPU's gradients (grad mode on in a backward pass is create_graph's)."""
    x = torch.randn(6, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    for t in (x, xt):
        y = (t.sin() * t).sum()
        (g,) = torch.autograd.grad(y, t, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), t)
        if t is x:
            want = (g.detach(), gg)
        else:
            torch.testing.assert_close(g.detach().cpu(), want[0])
            torch.testing.assert_close(gg.cpu(), want[1])
    assert torchtpu.get_eager_mode() == mode


def test_compiled_programs_give_xla_memory_figures():
    """torchtpu.memory.compiled_programs() (what benchmarks/checkpoint_memory.py
    reads) lists the fused graph a step brings, with XLA's figures for it:
    its arguments are its two input matrices, its output the scalar."""
    from torchtpu.memory import compiled_programs
    with torchtpu.eager_mode("fused"):
        # Sizes no other test uses: the graph is new to this process.
        a, b = torch.randn(48, 24).to("tpu"), torch.randn(24, 40).to("tpu")
        torchtpu.sync()
        torchtpu.wait_for_compiles()  # (an earlier test's graphs, compiled in the background)
        before = {p.id for p in compiled_programs()}
        for _ in range(2):
            (a @ b).relu().sum().item()
        torchtpu.wait_for_compiles()
        (a @ b).relu().sum().item()
    graphs = [p for p in compiled_programs() if p.id not in before and "fused" in p.name]
    assert len(graphs) == 1, graphs
    (graph,) = graphs
    # Each array's bytes on the device: a TPU pads them to its tiles (a
    # float32 scalar takes 512 bytes there), the CPU platform does not.
    on_device = [torchtpu.jax.to_jax(t).on_device_size_in_bytes()
                 for t in (a, b, torch.zeros((), device="tpu"))]
    assert (graph.arguments, graph.outputs, graph.aliased) == (on_device[0] + on_device[1], on_device[2], 0)
    assert graph.temp >= 0
    assert graph.footprint == graph.arguments + graph.outputs + graph.temp
    # Programs stay listed while loaded: a second look finds the same ones.
    assert graph.id in {p.id for p in compiled_programs()}
