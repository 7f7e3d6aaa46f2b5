"""Helpers shared by the benchmarks: timing, worker processes and the
tables they print."""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_ROWS = "ROWS "


def settle():
    """Wait for the fused graphs compiling in the background (tiered
    compilation): steady-state timings are of the compiled graphs. The
    first steps, which do not wait, are timed by recompiles.py."""
    torchtpu = sys.modules.get("torchtpu")
    if torchtpu is not None:
        torchtpu.wait_for_compiles()


def timings(fn, repeats, warmup=1):
    """(median, best) wall seconds of fn() over repeats, after warmup calls.
    The best shows the cost without interference from other processes."""
    for _ in range(warmup):
        fn()
    settle()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def in_one_process(measure, specs, reset):
    """[measure(spec) for each spec], one after another in this process, a
    spec's exception its {"error": ...}, reset() after each: a smoke run's
    figures (a process each costs seconds of start-up; they are not kept)."""
    results = []
    for spec in specs:
        try:
            results.append(measure(spec))
        except Exception as e:
            results.append({"error": f"{type(e).__name__}: {e}"[:400]})
        finally:
            reset()
    return results


def measured(specs, measure, smoke, budget, timeout, start):
    """(spec, its result) for each spec, by measure(spec or a list of them,
    timeout), a script's children: a smoke run's in one child, else each
    in its own, within the budget (seconds since start)."""
    together = None
    if smoke:
        together = measure(specs, min(budget, timeout * len(specs)))
        if not isinstance(together, list):  # (its error, for every figure)
            together = [together] * len(specs)
    for i, spec in enumerate(specs):
        left = budget - (time.perf_counter() - start)
        if together is not None:
            result = together[i]
        elif left < 20:
            result = {"error": "not run: the time budget was spent"}
        else:
            result = measure(spec, min(timeout, left))
        yield spec, result


def alternating_ms(fns, repeats, warmup):
    """{name: median ms of fns[name]()}, the calls alternating between the
    functions so that all of them see the same machine load."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    settle()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timings(fn, 1, warmup=0)[0])
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def table(bench, rows):
    """A markdown table of rows, with the columns (key, title, format) that
    the benchmark function carries as bench.columns."""
    head = [title for _, title, _ in bench.columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for key, _, fmt in bench.columns) + " |")
    return "\n".join(lines)


def print_rows(rows):
    """A worker's rows, on the line worker_rows() reads."""
    print(_ROWS + json.dumps(rows), flush=True)


def worker_rows(script, args, timeout):
    """The rows of `script --worker *args`, run in a process of its own with
    an empty compilation cache (as a fresh program starts)."""
    with tempfile.TemporaryDirectory() as cache_dir:
        proc = subprocess.run([sys.executable, os.path.abspath(script), "--worker", *args],
                              env=dict(os.environ, TORCHTPU_CACHE_DIR=cache_dir),
                              capture_output=True, text=True, timeout=timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(_ROWS)), None)
    if line is None:
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(args)} failed:\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(line[len(_ROWS):])
