"""The cache's disk tier, its files: where the cache lives, which files are
trusted, atomic writes and checked reads, and DiskCache, the storage backend
JAX's persistent cache writes through (torchtpu.cache configures it).

JAX's own file cache has no read-only mode, writes entries in place (a killed
or concurrent writer can leave a torn file), never overwrites an existing
entry (a corrupted one would stay forever) and only notices garbage when
deserialization fails. Here:

- each entry is written to a temporary file and renamed into place, next to a
  small `<key>-check` file (sha256 of the entry, its compile time), also
  written by rename; both renames happen under an exclusive `flock` and reads
  take a shared one, so a reader always sees a matching pair;
- an entry whose check is missing or does not match is a miss: it is
  compiled again and the put overwrites it (one warning per process);
- `TORCHTPU_CACHE_READONLY=1` reads and never writes;
- a directory that cannot be written degrades to memory only, with one warning;
- entries are machine code this process runs, so only trusted ones are loaded
  (see "trust" below): the directory and each file must be owned by the
  current user, root or a uid in TORCHTPU_CACHE_TRUSTED_UIDS and writable by
  nobody else. torchtpu creates directories 0700 and files 0600.
"""
import atexit
import contextlib
import errno
import hashlib
import json
import os
import pathlib
import secrets
import stat
import threading
import time
import warnings

from . import compat, config, metrics

try:
    import fcntl
except ImportError:  # no flock (Windows): renames alone keep entries whole
    fcntl = None

ENTRY_SUFFIX = "-cache"   # JAX's name for an entry (torchtpu's records use it too)
CHECK_SUFFIX = "-check"   # torchtpu's integrity record beside it
TMP_PREFIX = ".tmp-"
LOCK_NAME = ".torchtpu.lock"
LOOKUPS_NAME = ".torchtpu-lookups"  # hits and misses of the processes that used it
_OWN_SUFFIXES = (ENTRY_SUFFIX, CHECK_SUFFIX, "-atime")
PROGRAM_PREFIX = "program-"  # a fused graph's stored executable
KERNEL_PREFIX = "kernel-"    # a per-op kernel's record (torchtpu.cache)
VALUE_PREFIX = "value-"      # a small stored value: a meta outcome, a start-up's list


# ---- location ----------------------------------------------------------------

def _default_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchtpu")


