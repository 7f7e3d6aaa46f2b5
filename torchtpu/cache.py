"""The one place that turns a JAX function plus a key into a compiled callable.

Two tiers: an in-memory LRU of kernels over a disk cache that all modes and
processes share. On disk (`torchtpu/cache_files.py` keeps the files: trust,
atomic writes, checked reads, read-only mode):

- each per-op kernel has a record (`kernel-<key>-cache`, cache_kernels.py):
  its abstract trace (result shapes, dtypes and structure, what fused mode
  needs to record the op) and, once a mode compiled it, its executable;
- each fused graph's executable is stored (`program-<key>-cache`);
- small values (`value-<key>-cache`): each call's meta outcome
  (dispatch.meta.meta_outcome) and the list of what a run's start-up
  loaded, which the next run loads ahead on a thread (start_prefetch);
- anything else torchtpu compiles (a user's kernel, a view read) goes through
  JAX's persistent cache, in JAX's entry format, written through the same
  checked storage.

The keys are torchtpu's own, stable across processes: the op and its
arguments' specs (or the graph's ops and dataflow), the argument avals,
torchtpu's code, the torch and JAX versions, the platform, devices and XLA
flags. A warm start so neither traces nor lowers what it loads, as JAX's own
cache must to compute its key. Each stored executable's module is named
after its key: XLA's CPU runtime cannot hold two loaded executables of one
module name and different code (one of them fails with "Function ... not
found").

Run `python -m torchtpu.cache info|clear [--dir D]` to inspect or empty a
cache directory.
"""
if __name__ == "__main__":  # python -m torchtpu.cache: use the package's module
    from torchtpu.cache import _main
    raise SystemExit(_main())

import atexit
import collections
import gc
import hashlib
import json
import os
import pathlib
import pickle
import sys
import threading
import time
import warnings

import jax
from jax import monitoring

from . import background, compat, config, metrics, profiling
from .cache_files import (  # noqa: F401 (the names the cache's users and tests know)
    CHECK_SUFFIX, ENTRY_SUFFIX, KERNEL_PREFIX, LOCK_NAME, LOOKUPS, PROGRAM_PREFIX, STATS,
    TMP_PREFIX, VALUE_PREFIX, DiskCache, Untrusted, _jax_cc, _main, _sha256, _tl, _warned, _warn_once,
    cache_dir, clear_disk, disk_info, open_dir, open_disk, readonly, trusted_uids, untrusted_reason)

if sys.argv[:1] == ["-m"]:
    # `python -m torchtpu.cache` imports the package (and so this module)
    # before running this file as __main__, which runpy warns about; the
    # __main__ copy only hands over to this module.
    warnings.filterwarnings("ignore", r"'torchtpu\.cache' found in sys\.modules",
                            RuntimeWarning)

MEMORY_ENTRIES = config.MEMORY_CACHE_ENTRIES.number()
# An OrderedDict in recency order: a hit costs one more C-level move.
_memory = collections.OrderedDict()


def _map_limit():
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):  # not Linux: no such limit
        return None


def _mappings():
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


# XLA's CPU runtime maps each loaded executable's code and data into regions
# of their own (3 to 10 a kernel, more for a large graph). Linux refuses a
# process more than vm.max_map_count of them (65,530 by default), and XLA's
# next compile then dies of a segfault, which thousands of distinct kernels
# in one long process reach. So the memory tier also sheds its older half
# whenever the process holds over half that limit (checked every
# _MAPPINGS_EVERY stores; a check reads /proc/self/maps, 50 us to 2 ms).
_limit = _map_limit()
MAPPINGS_KEPT = _limit // 2 if _limit else None
_MAPPINGS_EVERY = 128
_stores = 0


