"""tpu:N as CUDA has cuda:N: tensors placed on the device they name, kept
there by every op in every mode, CUDA's error for two devices in one op,
copies device to device, and the current device (torch.tpu.set_device,
torch.tpu.device, torch.accelerator) for "tpu" without an index."""
import io

import jax
import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu import metrics
from torchtpu.dispatch.host import device_array

pytestmark = pytest.mark.skipif(
    torch.tpu.device_count() < 2,
    reason="needs two devices (tests/conftest.py sets XLA's host device count to 2)")

TPU1 = torch.device("tpu", 1)


def on(t, index):
    """t reports tpu:index and its data lives on that JAX device."""
    assert t.device == torch.device("tpu", index)
    arr = t._storage.array
    if hasattr(arr, "devices"):
        assert arr.devices() == {jax.local_devices()[index]}
    return True


def test_factories_and_copies_place_on_the_named_device(mode):
    x_cpu = torch.randn(4, 3)
    made = [torch.ones(4, 3, device="tpu:1"), torch.zeros(4, 3, device=TPU1),
            torch.full((4, 3), 2.0, device="tpu:1"), torch.arange(12, device="tpu:1"),
            torch.empty(4, 3, device="tpu:1").fill_(3.0), torch.randn(4, 3, device="tpu:1"),
            x_cpu.to("tpu:1"), x_cpu.to(TPU1), torch.tensor([1, 2], device="tpu:1"),
            torch.nn.Linear(3, 2).to("tpu:1").weight]
    for t in made:
        torchtpu.sync()
        assert on(t, 1)
    torch.testing.assert_close(made[6].cpu(), x_cpu)
    torch.testing.assert_close(made[3].cpu(), torch.arange(12))
    torch.testing.assert_close(made[0].cpu(), torch.ones(4, 3))


def test_ops_keep_their_device_and_match_cpu(mode):
    x_cpu, w_cpu = torch.randn(5, 4), torch.randn(4, 3)
    x, w = x_cpu.to("tpu:1"), w_cpu.to("tpu:1")
    results = {
        "matmul": (x @ w, x_cpu @ w_cpu),
        "view": (x.t()[1:], x_cpu.t()[1:]),
        "reduction": (x.sum(0), x_cpu.sum(0)),
        "scalar": (x * 2 + torch.tensor(1.0), x_cpu * 2 + 1),
        "softmax": (F.softmax(x, -1), F.softmax(x_cpu, -1)),
        "nonzero": (torch.nonzero(x > 0), torch.nonzero(x_cpu > 0)),
        "mask": (x[x > 0], x_cpu[x_cpu > 0]),
        "unique": (torch.unique(torch.tensor([3, 1, 3], device="tpu:1")), torch.tensor([1, 3])),
    }
    y = x.clone()
    y.add_(1)
    y[0] = 7
    results["in-place"] = (y, torch.cat([torch.full((1, 4), 7.0), x_cpu[1:] + 1]))
    for name, (got, want) in results.items():
        assert on(got, 1), name
        torch.testing.assert_close(got.cpu(), want, msg=name)


def test_empty_tensors_and_their_views_are_read_on_their_device(mode):
    """An empty view's reader uses none of its input, yet runs on the
    input's device (it ran on tpu:0, and a collective over such a tensor,
    Accelerate's copy_tensor_to_devices of a (2, 0, 3) tensor, raised)."""
    x = torch.randn(4, 3, device="tpu:1")
    empties = {"zeros": torch.zeros(2, 0, 3, device="tpu:1"),
               "clone": torch.ones(3, 0, device="tpu:1").clone(),
               "columns": x[:, :0], "rows": x[2:2], "strided": x.t()[:, 1:1]}
    for name, t in empties.items():
        arr = device_array(t)
        assert arr.devices() == {jax.local_devices()[1]}, name
        assert arr.shape == tuple(t.shape), name
        for got in (t + 1, torch.cat([t, t]), t.sum(-1)):
            assert on(got, 1), name
            assert device_array(got).devices() == {jax.local_devices()[1]}, name
        want = torch.empty(t.shape)
        torch.testing.assert_close(t.sum(-1).cpu(), want.sum(-1), msg=name)
        torch.testing.assert_close(torch.cat([t, t]).cpu(), torch.cat([want, want]), msg=name)


def test_training_on_the_second_device_matches_cpu(mode):
    torch.manual_seed(0)
    model_cpu = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.load_state_dict(model_cpu.state_dict())
    model.to("tpu:1")
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model_cpu, model)]
    x_cpu, y_cpu = torch.randn(16, 6), torch.randint(0, 2, (16,))
    x, y = x_cpu.to("tpu:1"), y_cpu.to("tpu:1")
    for _ in range(3):
        for m, opt, xs, ys in ((model_cpu, opts[0], x_cpu, y_cpu), (model, opts[1], x, y)):
            opt.zero_grad()
            F.cross_entropy(m(xs), ys).backward()
            opt.step()
    for (name, p_cpu), p in zip(model_cpu.named_parameters(), model.parameters()):
        assert on(p, 1) and on(p.grad, 1)
        torch.testing.assert_close(p.detach().cpu(), p_cpu.detach(), msg=name, rtol=1e-5, atol=1e-6)
    state = opts[1].state[next(model.parameters())]
    assert on(state["exp_avg"], 1)


