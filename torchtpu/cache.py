"""The one place that turns a JAX function plus a key into a compiled callable.

Two tiers: an in-memory LRU of kernels (cachetools) over JAX's own persistent
compilation cache on disk, which all modes and processes share.
"""
import os
import time
import warnings

import cachetools
import jax
from jax import monitoring

from . import metrics

MEMORY_ENTRIES = int(os.environ.get("TORCHTPU_MEMORY_CACHE_ENTRIES", "8192"))
_memory = cachetools.LRUCache(maxsize=MEMORY_ENTRIES)


def _default_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchtpu")


def cache_dir():
    """The disk tier's directory, or None when it is off."""
    value = os.environ.get("TORCHTPU_CACHE_DIR", "").strip()
    if value.lower() == "off":
        return None
    return value or _default_dir()


def _configure_disk():
    path = cache_dir()
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
        writable = os.access(path, os.W_OK)
    except OSError:
        writable = False
    if not writable and os.environ.get("TORCHTPU_CACHE_READONLY") != "1":
        warnings.warn(f"torchtpu: cache directory {path} is not writable; "
                      "compiled kernels are kept in memory only", stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    # Keep even the smallest per-op executables: they are most of what a
    # process compiles, and each costs milliseconds to rebuild.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


DISK_DIR = _configure_disk()


def _on_event(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        metrics.M.disk_cache_hits += 1
    elif event == "/jax/compilation_cache/cache_misses":
        metrics.M.disk_cache_misses += 1


def _on_duration(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        metrics.M.compilations += 1
        metrics.M.compile_seconds += duration


monitoring.register_event_listener(_on_event)
monitoring.register_event_duration_secs_listener(_on_duration)


def lookup(key):
    """The cached entry for key, or None."""
    entry = _memory.get(key)
    if entry is not None:
        metrics.M.memory_cache_hits += 1
    return entry


def store(key, entry):
    _memory[key] = entry
    return entry


def jit(fn, name=None):
    """Compile fn through JAX (lazily, at its first call); the disk tier is
    JAX's persistent cache."""
    if name is not None:
        fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn)


def clear(memory=True, disk=False):
    if memory:
        _memory.clear()
    if disk and DISK_DIR:
        for entry in os.listdir(DISK_DIR):
            try:
                os.remove(os.path.join(DISK_DIR, entry))
            except OSError:
                pass
