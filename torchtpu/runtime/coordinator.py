"""JAX's coordination service in a process of its own, not inside rank 0.

jax.distributed runs its coordination service in process 0. When that
process dies, every other process's JAX client finds the service gone and
aborts at once from a C++ thread (`Terminating process because the JAX
distributed service detected fatal errors`), before Python can raise
anything; the hook JAX's client offers in its place cannot be used from
Python (its argument has no Python type). Served from a child process of
rank 0 instead, the service outlives rank 0: a dead rank 0 is then a rank
like any other, whose peers' next collective fails with a Python error
naming it (agreement.py), and the service ends the survivors only after
its heartbeat timeout, as it does when another rank dies.

`serving(enabled)` is a context manager around jax.distributed.initialize:
in it, the service JAX starts in process 0 is started as that child
instead, and JAX holds a stand-in whose `shutdown()` (JAX's own, once every
process has passed its shutdown barrier) ends the child. If rank 0 dies,
the child sees its pipe close without that word, serves the others for
the heartbeat timeout and 10 s more (so that the service can tell them),
and ends. It shares rank 0's process group, so a launcher that ends that
group (torchrun, at a failure or a restart) ends it too.
This module imports nothing of torchtpu: it runs before the JAX backend.
"""
import contextlib
import json
import subprocess
import sys
import threading

from ..compat import jax_extension

# The child: start the service, say so, wait for the parent's word or end.
_CHILD = """\
import json, os, sys, time
from jax._src.lib import _jax
address, num_nodes, options = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
try:
    service = _jax.get_distributed_runtime_service(address, num_nodes, **options)
except Exception as e:
    print(f"failed {type(e).__name__}: {e}".replace(chr(10), " "), flush=True)
    sys.exit(1)
print("ready", flush=True)
word = sys.stdin.buffer.read()
if word == b"done":
    service.shutdown()
else:  # the parent died: let the service tell the others, then end
    time.sleep((options.get("heartbeat_timeout") or 100) + 10)
os._exit(0)
"""

_STARTUP_SECONDS = 120


class ServiceProcess:
    """Where JAX keeps its service: the child serving it."""

    def __init__(self, address, num_nodes, options):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, address, str(num_nodes), json.dumps(options)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        line = self._first_line()
        if line != "ready":
            self.proc.kill()
            ended = f"its process ended (exit status {self.proc.wait()})"
            raise RuntimeError(f"torchtpu: JAX's coordination service on {address} did not "
                               f"start: {line or ended}")

    def _first_line(self):
        got = []
        reader = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(_STARTUP_SECONDS)
        return got[0].decode(errors="replace").strip() if got else "no answer"

    def shutdown(self):
        try:
            self.proc.stdin.write(b"done")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


@contextlib.contextmanager
def serving(enabled):
    """jax.distributed.initialize inside starts its service as a child
    process (enabled) or, as JAX does, in this process."""
    extension = jax_extension()
    if extension is None:  # another JAX: keep JAX's way
        enabled = False
    if not enabled:
        yield
        return

    def start_child(address, num_nodes, **options):
        return ServiceProcess(address, num_nodes, options)

    start = extension.get_distributed_runtime_service
    extension.get_distributed_runtime_service = start_child
    try:
        yield
    finally:
        extension.get_distributed_runtime_service = start
