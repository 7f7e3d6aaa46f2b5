"""torch.tpu as a CUDA script calls torch.cuda: device selection and
information, memory statistics, streams and events."""
import gc
import subprocess
import sys

import jax
import pytest
import torch

import torchtpu  # noqa: F401


# ---- device selection and information ----------------------------------------

def test_device_context_manager():
    for d in (0, "tpu", "tpu:0", torch.device("tpu", 0), None, -1):
        with torch.tpu.device(d) as ctx:
            assert torch.tpu.current_device() == 0
        assert ctx.idx == (-1 if d in (None, -1) else 0)
    with torch.tpu.device(0):
        x = torch.ones(3, device="tpu")
    assert x.device == torch.device("tpu", 0)
    missing = torch.tpu.device_count()
    with pytest.raises(RuntimeError, match=f"tpu:{missing} is not available"):
        with torch.tpu.device(missing):
            pass
    with pytest.raises(ValueError, match="Expected a tpu device"):
        torch.tpu.device("cpu")
    with torch.tpu.device_of(x):
        pass
    with torch.tpu.device_of(torch.ones(2)):  # a CPU tensor: no-op
        pass


def test_set_device_rejects_other_types():
    with pytest.raises(ValueError, match="Expected a tpu device"):
        torch.tpu.set_device("cpu")
    with pytest.raises(RuntimeError, match="is not available"):
        torch.tpu.set_device(f"tpu:{torch.tpu.device_count()}")


def test_device_name_and_properties():
    dev = jax.devices(torch.tpu.platform)[0]
    assert torch.tpu.get_device_name() == dev.device_kind
    assert torch.tpu.get_device_name(0) == torch.tpu.get_device_name("tpu:0")
    props = torch.tpu.get_device_properties(0)
    assert props.name == dev.device_kind
    assert props.platform == dev.platform
    assert isinstance(props.total_memory, int) and props.total_memory > 0
    assert props.multi_processor_count >= 1
    assert (props.major, props.minor) == torch.tpu.get_device_capability()
    assert props.name in repr(props)
    with pytest.raises(RuntimeError):
        torch.tpu.get_device_properties(2)
    assert torch.tpu.is_bf16_supported() is True


# ---- memory ----------------------------------------------------------------

def test_memory_allocated_counts_live_tensors(mode):
    torch.tpu.reset_peak_memory_stats()
    before = torch.tpu.memory_allocated()
    x = torch.ones(1 << 18, device="tpu")  # 1 MiB
    y = x * 2
    nbytes = x.numel() * x.element_size()
    during = torch.tpu.memory_allocated()
    assert during >= before + 2 * nbytes
    assert torch.tpu.memory_reserved() >= during
    assert torch.tpu.memory_cached() == torch.tpu.memory_reserved()
    assert torch.tpu.max_memory_allocated() >= during
    stats = torch.tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == during
    assert stats["allocated_bytes.all.peak"] >= during
    assert stats["reserved_bytes.all.current"] >= during
    assert stats["allocation.all.current"] >= 2
    del x, y
    gc.collect()
    after = torch.tpu.memory_allocated()
    assert after <= during - 2 * nbytes
    # The peak stays until reset, then is the current figure.
    assert torch.tpu.max_memory_allocated() >= during
    assert torch.tpu.max_memory_reserved() >= during
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == torch.tpu.memory_allocated() == after
    torch.tpu.reset_max_memory_allocated()
    assert torch.tpu.max_memory_allocated() == after


def test_peak_seen_at_event_record(mode):
    # (A timing event: in fused mode a plain one issues nothing at record,
    # so x would never be allocated at all.)
    torch.tpu.reset_peak_memory_stats()
    base = torch.tpu.memory_allocated()
    x = torch.zeros(1 << 18, device="tpu") + 1
    torch.tpu.Event(enable_timing=True).record()
    del x
    gc.collect()
    assert torch.tpu.max_memory_allocated() >= base + (1 << 20)
    assert torch.tpu.memory_allocated() == base


