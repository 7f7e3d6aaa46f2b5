"""torch.tpu's memory statistics, as torch.cuda reports them.

The figures come from the platform's own statistics where it keeps them
(TPU and GPU: jax.Device.memory_stats()), else from torchtpu's count of
the live arrays on the device (the CPU platform reports none). That count
is taken when asked, so no op pays for it; the peak is the highest figure
seen at a memory query or an event's record, not a high-water mark
between them. A query is a sync point: it waits for the
issued work (fused mode: runs the pending ops), so that the figures count
exactly the tensors alive.
"""
import collections
import math
import typing

import jax
import jax.numpy as jnp

from . import errors, properties, runtime

# Per device index: the peak since the last reset, as this module has seen
# it, and the platform's own peak at that reset (its peak cannot be reset).
_peaks = {}

# Waits for what holds device arrays only until issued work completes (the
# events' waiter): after them, the live arrays are exactly the user's.
holders = []


def _peak(index):
    p = _peaks.get(index)
    if p is None:
        p = _peaks[index] = {"allocated": 0, "reserved": 0, "platform_peak_at_reset": None}
    return p


def _settle():
    """Wait for issued work: the executor holds the last op's results until
    then (strict mode), and fused mode's pending tensors have no memory yet.
    (modes is imported here: its executors need the device registered first.)"""
    from . import modes
    runtime.wait_transfers()
    modes.sync("memory_stats")
    for wait in holders:
        wait()


def live_arrays(index=None):
    """The arrays alive on tpu:index (None: on every device)."""
    arrays = jax.live_arrays(runtime.PLATFORM)
    if index is None or len(runtime.DEVICES) == 1:
        return arrays
    dev = runtime.device(index)
    return [a for a in arrays if dev in a.devices()]


def _figures(device=None, settle=True):
    """(allocated bytes, reserved bytes, live allocations, platform peak or None)."""
    index = properties.checked_index(device)
    if settle:
        _settle()
    stats = properties.platform_memory_stats(index)
    if stats and "bytes_in_use" in stats:
        allocated = int(stats["bytes_in_use"])
        reserved = int(stats.get("pool_bytes") or stats.get("bytes_reserved") or allocated)
        # (The platform's num_allocs counts every allocation ever made.)
        count = len(live_arrays(index))
        return allocated, max(reserved, allocated), count, stats.get("peak_bytes_in_use")
    arrays = live_arrays(index)
    allocated = sum(a.size * a.dtype.itemsize for a in arrays)  # (a.nbytes costs 6x more)
    return allocated, allocated, len(arrays), None


def sample(device=None, settle=True):
    """Take the current figures, raising the peaks to them; settle: wait for
    the issued work first (a sync point)."""
    allocated, reserved, count, platform_peak = _figures(device, settle)
    p = _peak(properties.checked_index(device))
    p["allocated"] = max(p["allocated"], allocated)
    if platform_peak is not None and (p["platform_peak_at_reset"] is None
                                      or platform_peak > p["platform_peak_at_reset"]):
        # The platform saw a new peak since the reset: its figure is exact.
        p["allocated"] = max(p["allocated"], int(platform_peak))
    p["reserved"] = max(p["reserved"], reserved, p["allocated"])
    return allocated, reserved, count


def memory_allocated(device=None):
    return sample(device)[0]


def max_memory_allocated(device=None):
    sample(device)
    return _peak(properties.checked_index(device))["allocated"]


def memory_reserved(device=None):
    return sample(device)[1]


def max_memory_reserved(device=None):
    sample(device)
    return _peak(properties.checked_index(device))["reserved"]


def reset_peak_memory_stats(device=None):
    allocated, reserved, _, platform_peak = _figures(device)
    _peak(properties.checked_index(device)).update(
        allocated=allocated, reserved=reserved,
        platform_peak_at_reset=None if platform_peak is None else int(platform_peak))


reset_max_memory_allocated = reset_peak_memory_stats
reset_max_memory_cached = reset_peak_memory_stats
memory_cached = memory_reserved  # torch.cuda's old names
max_memory_cached = max_memory_reserved


def reset_accumulated_memory_stats(device=None):
    """No accumulated counters are kept (only current and peak figures)."""
    properties.checked_index(device)


