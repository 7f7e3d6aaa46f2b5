"""torchtpu.data.DeviceLoader: batches on the device ahead of the step, with
the results of the plain loop; nested batches, workers, epochs, an early
break, a failing dataset, Accelerate's prepared loaders, two processes."""
import collections
import gc
import multiprocessing
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same
from processes import run_ranks
from torch.utils.data import DataLoader, Subset, TensorDataset

import torchtpu
from torchtpu import pinned, runtime
from torchtpu.data import DeviceLoader

FUSED_AND_STRICT = pytest.mark.parametrize("eager", ["strict", "fused"])


def _data(n=20):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g))


def _train(batches, device):
    """SGD with momentum over batches (moved to device if they are not there
    already); the losses and the final weights, on CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 2)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses).cpu(), [p.detach().cpu() for p in model.parameters()]


@FUSED_AND_STRICT
def test_training_matches_the_plain_loop_and_cpu(eager):
    loader = DataLoader(_data(), batch_size=4, shuffle=True, pin_memory=True,
                        generator=torch.Generator().manual_seed(2))
    with torchtpu.eager_mode(eager):
        fed_losses, fed_w = _train(DeviceLoader(loader), "tpu")
        loader.generator.manual_seed(2)
        plain_losses, plain_w = _train(loader, "tpu")
    loader.generator.manual_seed(2)
    cpu_losses, cpu_w = _train(loader, "cpu")
    assert len(fed_losses) == 5
    # The same kernels on the same values: the same bits as the plain loop.
    torch.testing.assert_close(fed_losses, plain_losses, rtol=0, atol=0)
    for a, b, c in zip(fed_w, plain_w, cpu_w):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c)
    torch.testing.assert_close(fed_losses, cpu_losses)


@FUSED_AND_STRICT
def test_batches_are_issued_ahead(eager):
    """With prefetch=2, taking batch 0 has fetched batches 0..2 from the
    loader and started their copies; the last batch fetches nothing more."""
    fetched = []
    data = _data(12)

    def collate(items):
        fetched.append(len(fetched))
        return torch.utils.data.default_collate(items)

    loader = DataLoader(data, batch_size=2, pin_memory=True, collate_fn=collate)
    with torchtpu.eager_mode(eager):
        it = iter(DeviceLoader(loader, prefetch=2))
        x, y = next(it)
        assert fetched == [0, 1, 2]
        assert len(runtime._in_flight) >= 2  # pinned: asynchronous copies
        assert x.device == torch.device("tpu", 0) and x.dtype == torch.float32
        assert_same(x, data.tensors[0][:2], rtol=0, atol=0)
        rest = list(it)
        assert len(rest) == 5 and fetched == list(range(6))
        assert_same(rest[-1][1], data.tensors[1][10:], rtol=0, atol=0)
    assert fetched == list(range(6))
    assert [len(list(DeviceLoader(loader, prefetch=p))) for p in (0, 1, 9)] == [6, 6, 6]


Pair = collections.namedtuple("Pair", "a b")


def test_nested_batches_keep_their_structure():
    transformers = pytest.importorskip("transformers")
    data = _data(8)

    def collate(items):
        x, y = torch.utils.data.default_collate(items)
        enc = transformers.BatchEncoding({"input_ids": x.long(), "mask": y > 0})
        return {"pair": Pair(x, [y, "label"]), "enc": enc, "n": len(items), "t": (x[:, 0],)}

    batches = list(DeviceLoader(DataLoader(data, batch_size=4, collate_fn=collate)))
    plain = list(DataLoader(data, batch_size=4, collate_fn=collate))
    assert len(batches) == 2
    for got, want in zip(batches, plain):
        assert type(got) is dict and set(got) == {"pair", "enc", "n", "t"}
        assert type(got["pair"]) is Pair and got["pair"].b[1] == "label" and got["n"] == 4
        assert type(got["enc"]) is transformers.BatchEncoding
        assert got["enc"].input_ids.dtype == torch.int64 and got["enc"]["mask"].dtype == torch.bool
        assert_same(got["pair"].a, want["pair"].a, rtol=0, atol=0)
        assert_same(got["pair"].b[0], want["pair"].b[0], rtol=0, atol=0)
        assert_same(got["enc"]["input_ids"], want["enc"]["input_ids"], rtol=0, atol=0)
        assert_same(got["enc"]["mask"], want["enc"]["mask"], rtol=0, atol=0)
        assert_same(got["t"][0], want["t"][0], rtol=0, atol=0)


def test_epochs_len_and_loader_attributes():
    data = _data(10)
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    fed = DeviceLoader(loader, "tpu")
    assert len(fed) == 3 and fed.dataset is data and fed.batch_size == 4
    epochs = [torch.cat([x.cpu() for x, _ in fed]) for _ in range(2)]
    loader.generator.manual_seed(3)
    plain = [torch.cat([x for x, _ in loader]) for _ in range(2)]
    for got, want in zip(epochs, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(epochs[0], epochs[1])  # each iter() is a new (shuffled) epoch


def test_device_and_prefetch_arguments():
    loader = DataLoader(_data(4), batch_size=2)
    assert DeviceLoader(loader).device == torch.device("tpu", 0)
    x, _ = next(iter(DeviceLoader(loader, "tpu:1")))
    assert x.device == torch.device("tpu", 1)
    with pytest.raises(ValueError, match="feeds a tpu device, not cpu"):
        DeviceLoader(loader, "cpu")
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        DeviceLoader(loader, prefetch=-1)


def _pinned_bytes():
    gc.collect()
    return sum(pinned._live.values())


def test_early_break_leaves_no_worker_thread_or_pinned_buffer():
    torchtpu.sync()
    base_bytes, base_threads = _pinned_bytes(), threading.active_count()
    loader = DataLoader(_data(40), batch_size=4, pin_memory=True, num_workers=1,
                        multiprocessing_context="spawn")
    for epoch in range(2):
        for i, (x, y) in enumerate(DeviceLoader(loader, prefetch=3)):
            assert x.device.type == "tpu"
            if i == 1:
                assert multiprocessing.active_children()  # the worker runs
                break
    del x, y
    torchtpu.sync()  # the copies issued ahead end; their buffers are freed
    assert _pinned_bytes() == base_bytes
    assert not multiprocessing.active_children()
    # The pinning threads are told to stop and end on their own (under load,
    # a moment later): a thread still alive after 10 s has leaked.
    deadline = time.monotonic() + 10
    while threading.active_count() > base_threads and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert threading.active_count() <= base_threads  # (the pinning thread ended too)


def test_workers_and_an_error_in_the_dataset():
    """Two workers give the plain loop's batches; an index error in a
    worker (batch 2 of 4) is raised at the loop's line after batches 0 and
    1, as the plain loop raises it."""
    data = _data(8)
    ok = DataLoader(data, batch_size=2, pin_memory=True, num_workers=2,
                    multiprocessing_context="spawn")
    got = torch.cat([x.cpu() for x, _ in DeviceLoader(ok)])
    torch.testing.assert_close(got, data.tensors[0], rtol=0, atol=0)

    bad = DataLoader(Subset(data, [0, 1, 2, 3, 99, 5, 6, 7]), batch_size=2, num_workers=1,
                     multiprocessing_context="spawn")
    seen = []
    with pytest.raises(IndexError, match="index 99 is out of bounds") as excinfo:
        for x, _ in DeviceLoader(bad, prefetch=2):  # the loop's line
            seen.append(x.cpu())
    assert len(seen) == 2
    torch.testing.assert_close(torch.cat(seen), data.tensors[0][:4], rtol=0, atol=0)
    here = [e for e in excinfo.traceback if str(e.path) == __file__]
    assert "for x, _ in DeviceLoader(bad, prefetch=2)" in str(here[-1].statement)


class _TpuDataset(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.arange(20.0).reshape(10, 2).to("tpu")

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return self.x[i] * 2


class _ForkReport(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([i, torch.tpu._is_in_bad_fork(), torchtpu.get_eager_mode() != ""])


def test_a_forked_worker_using_tpu_tensors_raises_instead_of_hanging(mode):
    """DataLoader workers forked from this process (Linux's default start
    method): a dataset holding tpu tensors raises torchtpu's fork error in
    the main process, as CUDA's "Cannot re-initialize CUDA in forked
    subprocess" (it hung in XLA's compiler before). A CPU dataset's workers
    run, and there tpu is "in a bad fork", so torch.manual_seed leaves it be."""
    torchtpu.sync()
    # (timeout: a regression fails here instead of hanging the run)
    bad = DataLoader(_TpuDataset(), batch_size=5, num_workers=1,
                     multiprocessing_context="fork", timeout=120)
    with pytest.raises(RuntimeError, match="cannot be used in a process forked from one using"):
        next(iter(bad))
    ok = DataLoader(_ForkReport(), batch_size=2, num_workers=2,
                    multiprocessing_context="fork", timeout=120)
    got = torch.cat(list(ok))
    assert got.tolist() == [[i, 1, 1] for i in range(4)]
    assert not torch.tpu._is_in_bad_fork()
    x = torch.arange(3.0, device="tpu") * 2  # this process still runs tpu work
    assert_same(x, torch.arange(3.0) * 2)


@pytest.mark.parametrize("sync", ["item", "synchronize"])
def test_a_sync_point_runs_the_graph_before_waiting_for_uploads(monkeypatch, sync):
    """In fused mode the pending step's graph is started before the wait
    for uploads in flight (the next batches), so that the two overlap."""
    graph_pending = []
    wait = runtime.wait_transfers

    def recording_wait():
        graph_pending.append(bool(torchtpu.modes.current()._graph.nodes))
        wait()

    monkeypatch.setattr(runtime, "wait_transfers", recording_wait)
    with torchtpu.eager_mode("fused"):
        y = (torch.arange(6.0, device="tpu") * 2).sum()
        ahead = torch.ones(1000).pin_memory().to("tpu", non_blocking=True)
        assert runtime._in_flight and torchtpu.modes.current()._graph.nodes
        assert (y.item() if sync == "item" else torch.tpu.synchronize()) in (30.0, None)
        assert graph_pending and not any(graph_pending) and not runtime._in_flight
        assert_same(ahead, torch.ones(1000), rtol=0, atol=0)


@pytest.fixture
def accelerator():
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield Accelerator()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@FUSED_AND_STRICT
def test_accelerate_prepared_loader(accelerator, eager):
    """Below Accelerate's loader: its end-of-data flag turns on at the
    user's last batch (not at the one fetched ahead), so gather_for_metrics
    keeps every sample of an uneven last batch; the loader is restored."""
    data = _data(10)
    loader = accelerator.prepare(DataLoader(data, batch_size=4, pin_memory=True))
    base = vars(loader)["base_dataloader"]
    with torchtpu.eager_mode(eager):
        fed = DeviceLoader(loader, prefetch=2)
        assert len(fed) == 3 and fed.device == torch.device("tpu", 0)
        ends, gathered = [], []
        for x, y in fed:
            assert x.device == torch.device("tpu", 0)
            ends.append(accelerator.gradient_state.end_of_dataloader)
            gathered.append(accelerator.gather_for_metrics(x * 2))
        assert ends == [False, False, True]
        assert [len(g) for g in gathered] == [4, 4, 2]
        assert_same(torch.cat(gathered), data.tensors[0] * 2)
        assert vars(loader)["base_dataloader"] is base
        # Training through it: the plain prepared loader's losses and weights.
        fed_losses, fed_w = _train(fed, "tpu")
        plain_losses, plain_w = _train(loader, "tpu")
    torch.testing.assert_close(fed_losses, plain_losses, rtol=0, atol=0)
    for a, b in zip(fed_w, plain_w):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_accelerate_dispatch_batches_is_refused(accelerator):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration
    AcceleratorState._reset_state(reset_partial_state=True)
    dispatching = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader = dispatching.prepare(DataLoader(_data(8), batch_size=4))
    with pytest.raises(NotImplementedError, match="dispatch_batches"):
        DeviceLoader(loader)


WORKER = textwrap.dedent("""\
    import json, sys
    import torch
    import torchtpu
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset
    from torchtpu.data import DeviceLoader

    acc = Accelerator()
    data = TensorDataset(torch.arange(10.0)[:, None])
    fed = DeviceLoader(acc.prepare(DataLoader(data, batch_size=2, pin_memory=True)))
    devices, mine, gathered = set(), [], []
    for (x,) in fed:
        devices.add(str(x.device))
        mine += x[:, 0].tolist()
        gathered += acc.gather_for_metrics(x)[:, 0].tolist()
    json.dump({"device": str(fed.device), "devices": sorted(devices), "mine": mine,
               "gathered": gathered}, open(sys.argv[1], "w"))
""")


def test_two_processes_each_feed_their_own_device(tmp_path):
    """Under torchrun, each process's DeviceLoader (no device named) feeds its
    tpu:LOCAL_RANK with its shard; gathered, the dataset once, in order."""
    pytest.importorskip("accelerate")
    reports = run_ranks(tmp_path, WORKER, 2, timeout=240)
    for rank, report in enumerate(reports):
        assert report["device"] == f"tpu:{rank}" and report["devices"] == [f"tpu:{rank}"]
        assert report["gathered"] == [float(i) for i in range(10)]
    # Batches of 2 alternate between the ranks; the uneven end wraps around.
    assert reports[0]["mine"] == [0.0, 1.0, 4.0, 5.0, 8.0, 9.0]
    assert reports[1]["mine"] == [2.0, 3.0, 6.0, 7.0, 0.0, 1.0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