def test_memory_summary_info_and_device_checks():
    keep = torch.ones(1 << 16, device="tpu")
    text = torch.tpu.memory_summary()
    assert "Allocated memory" in text and "Reserved memory" in text
    free, total = torch.tpu.mem_get_info()
    assert 0 <= free <= total
    assert total == torch.tpu.get_device_properties().total_memory
    torch.tpu.empty_cache()
    torch.tpu.reset_accumulated_memory_stats()
    assert torch.tpu.memory_allocated(0) == torch.tpu.memory_allocated("tpu:0") >= keep.nbytes
    missing = torch.tpu.device_count()
    with pytest.raises(RuntimeError, match=f"tpu:{missing} is not available"):
        torch.tpu.memory_allocated(missing)
    with pytest.raises(ValueError):
        torch.tpu.memory_stats("cpu")


def test_torch_accelerator_memory_functions_answer_for_tpu():
    """Device-generic scripts (and Accelerate's Trainer, which calls
    torch.accelerator.empty_cache) ask torch.accelerator, not torch.tpu."""
    acc = torch.accelerator
    assert acc.current_accelerator() == torch.device("tpu")
    keep = torch.ones(1 << 16, device="tpu")
    acc.empty_cache()
    acc.memory.empty_cache()
    allocated = torch.tpu.memory_allocated()
    assert allocated >= keep.nbytes
    assert acc.memory_allocated() == acc.memory_allocated(0) == allocated
    assert acc.memory_allocated(torch.device("tpu", 0)) == allocated
    assert acc.memory_reserved() == torch.tpu.memory_reserved()
    assert acc.memory_stats()["allocated_bytes.all.current"] == allocated
    acc.reset_peak_memory_stats()
    acc.reset_accumulated_memory_stats()
    assert acc.max_memory_allocated() == allocated
    assert acc.max_memory_reserved() == torch.tpu.max_memory_reserved()
    assert acc.get_memory_info() == torch.tpu.mem_get_info()
    missing = torch.tpu.device_count()
    with pytest.raises(RuntimeError, match=f"tpu:{missing} is not available"):
        acc.memory_allocated(missing)
    del keep


def test_torch_accelerator_synchronize_waits_for_work(mode):
    """Device-generic timing code (PyTorch's own example for
    torch.accelerator.synchronize) runs on tpu, in every mode."""
    acc = torch.accelerator
    a = torch.randn(64, 64)
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record()
    x = a.to(acc.current_accelerator())
    for _ in range(5):
        x = x @ x.T / 64
    end.record()
    acc.synchronize()
    assert x._storage.array.is_ready()
    assert start.elapsed_time(end) >= 0
    acc.synchronize(0)
    acc.synchronize(torch.device("tpu", 0))
    stream = acc.current_stream()
    assert stream == torch.tpu.current_stream() and isinstance(stream, torch.Stream)
    y = x @ x
    stream.synchronize()
    assert y._storage.array.is_ready()
    other = torch.tpu.Stream()
    acc.set_stream(other)
    assert acc.current_stream() == other == torch.tpu.current_stream()
    acc.set_stream(stream)
    expect = a
    for _ in range(5):
        expect = expect @ expect.T / 64
    torch.testing.assert_close(x.cpu(), expect, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match=f"tpu:{torch.tpu.device_count()} is not available"):
        acc.synchronize(torch.tpu.device_count())


def test_torch_accelerator_capability_lists_the_dtypes_tpu_tensors_hold():
    dtypes = torch.accelerator.get_device_capability()["supported_dtypes"]
    assert torch.accelerator.get_device_capability(0)["supported_dtypes"] == dtypes
    assert {torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64} <= dtypes
    for dtype in dtypes:  # each one is made, converted and read back as on CPU
        x = torch.arange(6).reshape(2, 3).to(dtype)
        t = x.to("tpu")
        assert t.dtype == dtype
        torch.testing.assert_close(t.to(torch.float32).cpu(), x.to(torch.float32))
        torch.testing.assert_close(t.cpu(), x)
    assert not dtypes & {torch.float8_e4m3fn, torch.quint8}
    with pytest.raises(RuntimeError, match="is not available"):
        torch.accelerator.get_device_capability(torch.tpu.device_count())