def test_two_devices_in_one_op_raise_cudas_error(mode):
    a, b = torch.ones(3, device="tpu:0"), torch.ones(3, device="tpu:1")
    message = "Expected all tensors to be on the same device, but found at least two devices, tpu:0 and tpu:1!"
    for fn in (lambda: a + b, lambda: b + a, lambda: torch.cat([a, b]), lambda: b.mul_(a),
               lambda: torch.stack([a, b]), lambda: torch.where(a > 0, a, b)):
        with pytest.raises(RuntimeError, match=message):
            fn()
    # The tensors are intact, and each device still works.
    torch.testing.assert_close((a + a).cpu(), torch.full((3,), 2.0))
    torch.testing.assert_close((b + b).cpu(), torch.full((3,), 2.0))


def test_copies_between_devices_go_device_to_device(mode):
    src_cpu = torch.randn(3, 4)
    src = src_cpu.to("tpu:0")
    moved = src.to("tpu:1")
    assert on(moved, 1) and on(src, 0)
    torch.testing.assert_close(moved.cpu(), src_cpu)
    back = (moved * 2).to("tpu:0", dtype=torch.float64)
    assert on(back, 0) and back.dtype == torch.float64
    torch.testing.assert_close(back.cpu(), (src_cpu * 2).double())
    dst = torch.zeros(4, 4, device="tpu:1")
    dst[:3].copy_(src)  # into a view, across devices
    assert on(dst, 1)
    torch.testing.assert_close(dst.cpu(), torch.cat([src_cpu, torch.zeros(1, 4)]))


def test_fused_graphs_run_on_their_devices():
    with torchtpu.eager_mode("fused"):
        metrics.reset()
        a, b = torch.ones(4, device="tpu:0"), torch.ones(4, device="tpu:1")
        c, d = a * 2, b * 3  # recorded in turn: a graph per device
        e = torch.zeros(2, device="tpu:1") + 1  # a graph of factories only
        values = [t.cpu() for t in (c, d, e)]
        assert on(c, 0) and on(d, 1) and on(e, 1)
        assert metrics.snapshot()["flushes"].get("device", 0) >= 2
    torch.testing.assert_close(values[0], torch.full((4,), 2.0))
    torch.testing.assert_close(values[1], torch.full((4,), 3.0))
    torch.testing.assert_close(values[2], torch.ones(2))


def test_current_device_places_tpu_without_an_index():
    original_to = torch.Tensor.to
    ways = {
        "torch.tpu.set_device": lambda i: torch.tpu.set_device(i),
        "torch.accelerator.set_device_index": lambda i: torch.accelerator.set_device_index(i),
    }
    for name, select in ways.items():
        select(1)
        try:
            assert torch.tpu.current_device() == 1 == torch.accelerator.current_device_index(), name
            for t in (torch.ones(2, device="tpu"), torch.ones(2).to("tpu"),
                      torch.ones(2).to(device=torch.device("tpu")), torch.tensor([1.0], device="tpu"),
                      torch.nn.Linear(2, 2).to("tpu").weight, torch.ones(2).tpu()):
                assert on(t, 1), name
            assert on(torch.ones(2, device="tpu:0"), 0)  # an index still names its device
        finally:
            select(0)
        assert torch.tpu.current_device() == 0
        assert on(torch.ones(2).to("tpu"), 0) and on(torch.tensor([1.0], device="tpu"), 0)
    assert torch.Tensor.to is original_to  # back on tpu:0, nothing stays patched
    for context in (torch.tpu.device(1), torch.accelerator.device_index(1)):
        with context:
            assert on(torch.ones(2, device="tpu"), 1) and on(torch.ones(2).to("tpu"), 1)
        assert torch.tpu.current_device() == 0 and on(torch.ones(2, device="tpu"), 0)


def test_a_missing_device_raises():
    n = torch.tpu.device_count()
    for fn in (lambda: torch.ones(2, device=f"tpu:{n}"), lambda: torch.ones(2).to(f"tpu:{n}"),
               lambda: torch.ones(2, device="tpu").to(f"tpu:{n}"), lambda: torch.tpu.set_device(n)):
        with pytest.raises(RuntimeError, match=f"tpu:{n} is not available"):
            fn()
    assert torch.tpu.current_device() == 0


def test_save_and_load_keep_the_device():
    t = torch.arange(6.0).to("tpu:1")
    buffer = io.BytesIO()
    torch.save({"t": t, "view": t[2:]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert on(loaded["t"], 1) and on(loaded["view"], 1)
    torch.testing.assert_close(loaded["view"].cpu(), torch.arange(2.0, 6.0))
    buffer.seek(0)
    moved = torch.load(buffer, map_location="tpu:0")
    assert on(moved["t"], 0)
    torch.testing.assert_close(moved["t"].cpu(), torch.arange(6.0))


def test_out_of_range_index_on_the_second_device_raises(mode):
    emb = torch.nn.Embedding(5, 2).to("tpu:1")
    ok = emb(torch.tensor([1, 4], device="tpu:1"))
    with pytest.raises(IndexError, match="index 7 is out of bounds"):
        emb(torch.tensor([7], device="tpu:1")).cpu()
    torch.testing.assert_close(ok.cpu(), emb.weight.detach().cpu()[[1, 4]])
    emb0 = torch.nn.Embedding(5, 2).to("tpu:0")  # the other device's check is its own
    torch.testing.assert_close(emb0(torch.tensor([2], device="tpu:0")).cpu(),
                               emb0.weight.detach().cpu()[[2]])


def test_memory_statistics_are_per_device():
    torchtpu.sync()
    before = [torch.tpu.memory_allocated(i) for i in (0, 1)]
    keep = torch.ones(1 << 16, device="tpu:1")
    assert torch.tpu.memory_allocated(1) - before[1] >= keep.nbytes
    assert torch.tpu.memory_allocated(0) - before[0] < keep.nbytes
    assert "device tpu:1" in torch.tpu.memory_summary(1)
