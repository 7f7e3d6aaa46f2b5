"""The one place that turns a JAX function plus a key into a compiled callable.

Two tiers: an in-memory LRU of kernels over JAX's own persistent
compilation cache on disk, which all modes and processes share.

The disk tier keeps JAX's entry format (`<key>-cache` files, written by JAX's
`put_executable_and_time`), but torchtpu supplies the storage backend JAX
writes through, because JAX's file cache has no read-only mode, writes entries
in place (a killed or concurrent writer can leave a torn file), never
overwrites an existing entry (a corrupted one would stay forever) and only
notices garbage when deserialization fails. Here:

- each entry is written to a temporary file and renamed into place, next to a
  small `<key>-check` file (sha256 of the entry, its compile time), also
  written by rename; both renames happen under an exclusive `flock` and reads
  take a shared one, so a reader always sees a matching pair;
- an entry whose check is missing or does not match is a miss: JAX compiles
  again and the put overwrites it (one warning per process);
- `TORCHTPU_CACHE_READONLY=1` reads and never writes;
- a directory that cannot be written degrades to memory only, with one warning.

Run `python -m torchtpu.cache info|clear [--dir D]` to inspect or empty a
cache directory.
"""
if __name__ == "__main__":  # python -m torchtpu.cache: use the package's module
    from torchtpu.cache import _main
    raise SystemExit(_main())

import collections
import contextlib
import hashlib
import json
import os
import pathlib
import tempfile
import threading
import time
import warnings

import sys

import jax
from jax import monitoring

from . import metrics

try:
    import fcntl
except ImportError:  # no flock (Windows): renames alone keep entries whole
    fcntl = None

if sys.argv[:1] == ["-m"]:
    # `python -m torchtpu.cache` imports the package (and so this module)
    # before running this file as __main__, which runpy warns about; the
    # __main__ copy only hands over to this module.
    warnings.filterwarnings("ignore", r"'torchtpu\.cache' found in sys\.modules",
                            RuntimeWarning)

MEMORY_ENTRIES = int(os.environ.get("TORCHTPU_MEMORY_CACHE_ENTRIES", "8192"))
# An OrderedDict in recency order: a hit costs one more C-level move.
_memory = collections.OrderedDict()

ENTRY_SUFFIX = "-cache"   # JAX's name for an entry
CHECK_SUFFIX = "-check"   # torchtpu's integrity record beside it
TMP_PREFIX = ".tmp-"
LOCK_NAME = ".torchtpu.lock"
_OWN_SUFFIXES = (ENTRY_SUFFIX, CHECK_SUFFIX, "-atime")


# ---- location ----------------------------------------------------------------

def _default_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchtpu")


def cache_dir():
    """The configured disk directory, or None when TORCHTPU_CACHE_DIR=off."""
    value = os.environ.get("TORCHTPU_CACHE_DIR", "").strip()
    if value.lower() == "off":
        return None
    return os.path.abspath(os.path.expanduser(value or _default_dir()))


def readonly():
    return os.environ.get("TORCHTPU_CACHE_READONLY", "").strip().lower() in ("1", "true", "yes")


# ---- plain file operations (also used by the command line) ------------------

def _sha256(data):
    return hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def _locked(path, exclusive):
    """flock on the directory's lock file. Readers never create it (a
    read-only run writes nothing); with no lock file yet there is no locking
    writer either, and a torn pair would still read as a miss."""
    if fcntl is None:
        yield
        return
    lock_path = os.path.join(path, LOCK_NAME)
    try:
        if exclusive:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        else:
            fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write_tmp(path, data):
    """data in a new temporary file in path (same filesystem, so a rename
    into place is atomic); returns its name."""
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(path):
    try:
        os.remove(path)
    except OSError:
        pass


def _probe_writable(path):
    try:
        os.makedirs(path, exist_ok=True)
        _unlink(_write_tmp(path, b""))
        return True
    except OSError:
        return False


