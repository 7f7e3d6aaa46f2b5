"""Where the time and the memory go: torch.profiler's ranges for torchtpu's
work (uploads, syncs, fused flushes and graph runs, compiles), the sync
report, the memory snapshot, out-of-memory errors and the report."""
import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import torchtpu


def _step_names(mode):
    torchtpu.set_eager_mode(mode)
    model = torch.nn.Linear(8, 4).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()  # the step's sync
    x_cpu = torch.randn(16, 8)
    for _ in range(3):
        step(x_cpu.to("tpu"))
    torchtpu.wait_for_compiles()  # (fused mode: its step's graph, fused)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x = x_cpu.to("tpu")  # an upload
        loss = step(x)
    assert loss == loss
    return [e.key for e in prof.key_averages()]


def test_a_strict_step_shows_its_ops_upload_and_sync():
    with torchtpu.eager_mode("strict"):
        names = _step_names("strict")
    assert {"aten::addmm", "aten::mean"} <= set(names)
    assert "torchtpu upload [16, 8] torch.float32" in names
    assert any(n.startswith("torchtpu sync (item) at ") and __file__ in n for n in names), names


def test_a_fused_step_shows_its_flush_and_graph_run_at_the_users_line():
    with torchtpu.eager_mode("fused"):
        names = _step_names("fused")
    assert {"aten::addmm", "aten::mean"} <= set(names)
    flushes = [n for n in names if n.startswith("torchtpu flush (item): ")]
    runs = [n for n in names if n.startswith("torchtpu graph run (hit): ")]
    assert flushes and runs, names
    assert all(__file__ in n for n in flushes + runs)


def test_no_range_without_a_profiler():
    from torchtpu import profiling
    assert not profiling.recording()
    with profiling.span(lambda: 1 / 0):  # the name is not even made
        pass


_COMPILING = textwrap.dedent("""
    import json, sys, torch, torchtpu
    from torch.profiler import ProfilerActivity, profile
    x = torch.randn(5, 3).to("tpu")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (x.exp() * 2).sum().item()
    print(json.dumps([e.key for e in prof.key_averages()]))
""")


def test_compiles_show_as_ranges(tmp_path):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", _COMPILING], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    names = json.loads(out.stdout.strip().splitlines()[-1])
    assert "torchtpu compile tpu_aten_exp_default" in names, names


def test_the_sync_report_names_each_sync_per_step(mode):
    model = torch.nn.Linear(4, 1).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4).to("tpu")
    torchtpu.metrics.reset()
    for _ in range(5):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert loss.item() >= 0  # sync one
        loss_line = sys._getframe().f_lineno - 1
        assert model.weight.sum().item() == model.weight.sum().item()  # two more
        weight_line = sys._getframe().f_lineno - 1
    report = torchtpu.metrics.sync_report()
    assert report.startswith("torchtpu syncs: 15 in 5 training steps (3.0 per step)")
    assert f"test_observability.py:{loss_line}: item x5 (1.0 per step), waited " in report
    assert f"test_observability.py:{weight_line}: item x10 (2.0 per step), waited " in report
    assert "waiting for the device: " in report