def memory_stats(device=None):
    """The figures under torch.cuda.memory_stats' key names."""
    allocated, reserved, count = sample(device)
    peak = _peak(properties.checked_index(device))
    stats = collections.OrderedDict()
    for name, current, peak in (("allocated_bytes", allocated, peak["allocated"]),
                                ("active_bytes", allocated, peak["allocated"]),
                                ("reserved_bytes", reserved, peak["reserved"]),
                                ("allocation", count, None)):
        stats[f"{name}.all.current"] = current
        if peak is not None:
            stats[f"{name}.all.peak"] = peak
    stats["num_alloc_retries"] = 0
    stats["num_ooms"] = 0
    return stats


def memory_summary(device=None, abbreviated=False):
    stats = memory_stats(device)
    index = properties.checked_index(device)
    source = "platform statistics" if properties.platform_memory_stats(index) else "live arrays"

    def mib(n):
        return f"{n / 2**20:12.2f} MiB"
    rows = [("Allocated memory", "allocated_bytes"), ("Active memory", "active_bytes"),
            ("Reserved memory", "reserved_bytes")]
    lines = [f"torch.tpu memory summary, device tpu:{index} ({runtime.PLATFORM}, from {source})",
             f"{'':24}{'current':>16}{'peak':>16}"]
    for label, key in rows:
        lines.append(f"{label:24}{mib(stats[key + '.all.current']):>16}"
                     f"{mib(stats[key + '.all.peak']):>16}")
    lines.append(f"{'Allocations':24}{stats['allocation.all.current']:>16}")
    return "\n".join(lines) + "\n"


def mem_get_info(device=None):
    """(free, total) bytes of the device memory."""
    stats = properties.platform_memory_stats(properties.checked_index(device))
    if stats and stats.get("bytes_limit"):
        total = int(stats["bytes_limit"])
        return total - int(stats.get("bytes_in_use", 0)), total
    return properties.host_memory()


def _record_memory_history(enabled="all", context="all", stacks="all", max_entries=None, **kwargs):
    """Note the user's line that makes each tensor's storage from now on
    (torch.cuda.memory._record_memory_history's switch: enabled=None turns
    it off); torch.tpu.memory_snapshot() lists them. It costs a stack walk
    per op while on."""
    from . import tensor
    tensor.record_creation_lines(enabled is not None)


def _recorded():
    """id(array) -> (its storage, the line that made it), for the storages
    made while recording whose array is a live device buffer."""
    from . import tensor
    lines = tensor.CREATION_LINES
    if lines is None:
        return {}
    return {id(s.array): (s, line) for s, line in list(lines.items())
            if isinstance(s.array, jax.Array) and not s.array.is_deleted()}


def memory_snapshot(device=None):
    """The tensors' storages alive on the device (every device: None), the
    largest first, each a dict of bytes, shape, dtype, device and the line
    that made it ("<not recorded>" for those made while
    _record_memory_history was off). A sync point."""
    index = None if device is None else properties.checked_index(device)
    _settle()
    recorded = _recorded()
    out = []
    for array in live_arrays(index):
        storage, line = recorded.get(id(array), (None, "<not recorded>"))
        out.append({"bytes": array.nbytes, "shape": tuple(array.shape), "dtype": str(array.dtype),
                    "device": storage.device if storage is not None else index, "line": line})
    out.sort(key=lambda e: -e["bytes"])
    return out


def _snapshot(device=None):
    """memory_snapshot() in the dict torch.cuda.memory._snapshot() returns,
    which PyTorch's memory visualizer (pytorch.org/memory_viz,
    torch.cuda._memory_viz) reads: XLA gives each buffer its own allocation,
    so each live array is a segment of one active block, its frame the
    line that made it. No allocation events are recorded: the device
    traces are empty. A sync point."""
    entries = memory_snapshot(device)
    segments, address = [], 0
    for e in entries:
        frames = []
        if e["line"] != "<not recorded>":
            filename, _, line = e["line"].rpartition(":")
            frames = [{"filename": filename, "line": int(line), "name": "<tpu op>"}]
        block = {"address": address, "size": e["bytes"], "requested_size": e["bytes"],
                 "state": "active_allocated", "frames": frames}
        segments.append({"device": e["device"], "address": address, "total_size": e["bytes"],
                         "allocated_size": e["bytes"], "active_size": e["bytes"],
                         "requested_size": e["bytes"], "stream": 0, "segment_type": "large",
                         "segment_pool_id": (0, 0), "is_expandable": False, "blocks": [block]})
        address += max(e["bytes"], 1)  # (addresses only tell segments apart)
    return {"segments": segments, "device_traces": [[] for _ in runtime.DEVICES],
            "allocator_settings": {}}


