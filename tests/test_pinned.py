"""Pinned memory and non_blocking copies, as a CUDA script uses them."""
import pytest
import torch
from conftest import assert_same
from torch.utils.data import DataLoader, TensorDataset

import torchtpu
from torchtpu import metrics, runtime


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool,
                                   torch.complex64])
def test_pin_memory_keeps_values_layout_and_dtype(dtype):
    src = (torch.randn(5, 6) * 4).to(dtype).t()  # a transposed (strided) tensor
    pinned = src.pin_memory()
    assert pinned.is_pinned() and not src.is_pinned()
    assert pinned.device.type == "cpu" and pinned.dtype == dtype
    assert pinned.shape == src.shape and pinned.stride() == src.stride()
    assert pinned.data_ptr() != src.data_ptr()
    torch.testing.assert_close(pinned, src, rtol=0, atol=0)
    assert pinned.pin_memory() is pinned  # already pinned: itself, as on CUDA
    assert pinned[1:, 2].is_pinned()      # views share the pinned memory
    assert not pinned.clone().is_pinned()
    assert torch.ones(0).pin_memory().is_pinned() is False  # no memory, as on CUDA


def test_pin_memory_is_differentiable():
    a = torch.randn(4, requires_grad=True)
    (a.pin_memory() * 3).sum().backward()
    torch.testing.assert_close(a.grad, torch.full((4,), 3.0))


def test_tpu_tensors_are_not_pinned():
    x = torch.randn(3).to("tpu")
    before = sum(metrics.M.cpu_fallbacks.values())
    assert x.is_pinned() is False
    assert sum(metrics.M.cpu_fallbacks.values()) == before
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        x.pin_memory()


def test_dataloader_pin_memory_cpu_only():
    """CPU-only code in a process that imported torchtpu (as HF Trainer's
    default pin_memory=True)."""
    data = TensorDataset(torch.randn(10, 3), torch.arange(10))
    pinned = list(DataLoader(data, batch_size=4, pin_memory=True))
    plain = list(DataLoader(data, batch_size=4))
    assert len(pinned) == len(plain) == 3
    for (px, py), (x, y) in zip(pinned, plain):
        assert px.is_pinned() and py.is_pinned()
        torch.testing.assert_close(px, x, rtol=0, atol=0)
        torch.testing.assert_close(py, y, rtol=0, atol=0)


def test_dataloader_pin_memory_with_a_worker():
    """With workers, a pin-memory thread of the loader's own pins batches."""
    data = TensorDataset(torch.randn(6, 2))
    loader = DataLoader(data, batch_size=3, pin_memory=True, num_workers=1,
                        multiprocessing_context="spawn")
    batches = [b for (b,) in loader]
    assert all(b.is_pinned() for b in batches)
    torch.testing.assert_close(torch.cat(batches), data.tensors[0], rtol=0, atol=0)


def test_non_blocking_copy_is_asynchronous_and_exact(mode):
    src = torch.randn(64, 32)
    pinned = src.pin_memory()
    x = pinned.to("tpu", non_blocking=True)
    if mode != "debug":  # debug waits for every op, the copy too
        # The transfer was handed the pinned memory itself and left running.
        assert runtime._in_flight
    torch.tpu.synchronize()
    assert not runtime._in_flight
    pinned.fill_(-1.0)  # after a sync point the buffer is the user's again
    assert_same(x, src, rtol=0, atol=0)
    # A converting copy, and copy_ into part of an existing tensor.
    pinned.copy_(src)
    y = pinned.to("tpu", torch.float64, non_blocking=True)
    z = torch.zeros(2, 64, 32, device="tpu")
    z[1].copy_(pinned, non_blocking=True)
    w = (z * 2).sum(0)
    torchtpu.sync()  # waits for the uploads too
    assert not runtime._in_flight
    pinned.fill_(-1.0)
    assert_same(y, src.double())
    assert_same(w, src * 2)


