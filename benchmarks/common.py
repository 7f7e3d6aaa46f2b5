"""Timing shared by the benchmarks."""
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
