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
- a directory that cannot be written degrades to memory only, with one warning;
- entries are machine code this process runs, so only trusted ones are loaded
  (see "trust" below): the directory and each file must be owned by the
  current user, root or a uid in TORCHTPU_CACHE_TRUSTED_UIDS and writable by
  nobody else. torchtpu creates directories 0700 and files 0600.

Run `python -m torchtpu.cache info|clear [--dir D]` to inspect or empty a
cache directory.
"""
if __name__ == "__main__":  # python -m torchtpu.cache: use the package's module
    from torchtpu.cache import _main
    raise SystemExit(_main())

import collections
import contextlib
import errno
import hashlib
import json
import os
import pathlib
import secrets
import stat
import sys
import threading
import time
import warnings

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


# ---- trust --------------------------------------------------------------------
# Whoever can write an entry chooses code this process runs (the checksum
# detects damage, not a writer who recomputes it). So the directory and every
# file read from it must be owned by a trusted user and writable by nobody
# else. Both are checked with fstat on the opened directory and files, and
# files are opened relative to the opened directory (without following
# links), so renaming things along the path after the check changes nothing.
# The directory's parents need no check of their own: whoever can change a
# parent can only swap in another directory, which is checked the same way.

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def trusted_uids():
    """The owners whose entries are loaded: the current user, root (who can
    write anything anyway) and the uids in TORCHTPU_CACHE_TRUSTED_UIDS
    (comma- or space-separated), for a shared cache another account filled."""
    uids = {os.geteuid(), 0}
    for part in os.environ.get("TORCHTPU_CACHE_TRUSTED_UIDS", "").replace(",", " ").split():
        try:
            uids.add(int(part))
        except ValueError:
            _warn_once("uids", f"torchtpu: TORCHTPU_CACHE_TRUSTED_UIDS: {part!r} is not a "
                       "numeric uid; ignored")
    return uids


def _user(uid):
    try:
        import pwd
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def untrusted_reason(st, uids):
    """Why a file or directory with this stat result is not trusted, or None."""
    if st.st_uid not in uids:
        return (f"owned by {_user(st.st_uid)}, not by you ({_user(os.geteuid())}), root "
                "or a uid in TORCHTPU_CACHE_TRUSTED_UIDS")
    writers = [who for bit, who in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others"))
               if st.st_mode & bit]
    if writers:
        return f"writable by {' and '.join(writers)} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


class Untrusted(Exception):
    """A cache file that is not loaded: its path and why."""


def _read_trusted(dir_fd, dir_path, name, uids):
    """The bytes of name in the opened directory, if its file is trusted."""
    path = os.path.join(dir_path, name)
    try:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Untrusted(f"{path} is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        why = "not a regular file" if not stat.S_ISREG(st.st_mode) else untrusted_reason(st, uids)
        if why:
            raise Untrusted(f"{path} is {why}")
        return f.read()


def open_dir(path, read_only):
    """(fd of the opened cache directory, None), or (None, why it is not
    used). A writable cache's missing directories are made, mode 0700."""
    if not read_only:
        try:
            _make_private_dirs(path)
        except OSError as e:
            return None, (f"cache directory {path} is not writable ({type(e).__name__}: {e}); "
                          "compiled kernels are kept in memory only")
    try:
        fd = os.open(path, os.O_RDONLY | _DIRECTORY)
    except OSError as e:
        what = "does not exist" if isinstance(e, FileNotFoundError) else \
            f"cannot be opened ({type(e).__name__}: {e})"
        return None, (f"{'read-only ' if read_only else ''}cache directory {path} {what}; "
                      "compiled kernels are kept in memory only")
    why = untrusted_reason(os.fstat(fd), trusted_uids())
    if why is not None:
        why = (f"not using the compilation cache in {path}: the directory is {why}. Its "
               "entries are compiled code this process would run, so they are only loaded "
               "from a directory nobody else can write (`chmod go-w` it, or set a "
               "TORCHTPU_CACHE_DIR of your own)")
    elif not read_only and not _probe_writable(fd):
        why = (f"cache directory {path} is not writable (TORCHTPU_CACHE_READONLY=1 reads "
               "it without writing)")
    if why is not None:
        os.close(fd)
        return None, why + "; compiled kernels are kept in memory only"
    return fd, None


