"""Host-to-device copies of a 64 MiB batch: plain against pinned non_blocking,
and how much of a copy hides behind a running step."""
import statistics
import time

import torch

import torchtpu

BATCH = (1024, 1024, 16)  # float32: 64 MiB


def _median_times(fn, repeats, sink):
    """Median (host-blocked, until-done) seconds of fn() -> a callable that
    waits; fn keeps its results in sink until then."""
    fn()()  # warm-up: compiles the kernels
    sink.clear()
    host, done = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        wait = fn()
        issued = time.perf_counter()
        wait()
        host.append(issued - start)
        done.append(time.perf_counter() - start)
        sink.clear()
    return statistics.median(host), statistics.median(done)


def transfers(repeats=9, n_matmuls=4, size=1024):
    src = torch.randn(BATCH)
    pinned = src.pin_memory()
    weight = torch.randn(size, size, device="tpu") / size ** 0.5
    sink = []

    def plain():
        sink.append(src.to("tpu"))
        return torchtpu.sync

    def non_blocking():
        sink.append(pinned.to("tpu", non_blocking=True))
        return torchtpu.sync

    def step():
        x = weight
        for _ in range(n_matmuls):
            x = x @ weight
        sink.append(x)
        return torchtpu.sync

    def step_and_copy():
        step()
        return non_blocking()

    rows = []
    for mode in ("strict", "fused"):
        with torchtpu.eager_mode(mode):
            case = []
            for name, fn in (("plain .to('tpu')", plain),
                             ("pinned .to('tpu', non_blocking=True)", non_blocking),
                             (f"step alone ({n_matmuls} matmuls {size}x{size})", step),
                             ("step, then the pinned non_blocking copy", step_and_copy)):
                host, done = _median_times(fn, repeats, sink)
                case.append({"mode": mode, "case": name, "host": host * 1e3, "done": done * 1e3,
                             "note": ""})
        plain_row, nb_row, step_row, both_row = case
        nb_row["note"] = (f"host blocked {plain_row['host'] / nb_row['host']:.1f}x less, "
                          f"done {plain_row['done'] / nb_row['done']:.2f}x as fast as plain")
        hidden = step_row["done"] + nb_row["done"] - both_row["done"]
        both_row["note"] = (f"{hidden:.1f} ms of the copy's {nb_row['done']:.1f} ms hidden "
                            f"({max(hidden, 0) / nb_row['done']:.0%})")
        rows += case
    return rows


transfers.title = ("Host-to-device copy of a 64 MiB float32 batch (medians): how long the "
                   "host is blocked, and until the copy is done")
transfers.columns = [("mode", "mode", "{}"), ("case", "case", "{}"),
                     ("host", "host blocked (ms)", "{:.2f}"), ("done", "until done (ms)", "{:.2f}"),
                     ("note", "", "{}")]
