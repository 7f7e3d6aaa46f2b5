"""Bad input raises PyTorch's exception types, at the user's line."""
import os
import subprocess
import sys

import pytest
import torch

import torchtpu


def _raises_like_cpu(fn, *cpu_inputs):
    """fn raises on CPU inputs and the same exception type on tpu inputs."""
    with pytest.raises(Exception) as cpu_err:
        fn(*cpu_inputs)
    with pytest.raises(cpu_err.type):
        out = fn(*[x.to("tpu") for x in cpu_inputs])
        torchtpu.sync()
        print(out)
    return cpu_err.type


def test_shape_mismatch(mode):
    assert _raises_like_cpu(lambda a, b: a + b, torch.ones(2, 3), torch.ones(3, 2)) is RuntimeError
    _raises_like_cpu(lambda a, b: a.view(5), torch.ones(2, 3), torch.ones(1))
    _raises_like_cpu(lambda a, b: a.add_(b), torch.ones(3), torch.ones(2, 3))


def test_matmul_shape_mismatch(mode):
    _raises_like_cpu(lambda a, b: a @ b, torch.ones(2, 3), torch.ones(2, 3))


def test_out_shape_mismatch(mode):
    # As on CPU: a non-empty out= of the wrong shape is resized, with PyTorch's warning.
    out = torch.empty(5).tpu()
    with pytest.warns(UserWarning, match="was resized"):
        r = torch.add(torch.ones(3).tpu(), 1, out=out)
    assert r is out and out.shape == (3,)
    assert torch.equal(out.cpu(), torch.full((3,), 2.0))


def test_device_mixing(mode):
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(2).tpu() * torch.ones(2)
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(2).tpu().add_(torch.ones(2))
    with pytest.raises(RuntimeError, match="same device"):
        torch.where(torch.ones(2, dtype=torch.bool).tpu(), torch.ones(2), torch.ones(2).tpu())


def test_out_of_range_select(mode):
    x = torch.arange(5.0)
    with pytest.raises(IndexError, match="out of bounds"):
        x.tpu()[10]
    with pytest.raises(IndexError):
        x.tpu()[-6]
    with pytest.raises(IndexError):
        x.tpu().view(5, 1)[:, 3]


def test_cpu_index_tensor_allowed(mode):
    # As with CUDA, advanced indices may live on the CPU.
    x = torch.arange(10.0)
    idx = torch.tensor([1, 3, -1])
    out = x.tpu()[idx]
    assert out.is_tpu
    torch.testing.assert_close(out.cpu(), x[idx])


def test_out_of_range_tensor_index(debug_mode):
    x = torch.arange(5.0)
    for fn in (lambda x: x[torch.tensor([1, 10], device=x.device)],
               lambda x: x.gather(0, torch.tensor([7], device=x.device)),
               lambda x: x.index_select(0, torch.tensor([7], device=x.device)),
               lambda x: x.__setitem__(torch.tensor([9], device=x.device), 1.0),
               lambda x: torch.nn.functional.embedding(torch.tensor([7], device=x.device),
                                                       x.view(5, 1))):
        _raises_like_cpu(fn, x)
    _raises_like_cpu(lambda x: x[torch.tensor([1, 10])], x)  # CPU index tensor


def test_bad_dtype_for_op(mode):
    _raises_like_cpu(lambda a, b: a.add_(b), torch.ones(2, dtype=torch.int64), torch.ones(2))


def test_bad_mode_name():
    with pytest.raises(ValueError) as err:
        torchtpu.set_eager_mode("fast")
    for name in ("debug", "strict", "fused"):
        assert name in str(err.value)
    with pytest.raises(ValueError):
        with torchtpu.eager_mode("nope"):
            pass
    assert torchtpu.get_eager_mode() in ("debug", "strict", "fused")


def test_error_points_at_user_line(debug_mode):
    import traceback

    def user_line():
        return torch.ones(2, 3).tpu() @ torch.ones(2, 3).tpu()
    with pytest.raises(RuntimeError) as err:
        user_line()
    frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
    assert "user_line" in frames


