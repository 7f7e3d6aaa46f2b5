"""Streams and events for tpu, as torch.cuda has them.

The device runs torchtpu's work from one queue: JAX issues each op (or
fused graph) in program order and the platform runs it in dependency
order. So a tpu stream is a name for that queue, every wait between streams
or on an event is already satisfied, and synchronizing a stream waits for
all issued work. A CUDA program written for several streams stays correct;
it just gets no overlap from them.

An event's record() marks the work issued so far (the device arrays alive
then, which hold the results of everything issued); a waiter thread stamps
the time when they are all complete. So elapsed_time() measures device
work, and record() does not block the host. In fused mode a timing
event's record() is a flush boundary: the ops recorded so far are issued
(compiled as one graph, not waited for) so that the event stands after them
and its time is theirs. A plain event's record() issues nothing: what can be
asked of it later (query, synchronize) issues the pending ops then and
waits for them, so it waits for at least the work before the record, and
the stream waits a library builds from events (FSDP2 records several a
step) no longer cut the step's graph.

PyTorch's own torch.Event and torch.Stream call the C++ device guard for
these (record, synchronize, elapsed_time), which a Python backend cannot
provide in torch 2.13; install() makes torch.Event("tpu") and
torch.Stream("tpu") build these classes instead.
"""
import atexit
import itertools
import os
import queue
import threading
import time

import torch

from . import memory, properties, runtime

_TorchStream = torch.Stream
_TorchEvent = torch.Event
_stream_ids = itertools.count(1)
_local = threading.local()


def _issue_pending():
    """Fused mode: issue the recorded ops, without waiting."""
    from . import modes  # (its executors need the device registered first)
    flush = getattr(modes.current(), "flush", None)
    if flush is not None:
        flush("event")


def _fused():
    from . import modes
    return modes.current().fuses


def synchronize(device=None):
    """Wait for all issued work: ops, and uploads from pinned memory."""
    from . import modes  # (its executors need the device registered first)
    properties.checked_index(device)
    modes.sync()
    runtime.wait_transfers()  # after: a fused graph runs while they transfer


def _wait_for_all():
    synchronize()


def _marker():
    """The device arrays alive now: the results of all work issued so far.
    (Held by an event until it is stamped, they are not donated to a fused
    graph meanwhile: the executor donates only arrays nothing else holds.)"""
    return memory.live_arrays()


def _ready(arrays):
    for a in arrays:
        if not a.is_deleted() and not a.is_ready():
            return False
    return True


def _block(arrays):
    for a in arrays:
        try:
            a.block_until_ready()
        except RuntimeError:  # deleted by its owner: nothing to wait for
            pass


class _Waiter:
    """One daemon thread that stamps each recorded event when its work is done."""

    def __init__(self):
        self._queue = queue.Queue()
        self._thread = None
        self.pending = 0  # events submitted and not yet stamped
        self._idle = threading.Condition()

    def submit(self, event, arrays):
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="torchtpu-events", daemon=True)
            self._thread.start()
            atexit.register(self.stop)
        with self._idle:
            self.pending += 1
        self._queue.put((event, arrays))

    def _loop(self):
        while True:
            event, arrays = self._queue.get()
            if event is None:
                return
            _block(arrays)
            event._stamp(time.perf_counter())
            del event, arrays  # (first: a drained waiter holds no arrays)
            with self._idle:
                self.pending -= 1
                self._idle.notify_all()

    def drain(self):
        """Wait until every submitted event is stamped and its arrays let go
        (a memory query's duty: the tensors the user freed are freed)."""
        with self._idle:
            self._idle.wait_for(lambda: self.pending == 0)

    def stop(self):
        """At exit: let the thread finish the events before it and end.
        Left waiting inside the runtime as the interpreter finalizes, it
        would be ended there on its way back to Python, which aborts the
        process (std::terminate)."""
        if self._thread is not None:
            self._queue.put((None, None))
            self._thread.join()
            self._thread = None


_waiter = _Waiter()
memory.holders.append(_waiter.drain)
# A forked child (a DataLoader worker) has no waiter thread: it starts its own.
os.register_at_fork(after_in_child=_waiter.__init__)


class Stream(_TorchStream):
    """A tpu stream (torch.tpu.Stream); all of them name the device's one queue."""

    def __new__(cls, device=None, priority=0, **kwargs):
        if "stream_id" in kwargs:  # torch.Stream(stream_id=, device_index=, device_type=)
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, stream_id=next(_stream_ids),
                               device_index=properties.checked_index(device),
                               device_type=_DEVICE_TYPE)

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event):
        """Work issued later runs after the event's work: already so."""

    def wait_stream(self, stream):
        """Work issued later runs after the stream's work: already so."""

    def record_event(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self):
        """Whether all issued work is complete (fused mode: issues pending ops)."""
        _issue_pending()
        return _ready(_marker())

    def synchronize(self):
        _wait_for_all()

    def __enter__(self):
        self._previous = current_stream()
        set_stream(self)
        return self

    def __exit__(self, *exc):
        set_stream(self._previous)
        return False

    def __repr__(self):
        return f"torch.tpu.Stream(device=tpu:{self.device_index} stream_id={self.stream_id})"


