"""The thread that compiles fused graphs while the program goes on (tiered
compilation, modes/fused.py). Jobs run one at a time, in order: XLA's
compiler releases the GIL, so the program runs beside it. At exit the job
under way is finished (its executable is stored for the next process) and
queued ones are dropped; in a forked child, jobs never started fail."""
import atexit
import collections
import os
import threading
import time

_cv = threading.Condition()
_queue = collections.deque()
_state = {"thread": None, "running": None}


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


def _loop():
    try:
        # Behind the program: its own work (op by op meanwhile) comes first.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
    while True:
        with _cv:
            while not _queue:
                _cv.wait()
            job = _state["running"] = _queue.popleft()
        start = time.perf_counter()
        try:
            job.value = job.work()
        except BaseException as e:  # noqa: BLE001 (reported at the graph's next flush)
            job.error = e
        job.seconds = time.perf_counter() - start
        job.work = None
        with _cv:
            job.done = True
            _state["running"] = None
            _cv.notify_all()


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
