"""Out-of-range indices in strict and fused mode: checked on device, raised at
the next sync point (as CUDA's device-side assert, with a clear message).

Each indexing kernel (errors.BOUNDS names the ops and their index arguments)
computes, beside its results, a small int64 flag: which index argument held
an out-of-range value (0: none), that value, its position, the dimension and
its size. The dispatcher hands the flag here (note) with the op and the
user's line; nothing is read then. At each sync point the executors call
check(): the flags that exist by then are read together, in one transfer,
and the first out-of-range one raises the exception CPU raises.

What a bad op produced is garbage, and so is what was computed from it
before its flag was read (a loss, gradients, parameters an optimizer
updated). While flags are unread the dispatcher tracks which storages
depend on which flags (propagate); when a flag says out of range, those
storages are marked Lost with the error, so reading them raises it instead
of giving a garbage value, while tensors that do not depend on the bad op
keep theirs. Debug mode checks on the host before the op runs
(errors.check_bounds) and records nothing here.
"""
import os
import weakref

import jax
import jax.numpy as jnp

from . import errors
from .tensor import Lost, Pending, Storage

# The check's switch (for measuring its cost; kernels read it when built).
ON = os.environ.get("TORCHTPU_INDEX_CHECKS", "1") != "0"
# Unread flags at which check() reads those that exist (a loop that never
# syncs would otherwise hold one flag per indexing op).
MAX_UNREAD = 1024


def set_enabled(on):
    """Build indexing kernels with (True) or without the device check; drops
    the compiled kernels and graphs so that new ones are built."""
    global ON
    from . import cache
    check()
    ON = bool(on)
    cache.clear()


def kernel_bound(plan):
    """The errors.Bound an op's kernel checks on device, or None."""
    if not ON:
        return None
    return errors.bound_for(plan.func, plan.functional)


# ---- on device ---------------------------------------------------------------

def device_flag(bound, args, kwargs):
    """The flag of one call (traced inside the op's kernel): int64[5] =
    (1 + which index argument is out of range, or 0; its first bad value;
    that value's flat position; the dimension; its size)."""
    zero = jnp.zeros((), jnp.int64)
    flag = (zero, zero, zero, zero, zero)
    checks = bound.spec(*args, **kwargs)
    # The first bad argument wins: fold from the last.
    for i in reversed(range(len(checks))):
        index, dim, size, negative_ok, *allowed = checks[i]
        if index is None or getattr(index, "size", 0) == 0:
            continue
        flat = index.reshape(-1).astype(jnp.int64)
        bad = (flat < (-size if negative_ok else 0)) | (flat >= size)
        if allowed:
            bad = bad & (flat != allowed[0])
        pos = jnp.argmax(bad)
        hit = bad[pos]
        found = (jnp.int64(i + 1), flat[pos], pos.astype(jnp.int64), jnp.int64(dim), jnp.int64(size))
        flag = tuple(jnp.where(hit, f, old) for f, old in zip(found, flag))
    return jnp.stack(flag)


# ---- pending flags and what depends on them ------------------------------------

class _Check:
    """One unread flag: the op, where the user issued it, how to report it."""
    __slots__ = ("flag", "bound", "func", "line")

    def __init__(self, flag, bound, func, line):
        self.flag = Storage(flag)  # a Storage: fused mode materializes what one holds
        self.bound = bound
        self.func = func
        self.line = line


_unread = []  # _Check, in issue order
# id(storage) -> (weak reference to it, frozenset of the _Checks its value
# depends on); empty whenever no flag is unread.
tainted = {}


def _forget(key):
    return lambda ref: tainted.pop(key, None)


def _taint(storages, deps):
    for s in storages:
        key = id(s)
        old = tainted.get(key)
        if old is None:
            tainted[key] = (weakref.ref(s, _forget(key)), deps)
        elif not deps <= old[1]:
            tainted[key] = (old[0], old[1] | deps)


def _deps(storages):
    deps = None
    for s in storages:
        entry = tainted.get(id(s))
        if entry is not None:
            deps = entry[1] if deps is None or deps is entry[1] else deps | entry[1]
    return deps


def note(bound, func, flag, inputs, produced, line):
    """A checked op ran (or was recorded): its flag, unread; what it produced
    depends on it and on whatever its inputs depend on."""
    c = _Check(flag, bound, func, line)
    _unread.append(c)
    deps = _deps(inputs)
    _taint(produced, frozenset((c,)) if deps is None else deps | {c})
    if len(_unread) >= MAX_UNREAD:
        check()


def propagate(inputs, produced):
    """An op ran while flags are unread: what it produced depends on what its
    inputs depend on."""
    deps = _deps(inputs)
    if deps is not None:
        _taint(produced, deps)


# ---- at sync points --------------------------------------------------------------

def check():
    """Read every flag computed by now (one transfer); raise the first
    out-of-range index, after marking what depends on a bad op Lost."""
    if not _unread:
        return
    ready = [c for c in _unread if type(c.flag.array) is not Pending]
    if not ready:
        return
    values = jax.device_get([c.flag.array for c in ready])
    _unread[:] = [c for c in _unread if type(c.flag.array) is Pending]
    failed = {}
    for c, v in zip(ready, values):
        if v[0]:
            failed[c] = errors.out_of_range(c.bound, c.func, c.line, int(v[1]), int(v[3]),
                                            int(v[4]), int(v[2]))
    if failed:
        _mark_lost(failed)
    if not _unread:
        tainted.clear()
    if failed:
        raise next(iter(failed.values()))


def _mark_lost(failed):
    """Storages whose value depends on a failed check hold Lost(its error)
    (the first such check's, in issue order)."""
    order = list(failed)
    for ref, deps in list(tainted.values()):
        s = ref()
        if s is None or deps.isdisjoint(failed):
            continue
        first = next(c for c in order if c in deps)
        arr = s.array
        if type(arr) is not Lost:
            s.assign(Lost(failed[first], arr.shape, arr.dtype))