_DEVICE_TYPE = int(torch._C._autograd.DeviceType.PrivateUse1)  # as Stream.device_type gives it
_default = Stream(stream_id=0, device_index=0, device_type=_DEVICE_TYPE)


class Event(_TorchEvent):
    """A tpu event (torch.tpu.Event), with torch.cuda.Event's arguments."""

    def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
        if interprocess:
            raise RuntimeError("torchtpu: interprocess events are not supported on tpu")
        self = super().__new__(cls, "tpu", enable_timing=enable_timing, blocking=blocking)
        self._timing = enable_timing
        self._recorded = False
        self._done = threading.Event()
        self._time = None
        self._arrays = None
        self._unissued = False  # recorded in fused mode, the work before it not yet issued
        return self

    def __init__(self, *args, **kwargs):
        pass

    def _stamp(self, t):
        self._time = t
        self._arrays = None
        self._done.set()

    def record(self, stream=None):
        """Mark the work issued so far; returns at once (fused mode: a timing
        event issues the recorded ops first, a plain one when asked about)."""
        self._recorded = True
        self._done = threading.Event()
        self._time = None
        self._arrays = None
        self._unissued = not self._timing and _fused()
        if not self._unissued:
            self._mark()

    def _mark(self):
        _issue_pending()
        self._unissued = False
        self._arrays = arrays = _marker()
        memory.sample(settle=False)
        if _waiter.pending == 0 and _ready(arrays):  # (earlier events stamp first)
            self._stamp(time.perf_counter())
        else:
            _waiter.submit(self, arrays)

    def query(self):
        """Whether the work before the record is complete (stamped or not yet)."""
        if self._unissued:
            self._mark()
        if not self._recorded or self._done.is_set():
            return True
        arrays = self._arrays
        return arrays is None or _ready(arrays)

    def synchronize(self):
        if self._unissued:
            self._mark()
        if self._recorded:
            self._done.wait()

    def wait(self, stream=None):
        """Make stream wait for this event's work: already so (one queue)."""

    def elapsed_time(self, end_event):
        """Milliseconds of device time between this event and end_event."""
        if not (self._timing and end_event._timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if not (self._recorded and end_event._recorded):
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end_event.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        self.synchronize()  # complete: the stamps are on their way
        end_event.synchronize()
        return (end_event._time - self._time) * 1000.0

    def ipc_handle(self):
        raise RuntimeError("torchtpu: interprocess events are not supported on tpu")

    def __repr__(self):
        state = "recorded" if self._recorded else "not recorded"
        return f"torch.tpu.Event({state}, enable_timing={self._timing})"


def current_stream(device=None):
    properties.checked_index(device)
    return getattr(_local, "stream", None) or _default


def default_stream(device=None):
    properties.checked_index(device)
    return _default


def set_stream(stream):
    if stream is not None:
        _local.stream = stream


class StreamContext:
    """torch.tpu.stream(s): make s the current stream in the block (None: no-op)."""

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        self._previous = current_stream()
        set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            set_stream(self._previous)
        return False


def stream(stream):
    return StreamContext(stream)


def _is_tpu(device):
    if device is None:
        return properties.tpu_is_the_accelerator()
    if isinstance(device, int):
        return False
    return torch.device(device).type == "tpu"


class _AnyEventType(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _TorchEvent)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _TorchEvent)


class _AnyStreamType(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _TorchStream)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _TorchStream)


class TorchEvent(_TorchEvent, metaclass=_AnyEventType):
    """torch.Event: a tpu Event for the tpu device, else PyTorch's own.
    isinstance(e, torch.Event) holds for both."""

    def __new__(cls, device=None, *, enable_timing=False, blocking=False, interprocess=False):
        if cls is not TorchEvent:  # a subclass of torch.Event made after the install
            return _TorchEvent.__new__(cls, device, enable_timing=enable_timing,
                                       blocking=blocking, interprocess=interprocess)
        if _is_tpu(device):
            return Event(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)
        return _TorchEvent(device, enable_timing=enable_timing, blocking=blocking,
                           interprocess=interprocess)


class TorchStream(_TorchStream, metaclass=_AnyStreamType):
    """torch.Stream: a tpu Stream for the tpu device, else PyTorch's own."""

    def __new__(cls, device=None, *args, **kwargs):
        if cls is not TorchStream:  # a subclass of torch.Stream made after the install
            return _TorchStream.__new__(cls, device, *args, **kwargs)
        if "stream_id" in kwargs:
            if kwargs.get("device_type") == _DEVICE_TYPE:
                return Stream(**kwargs)
            return _TorchStream(**kwargs)
        if _is_tpu(device):
            return Stream(device, **kwargs)
        return _TorchStream(device, *args, **kwargs)


def install():
    """Make torch.Event / torch.Stream of the tpu device these classes."""
    TorchEvent.__name__ = TorchEvent.__qualname__ = "Event"
    TorchStream.__name__ = TorchStream.__qualname__ = "Stream"
    TorchEvent.__module__ = TorchStream.__module__ = "torch"
    torch.Event = TorchEvent
    torch.Stream = TorchStream


NAMES = ("Stream", "Event", "current_stream", "default_stream", "set_stream", "stream",
         "StreamContext")