def _dump_snapshot(filename="dump_snapshot.pickle"):
    """Write _snapshot() as torch.cuda.memory._dump_snapshot does (a pickle)."""
    import pickle
    with open(filename, "wb") as f:
        pickle.dump(_snapshot(), f)


def pending_bytes(value):
    """The bytes an array, or a fused-mode pending value, takes."""
    return math.prod(value.shape) * jnp.dtype(value.dtype).itemsize


def _failed(value):
    """Whether value is an array whose computation failed (its allocation,
    queued behind other ops): it holds no memory. Only a finished one is
    asked, so this waits for nothing."""
    try:
        if isinstance(value, jax.Array) and value.is_ready():
            value.block_until_ready()
    except Exception:  # noqa: BLE001 (its own error, raised where it is read)
        return True
    return False


def _holders_text(most=5, pending=()):
    """The largest live device buffers, and the pending values of fused mode
    in `pending` ((value, storage) pairs: a graph's results about to be
    made), with the lines that made them where recorded (no sync: an
    out-of-memory error is being raised)."""
    from . import tensor
    recorded = _recorded()
    lines = tensor.CREATION_LINES or {}
    held = [(a.nbytes, a, recorded[id(a)][1] if id(a) in recorded else None)
            for a in jax.live_arrays(runtime.PLATFORM)]
    held += [(pending_bytes(p), p, lines.get(owner)) for p, owner in pending]
    held = [h for h in sorted(held, key=lambda h: -h[0])[:2 * most] if not _failed(h[1])][:most]
    if not held:
        return ""
    text = [f"{n / 2**20:.1f} MiB {a.dtype}{list(a.shape)}" + (f" made at {line}" if line else "")
            for n, a, line in held]
    hint = "" if tensor.CREATION_LINES is not None else (
        " (torch.tpu.memory._record_memory_history() names their lines)")
    return "The largest live tensors: " + "; ".join(text) + hint


errors.register_memory_holders(_holders_text)


def empty_cache():
    """Nothing to release: XLA frees an array's memory when its last tensor
    goes, and torchtpu keeps no cache of freed blocks."""


NAMES = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
         "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
         "reset_accumulated_memory_stats", "memory_stats", "memory_summary", "mem_get_info",
         "empty_cache", "memory_cached", "max_memory_cached", "memory_snapshot",
         "_record_memory_history", "_snapshot", "_dump_snapshot")


# ---- XLA's figures for its compiled programs ----------------------------------------

class Program(typing.NamedTuple):
    """A compiled XLA program loaded on the platform, with the memory XLA's
    compiler assigned one run of it, in bytes."""
    name: str
    temp: int       # its intermediates, in buffers XLA shares between values not live at once
    arguments: int
    outputs: int
    aliased: int    # outputs written into donated arguments' buffers
    id: int         # the loaded executable's id(): tells programs apart while they live

    @property
    def footprint(self):
        """What a run holds at once, at most: its arguments, its outputs not
        written over them, and its intermediates. A step of several
        programs peaks at its largest: what one program hands the next
        (saved activations) is an output of the one, an argument of the
        other, never one of their intermediates."""
        return self.arguments + self.outputs - self.aliased + self.temp


def compiled_programs():
    """The XLA programs loaded now (kernels, fused graphs, replayed captures,
    torch.compile's graphs, each loaded once however often it runs), with
    their memory: the programs a workload brought are those listed after
    it and not before (fused graphs stay loaded while the graph cache holds
    them)."""
    programs = []
    for executable in runtime.DEVICES[0].client.live_executables():
        stats = executable.get_compiled_memory_stats()
        modules = executable.hlo_modules()
        programs.append(Program(modules[0].name if modules else "?", stats.temp_size_in_bytes,
                                stats.argument_size_in_bytes, stats.output_size_in_bytes,
                                stats.alias_size_in_bytes, id(executable)))
    return programs

