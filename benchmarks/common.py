"""Helpers shared by the benchmarks: timing and the tables they print."""
import statistics
import time


def timings(fn, repeats, warmup=1):
    """(median, best) wall seconds of fn() over repeats, after warmup calls.
    The best shows the cost without interference from other processes."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def alternating_ms(fns, repeats, warmup):
    """{name: median ms of fns[name]()}, the calls alternating between the
    functions so that all of them see the same machine load."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
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