# ---- streams ---------------------------------------------------------------

def test_streams_api():
    default = torch.tpu.default_stream()
    assert torch.tpu.current_stream() == default
    s = torch.tpu.Stream()
    assert isinstance(s, torch.Stream) and s.device == torch.device("tpu", 0)
    assert s != default
    with torch.tpu.stream(s) as entered:
        assert entered is s and torch.tpu.current_stream() == s
        inner = torch.tpu.Stream()
        with inner:  # a stream is its own context manager too
            assert torch.tpu.current_stream() == inner
        assert torch.tpu.current_stream() == s
        x = torch.randn(8, 8)
        y = x.to("tpu") @ x.to("tpu")
    assert torch.tpu.current_stream() == default
    with torch.tpu.stream(None):  # no-op, as on CUDA
        assert torch.tpu.current_stream() == default
    default.wait_stream(s)
    ev = s.record_event()
    default.wait_event(ev)
    s.synchronize()
    assert s.query() and default.query() and ev.query()
    torch.testing.assert_close(y.cpu(), x @ x)
    with pytest.raises(RuntimeError, match="is not available"):
        torch.tpu.Stream(f"tpu:{torch.tpu.device_count()}")


def test_torch_stream_of_the_device():
    s = torch.Stream("tpu")
    assert type(s) is torch.tpu.Stream and isinstance(s, torch.Stream)
    assert type(torch.Stream()) is torch.tpu.Stream  # the current accelerator
    s.synchronize()
    assert s.query()
    cpu = torch.Stream("cpu")
    assert type(cpu) is not torch.tpu.Stream and isinstance(cpu, torch.Stream)


def test_stream_synchronize_waits_for_work(mode):
    a = torch.randn(64, 64)
    x = a.to("tpu")
    for _ in range(5):
        x = x @ x.T / 64
    torch.tpu.current_stream().synchronize()
    arr = x._storage.array
    assert arr.is_ready()
    expect = a
    for _ in range(5):
        expect = expect @ expect.T / 64
    torch.testing.assert_close(x.cpu(), expect, rtol=1e-4, atol=1e-5)


# ---- events ------------------------------------------------------------------

def _timed(make_event, n_matmuls):
    # Scaled so that a's powers stay near 1 (no underflow to zero).
    a = torch.randn(512, 512, device="tpu") / 512 ** 0.5
    start, end = make_event(), make_event()
    start.record()
    b = a
    for _ in range(n_matmuls):
        b = b @ a
    end.record()
    end.synchronize()
    assert start.query() and end.query()
    return start.elapsed_time(end), b, a


@pytest.mark.parametrize("make_event", [lambda: torch.tpu.Event(enable_timing=True),
                                        lambda: torch.Event("tpu", enable_timing=True),
                                        lambda: torch.Event(enable_timing=True)],
                         ids=["torch.tpu.Event", "torch.Event(tpu)", "torch.Event()"])
def test_event_times_device_work(make_event):
    for mode in ("strict", "fused"):
        with torchtpu.eager_mode(mode):
            _timed(make_event, 30)  # compiles the kernels outside the timed runs
            # The fastest of three runs each: a shared machine's pause (a GC,
            # another process) can land in any single one.
            empty = min(_timed(make_event, 0)[0] for _ in range(3))
            runs = [_timed(make_event, 30) for _ in range(3)]
            busy = min(r[0] for r in runs)
            _, b, a = runs[0]
            assert 0 <= empty < busy, (mode, empty, busy)
            expect = a.cpu()
            for _ in range(30):
                expect = expect @ a.cpu()
            assert expect.abs().max() > 0.01
            torch.testing.assert_close(b.cpu(), expect, rtol=1e-4, atol=1e-5)


