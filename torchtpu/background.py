"""The thread that compiles fused graphs while the program goes on (tiered
compilation, modes/fused.py). Jobs run one at a time, in order: XLA's
compiler releases the GIL, so the program runs beside it. At exit the job
under way is finished (its executable is stored for the next process) and
queued ones are dropped; in a forked child, jobs never started fail.

The program's own work comes first. A job starts only once the program
has compiled nothing of its own for QUIET seconds: a program still warming
up (its first steps, a first evaluation, a new batch size) has the cores
for its own kernels, and a short one does not share them with graphs it
would run few times. The thread runs at a lower priority (nice 10); XLA
compiles on threads of its own (its client's pools) while the thread that
asked waits, so on the CPU platform, where those threads, the program's
kernels and its Python share the host's cores, they are put behind the
program too while jobs are queued, and back after, where the process may
raise a priority again (else they are left alone)."""
import atexit
import collections
import os
import threading
import time

_cv = threading.Condition()
_queue = collections.deque()
_state = {"thread": None, "running": None, "foreground": 0.0}


class Job:
    """work() run on the compile thread: done once it finished, with what
    it returned (value) or raised (error)."""
    __slots__ = ("work", "done", "value", "error", "seconds")

    def __init__(self, work):
        self.work = work
        self.done = False
        self.value = self.error = None
        self.seconds = 0.0


def finished(value):
    """A Job that is done already (an executable loaded from the disk)."""
    job = Job(None)
    job.value, job.done = value, True
    return job


def submit(work):
    job = Job(work)
    with _cv:
        _queue.append(job)
        if _state["thread"] is None:
            _state["thread"] = threading.Thread(target=_loop, name="torchtpu-compile", daemon=True)
            _state["thread"].start()
        _cv.notify_all()
    return job


def on_compile_thread():
    return threading.current_thread() is _state["thread"]


def wait():
    """Block until every submitted job has finished."""
    with _cv:
        while _queue or _state["running"] is not None:
            _cv.wait()


# The priority (nice value) of background compilation.
BEHIND = 10
# Seconds without a compilation of the program's own before a job starts.
QUIET = 0.5


def foreground_compiled():
    """The program compiled something (not on this thread)."""
    _state["foreground"] = time.monotonic()


def _loop():
    behind = _xla_behind()
    lowered = {}  # XLA's threads put behind the program -> their own nice value
    while True:
        with _cv:
            while not _queue:
                _cv.wait()
        # The program is still compiling kernels of its own: it comes first.
        while (left := QUIET - (time.monotonic() - _state["foreground"])) > 0:
            time.sleep(left)
        with _cv:
            if not _queue:
                continue
            job = _state["running"] = _queue.popleft()
        if behind:
            _put_behind(lowered)
        start = time.perf_counter()
        try:
            job.value = job.work()
        except BaseException as e:  # noqa: BLE001 (reported at the graph's next flush)
            job.error = e
        job.seconds = time.perf_counter() - start
        job.work = None
        with _cv:
            if not _queue and lowered:
                _put_back(lowered)  # (before wait() returns)
            job.done = True
            _state["running"] = None
            _cv.notify_all()


def _xla_behind():
    """Put this thread behind the program; whether XLA's threads are to be
    too: on the CPU platform, and where their priority can be raised back
    (root, or RLIMIT_NICE: tried on this thread)."""
    from . import runtime
    me = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, me, BEHIND)
    except (AttributeError, OSError):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, me, BEHIND - 1)
        os.setpriority(os.PRIO_PROCESS, me, BEHIND)
    except OSError:
        return False
    return runtime.PLATFORM == "cpu"


def _xla_threads():
    """The native ids of XLA's threads that may compile: the process's
    threads Python did not start that bear the process's own name (XLA's
    pools leave theirs unnamed; its named ones run kernels)."""
    python = {t.native_id for t in threading.enumerate()}
    ids = []
    try:
        with open("/proc/self/comm") as f:
            unnamed = f.read()
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return ids
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read() == unnamed and int(task) not in python:
                    ids.append(int(task))
        except OSError:
            continue  # (a thread that ended)
    return ids


def _put_behind(lowered):
    for tid in _xla_threads():
        if tid not in lowered:
            try:
                nice = os.getpriority(os.PRIO_PROCESS, tid)
                if nice < BEHIND:
                    os.setpriority(os.PRIO_PROCESS, tid, BEHIND)
                    lowered[tid] = nice
            except OSError:
                continue


def _put_back(lowered):
    for tid, nice in lowered.items():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            continue  # (a thread that ended)
    lowered.clear()


def _at_exit():
    # A compile left running while the interpreter shuts down would run on
    # inside XLA as its runtime is torn down: finish it.
    with _cv:
        _queue.clear()
        while _state["running"] is not None:
            _cv.wait()


def _after_fork_in_child():
    global _cv
    _cv = threading.Condition()
    jobs = list(_queue) + ([_state["running"]] if _state["running"] is not None else [])
    _queue.clear()
    _state.update(thread=None, running=None)
    for job in jobs:
        job.error = RuntimeError("a fused graph's compilation was under way when the process forked")
        job.done = True


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
