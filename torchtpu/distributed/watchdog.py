"""The watchdog: a rank that does not come to a collective in time is named.

A rank stuck between collectives (a deadlock, a data-dependent branch, a
slow host) otherwise looks like a slow step: the others wait in the next
collective's agreement (agreement.py) until the group's timeout, saying
nothing of who is missing. With TORCHTPU_WATCHDOG seconds (600 by default;
0 or off: none) the agreement waits that long, then:

- the waiting rank reads, from the group's store, where each rank last
  entered a collective (each rank writes its count, the collective and the
  user's line there as it enters one: one small store write per
  collective), and raises DistBackendError naming the ranks that have not
  reached this collective, their last collective, and its own last
  completed collective and the line it waits at;
- it first asks the missing ranks, through the store, to print that and
  their Python stack (faulthandler, every thread) to their stderr and end
  (exit status 1), as PyTorch's NCCL watchdog ends a stuck process: a rank
  stuck for good would otherwise never end. A thread in each process looks
  for that request every second; it waits up to a few seconds for them.

Collectives of the whole group are counted; send/recv wait for one peer,
which is the one named.
"""
import atexit
import datetime
import faulthandler
import json
import os
import sys
import threading
import time
import weakref

from torch.distributed import DistBackendError

from .. import config, errors

_KEY = "torchtpu_watchdog/"
_POLL_SECONDS = 1.0
_ACK_SECONDS = 5.0  # how long a waiting rank waits for a missing one to print its stack


def seconds():
    """TORCHTPU_WATCHDOG in seconds; None when off."""
    text = config.WATCHDOG.text()
    if not config.WATCHDOG.on():
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"TORCHTPU_WATCHDOG={text!r} is not a number of seconds "
                         "(0 or off: no watchdog)") from None
    return value if value > 0 else None


class Watch:
    """One process group's watchdog: where this rank is, for the others,
    and what it says when a collective's agreement is not done in time."""

    def __init__(self, store, rank, size, timeout):
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self.count = 0            # the group's collectives this rank has entered
        self.at = None            # "#n name at file:line" of the last one entered
        self.last_done = None     # the same, of the last one completed

    def wait(self, name, works, peer=None):
        """Run gloo's works (functions returning a Work) in turn, each waited
        for at most the watchdog's timeout (RuntimeError past it)."""
        if peer is None:
            self.count += 1
        line = errors.user_line()
        self.at = f"#{self.count} {name} at {line}" if peer is None else f"{name} at {line}"
        self._set(f"{_KEY}{self.rank}", json.dumps([self.count, self.at, self.last_done]))
        started = time.monotonic()
        limit = datetime.timedelta(seconds=self.timeout)
        for work in works:
            try:
                work().wait(limit)
            except RuntimeError as e:
                # (Past the group's own timeout, shorter, gloo's error stands.)
                if "Operation timed out" not in str(e) \
                        or time.monotonic() - started < self.timeout:
                    raise
                raise DistBackendError(self.diagnosis(name, peer)) from None
        self.last_done = self.at

    def diagnosis(self, name, peer=None):
        """Who has not come to this collective: the message the waiting rank
        raises, after asking those ranks to print their stack and end."""
        ranks = [peer] if peer is not None else [r for r in range(self.size) if r != self.rank]
        records = {r: self._get(f"{_KEY}{r}") for r in ranks}
        missing = [r for r in ranks if peer is not None or records[r] is None
                   or records[r][0] < self.count]
        told = []
        for r in missing:
            rec = records[r]
            told.append(f"rank {r} has not reached it; " + (
                "it has entered no collective yet" if rec is None else
                f"its last collective entered: {rec[1]}"))
        where = (f"Rank {self.rank} waits at {self.at}; its last completed collective: "
                 f"{self.last_done or 'none'}")
        if not missing:  # every rank says it is here: the exchange itself is stuck
            told.append("every rank has entered it (a stuck connection?)")
        message = (f"{name}: the watchdog (TORCHTPU_WATCHDOG={self.timeout:g} s) found "
                   f"{'no rank' if not missing else ', '.join(f'rank {r}' for r in missing)} "
                   f"missing after {self.timeout:g} s: {'; '.join(told)}. {where}.")
        for r in missing:
            self._set(f"{_KEY}stalled/{r}", message)
        printed = self._acknowledged(missing)
        for r in printed:
            message += f" Rank {r} printed its Python stack to its stderr and ended."
        return message

    def _acknowledged(self, ranks, wait=_ACK_SECONDS):
        """Those of ranks that say they printed their stack, within wait seconds."""
        deadline = time.monotonic() + wait
        printed = []
        while True:
            printed = [r for r in ranks
                       if self._get(f"{_KEY}printed/{r}", decode=False) is not None]
            if len(printed) == len(ranks) or time.monotonic() > deadline:
                return printed
            time.sleep(0.1)

    # The store may be gone (rank 0's process, which serves it, ended): the
    # watchdog then has nothing to say, and the collective's own error stands.
    def _set(self, key, value):
        try:
            self.store.set(key, value)
        except Exception:
            pass

    def _get(self, key, decode=True):
        try:
            if not self.store.check([key]):
                return None
            value = self.store.get(key)
        except Exception:
            return None
        return json.loads(value) if decode else value

    def stalled(self):
        """The waiting ranks' message, when they have found this rank missing."""
        return self._get(f"{_KEY}stalled/{self.rank}", decode=False)


_by_gloo = weakref.WeakKeyDictionary()  # a group's gloo -> its Watch
_thread = None


def of(gloo):
    return _by_gloo.get(gloo)


def watch(gloo, store, rank, size):
    """Watch the group whose agreement goes through gloo (when it has
    several processes and the watchdog is on); the first starts the thread
    that looks for requests to print."""
    global _thread
    timeout = seconds()
    if timeout is None or size < 2:
        return
    _by_gloo[gloo] = Watch(store, rank, size, timeout)
    if _thread is None:
        _thread = threading.Thread(target=_look_for_requests, daemon=True,
                                   name="torchtpu-watchdog")
        _thread.start()
        atexit.register(_stop_looking)


_stop = threading.Event()


def _stop_looking():
    """At exit, before the interpreter and then the C++ runtime are torn
    down: a daemon thread left inside a store call as they are (it polls
    every second) can end the process in std::terminate."""
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=10)


def _look_for_requests():
    while not _stop.wait(_POLL_SECONDS):
        for w in list(_by_gloo.values()):
            message = w.stalled()
            if message is not None:
                _print_and_end(w, message.decode(errors="replace"))


def _print_and_end(w, message):
    """This rank is the one missing: say so, print every thread's stack
    and end the process (the others have raised; its next collective could
    never complete)."""
    sys.stdout.flush()
    sys.stderr.write(f"torchtpu watchdog: rank {w.rank} is missing from a collective the "
                     f"other ranks wait in. They say: {message}\nRank {w.rank}'s Python stack "
                     f"(its last collective entered: {w.at or 'none'}):\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    w._set(f"{_KEY}printed/{w.rank}", "1")
    os._exit(1)