def _configure_disk():
    """Point JAX's persistent cache at torchtpu's directory through DiskCache;
    returns (directory or None, read_only)."""
    path = cache_dir()
    ro = readonly()
    if path is None:
        return None, ro
    if _jax_cc is None:  # pragma: no cover
        warnings.warn("torchtpu: this JAX has no compilation cache backend to wrap; "
                      "the disk cache is off", stacklevel=2)
        return None, ro
    disk = open_disk(path, ro)
    if disk is None:
        return None, ro
    jax.config.update("jax_compilation_cache_dir", path)
    # Keep even the smallest per-op executables: they are most of what a
    # process compiles, and each costs milliseconds to rebuild.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # JAX would also point XLA's own GPU caches into the directory: files XLA
    # reads without the checks above, whose path enters every entry's key (a
    # copy of the cache at another path would miss everything).
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    _jax_cc.reset_cache()
    _jax_cc._cache = disk
    _jax_cc._cache_initialized = True
    return path, ro


DISK_DIR, READONLY = _configure_disk()


# ---- JAX's monitoring events ------------------------------------------------------

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _on_event(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        metrics.M.disk_cache_hits += 1
        LOOKUPS["hits"] += 1
        _tl.disk_hit = True
    elif event == "/jax/compilation_cache/cache_misses" and not getattr(_tl, "bypass", False):
        _count_disk_miss()  # (torchtpu's own records count theirs in _compile)


def _count_disk_miss():
    metrics.M.disk_cache_misses += 1
    LOOKUPS["misses"] += 1


def _on_duration(event, duration, **kwargs):
    if event == _BACKEND_COMPILE:
        # JAX times the whole compile-or-load; a disk hit compiled nothing.
        if getattr(_tl, "disk_hit", False):
            _tl.disk_hit = False
            STATS.disk_load_seconds += duration
        elif background.on_compile_thread():  # (not time the program waited: modes/fused.py)
            STATS.background_compiles += 1
            STATS.background_compile_seconds += duration
        else:
            background.foreground_compiled()
            metrics.M.compilations += 1
            batch = getattr(_tl, "compiling_ahead", None)
            if batch is None:
                metrics.M.compile_seconds += duration
            else:  # (side by side with others: counted by cache_kernels.compile_ahead)
                batch.append(duration)
    elif event == "/jax/compilation_cache/compile_time_saved_sec":
        # JAX's figure uses the compile time rounded down to whole seconds
        # (0 for nearly every per-op kernel); the check file has the real one,
        # used once the retrieval time is known (the next event).
        if getattr(_tl, "hit_compile_seconds", None) is None:
            STATS.compile_seconds_saved += duration
    elif event == "/jax/compilation_cache/cache_retrieval_time_sec":
        saved = getattr(_tl, "hit_compile_seconds", None)
        if saved is not None:
            STATS.compile_seconds_saved += saved - duration
            _tl.hit_compile_seconds = None


monitoring.register_event_listener(_on_event)
monitoring.register_event_duration_secs_listener(_on_duration)


# ---- the API ---------------------------------------------------------------------

def lookup(key):
    """The cached entry for key, or None."""
    entry = _memory.get(key)
    if entry is not None:
        _memory.move_to_end(key)
        metrics.M.memory_cache_hits += 1
    else:
        STATS.memory_misses += 1
    return entry


def store(key, entry):
    global _stores
    _memory[key] = entry
    if len(_memory) > MEMORY_ENTRIES:
        _memory.popitem(last=False)
    _stores += 1
    if MAPPINGS_KEPT and _stores % _MAPPINGS_EVERY == 0 and _mappings() > MAPPINGS_KEPT:
        _shed()
    return entry


def _shed():
    """Drop the older half of the memory tier, and the executables only it
    held (their disk records stay: a later miss loads them again)."""
    for _ in range(len(_memory) // 2):
        _memory.popitem(last=False)
    gc.collect()
    STATS.memory_sheds += 1


def served_generally(general, key):
    """Whether a call whose kernel key is key (missing from the cache) runs
    the kernel of general, a key whose static values (view offsets) that
    kernel takes at run time: every key but the first met does. The first
    keeps its own kernel, so a program whose offsets never move (views of
    one flat buffer, a key and a value split from one projection) compiles
    and fuses as before; one whose offsets move compiles at most two
    kernels per op (and fused mode at most one graph more per combination of
    ops back at their first offset, as a ring buffer comes round). The first
    key is kept in the memory cache."""
    marker = ("first specialization", general)
    first = _memory.get(marker)
    if first is None:
        store(marker, key)
        return False
    return first != key


def jit(fn, name=None, donate_argnums=(), device=0, options=None):
    """Compile fn through JAX (lazily, at its first call); the disk tier is
    JAX's persistent cache. donate_argnums: arguments whose buffers the
    computation may reuse for its results (the caller's are invalidated).
    device: the index of the device it runs on. Its results are placed there,
    committed to it: JAX would put a factory's on its default device,
    uncommitted, and a kernel later given a committed array in its place
    would compile again. None: where its inputs are (a reader's); kept when
    fn does not use them (an empty view's reader), as JAX would drop them and
    run it on its default device. options: XLA's compiler options."""
    from . import runtime
    if name is not None:
        fn.__name__ = fn.__qualname__ = name
    placed = dict(keep_unused=True) if device is None else dict(out_shardings=runtime.SHARDINGS[device])
    # PyTorch's rounding goes with every program from here: JAX adds the
    # options a later .lower().compile(options) is given to these.
    return jax.jit(fn, donate_argnums=donate_argnums,
                   compiler_options=runtime.compiler_options(options), **placed)


# ---- stored executables and kernel records -------------------------------------
# A record is a header line of JSON (the abstract trace: result structure,
# shapes, dtypes) then, where there is one, the serialized executable.
_RECORD_FORMAT = b"torchtpu-record-1\n"
_source_version = None
_lapack_ready = False


def _source_digest():
    """torchtpu's own code and the versions it runs on: a record is only
    reused by the same lowerings."""
    global _source_version
    if _source_version is None:
        import torch
        h = hashlib.sha256(f"{jax.__version__} {torch.__version__}".encode())
        root = pathlib.Path(__file__).parent
        for f in sorted(root.rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
        _source_version = h.hexdigest()
    return _source_version


def _avals_text(args):
    return " ".join(f"{x.dtype}{list(x.shape)}{'w' if getattr(x, 'weak_type', False) else ''}"
                    if hasattr(x, "shape") and hasattr(x, "dtype") else type(x).__name__
                    for x in jax.tree_util.tree_leaves(args))


def _context(args, device):
    """What a record is valid for besides the function itself: the platform
    and devices, the flags XLA compiles with and JAX's tracing options."""
    from . import runtime
    first = runtime.DEVICES[0]
    devices = sorted({str(d) for x in jax.tree_util.tree_leaves(args)  # (arrays' and specs' alike)
                      if getattr(x, "sharding", None) is not None for d in x.sharding.device_set})
    return "\n".join([
        f"platform {runtime.PLATFORM} {first.client.platform_version} {first.device_kind} "
        f"x{len(runtime.DEVICES)} on {device}",
        f"devices {devices}",
        f"matmul precision {jax.config.jax_default_matmul_precision} promotion "
        f"{jax.config.jax_numpy_dtype_promotion}",
        *(f"{name}={os.environ.get(name, '')}" for name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"))])


def _record_key(prefix, key_text, args, device):
    text = "\n".join([_source_digest(), key_text, "args " + _avals_text(args),
                      _context(args, device)])
    return prefix + _sha256(text.encode())


def _disk():
    """The DiskCache records go to, or None (memory only)."""
    store_ = _jax_cc._cache if DISK_DIR is not None and _jax_cc is not None else None
    return store_ if isinstance(store_, DiskCache) else None


def encode_tree(template):
    """A kernel's out_tree (see dispatch.meta.flatten) as JSON."""
    if template is ...:
        return "x"
    if template is None:
        return None
    kind, items = template
    if kind is not tuple and kind is not list:
        raise TypeError(f"result structure {kind.__name__} is not stored")
    return [kind.__name__, [encode_tree(t) for t in items]]


def decode_tree(data):
    if data == "x":
        return ...
    if data is None:
        return None
    kind, items = data
    return ({"tuple": tuple, "list": list}[kind], [decode_tree(t) for t in items])


def _trace_header(out_tree, avals):
    """The abstract trace as JSON, or None when some part does not round-trip."""
    try:
        parts = [[[list(a.shape), str(a.dtype)] for a in part] for part in avals]
        if any(jax.numpy.dtype(d) != a.dtype for part, p in zip(avals, parts)
               for a, (_, d) in zip(part, p)):
            return None
        return {"out_tree": encode_tree(out_tree), "avals": parts}
    except (TypeError, ValueError, AttributeError):
        return None


def _decode_avals(header):
    """(result avals, written avals) from a header; raises on anything else."""
    outs, written = header["avals"]
    return tuple(tuple(jax.ShapeDtypeStruct(tuple(int(n) for n in shape), jax.numpy.dtype(d))
                       for shape, d in part) for part in (outs, written))


def _encode(header, compiled=None):
    """A record's bytes: the header, then compiled's executable (if given
    and serializable)."""
    tail = b""
    if compiled is not None:
        from jax.experimental import serialize_executable
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError):  # host callbacks, closed-over constants
            pass
        else:
            trees = pickle.dumps((in_tree, out_tree))
            # (The LAPACK question reads the compiled module's text: a cold cost.)
            header = dict(header, trees=len(trees), results=_results_text(compiled),
                          lapack="lapack" in compiled.as_text())
            tail = trees + payload
    return _RECORD_FORMAT + json.dumps(header).encode() + b"\n" + tail


def _decode(blob):
    """(header, the rest) of a record; ValueError for anything else."""
    if not blob.startswith(_RECORD_FORMAT):
        raise ValueError("not a record of this torchtpu")
    end = blob.index(b"\n", len(_RECORD_FORMAT))
    header = json.loads(blob[len(_RECORD_FORMAT):end])
    if not isinstance(header, dict):
        raise ValueError("a record's header is not an object")
    return header, blob[end + 1:]


def _load_executable(header, rest, device):
    """The jax.stages.Compiled a record holds, loaded for the device it was
    compiled for (by default it would be given every local device)."""
    global _lapack_ready
    from jax.experimental import serialize_executable
    if header.get("lapack") and not _lapack_ready:
        # An executable calls LAPACK through handlers JAX sets up while it
        # lowers a linear-algebra op; a loaded one needs them too.
        compat.initialize_lapack()
        _lapack_ready = True
    n = header["trees"]
    in_tree, out_tree = pickle.loads(rest[:n])
    from . import runtime
    target = runtime.DEVICES[device]
    return serialize_executable.deserialize_and_load(bytes(rest[n:]), in_tree, out_tree,
                                                     target.client, [target])


def _compile(fn, name, key, args, donate_argnums, device, traced=None, options=None):
    """fn compiled for args, its module named after its record's key, past
    JAX's own disk entries (the record holds the executable), which JAX
    then neither serializes nor writes. JAX counts the compilation; the
    disk miss is counted here. traced: fn's trace for args, if made already
    (by jit)."""
    _tl.bypass = True
    try:
        with profiling.span(lambda: f"torchtpu compile {name}"), compat.no_jax_cache_write():
            if traced is None:
                traced = jit(fn, f"{name}_{key[-16:]}", donate_argnums, device).trace(*args)
            compiled = traced.lower().compile(options)
    finally:
        _tl.bypass = False
    _count_disk_miss()
    return compiled


def _read(disk, key):
    """A record's (header, rest), or (None, None) when missing or refused
    (a damaged one is counted and warned about by the store)."""
    blob = disk.get(key)
    if blob is None:
        return None, None
    try:
        return _decode(blob)
    except (ValueError, UnicodeDecodeError) as e:
        disk._corrupt(key, f"{type(e).__name__}: {e}")
        return None, None


def _results_text(compiled):
    return " ".join(f"{a.dtype}{list(a.shape)}" for a in jax.tree_util.tree_leaves(compiled.out_info))


def _load_checked(header, rest, device):
    """A record's executable; raises when it does not load or its results
    are not the ones its header names."""
    compiled = _load_executable(header, rest, device)
    if _results_text(compiled) != header.get("results"):
        raise ValueError("its results are not the ones its record names")
    return compiled


def _count_hit(took, saved):
    metrics.M.disk_cache_hits += 1
    LOOKUPS["hits"] += 1
    STATS.disk_load_seconds += took
    if saved is not None:
        STATS.compile_seconds_saved += max(saved - took, 0.0)


def _stored_executable(disk, key, device):
    """(header, executable) of key's record, counted as a disk hit: loaded
    ahead by the prefetch thread, or now; (header or None, None) when there
    is none or it does not load (counted as damaged)."""
    ahead = _take_prefetched(key)
    if ahead is not None:
        header, compiled, took, saved = ahead
        STATS.prefetched += 1
        _count_hit(took, saved)
        return header, compiled
    started = time.monotonic()
    header, rest = _read(disk, key)
    if header is None or "trees" not in header:
        return header, None
    try:
        compiled = _load_checked(header, rest, device)
    except Exception as e:  # damaged or stale: compile again and replace it
        disk._corrupt(key, f"{type(e).__name__}: {str(e)[:200]}")
        return header, None
    _count_hit(time.monotonic() - started, getattr(_tl, "hit_compile_seconds", None))
    return header, compiled


class _FirstCall:
    """A callable that becomes resolve(args) at its first call."""
    __slots__ = ("resolve", "call")

    def __init__(self, resolve):
        self.resolve = resolve
        self.call = None

    def __call__(self, *args):
        if self.call is None:
            self.call = self.resolve(args)
        return self.call(*args)


def compiled_of(jitted, specs):
    """The XLA executable behind what jit_stored gave for arguments like
    specs (shape_specs of them), once compiled or loaded; None before that.
    (A plain jax.jit, with no disk tier, gives it from JAX's caches.)"""
    if isinstance(jitted, background.Job):
        return jitted.value if jitted.done and jitted.error is None else None
    if isinstance(jitted, _FirstCall):
        return jitted.call
    if hasattr(jitted, "lower"):
        return jitted.lower(*specs).compile()
    return None


def shape_specs(args):
    """args with each array as its shape, dtype and sharding: what compiling
    for them takes, without keeping the arrays (or their buffers) alive."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                       weak_type=getattr(x, "weak_type", False))
        if isinstance(x, jax.Array) else x, args)


def jit_stored(fn, args, key_text, name=None, donate_argnums=(), device=0, when="first call", options=None):
    """jit(fn) for arguments like args (a fused graph's) through a stored
    executable: key_text describes fn completely and the same way in every
    process (None: not storable). when: "first call" loads or compiles it
    then; "background" loads it now or compiles it on the compile thread,
    giving a background.Job whose value is the executable; "stored" loads
    it now, giving such a Job, or None when none is stored (options: XLA's)."""
    disk = _disk()
    if when != "first call":
        return _jit_in_background(fn, args, key_text, name or fn.__name__, donate_argnums, device, disk,
                                  when == "background", options)
    if key_text is None or disk is None:
        return jit(fn, name, donate_argnums, device, options)
    name = name or fn.__name__
    key = _record_key(PROGRAM_PREFIX, f"{key_text}\ndonate {tuple(donate_argnums)}", args, device)

    def resolve(call_args):
        _note_startup(key, device)
        _, compiled = _stored_executable(disk, key, device)
        if compiled is not None:
            STATS.programs_loaded += 1
            return compiled
        compiled = _compile(fn, name, key, call_args, donate_argnums, device, options=options)
        disk.put(key, _encode({}, compiled))
        return compiled
    return _FirstCall(resolve)


def _jit_in_background(fn, args, key_text, name, donate_argnums, device, disk, compile, options):
    key = None
    if key_text is not None and disk is not None:
        key = _record_key(PROGRAM_PREFIX, f"{key_text}\ndonate {tuple(donate_argnums)}", args, device)
        _, compiled = _stored_executable(disk, key, device)
        if compiled is not None or compile:
            # (A record that is, or will be, there: the next start-up loads it ahead.)
            _note_startup(key, device)
        if compiled is not None:
            STATS.programs_loaded += 1
            return background.finished(compiled)
    if not compile:
        return None
    specs = shape_specs(args)  # (the thread must not keep the arrays alive)

    def work():
        if key is None:
            return jit(fn, name, donate_argnums, device).lower(*specs).compile(options)
        compiled = _compile(fn, name, key, specs, donate_argnums, device, options=options)
        disk.put(key, _encode({}, compiled))
        return compiled
    return background.submit(work)


_DAMAGED = object()


def _decoded(disk, key, decode):
    """decode() of the record read for key, or _DAMAGED (counted, warned
    about) when it raises as a decoder does on what it did not write."""
    try:
        return decode()
    except (KeyError, TypeError, ValueError) as e:
        disk._corrupt(key, f"{type(e).__name__}: {e}")
        return _DAMAGED


def stored_value(key_text, compute, encode, decode):
    """compute(), or the value an earlier process stored under key_text (a
    full description of what compute depends on, the same in every process):
    a small record, keyed with torchtpu's code and the versions it runs on.
    encode(value) gives JSON data or None (not stored); decode(data) raises
    TypeError/ValueError/KeyError on anything it cannot have written."""
    disk = _disk()
    if disk is None:
        return compute()
    key = VALUE_PREFIX + _sha256("\n".join([_source_digest(), key_text]).encode())
    header, _ = _read(disk, key)
    if header is not None:
        value = _decoded(disk, key, lambda: decode(header["value"]))
        if value is not _DAMAGED:
            STATS.values_loaded += 1
            return value
    value = compute()
    data = encode(value)
    if data is not None:
        disk.put(key, _encode({"value": data}))
    return value


# ---- prefetch: what a start-up loads, loaded on a thread ----------------------
# A run lists the records of the executables it loaded or compiled first; the
# next run of the same code on the same platform loads those on a thread while
# the program builds its model and records its first step (XLA deserializes
# without holding the GIL). An executable loaded ahead is used only when the
# run asks for its very key, after the same checks; the list only decides
# what is loaded early. TORCHTPU_CACHE_PREFETCH=0 turns it off.

PREFETCH = config.CACHE_PREFETCH.on()
_STARTUP_LIMIT = 256
_startup_used = []  # [key, device] of what this run loaded or compiled first
_prefetch = {"thread": None, "listed": None, "done": False, "stop": False, "loaded": {}}
_prefetch_ready = threading.Condition()


def _startup_key():
    return VALUE_PREFIX + _sha256("\n".join([_source_digest(), "start-up",
                                              _context((), 0)]).encode())


def start_prefetch():
    """Start loading what the last run's start-up loaded (once torchtpu is
    imported, before the program builds anything)."""
    disk = _disk()
    if not PREFETCH or disk is None or _prefetch["thread"] is not None:
        return
    # What the thread imports, imported here: the program may be importing
    # other modules meanwhile.
    from jax.experimental import serialize_executable  # noqa: F401
    from . import runtime  # noqa: F401
    t = _prefetch["thread"] = threading.Thread(target=_prefetch_run, args=(disk,), daemon=True,
                                               name="torchtpu-cache-prefetch")
    t.start()
    atexit.register(_finish_prefetch, disk)


def _prefetch_run(disk):
    from . import runtime
    _tl.quiet = True  # what this thread finds damaged, the run finds and reports itself
    listed = []
    try:
        header, _ = _read(disk, _startup_key())
        entries = header.get("startup") if header is not None else None
        if isinstance(entries, list):
            listed = [(k, d) for k, d in (e for e in entries if isinstance(e, list) and len(e) == 2)
                      if isinstance(k, str) and type(d) is int and 0 <= d < len(runtime.DEVICES)]
    finally:
        with _prefetch_ready:
            _prefetch["listed"] = {k for k, _ in listed}
            _prefetch_ready.notify_all()
    try:
        for key, device in listed:
            if _prefetch["stop"]:
                break
            entry = None
            started = time.monotonic()
            header, rest = _read(disk, key)
            if header is not None and "trees" in header:
                try:
                    compiled = _load_checked(header, rest, device)
                except Exception:  # the run reads it again, and reports it
                    pass
                else:
                    entry = (header, compiled, time.monotonic() - started,
                             getattr(_tl, "hit_compile_seconds", None))
            with _prefetch_ready:
                _prefetch["loaded"][key] = entry
                _prefetch_ready.notify_all()
    finally:
        with _prefetch_ready:
            _prefetch["done"] = True
            _prefetch_ready.notify_all()


def _take_prefetched(key):
    """(header, executable, load seconds, compile seconds saved) loaded ahead
    for key, waiting while the thread is on it; None when it was not listed
    or did not load."""
    t = _prefetch["thread"]
    if t is None:
        return None
    with _prefetch_ready:
        while True:
            listed = _prefetch["listed"]
            if listed is not None and key not in listed:
                return None
            if key in _prefetch["loaded"]:
                return _prefetch["loaded"].pop(key)
            if _prefetch["done"] or not t.is_alive():  # (a forked child has no thread)
                return None
            _prefetch_ready.wait(0.05)


def _note_startup(key, device):
    if len(_startup_used) < _STARTUP_LIMIT:
        _startup_used.append([key, device])


def _finish_prefetch(disk):
    """At exit: stop the thread after the executable it is loading (it must
    not be inside XLA when the interpreter goes), and list this start-up."""
    _prefetch["stop"] = True
    _prefetch["thread"].join(timeout=60)
    listed = _prefetch["listed"]
    if _startup_used and (listed is None or {k for k, _ in _startup_used} != listed):
        disk.put(_startup_key(), _encode({"startup": _startup_used}))


def stats():
    """What the cache did in this process, and what its directory holds."""
    m = metrics.M
    info = disk_info(DISK_DIR) if DISK_DIR else {}
    return {
        "dir": DISK_DIR,
        "read_only": READONLY,
        "memory_entries": len(_memory),
        "memory_hits": m.memory_cache_hits,
        "memory_misses": STATS.memory_misses,
        "disk_hits": m.disk_cache_hits,
        "disk_misses": m.disk_cache_misses,
        "disk_corrupt": STATS.disk_corrupt,
        "disk_untrusted": STATS.disk_untrusted,
        "disk_evicted": STATS.disk_evicted,
        "disk_entries": info.get("entries", 0),
        "disk_programs": info.get("programs", 0),
        "programs_loaded": STATS.programs_loaded,
        "disk_kernels": info.get("kernels", 0),
        "disk_values": info.get("values", 0),
        "kernels_loaded": STATS.kernels_loaded,
        "traces_loaded": STATS.traces_loaded,
        "values_loaded": STATS.values_loaded,  # meta outcomes (dispatch.meta.meta_outcome)
        "prefetched": STATS.prefetched,
        "disk_bytes": info.get("bytes", 0),
        "disk_limit": info.get("limit"),
        "compilations": m.compilations,
        "compile_seconds": round(m.compile_seconds, 6),
        "compile_seconds_saved": round(STATS.compile_seconds_saved, 6),
    }


def clear(memory=True, disk=False):
    """Drop the in-memory kernels and/or the disk entries (not in read-only
    mode). Kernels JAX already holds for live functions stay usable."""
    if memory:
        _memory.clear()
    if disk and DISK_DIR:
        if READONLY:
            raise RuntimeError(f"torchtpu: the compilation cache in {DISK_DIR} is read-only "
                               "(TORCHTPU_CACHE_READONLY=1); not clearing it")
        clear_disk(DISK_DIR)