def cache_dir():
    """The configured disk directory, or None when TORCHTPU_CACHE_DIR=off."""
    value = config.CACHE_DIR.text()
    if value.lower() == "off":
        return None
    return os.path.abspath(os.path.expanduser(value or _default_dir()))


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def max_bytes():
    """TORCHTPU_CACHE_MAX_BYTES in bytes; None for no limit."""
    text = config.CACHE_MAX_BYTES.text().upper().removesuffix("B").removesuffix("I")
    unit = text[-1:] if text[-1:] in _UNITS else ""
    try:
        value = int(float(text[:len(text) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"TORCHTPU_CACHE_MAX_BYTES={config.CACHE_MAX_BYTES.text()!r} is not a size "
                         "(bytes, or a number with K, M, G or T)") from None
    return value if value > 0 else None


def readonly():
    return config.CACHE_READONLY.on()


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
    for part in config.CACHE_TRUSTED_UIDS.text().replace(",", " ").split():
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
    """Entries (JAX's executables), stored programs (fused graphs' executables),
    kernel records, stored values, bytes and leftover temporary files in a cache directory."""
    info = {"dir": path, "exists": bool(path) and os.path.isdir(path), "entries": 0,
            "programs": 0, "kernels": 0, "values": 0, "bytes": 0, "limit": max_bytes(),
            "unverified_entries": 0, "temp_files": 0, "hits": 0, "misses": 0, "hit_rate": None}
    if not info["exists"]:
        return info
    info["hits"], info["misses"] = _read_lookups(os.path.join(path, LOOKUPS_NAME))
    if info["hits"] + info["misses"]:
        info["hit_rate"] = info["hits"] / (info["hits"] + info["misses"])
    names = set()
    for e in os.scandir(path):
        try:
            if e.name.startswith(TMP_PREFIX):
                info["temp_files"] += 1
            elif e.name.endswith(ENTRY_SUFFIX):
                info["programs" if e.name.startswith(PROGRAM_PREFIX) else
                     "kernels" if e.name.startswith(KERNEL_PREFIX) else
                     "values" if e.name.startswith(VALUE_PREFIX) else "entries"] += 1
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
                if e.name.startswith(TMP_PREFIX) or e.name.endswith(_OWN_SUFFIXES) \
                        or e.name == LOOKUPS_NAME:
                    try:
                        os.remove(e.name, dir_fd=dir_fd)
                        removed += 1
                    except OSError:
                        pass
    finally:
        os.close(dir_fd)
    return removed


def _entries(dir_fd):
    """(key, bytes of its entry and check, last use) of each entry in the
    directory; last use is its check's modification time (a read renews it)."""
    sizes, used = {}, {}
    for e in os.scandir(dir_fd):
        for suffix in (ENTRY_SUFFIX, CHECK_SUFFIX):
            if e.name.endswith(suffix):
                key = e.name[:-len(suffix)]
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:  # removed meanwhile
                    continue
                sizes[key] = sizes.get(key, 0) + st.st_size
                if suffix == CHECK_SUFFIX:
                    used[key] = st.st_mtime
    return [(key, size, used.get(key, 0.0)) for key, size in sizes.items()]


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


# ---- the directory's hit rate ---------------------------------------------------
# A process counts its own lookups (an executable found on disk or not); at
# exit it adds them to the directory's totals, so that `python -m
# torchtpu.cache info`, another process, can give the hit rate of every run
# since the directory was last cleared. (A killed process adds nothing.)

def _read_lookups(name, dir_fd=None):
    """(hits, misses) in the lookups file; (0, 0) when missing or unreadable
    (only counts: a damaged file costs the history, nothing more)."""
    try:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            counts = json.loads(f.read())
        hits, misses = counts["hits"], counts["misses"]
        if type(hits) is int and type(misses) is int and hits >= 0 and misses >= 0:
            return hits, misses
    except (OSError, ValueError, TypeError, KeyError):
        pass
    return 0, 0


def add_lookups(dir_fd, hits, misses):
    """Add a process's hits and misses to the directory's totals, under the
    exclusive lock (no two processes add to the same old totals)."""
    if not hits and not misses:
        return
    try:
        with _locked(dir_fd, exclusive=True):
            old_hits, old_misses = _read_lookups(LOOKUPS_NAME, dir_fd)
            tmp = _write_tmp(dir_fd, json.dumps({"hits": old_hits + hits,
                                                 "misses": old_misses + misses}).encode())
            try:
                os.replace(tmp, LOOKUPS_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError:
                _unlink(tmp, dir_fd)
                raise
    except OSError:  # a full disk, a vanished directory: the counts are lost, nothing else
        pass


# ---- counters ------------------------------------------------------------------

class _Stats:
    def __init__(self):
        self.reset()

    def reset(self):
        self.memory_misses = 0
        self.memory_sheds = 0
        self.disk_evicted = 0
        self.disk_corrupt = 0
        self.disk_untrusted = 0
        self.compile_seconds_saved = 0.0
        self.disk_load_seconds = 0.0
        self.programs_loaded = 0
        self.kernels_loaded = 0
        self.traces_loaded = 0
        self.values_loaded = 0
        self.prefetched = 0
        self.background_compiles = 0
        self.background_compile_seconds = 0.0

    def snapshot(self):
        return {"memory_cache_misses": self.memory_misses,
                "memory_cache_sheds": self.memory_sheds,
                "disk_cache_evicted": self.disk_evicted,
                "disk_cache_corrupt": self.disk_corrupt,
                "disk_cache_untrusted": self.disk_untrusted,
                "compile_seconds_saved": round(self.compile_seconds_saved, 6),
                "disk_load_seconds": round(self.disk_load_seconds, 6),
                "programs_loaded": self.programs_loaded,
                "kernels_loaded": self.kernels_loaded,
                "traces_loaded": self.traces_loaded,
                "values_loaded": self.values_loaded,
                "prefetched": self.prefetched,
                "background_compiles": self.background_compiles,
                "background_compile_seconds": round(self.background_compile_seconds, 6)}


STATS = _Stats()
metrics.register_provider(STATS.snapshot, STATS.reset)
# This process's disk lookups of executables, for the directory's hit rate
# (not reset with the metrics: they are added to the directory's at exit).
LOOKUPS = {"hits": 0, "misses": 0}

# Per thread (JAX compiles in the calling thread): what the current
# compile_or_get_cached call found on disk.
_tl = threading.local()
_warned = set()


def _warn_once(what, message):
    if what not in _warned:
        _warned.add(what)
        warnings.warn(message, stacklevel=3)


# ---- the storage backend JAX writes through -----------------------------------

_jax_cc, _CacheInterface = compat.compilation_cache()


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
        self._swept = read_only  # stale temporaries are swept before the first write
        self._trusted = trusted_uids()
        self._limit = max_bytes()
        self._used = None  # the directory's bytes as this process last knew them

    def get(self, key):
        if getattr(_tl, "bypass", False):  # torchtpu stores this executable itself
            return None
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
            if getattr(_tl, "quiet", False):  # the prefetch thread: the run reads it again
                return None
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
            if getattr(_tl, "quiet", False):
                return None
            _warn_once("read", f"torchtpu: cannot read the compilation cache in {self.dir} "
                       f"({type(e).__name__}: {e}); compiling instead")
            return None
        if not isinstance(check, dict) or check.get("sha256") != _sha256(value) \
                or check.get("size") != len(value):
            self._corrupt(key, "contents do not match their checksum (truncated or garbled)")
            return None
        _tl.hit_compile_seconds = check.get("compile_seconds")
        if not self.read_only:
            try:  # used now: the last to be evicted
                os.utime(key + CHECK_SUFFIX, dir_fd=self.dir_fd)
            except OSError:  # another user's entry, or evicted meanwhile
                pass
        return value

    def _corrupt(self, key, why):
        if getattr(_tl, "quiet", False):  # the prefetch thread: the run reads it again
            return
        STATS.disk_corrupt += 1
        _warn_once("corrupt", f"torchtpu: compilation cache entry {key} in {self.dir} is "
                   f"unreadable ({why}); compiling again and replacing it "
                   "(further bad entries are counted in metrics disk_cache_corrupt)")

    def put(self, key, value):
        if self.read_only or self._write_failed or getattr(_tl, "bypass", False):
            return
        miss_at = getattr(_tl, "miss_at", None)
        compile_seconds = time.monotonic() - miss_at if miss_at is not None else None
        check = json.dumps({"sha256": _sha256(value), "size": len(value),
                            "compile_seconds": compile_seconds}).encode()
        if not self._swept:
            # Here, not at start-up: a warm start writes nothing, and a large
            # directory's scan would cost it tens of milliseconds.
            self._swept = True
            _remove_stale_temps(self.dir_fd)
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
            if self._limit is not None:
                self._within_limit(len(value) + len(check))
        except OSError as e:
            self._write_failed = True
            _warn_once("write", f"torchtpu: cannot write the compilation cache in {self.dir} "
                       f"({type(e).__name__}: {e}); compiled kernels are kept in memory only")
        finally:
            for t in tmps:
                _unlink(t, self.dir_fd)

    def _rename(self, src, dst):
        os.replace(src, dst, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)

    def _within_limit(self, written):
        """After a write of `written` bytes: past the limit, remove the least
        recently used entries (by their check file's time, which a read
        renews) down to 80% of it. Under the exclusive lock, so no other
        process is reading what goes; a concurrent evicter finds the
        directory already within the limit."""
        if self._used is not None:
            self._used += written
            if self._used <= self._limit:
                return
        with _locked(self.dir_fd, exclusive=True):
            entries = _entries(self.dir_fd)
            self._used = sum(size for _, size, _ in entries)
            if self._used <= self._limit:
                return
            for key, size, _ in sorted(entries, key=lambda e: e[2]):
                if self._used <= 0.8 * self._limit:
                    break
                # The entry first: a check without its entry reads as a miss.
                _unlink(key + ENTRY_SUFFIX, self.dir_fd)
                _unlink(key + CHECK_SUFFIX, self.dir_fd)
                self._used -= size
                STATS.disk_evicted += 1


# ---- configuration -------------------------------------------------------------

def open_disk(path, read_only):
    """A DiskCache over path, or None after one warning saying why not (the
    directory is missing, unwritable or not trusted)."""
    dir_fd, why = open_dir(path, read_only)
    if dir_fd is None:
        warnings.warn(f"torchtpu: {why}", stacklevel=3)
        return None
    if not read_only:  # a read-only run writes nothing, its counts neither
        atexit.register(lambda: add_lookups(dir_fd, LOOKUPS["hits"], LOOKUPS["misses"]))
    return DiskCache(path, dir_fd, read_only)


# ---- command line: python -m torchtpu.cache info|clear -----------------------------

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
    print(f"kernel records      {info['kernels']}")
    print(f"stored values       {info['values']}")
    print(f"bytes               {info['bytes']} ({_human(info['bytes'])})")
    limit = info["limit"]
    print("limit               " + (f"{limit} ({_human(limit)}; TORCHTPU_CACHE_MAX_BYTES)" if limit
                                      else "none (TORCHTPU_CACHE_MAX_BYTES=0)"))
    rate = info["hit_rate"]
    print("hit rate            " + ("no lookups recorded" if rate is None else
                                    f"{100 * rate:.1f}% ({info['hits']} hits, {info['misses']} "
                                    "misses: executables looked up by the runs that ended "
                                    "since it was last cleared)"))
    print(f"unverified entries  {info['unverified_entries']}")
    print(f"temporary files     {info['temp_files']}")
    return 0