def test_process_exits_cleanly_with_events_still_waiting(tmp_path):
    """A program that ends while recorded events wait on its last work (as
    FSDP2's do) exits with status 0: the thread stamping them is not left
    inside the runtime as the interpreter finalizes (which aborted it)."""
    script = tmp_path / "events_at_exit.py"
    script.write_text(
        "import torch, torchtpu\n"
        "x = torch.randn(800, 800, device='tpu') / 800 ** 0.5\n"
        "for _ in range(10):\n"
        "    x = x @ x\n"
        "    torch.tpu.Event().record()\n"
        "print('issued')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == "issued\n" and "terminate" not in proc.stderr, proc.stderr


def test_event_api_semantics(mode):
    e = torch.tpu.Event(enable_timing=True)
    assert isinstance(e, torch.Event) and e.device == torch.device("tpu")
    assert e.query()  # never recorded: nothing to wait for, as on CUDA
    e.synchronize()
    other = torch.tpu.Event(enable_timing=True)
    with pytest.raises(RuntimeError, match="must be recorded"):
        e.elapsed_time(other)
    x = torch.randn(32, 32, device="tpu")
    e.record()
    y = (x @ x).sum()
    other.record(torch.tpu.current_stream())
    other.wait()
    other.synchronize()
    assert e.elapsed_time(other) >= 0
    untimed = torch.tpu.Event()
    untimed.record()
    untimed.synchronize()
    with pytest.raises(RuntimeError, match="enable_timing"):
        e.elapsed_time(untimed)
    e.record()  # an event records again
    e.synchronize()
    assert other.elapsed_time(e) >= 0
    torch.testing.assert_close(y.cpu(), (x.cpu() @ x.cpu()).sum(), rtol=1e-4, atol=1e-4)
    assert type(torch.Event("cpu")) is not torch.tpu.Event


def test_event_record_is_a_flush_boundary_in_fused_mode():
    """A timing event's record issues the recorded ops (its time is
    theirs); a plain event's issues nothing until it is asked about, then
    waits for at least the work before it."""
    from torchtpu.modes.fused import STATS
    from torchtpu.tensor import Pending
    with torchtpu.eager_mode("fused"):
        x = torch.randn(16, device="tpu")
        y = x * 2 + 1
        before = STATS.flushes["event"]
        torch.tpu.Event(enable_timing=True).record()
        assert STATS.flushes["event"] == before + 1
        assert type(y._storage.array) is not Pending  # issued, not recorded
        torch.testing.assert_close(y.cpu(), x.cpu() * 2 + 1)

        for ask in ("synchronize", "query"):
            z = y * 3
            plain = torch.tpu.Event()
            plain.record()
            torch.tpu.current_stream().wait_event(plain)
            assert STATS.flushes["event"] == before + 1
            assert type(z._storage.array) is Pending  # still recorded
            getattr(plain, ask)()
            assert STATS.flushes["event"] == before + 2
            assert type(z._storage.array) is not Pending
            plain.synchronize()
            assert plain.query() and z._storage.array.is_ready()
            before += 1
            torch.testing.assert_close(z.cpu(), (x.cpu() * 2 + 1) * 3)


def test_subclasses_of_torch_event_and_stream_still_construct():
    """Classes deriving from torch.Event / torch.Stream after import (as
    Inductor's CPU device interface does) get instances of their own."""
    class TimedEvent(torch.Event):
        def __init__(self, enable_timing=True):
            self.time = 0.0

    e = TimedEvent(enable_timing=True)
    assert type(e) is TimedEvent and e.time == 0.0 and isinstance(e, torch.Event)

    class MyStream(torch.Stream):
        pass

    s = MyStream("tpu")
    assert type(s) is MyStream and isinstance(s, torch.Stream)
    from torch._dynamo.device_interface import CpuInterface
    assert type(CpuInterface.Event(enable_timing=True)) is CpuInterface.Event