def test_blocking_copy_snapshots_the_source(mode):
    src = torch.randn(16)
    pinned = src.pin_memory()
    x = pinned.to("tpu")  # blocking: the buffer is free at once
    pinned.fill_(0.0)
    assert_same(x, src, rtol=0, atol=0)
    plain = src.clone()
    y = plain.to("tpu", non_blocking=True)  # not pinned: as a blocking copy
    plain.fill_(0.0)
    assert_same(y, src, rtol=0, atol=0)


def test_training_from_a_pinned_loader(mode):
    """A CUDA-style loop: pinned batches, non_blocking copies, SGD; losses
    and weights as the same loop on CPU."""
    data = TensorDataset(torch.randn(12, 4), torch.randn(12, 1))

    def train(device):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for x, y in DataLoader(data, batch_size=4, pin_memory=True):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses), model.weight.detach()

    tpu_losses, tpu_w = train("tpu")
    cpu_losses, cpu_w = train("cpu")
    assert_same(tpu_losses, cpu_losses)
    assert_same(tpu_w, cpu_w)


def test_upload_into_a_whole_tensor_is_seen_by_its_views(mode):
    """A CPU tensor copied into a whole tpu tensor becomes its storage's
    value: views of it, and autograd's version counter, see the write."""
    base = torch.zeros(3, 4, device="tpu")
    row = base[1]
    version = base._version
    src = torch.randn(3, 4)
    base.copy_(src.pin_memory(), non_blocking=True)
    assert base._version == version + 1
    assert_same(row, src[1], rtol=0, atol=0)
    base.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # broadcast over the rows
    assert_same(row, torch.tensor([1.0, 2.0, 3.0, 4.0]), rtol=0, atol=0)
    half = torch.zeros(2, 2, device="tpu", dtype=torch.float16)
    half.copy_(torch.tensor([[1.5, -2.0], [3.0, 0.25]], dtype=torch.float64))
    assert_same(half, torch.tensor([[1.5, -2.0], [3.0, 0.25]], dtype=torch.float16))


def test_upload_overwritten_in_a_flush_before_the_sync_point():
    """Fused mode: an upload written in place and flushed (a graph that may
    reuse its buffer) before the sync point that waits for it."""
    with torchtpu.eager_mode("fused"):
        src = torch.randn(1000)
        pinned = src.pin_memory()
        x = pinned.to("tpu", non_blocking=True)
        x.mul_(2)
        torch.tpu.Event(enable_timing=True).record()  # a flush
        torch.tpu.synchronize()
        pinned.fill_(0)
        assert_same(x, src * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_large_uploads_and_empties(mode, dtype):
    """Over 1 MiB, uploads and empty tensors take another path on the CPU
    platform (fresh aligned host buffers handed to JAX): the same results."""
    src = (torch.randn(520, 1024) * 8).to(dtype)
    expect = src.clone()
    x = src.to("tpu")
    src.zero_()  # the upload is a copy
    assert_same(x, expect, rtol=0, atol=0)
    e = torch.empty(520, 1024, dtype=dtype, device="tpu")
    assert e.shape == (520, 1024) and e.dtype == dtype and e.stride() == (1024, 1)
    e.fill_(1)
    e[0, :3] = x[0, :3]
    assert_same(e[0, :4], torch.cat([expect[0, :3], torch.ones(1, dtype=dtype)]), rtol=0, atol=0)
    assert_same(e[1:].sum(), torch.ones(519, 1024, dtype=dtype).sum())
    s = torch.empty_strided((520, 1024), (1024, 1), dtype=dtype, device="tpu")
    assert s.stride() == (1024, 1)
    c = torch.empty(8, 64, 32, 32, dtype=dtype, device="tpu", memory_format=torch.channels_last)
    assert c.stride() == torch.empty(8, 64, 32, 32, memory_format=torch.channels_last).stride()
