"""The eager modes: debug, strict, fused. Same interface, different timing.

An executor has run(kernel, flat, call) -> (outputs, new storage arrays),
concrete(storage, reason) -> the storage's concrete array (waiting as
needed) and sync(reason) -> wait for all issued work, where reason names
why ("item", "print", ...: fused mode reports it per flush); and what other
layers may ask of it:
records, fuses and waits_each_op (modes/strict.py says what each means).
Fused mode also has flush(reason) and record_collective(...).
"""
import contextlib
import os
import time

from .. import config, errors, metrics, profiling
from .forked import ForkedExecutor

MODES = ("debug", "strict", "fused")
_executors = {}
_current = None


def _executor(name):
    ex = _executors.get(name)
    if ex is None:
        if name == "debug":
            from .debug import DebugExecutor as cls
        elif name == "strict":
            from .strict import StrictExecutor as cls
        else:
            from .fused import FusedExecutor as cls
        ex = _executors[name] = cls()
    return ex


def _check(name):
    if name not in MODES:
        raise ValueError(f"unknown eager mode {name!r}; valid modes are: {', '.join(MODES)}")
    return name


def current():
    return _current


def get_eager_mode():
    return _current.name


def set_eager_mode(name):
    global _current
    _check(name)
    try:
        if _current is not None and _current.name != name:
            sync_point("mode_switch", _current.sync)
    finally:
        # Switched even when the sync raises (an out-of-range index found then).
        _current = _executor(name)


def swap(executor):
    """Make executor take the ops from now on, without a sync (a graph
    capture, a compiled graph's trace); returns the one it replaces, which
    swap(previous) restores."""
    global _current
    previous, _current = _current, executor
    return previous


@contextlib.contextmanager
def using(executor):
    """Run the block with executor taking the ops, then restore the one
    before (no sync at either end)."""
    previous = swap(executor)
    try:
        yield executor
    finally:
        swap(previous)


@contextlib.contextmanager
def eager_mode(name):
    """Run the block in the given eager mode, then restore the previous one."""
    _check(name)
    previous = get_eager_mode()
    set_eager_mode(name)
    try:
        yield
    finally:
        set_eager_mode(previous)


def forget_flush_sites():
    """Forget which graphs earlier flushes brought at each line (fused mode's
    churn guard), as a new process would."""
    for ex in _executors.values():
        forget = getattr(ex, "forget_sites", None)
        if forget is not None:
            forget()


def sync_point(reason, wait):
    """wait(reason): a read of device values on the host or a wait for all
    issued work, counted once as a sync at the user's line, with its reason
    and how long it waited (torchtpu.metrics.sync_report, the advisor)."""
    line = errors.user_line()
    with profiling.span(lambda: f"torchtpu sync ({reason}) at {line}"):
        start = time.perf_counter()
        try:
            return wait(reason)
        finally:
            metrics.note_sync(line, reason, time.perf_counter() - start)


def sync(reason="sync"):
    """Wait for all pending work."""
    sync_point(reason, _current.sync)


def in_forked_child():
    """Whether this process was forked from one using tpu (its tpu work raises)."""
    return isinstance(_current, ForkedExecutor)


def _after_fork_in_child():
    global _current
    forked = ForkedExecutor(_current.name)
    _executors.update(dict.fromkeys(MODES, forked))  # set_eager_mode keeps it
    _current = forked


os.register_at_fork(after_in_child=_after_fork_in_child)


set_eager_mode(_check(config.EAGER_MODE.text().lower()))