def test_the_report_holds_what_a_bug_report_needs(tmp_path):
    x = torch.randn(3, 3).to("tpu")
    (x @ x).sum().item()
    text = torchtpu.report()
    for part in ("torchtpu report", f"torch {torch.__version__}", "platform cpu: ",
                 "tpu:0 = ", "eager mode ", "float32 matmuls at XLA's HIGHEST precision", "cache:",
                 "metrics:", "ops dispatched", "syncs:", "torchtpu syncs: ", "memory:",
                 "MiB allocated"):
        assert part in text, part
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / "cache"), TORCHTPU_EAGER_MODE="fused")
    out = subprocess.run([sys.executable, "-m", "torchtpu", "report"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "eager mode fused" in out.stdout and "TORCHTPU_EAGER_MODE=fused" in out.stdout
    assert f"disk cache {tmp_path / 'cache'}: " in out.stdout


def test_the_memory_snapshot_names_the_line_of_the_largest_tensor(mode):
    torch.tpu.memory._record_memory_history()
    try:
        big = torch.zeros(300, 400, device="tpu") + 1
        big_line = sys._getframe().f_lineno - 1
        small = torch.ones(7, device="tpu") * 3
        snap = torch.tpu.memory_snapshot()
        assert snap[0] == {"bytes": 300 * 400 * 4, "shape": (300, 400), "dtype": "float32",
                           "device": 0, "line": f"{__file__}:{big_line}"}
        assert any(e["shape"] == (7,) and e["line"] != "<not recorded>" for e in snap)
        del big
        assert all(e["shape"] != (300, 400) for e in torch.tpu.memory_snapshot())
        assert small.sum().item() == 21.0
    finally:
        torch.tpu.memory._record_memory_history(enabled=None)


_EXHAUSTING = textwrap.dedent("""
    import resource, sys, torch, torchtpu
    # (A cap on the address space: the allocation fails at once, whatever
    # the machine's overcommit policy.)
    resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))
    torchtpu.set_eager_mode(sys.argv[1])
    torch.tpu.memory._record_memory_history()
    kept = torch.zeros(500, 500, device="tpu") + 1
    if sys.argv[2] == "queued":  # behind a running op: its allocation fails as it runs
        # (kept is read first: a fused graph whose allocation fails as it
        # runs fails as a whole, busy with it.)
        print("kept", kept.sum().item())
        busy = torch.ones(1500, 1500, device="tpu")
        busy = (busy @ busy).tanh() @ busy
    try:
        huge = torch.ones(2 ** 36, device="tpu") * 2
        print(huge.sum().item())
    except torch.OutOfMemoryError as e:
        print("OOM", e)
    print("after", kept.sum().item())
""")


@pytest.mark.parametrize("mode,when", [("strict", "alone"), ("fused", "alone"), ("fused", "queued")])
def test_running_out_of_device_memory_raises_torchs_error_naming_the_holders(mode, when):
    out = subprocess.run([sys.executable, "-c", _EXHAUSTING, mode, when], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, TORCHTPU_CACHE_DIR="off"))
    assert out.returncode == 0, out.stderr
    oom = next(line for line in out.stdout.splitlines() if line.startswith("OOM "))
    # (XLA's RESOURCE_EXHAUSTED, or where the op was queued behind others,
    # its INTERNAL error at the read: both name the allocation.)
    assert "Out of memory allocating" in oom
    assert "The largest live tensors: 1.0 MiB float32[500, 500] made at <string>:" in oom
    assert "after 250000.0" in out.stdout  # nothing else lost


def test_a_device_trace_names_the_graphs_and_torchtpus_ranges(tmp_path):
    with torchtpu.eager_mode("fused"):
        model = torch.nn.Linear(8, 4).to("tpu")
        x = torch.randn(16, 8).to("tpu")
        for _ in range(3):
            model(x).sum().item()
        with torchtpu.profiler.trace(tmp_path):
            model(x).sum().item()
            line = sys._getframe().f_lineno - 1
    import jax
    (path,) = tmp_path.glob("plugins/profile/*/*.xplane.pb")
    names = {ev.name for plane in jax.profiler.ProfileData.from_file(str(path)).planes
             for row in plane.lines for ev in row.events}
    assert any("tpu_fused_" in n for n in names), names
    assert f"torchtpu flush (item): 2 ops at {__file__}:{line}" in names
    assert any(n.startswith("torchtpu sync (profiler) at ") and __file__ in n for n in names)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_going_over_the_memory_fraction_raises_naming_the_top_holder_and_loses_nothing(mode):
    from torchtpu.tensor import Storage
    torch.manual_seed(0)
    cpu_model = torch.nn.Linear(256, 256)
    x_cpu = torch.randn(64, 256)
    total = torch.tpu.mem_get_info()[1]
    with torchtpu.eager_mode(mode):
        model = torch.nn.Linear(256, 256).to("tpu")
        model.load_state_dict(cpu_model.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = x_cpu.to("tpu")

        def step():
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.item()
        step()
        torch.tpu.memory._record_memory_history()
        gc.collect()  # (earlier tests' garbage may hold device arrays)
        try:
            torch.tpu.set_per_process_memory_fraction(
                (torch.tpu.memory_allocated() + (30 << 20)) / total)
            held = torch.ones(6000, 1024, device="tpu")  # 23.4 MiB
            held_line = sys._getframe().f_lineno - 1
            held2 = None
            over_line = sys._getframe().f_lineno + 2
            with pytest.raises(torch.OutOfMemoryError) as e:
                held2 = held[:4000] * 2  # 15.6 MiB more
                step()  # fused mode's sync point
            msg = str(e.value)
            if mode == "strict":
                assert msg.startswith(f"torchtpu: aten.mul.Tensor(float32[4000, 1024], 2) at "
                                      f"{__file__}:{over_line} would take 15.6 MiB, "), msg
            else:
                assert msg.startswith("torchtpu: a fused graph of "), msg
                assert f"run at {__file__}:" in msg and "(item) would keep " in msg
                assert msg.endswith("Its ops stay pending: free tensors and sync again.")
            assert "over its limit of " in msg and "set_per_process_memory_fraction(" in msg
            assert (f"The largest live tensors: 23.4 MiB float32[6000, 1024] made at "
                    f"{__file__}:{held_line}") in msg, msg
            del held, held2
            step()  # the next step runs
            steps = 2 if mode == "strict" else 3  # (fused: the failed step's ops ran too)
        finally:
            torch.tpu.set_per_process_memory_fraction(1.0)
            torch.tpu.memory._record_memory_history(enabled=None)
        weight = model.weight.cpu()
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    for _ in range(steps):
        cpu_opt.zero_grad()
        cpu_model(x_cpu).pow(2).mean().backward()
        cpu_opt.step()
    torch.testing.assert_close(weight, cpu_model.weight, rtol=1e-5, atol=1e-6)
    # With no fraction set, nothing checks storages.
    assert Storage.__init__ is Storage._init and Storage.assign is Storage._assign
    assert torch.tpu.get_per_process_memory_fraction() == 1.0


def test_over_the_memory_fraction_a_compiled_graph_names_xlas_planned_peak():
    """A fused graph compiled before, run again over the limit: the error
    gives the temporaries XLA's memory analysis plans for it (here at least
    the 1 MiB softmax(x @ x) held while the second matmul runs)."""
    import re

    from torchtpu.modes import graph
    x_cpu = torch.randn(512, 512)
    total = torch.tpu.mem_get_info()[1]
    with torchtpu.eager_mode("fused"):
        x = x_cpu.to("tpu")

        def f():
            return ((x @ x).softmax(-1) @ x * 0.75).sum(0)  # one flush, at .cpu()
        for _ in range(3):  # met, compiled, run compiled
            f().cpu()
        gc.collect()
        try:
            torch.tpu.set_per_process_memory_fraction((torch.tpu.memory_allocated() + 1024) / total)
            with pytest.raises(torch.OutOfMemoryError) as e:
                f().cpu()  # its 2 KiB result goes over
        finally:
            torch.tpu.set_per_process_memory_fraction(1.0)
        msg = str(e.value)
        del e  # (its traceback's frames hold x: the tests after it see no such tensor)
        planned = re.search(r"XLA plans the graph ([0-9.]+) MiB of temporaries at its peak "
                            r"\(its compiled memory analysis\), beside 1\.0 MiB of arguments "
                            r"and 0\.0 MiB of results\.", msg)
        assert planned, msg
        temps = {round(ex.memory_analysis().temp_size_in_bytes / 2**20, 1)
                 for ex in map(graph.executable_of, [v for v in torchtpu.cache._memory.values()
                                                      if isinstance(v, graph.GraphEntry)]) if ex is not None}
        assert float(planned.group(1)) >= 1.0 and float(planned.group(1)) in temps, (msg, temps)
        torch.testing.assert_close(f().cpu(), ((x_cpu @ x_cpu).softmax(-1) @ x_cpu * 0.75).sum(0),
                                   rtol=1e-4, atol=1e-3)


def test_the_memory_fraction_is_checked_as_cudas():
    with pytest.raises(ValueError, match="Allowed range: 0~1"):
        torch.tpu.set_per_process_memory_fraction(1.5)
    with pytest.raises(TypeError, match="must be `float`"):
        torch.tpu.set_per_process_memory_fraction(1)


def test_the_dumped_snapshot_reads_in_pytorchs_memory_visualizer(tmp_path):
    import pickle

    from torch.cuda import _memory_viz
    # The snapshot lists every live block: an earlier test's exception (its
    # traceback's frames) can hold a bigger one until Python collects it.
    gc.collect()
    torch.tpu.memory._record_memory_history()
    try:
        big = torch.ones(300, 500, device="tpu") * 2
        big_line = sys._getframe().f_lineno - 1
        torch.tpu.memory._dump_snapshot(str(tmp_path / "snap.pickle"))
    finally:
        torch.tpu.memory._record_memory_history(enabled=None)
    with open(tmp_path / "snap.pickle", "rb") as f:
        snap = pickle.load(f)
    largest = max((b for seg in snap["segments"] for b in seg["blocks"]), key=lambda b: b["size"])
    assert largest["size"] == 300 * 500 * 4 and largest["state"] == "active_allocated"
    assert largest["frames"][0]["filename"] == __file__
    assert largest["frames"][0]["line"] == big_line
    summary = _memory_viz.segsum(snap)  # the visualizer's text summary of the segments
    total = sum(seg["total_size"] for seg in snap["segments"])
    assert f"segments: {len(snap['segments'])}\n" in summary
    assert f"total_allocated: {_memory_viz.Bytes(total)}\n" in summary
    stacks = _memory_viz.memory(snap, format_flamegraph=lambda text: text)
    assert f"test_observability.py:{big_line}:<tpu op> {300 * 500 * 4}" in stacks
    assert big.sum().item() == 300 * 500 * 2


def test_torch_profilers_on_trace_ready_writes_the_device_trace(tmp_path):
    """torch.profiler.profile(on_trace_ready=torchtpu.profiler.device_trace_handler(dir)):
    the device trace of each recorded window, with a schedule of two active
    steps, and the handler it is given next called too."""
    seen = []
    with torchtpu.eager_mode("fused"):
        model = torch.nn.Linear(8, 4).to("tpu")
        x = torch.randn(16, 8).to("tpu")
        handler = torchtpu.profiler.device_trace_handler(tmp_path, then=seen.append)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    schedule=torch.profiler.schedule(wait=1, warmup=1, active=2),
                                    on_trace_ready=handler) as prof:
            for _ in range(4):
                model(x).sum().item()
                prof.step()
    import jax
    (path,) = tmp_path.glob("plugins/profile/*/*.xplane.pb")
    names = {ev.name for plane in jax.profiler.ProfileData.from_file(str(path)).planes
             for row in plane.lines for ev in row.events}
    assert any("tpu_fused_" in n for n in names), names
    assert any(n.startswith("torchtpu flush (item): ") and __file__ in n for n in names), names
    assert seen == [prof]
    # The device trace stops with the recording: nothing traces afterwards.
    assert torchtpu.profiling.DEVICE_TRACE[0] is False
