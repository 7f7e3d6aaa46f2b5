"""torchtpu.report(): what a bug report needs, in one text - versions, the
platform and its devices, the settings, the cache, the metrics, the syncs
and the memory. `python -m torchtpu report` prints it for a new process."""
import importlib.metadata
import os
import platform
import sys

import jax
import torch

from . import cache, config, metrics, modes, runtime
from .memory import max_memory_allocated, memory_allocated
from .ops import precision_setting


def _versions():
    try:
        version = importlib.metadata.version("torchtpu")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        version = "(not installed)"
    return [f"torchtpu {version}, torch {torch.__version__}, jax {jax.__version__}, "
            f"Python {platform.python_version()}, {platform.platform()}"]


def _devices():
    devices = ", ".join(f"tpu:{i} = {d.device_kind} ({d.platform}:{d.id})"
                        for i, d in enumerate(runtime.DEVICES))
    return [f"platform {runtime.PLATFORM}: {len(runtime.DEVICES)} device(s): {devices}"]


def _settings():
    set_vars = [f"{name}={os.environ[name]}" for name in config.VARIABLES if os.environ.get(name)]
    return [f"eager mode {modes.get_eager_mode()}; float32 matmuls at XLA's "
            f"{precision_setting().name} precision",
            "set: " + (" ".join(set_vars) if set_vars else "no TORCHTPU_* variable")]


def _cache():
    s = cache.stats()
    if s["dir"] is None:
        disk = "disk cache off"
    else:
        limit = s["disk_limit"]
        disk = (f"disk cache {s['dir']}: {s['disk_bytes'] / 2**20:.1f} MiB"
                + (f" of {limit / 2**30:.1f} GiB" if limit else ", no limit")
                + (" (read-only)" if s["read_only"] else ""))
    looked = s["disk_hits"] + s["disk_misses"]
    rate = f"{100 * s['disk_hits'] / looked:.0f}%" if looked else "-"
    return [disk, f"this process: {s['memory_hits']} memory hits, {s['disk_hits']} disk hits "
                  f"of {looked} disk lookups ({rate}), {s['compilations']} compilations "
                  f"({s['compile_seconds']:.1f} s)"]


def _memory():
    return [f"tpu:{i}: {memory_allocated(i) / 2**20:.1f} MiB allocated, "
            f"{max_memory_allocated(i) / 2**20:.1f} MiB at most" for i in range(len(runtime.DEVICES))]


def report():
    """The report as text (print it)."""
    # (Memory last: its figures wait for issued work, a sync of their own.)
    sections = [("versions", _versions), ("devices", _devices), ("settings", _settings),
                ("cache", _cache), ("metrics", lambda: metrics.summary().splitlines()),
                ("syncs", lambda: metrics.sync_report().splitlines()), ("memory", _memory)]
    out = ["torchtpu report"]
    for title, make in sections:
        try:
            lines = make()
        except Exception as e:  # a report must come out whatever is broken
            lines = [f"(unavailable: {type(e).__name__}: {e})"]
        out.append(f"{title}:")
        out += [f"  {line}" for line in lines]
    return "\n".join(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["report"]:
        print("usage: python -m torchtpu report", file=sys.stderr)
        return 2
    print(report())
    return 0