def test_user_line_when_the_package_is_imported_through_an_unnormalized_path(tmp_path):
    """torchtpu imported through sys.path entry "<repo>/tests/..": its code's
    file names hold the "..", and errors still name the user's line."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "user.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.join(repo, 'tests', '..')!r})\n"
        "import torch, torchtpu\n"
        "assert '..' in torchtpu.__file__, torchtpu.__file__\n"
        "torchtpu.set_eager_mode('fused')\n"
        "x = torch.ones(3, device='tpu')\n"
        "y = x[torch.tensor([5], device='tpu')]\n"
        "try:\n"
        "    y.cpu()\n"
        "except IndexError as e:\n"
        "    print(e)\n"
        "print(torchtpu.metrics.sync_report())\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=dict(env, TORCHTPU_CACHE_DIR="off"), timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"(aten.index.Tensor at {script}:7)" in proc.stdout, proc.stdout
    assert "user.py:9: cpu x1" in proc.stdout, proc.stdout


def test_error_in_a_backward_op_raises_from_backward(tmp_path):
    """An op failing in a backward pass raises from backward() in every mode
    (torch 2.13 aborts the process if it is raised inside the pass); the
    gradients it feeds are lost, the others are right, and the process
    trains on."""
    script = tmp_path / "bad_backward.py"
    script.write_text(
        "import torch, torchtpu\n"
        "from torchtpu.ops import LOWERINGS\n"
        "def bad(*a, **k):\n"
        "    raise ValueError('lowering exploded')\n"
        "LOWERINGS[torch.ops.aten.threshold_backward.default] = bad\n"
        "for mode in ('debug', 'strict', 'fused'):\n"
        "    torchtpu.set_eager_mode(mode)\n"
        "    x = torch.randn(5, device='tpu', requires_grad=True)\n"
        "    w = torch.randn(5, device='tpu', requires_grad=True)\n"
        "    try:\n"
        "        (torch.relu(x) * w).sum().backward()\n"
        "    except ValueError as e:\n"
        "        print(mode, 'raised:', e)\n"
        "    print(mode, 'w.grad right:', torch.equal(w.grad.cpu(), torch.relu(x).detach().cpu()))\n"
        "    try:\n"
        "        x.grad.cpu()\n"
        "    except RuntimeError as e:\n"
        "        print(mode, 'x.grad:', e)\n"
        "    try:\n"
        "        (x.grad * 2).cpu()\n"
        "    except RuntimeError as e:\n"
        "        print(mode, 'x.grad * 2:', e)\n"
        "    x.grad = None\n"
        "    torch.sigmoid(x).sum().backward()\n"
        "    s = torch.sigmoid(x.detach().cpu())\n"
        "    print(mode, 'next backward right:', torch.allclose(x.grad.cpu(), s * (1 - s)))\n"
        "    try:\n"  # accumulating into the existing gradient, in place
        "        torch.relu(x).sum().backward()\n"
        "    except ValueError:\n"
        "        pass\n"
        "    try:\n"
        "        x.grad.cpu()\n"
        "    except RuntimeError as e:\n"
        "        print(mode, 'accumulated x.grad:', e)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=dict(os.environ, TORCHTPU_CACHE_DIR="off"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    for mode in ("debug", "strict", "fused"):
        assert (f"{mode} raised: torchtpu: aten.threshold_backward.default(float32[5], "
                "float32[5], 0) failed in its tpu lowering") in proc.stdout
        assert f"{mode} w.grad right: True" in proc.stdout
        assert (f"{mode} x.grad: torchtpu: this tensor has no value: the op that computes it "
                "failed (ValueError: aten.threshold_backward.default") in proc.stdout
        assert (f"{mode} x.grad * 2: torchtpu: this tensor has no value: the op that computes "
                "it failed (ValueError: aten.threshold_backward.default") in proc.stdout
        assert f"{mode} next backward right: True" in proc.stdout
        assert (f"{mode} accumulated x.grad: torchtpu: this tensor has no value: the op that "
                "computes it failed (ValueError: aten.threshold_backward.default") in proc.stdout
    assert proc.stdout.count("lowering exploded") == 12


def test_sparse_layouts_are_refused_clearly():
    x = torch.randn(3, 3, device="tpu")
    for convert in (x.to_sparse, x.to_sparse_csr):
        with pytest.raises(NotImplementedError, match="sparse layouts are not supported on tpu"):
            convert()
    # A sparse CPU tensor moved to tpu.
    for sparse in (torch.randn(3, 3).to_sparse(), torch.randn(3, 3).to_sparse_csr()):
        with pytest.raises(NotImplementedError, match="sparse layouts are not supported on tpu"):
            sparse.to("tpu")
    # Modules whose backward makes sparse gradients (on the CPU fallback for
    # EmbeddingBag): the same error, naming the way out.
    idx = torch.tensor([[0, 1, 2], [1, 2, 3]], device="tpu")
    for module in (torch.nn.Embedding(4, 3, sparse=True), torch.nn.EmbeddingBag(4, 3, sparse=True)):
        out = module.to("tpu")(idx)
        with pytest.raises(NotImplementedError, match="sparse layouts are not supported on tpu.*sparse=False"):
            out.sum().backward()