def _make_private_dirs(path):
    """mkdir -p, each new directory 0700 whatever the umask."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)  # the umask can only take bits away from 0700
        except FileExistsError:  # made meanwhile by another process
            continue
        os.chmod(d, 0o700)


# ---- plain file operations (also used by the command line) ------------------

def _sha256(data):
    return hashlib.sha256(data).hexdigest()


def _create_private(name, dir_fd, exclusive=True):
    """Open name in the directory for writing, created mode 0600 whatever
    the umask; returns the fd."""
    flags = os.O_WRONLY | os.O_CREAT | _NOFOLLOW | (os.O_EXCL if exclusive else 0)
    fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o600)
    except OSError:  # an existing file of another owner (only opened to lock)
        pass
    return fd


@contextlib.contextmanager
def _locked(dir_fd, exclusive):
    """flock on the directory's lock file. Readers never create it (a
    read-only run writes nothing); with no lock file yet there is no locking
    writer either, and a torn pair would still read as a miss."""
    if fcntl is None:
        yield
        return
    try:
        if exclusive:
            fd = _create_private(LOCK_NAME, dir_fd, exclusive=False)
        else:
            fd = os.open(LOCK_NAME, os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write_tmp(dir_fd, data):
    """data in a new temporary file, mode 0600, in the directory (same
    filesystem, so a rename into place is atomic); returns its name."""
    name = TMP_PREFIX + secrets.token_hex(12)
    fd = _create_private(name, dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        _unlink(name, dir_fd)
        raise
    return name


def _unlink(name, dir_fd=None):
    try:
        os.remove(name, dir_fd=dir_fd)
    except OSError:
        pass


def _probe_writable(dir_fd):
    try:
        _unlink(_write_tmp(dir_fd, b""), dir_fd)
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
    try:
        dir_fd = os.open(path, os.O_RDONLY | _DIRECTORY) if path else None
    except OSError:
        return 0
    if dir_fd is None:
        return 0
    removed = 0
    try:
        with _locked(dir_fd, exclusive=True):
            for e in os.scandir(dir_fd):
                if e.name.startswith(TMP_PREFIX) or e.name.endswith(_OWN_SUFFIXES):
                    try:
                        os.remove(e.name, dir_fd=dir_fd)
                        removed += 1
                    except OSError:
                        pass
    finally:
        os.close(dir_fd)
    return removed


def _remove_stale_temps(dir_fd, older_than=3600.0):
    """Temporaries left by killed writers (never read; only take space)."""
    now = time.time()
    try:
        for e in os.scandir(dir_fd):
            if e.name.startswith(TMP_PREFIX):
                try:
                    if now - e.stat(follow_symlinks=False).st_mtime > older_than:
                        os.remove(e.name, dir_fd=dir_fd)
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
        self.disk_untrusted = 0
        self.compile_seconds_saved = 0.0
        self.disk_load_seconds = 0.0
        self.programs_loaded = 0

    def snapshot(self):
        return {"memory_cache_misses": self.memory_misses,
                "disk_cache_corrupt": self.disk_corrupt,
                "disk_cache_untrusted": self.disk_untrusted,
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
    """JAX's CacheInterface over one opened, trusted directory (dir_fd, from
    open_dir): atomic, verified, optionally read-only. Values are JAX's
    compressed entries, stored as JAX names them; only trusted files are read."""

    def __init__(self, path, dir_fd, read_only=False):
        self.dir = path
        self.dir_fd = dir_fd
        self._path = pathlib.Path(path)  # JAX logs it
        self.read_only = read_only
        self._write_failed = False
        self._trusted = trusted_uids()

    def get(self, key):
        _tl.hit_compile_seconds = None
        _tl.miss_at = time.monotonic()  # a miss is followed by a compile, then put()
        try:
            with _locked(self.dir_fd, exclusive=False):
                value = _read_trusted(self.dir_fd, self.dir, key + ENTRY_SUFFIX, self._trusted)
                check = json.loads(_read_trusted(self.dir_fd, self.dir, key + CHECK_SUFFIX,
                                                 self._trusted))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except Untrusted as e:
            STATS.disk_untrusted += 1
            _warn_once("untrusted", f"torchtpu: not loading compilation cache entry {e}; "
                       "compiling instead" + ("" if self.read_only else " and replacing it")
                       + " (further refused entries are counted in metrics "
                       "disk_cache_untrusted)")
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
        tmps = []
        try:
            tmps.append(_write_tmp(self.dir_fd, value))
            tmps.append(_write_tmp(self.dir_fd, check))
            with _locked(self.dir_fd, exclusive=True):
                # The check first: a writer killed between the two renames
                # leaves an old entry beside a new check, which reads as a miss.
                self._rename(tmps[1], key + CHECK_SUFFIX)
                self._rename(tmps[0], key + ENTRY_SUFFIX)
            tmps.clear()
        except OSError as e:
            self._write_failed = True
            _warn_once("write", f"torchtpu: cannot write the compilation cache in {self.dir} "
                       f"({type(e).__name__}: {e}); compiled kernels are kept in memory only")
        finally:
            for t in tmps:
                _unlink(t, self.dir_fd)

    def _rename(self, src, dst):
        os.replace(src, dst, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)


# ---- configuration -------------------------------------------------------------

def open_disk(path, read_only):
    """A DiskCache over path, or None after one warning saying why not (the
    directory is missing, unwritable or not trusted)."""
    dir_fd, why = open_dir(path, read_only)
    if dir_fd is None:
        warnings.warn(f"torchtpu: {why}", stacklevel=3)
        return None
    if not read_only:
        _remove_stale_temps(dir_fd)
    return DiskCache(path, dir_fd, read_only)


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


def jit(fn, name=None, donate_argnums=(), device=0):
    """Compile fn through JAX (lazily, at its first call); the disk tier is
    JAX's persistent cache. donate_argnums: arguments whose buffers the
    computation may reuse for its results (the caller's are invalidated).
    device: the index of the device it runs on. Off device 0 its results are
    placed there (JAX would put a factory's on its default device, device 0)."""
    if name is not None:
        fn.__name__ = fn.__qualname__ = name
    if device:
        from . import runtime
        return jax.jit(fn, donate_argnums=donate_argnums, out_shardings=runtime.SHARDINGS[device])
    return jax.jit(fn, donate_argnums=donate_argnums)


# ---- stored programs ------------------------------------------------------------
# A fused graph's traced program, stored (beside JAX's entries) under a key
# that is stable across processes: the graph's ops, argument shapes,
# torchtpu's own code, the platform, devices and XLA flags. A warm start
# loads it instead of tracing the graph op by op again.
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


def _program_context(args):
    """What a stored executable is valid for besides the graph itself: the
    platform and devices it was compiled for, and the flags XLA compiled it
    with (JAX's own key covers these for its entries)."""
    from . import runtime
    first = runtime.DEVICES[0]
    devices = sorted({str(d) for x in jax.tree_util.tree_leaves(args) if hasattr(x, "devices")
                      for d in x.devices()})
    return "\n".join([
        f"platform {runtime.PLATFORM} {first.client.platform_version} {first.device_kind} "
        f"x{len(runtime.DEVICES)}",
        f"devices {devices}",
        *(f"{name}={os.environ.get(name, '')}" for name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"))])


def jit_stored(fn, args, key_text, name=None, donate_argnums=(), device=0):
    """jit(fn) for these args through a stored program: key_text describes fn
    completely and the same way in every process (None: not storable).

    What is stored is the traced program (StableHLO, via jax.export), and
    JAX's persistent cache then finds the executable compiled from it. Not
    the executable itself (jax.experimental.serialize_executable): XLA's CPU
    runtime cannot hold two loaded executables that share function names,
    and one of them fails when it runs ("Function ... not found")."""
    store_ = _jax_cc._cache if DISK_DIR is not None and _jax_cc is not None else None
    if key_text is None or not isinstance(store_, DiskCache):
        return jit(fn, name, donate_argnums, device)
    key_text += f"\ndonate {tuple(donate_argnums)}\n{_program_context(args)}"
    from jax import export
    key = PROGRAM_PREFIX + _sha256((_source_digest() + "\n" + key_text).encode())
    blob = store_.get(key)
    if blob is not None:
        try:
            program = export.deserialize(bytearray(blob))
            STATS.programs_loaded += 1
            return jit(program.call, None, donate_argnums, device)
        except Exception as e:  # a damaged program: trace again and replace it
            store_._corrupt(key, f"{type(e).__name__}: {e}")
    jitted = jit(fn, name, donate_argnums, device)
    try:
        program = export.export(jitted)(*args)
        blob = program.serialize()
    except Exception:  # not exportable (a custom call without a stable form)
        return jitted
    store_.put(key, bytes(blob))
    return jit(program.call, None, donate_argnums, device)


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