def disk_info(path):
    """Entries (JAX's executables), stored programs (fused graphs), bytes and
    leftover temporary files in a cache directory."""
    info = {"dir": path, "exists": bool(path) and os.path.isdir(path), "entries": 0,
            "programs": 0, "bytes": 0, "unverified_entries": 0, "temp_files": 0}
    if not info["exists"]:
        return info
    names = set()
    for e in os.scandir(path):
        try:
            if e.name.startswith(TMP_PREFIX):
                info["temp_files"] += 1
            elif e.name.endswith(ENTRY_SUFFIX):
                info["programs" if e.name.startswith(PROGRAM_PREFIX) else "entries"] += 1
                info["bytes"] += e.stat().st_size
            elif e.name.endswith(CHECK_SUFFIX):
                info["bytes"] += e.stat().st_size
            names.add(e.name)
        except OSError:  # removed meanwhile by another process
            pass
    info["unverified_entries"] = sum(
        1 for n in names if n.endswith(ENTRY_SUFFIX)
        and n[:-len(ENTRY_SUFFIX)] + CHECK_SUFFIX not in names)
    return info


def clear_disk(path):
    """Remove the cache's own files (entries, checks, temporaries) from path;
    anything else there is left alone. Returns how many files went."""
    if not path or not os.path.isdir(path):
        return 0
    removed = 0
    with _locked(path, exclusive=True):
        for e in os.scandir(path):
            if e.name.startswith(TMP_PREFIX) or e.name.endswith(_OWN_SUFFIXES):
                try:
                    os.remove(e.path)
                    removed += 1
                except OSError:
                    pass
    return removed


def _remove_stale_temps(path, older_than=3600.0):
    """Temporaries left by killed writers (never read; only take space)."""
    now = time.time()
    try:
        for e in os.scandir(path):
            if e.name.startswith(TMP_PREFIX):
                try:
                    if now - e.stat().st_mtime > older_than:
                        os.remove(e.path)
                except OSError:
                    pass
    except OSError:
        pass


# ---- counters ------------------------------------------------------------------

class _Stats:
    def __init__(self):
        self.reset()

    def reset(self):
        self.memory_misses = 0
        self.disk_corrupt = 0
        self.compile_seconds_saved = 0.0
        self.disk_load_seconds = 0.0
        self.programs_loaded = 0

    def snapshot(self):
        return {"memory_cache_misses": self.memory_misses,
                "disk_cache_corrupt": self.disk_corrupt,
                "compile_seconds_saved": round(self.compile_seconds_saved, 6),
                "disk_load_seconds": round(self.disk_load_seconds, 6),
                "programs_loaded": self.programs_loaded}


STATS = _Stats()
metrics.register_provider(STATS.snapshot, STATS.reset)

# Per thread (JAX compiles in the calling thread): what the current
# compile_or_get_cached call found on disk.
_tl = threading.local()
_warned = set()


def _warn_once(what, message):
    if what not in _warned:
        _warned.add(what)
        warnings.warn(message, stacklevel=3)


# ---- the storage backend JAX writes through -----------------------------------

try:
    from jax._src import compilation_cache as _jax_cc
    from jax._src.compilation_cache_interface import CacheInterface as _CacheInterface
except ImportError:  # pragma: no cover - JAX moved its internals
    _jax_cc = None
    _CacheInterface = object


