"""Graph capture and replay with CUDA Graphs' API: torch.tpu.TPUGraph,
torch.tpu.graph, torch.tpu.graph_pool_handle,
torch.tpu.is_current_stream_capturing.

Capture swaps the current executor for modes.capture's, which records the
region into one graph; replay runs that graph's one compiled function over
the captured storages and writes the results back into them, with no
per-op work on the host (torchtpu.modes.capture says what is recorded and
what replay draws from the random generator).
"""
import gc

from . import metrics

_capturing = None  # the TPUGraph being captured


def is_current_stream_capturing():
    """Whether a tpu graph is being captured (tpu streams are one queue)."""
    return _capturing is not None


def graph_pool_handle():
    """A memory pool handle to share between captures (XLA owns device
    memory: the handle is accepted and names nothing)."""
    return (0, 0)


class TPUGraph:
    """A captured region, replayed with replay(): torch.cuda.CUDAGraph's API."""

    def __init__(self, keep_graph=False):
        self._graph = None
        self._executor = None
        self._previous = None
        self._issued = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        global _capturing
        from . import modes  # (not at import: the executors need the device registered)
        from .modes.capture import CaptureExecutor
        if _capturing is not None:
            raise RuntimeError("torchtpu: a tpu graph is already being captured")
        if self._graph is not None:
            raise RuntimeError("torchtpu: this TPUGraph holds a capture already: reset() it first")
        modes.sync()  # what ran before capture is issued and its values known
        _install_optimizer_check()
        self._executor = CaptureExecutor()
        self._previous = modes._current
        modes._current = self._executor
        _capturing = self

    def capture_end(self):
        global _capturing
        from . import modes
        if _capturing is not self:
            raise RuntimeError("torchtpu: capture_end() without capture_begin()")
        ex = self._executor
        modes._current = self._previous
        _capturing = None
        self._executor = None
        if ex.failed is not None:
            ex.abandon(ex.failed)
            raise RuntimeError(f"torchtpu: the tpu graph capture failed: {ex.failed}")
        self._graph = ex.finish()
        metrics.M.extra["graphs_captured"] = metrics.M.extra.get("graphs_captured", 0) + 1

    def _abort(self, error):
        """capture end after an exception in the region."""
        global _capturing
        from . import modes
        ex = self._executor
        modes._current = self._previous
        _capturing = None
        self._executor = None
        ex.abandon(error)

    def replay(self):
        from . import modes
        if self._graph is None:
            raise RuntimeError("torchtpu: replay() of a TPUGraph that holds no capture")
        ex = modes.current()
        if ex is self._executor or _capturing is not None:
            raise RuntimeError("torchtpu: replay() inside a graph capture")
        if ex._last is self._issued:
            ex._last = None  # (a donated buffer's holders are counted)
        self._issued = None
        results = self._graph.replay(getattr(ex, "flush", lambda reason: None))
        # What synchronize() and events wait for.
        ex._last = self._issued = results
        metrics.M.extra["graph_replays"] = metrics.M.extra.get("graph_replays", 0) + 1

    def reset(self):
        if _capturing is self:
            raise RuntimeError("torchtpu: reset() during capture")
        self._graph = None
        self._issued = None

    def pool(self):
        return graph_pool_handle()

    def enable_debug_mode(self):
        pass

    def debug_dump(self, debug_path):
        raise RuntimeError("torchtpu: a tpu graph has no debug dump (TORCHTPU_FUSE_DEBUG=1 "
                           "describes fused graphs)")


class graph:
    """Capture the block into a TPUGraph: torch.cuda.graph's API. As on CUDA,
    the block's work is recorded, not run: run it with g.replay()."""

    def __init__(self, tpu_graph, pool=None, stream=None, capture_error_mode="global"):
        self.tpu_graph = tpu_graph
        self.pool = pool
        self.capture_error_mode = capture_error_mode

    def __enter__(self):
        gc.collect()
        self.tpu_graph.capture_begin(self.pool, self.capture_error_mode)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.tpu_graph._abort(exc)
            return False
        self.tpu_graph.capture_end()
        return False


_OPTIMIZER_CHECKED = False


def _install_optimizer_check():
    """Optimizers whose state steps live on the host unless capturable=True
    (Adam, AdamW, ...) check for capture on CUDA and XPU only: make the same
    check raise on tpu, since their host-side bias corrections would be
    captured as constants and every replay would use the first step's."""
    global _OPTIMIZER_CHECKED
    if _OPTIMIZER_CHECKED:
        return
    _OPTIMIZER_CHECKED = True
    from torch.optim.optimizer import Optimizer
    original = Optimizer._accelerator_graph_capture_health_check

    def check(self):
        if _capturing is not None and not all(g.get("capturable", True) for g in self.param_groups):
            raise RuntimeError("Attempting TPU graph capture of step() for an instance of "
                               f"{type(self).__name__} but param_groups' capturable is False.")
        original(self)

    Optimizer._accelerator_graph_capture_health_check = check


NAMES = ("TPUGraph", "graph", "graph_pool_handle", "is_current_stream_capturing")

__all__ = list(NAMES)