class DiskCache(_CacheInterface):
    """JAX's CacheInterface over one directory: atomic, verified, optionally
    read-only. Values are JAX's compressed entries, stored as JAX names them."""

    def __init__(self, path, read_only=False):
        self.dir = path
        self._path = pathlib.Path(path)  # JAX logs it
        self.read_only = read_only
        self._write_failed = False

    def _files(self, key):
        return (os.path.join(self.dir, key + ENTRY_SUFFIX),
                os.path.join(self.dir, key + CHECK_SUFFIX))

    def get(self, key):
        entry_path, check_path = self._files(key)
        _tl.hit_compile_seconds = None
        _tl.miss_at = time.monotonic()  # a miss is followed by a compile, then put()
        try:
            with _locked(self.dir, exclusive=False):
                with open(entry_path, "rb") as f:
                    value = f.read()
                with open(check_path, "rb") as f:
                    check = json.loads(f.read())
        except (FileNotFoundError, NotADirectoryError):
            return None
        except ValueError as e:  # the check file is not JSON
            self._corrupt(key, f"{type(e).__name__}: {e}")
            return None
        except OSError as e:
            _warn_once("read", f"torchtpu: cannot read the compilation cache in {self.dir} "
                       f"({type(e).__name__}: {e}); compiling instead")
            return None
        if not isinstance(check, dict) or check.get("sha256") != _sha256(value) \
                or check.get("size") != len(value):
            self._corrupt(key, "contents do not match their checksum (truncated or garbled)")
            return None
        _tl.hit_compile_seconds = check.get("compile_seconds")
        return value

    def _corrupt(self, key, why):
        STATS.disk_corrupt += 1
        _warn_once("corrupt", f"torchtpu: compilation cache entry {key} in {self.dir} is "
                   f"unreadable ({why}); compiling again and replacing it "
                   "(further bad entries are counted in metrics disk_cache_corrupt)")

    def put(self, key, value):
        if self.read_only or self._write_failed:
            return
        miss_at = getattr(_tl, "miss_at", None)
        compile_seconds = time.monotonic() - miss_at if miss_at is not None else None
        check = json.dumps({"sha256": _sha256(value), "size": len(value),
                            "compile_seconds": compile_seconds}).encode()
        entry_path, check_path = self._files(key)
        tmps = []
        try:
            tmps.append(_write_tmp(self.dir, value))
            tmps.append(_write_tmp(self.dir, check))
            with _locked(self.dir, exclusive=True):
                # The check first: a writer killed between the two renames
                # leaves an old entry beside a new check, which reads as a miss.
                os.replace(tmps[1], check_path)
                os.replace(tmps[0], entry_path)
            tmps.clear()
        except OSError as e:
            self._write_failed = True
            _warn_once("write", f"torchtpu: cannot write the compilation cache in {self.dir} "
                       f"({type(e).__name__}: {e}); compiled kernels are kept in memory only")
        finally:
            for t in tmps:
                _unlink(t)


# ---- configuration -------------------------------------------------------------

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
    if ro:
        if not os.path.isdir(path):
            warnings.warn(f"torchtpu: read-only cache directory {path} does not exist; "
                          "compiled kernels are kept in memory only", stacklevel=2)
            return None, ro
    elif not _probe_writable(path):
        warnings.warn(f"torchtpu: cache directory {path} is not writable; compiled kernels "
                      "are kept in memory only (TORCHTPU_CACHE_READONLY=1 reads it without "
                      "writing)", stacklevel=2)
        return None, ro
    else:
        _remove_stale_temps(path)
    jax.config.update("jax_compilation_cache_dir", path)
    # Keep even the smallest per-op executables: they are most of what a
    # process compiles, and each costs milliseconds to rebuild.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _jax_cc.reset_cache()
    _jax_cc._cache = DiskCache(path, read_only=ro)
    _jax_cc._cache_initialized = True
    return path, ro


DISK_DIR, READONLY = _configure_disk()


# ---- JAX's monitoring events ------------------------------------------------------

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _on_event(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        metrics.M.disk_cache_hits += 1
        _tl.disk_hit = True
    elif event == "/jax/compilation_cache/cache_misses":
        metrics.M.disk_cache_misses += 1


def _on_duration(event, duration, **kwargs):
    if event == _BACKEND_COMPILE:
        # JAX times the whole compile-or-load; a disk hit compiled nothing.
        if getattr(_tl, "disk_hit", False):
            _tl.disk_hit = False
            STATS.disk_load_seconds += duration
        else:
            metrics.M.compilations += 1
            metrics.M.compile_seconds += duration
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
    _memory[key] = entry
    if len(_memory) > MEMORY_ENTRIES:
        _memory.popitem(last=False)
    return entry


def jit(fn, name=None, donate_argnums=()):
    """Compile fn through JAX (lazily, at its first call); the disk tier is
    JAX's persistent cache. donate_argnums: arguments whose buffers the
    computation may reuse for its results (the caller's are invalidated)."""
    if name is not None:
        fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn, donate_argnums=donate_argnums)


# ---- stored programs ------------------------------------------------------------
# A fused graph's traced program (StableHLO, via jax.export), stored beside
# JAX's entries under a key that is stable across processes: a warm start
# loads it instead of tracing and lowering the graph op by op again, and
# JAX's persistent cache then finds the executable compiled from it.
PROGRAM_PREFIX = "program-"
_source_version = None


def _source_digest():
    """torchtpu's own code and the versions it runs on: a stored program is
    only reused by the same lowerings."""
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


def jit_stored(fn, args, key_text, name=None, donate_argnums=()):
    """jit(fn) for these args through a stored program: key_text describes fn
    completely and the same way in every process (None: not storable)."""
    store_ = _jax_cc._cache if DISK_DIR is not None and _jax_cc is not None else None
    if key_text is None or not isinstance(store_, DiskCache):
        return jit(fn, name, donate_argnums)
    key_text += f"\ndonate {tuple(donate_argnums)}"
    from jax import export
    key = PROGRAM_PREFIX + _sha256((_source_digest() + "\n" + key_text).encode())
    blob = store_.get(key)
    if blob is not None:
        try:
            program = export.deserialize(bytearray(blob))
            STATS.programs_loaded += 1
            return jax.jit(program.call, donate_argnums=donate_argnums)
        except Exception as e:  # a damaged program: trace again and replace it
            store_._corrupt(key, f"{type(e).__name__}: {e}")
    jitted = jit(fn, name, donate_argnums)
    try:
        program = export.export(jitted)(*args)
        blob = program.serialize()
    except Exception:  # not exportable (a custom call without a stable form)
        return jitted
    store_.put(key, bytes(blob))
    return jax.jit(program.call, donate_argnums=donate_argnums)


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
        "disk_entries": info.get("entries", 0),
        "disk_programs": info.get("programs", 0),
        "programs_loaded": STATS.programs_loaded,
        "disk_bytes": info.get("bytes", 0),
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


# ---- command line ------------------------------------------------------------------

def _human(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python -m torchtpu.cache",
                                description="Inspect or empty torchtpu's compilation cache.")
    p.add_argument("command", choices=("info", "clear"))
    p.add_argument("--dir", help="cache directory (default: TORCHTPU_CACHE_DIR, "
                                 "else $XDG_CACHE_HOME/torchtpu or ~/.cache/torchtpu)")
    p.add_argument("--json", action="store_true", help="print info as JSON")
    args = p.parse_args(argv)
    path = os.path.abspath(os.path.expanduser(args.dir)) if args.dir else cache_dir()
    if path is None:
        print("disk cache is off (TORCHTPU_CACHE_DIR=off)")
        return 0
    if args.command == "clear":
        if not args.dir and readonly():
            print(f"{path} is read-only (TORCHTPU_CACHE_READONLY=1); not clearing")
            return 1
        print(f"removed {clear_disk(path)} files from {path}")
        return 0
    info = disk_info(path)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"dir                 {path}{'' if info['exists'] else ' (does not exist)'}")
    print(f"entries             {info['entries']}")
    print(f"stored programs     {info['programs']}")
    print(f"bytes               {info['bytes']} ({_human(info['bytes'])})")
    print(f"unverified entries  {info['unverified_entries']}")
    print(f"temporary files     {info['temp_files']}")
    return 0
