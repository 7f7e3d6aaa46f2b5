"""Graph capture and replay with CUDA Graphs' API: torch.tpu.TPUGraph,
torch.tpu.graph, torch.tpu.make_graphed_callables, torch.tpu.graph_pool_handle,
torch.tpu.is_current_stream_capturing.

Capture swaps the current executor for modes.capture's, which records the
region into one graph; replay runs that graph's one compiled function over
the captured storages and writes the results back into them, with no
per-op work on the host (torchtpu.modes.capture says what is recorded and
what replay draws from the random generator).
"""
import gc

from . import metrics, properties

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
        self._previous = modes.swap(self._executor)
        _capturing = self

    def capture_end(self):
        global _capturing
        from . import modes
        if _capturing is not self:
            raise RuntimeError("torchtpu: capture_end() without capture_begin()")
        ex = self._executor
        modes.swap(self._previous)
        _capturing = None
        self._executor = None
        if ex.failed is not None:
            ex.abandon(ex.failed)
            raise RuntimeError(f"torchtpu: the tpu graph capture failed: {ex.failed}")
        self._graph = ex.finish()
        metrics.M.extra["graphs_captured"] = metrics.M.extra.get("graphs_captured", 0) + 1

    def _end_capture(self, exc):
        """The end of a `with` block capturing into this graph."""
        if exc is not None:
            self._abort(exc)
        else:
            self.capture_end()

    def _abort(self, error):
        """capture end after an exception in the region."""
        global _capturing
        from . import modes
        ex = self._executor
        modes.swap(self._previous)
        _capturing = None
        self._executor = None
        ex.abandon(error)

    def replay(self):
        self.replay_over(None, None)

    def replay_over(self, inputs, outputs):
        """replay() with other storages in the captured ones' places, in the
        captured graph's input and output order (None: the captured ones):
        how torch.compile's mode="reduce-overhead" replays a compiled graph
        on each call's tensors (torchtpu.compiled)."""
        from . import modes
        if self._graph is None:
            raise RuntimeError("torchtpu: replay() of a TPUGraph that holds no capture")
        ex = modes.current()
        if ex is self._executor or _capturing is not None:
            raise RuntimeError("torchtpu: replay() inside a graph capture")
        if ex._last is self._issued:
            ex._last = None  # (a donated buffer's holders are counted)
        self._issued = None
        results = self._graph.replay(getattr(ex, "flush", lambda reason: None), inputs, outputs)
        # What synchronize() and events wait for.
        ex._last = self._issued = results
        metrics.M.extra["graph_replays"] = metrics.M.extra.get("graph_replays", 0) + 1

    @property
    def captured(self):
        """The capture (modes.capture.CapturedGraph): the storages it reads
        and writes, in order; None before capture."""
        return self._graph

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
        self.tpu_graph._end_capture(exc)
        return False


class AcceleratorGraph(TPUGraph):
    """torch.accelerator.Graph's API (torch 2.13) on tpu: its settings are
    given when it is made, capture_begin() takes none, and the graph is its
    own context manager."""

    def __init__(self, keep_graph=False, *, pool=None, capture_error_mode="default"):
        super().__init__(keep_graph)
        self.graph_pool = pool
        self.capture_error_mode = capture_error_mode

    def capture_begin(self):
        super().capture_begin(self.graph_pool, self.capture_error_mode)

    def instantiate(self):
        """Nothing to do: the capture is compiled when it ends."""

    def __enter__(self):
        self.capture_begin()

    def __exit__(self, exc_type, exc, tb):
        self._end_capture(exc)
        return False


def accelerator_graph_class(torch_graph):
    """The class to put at torch.accelerator.Graph: it makes an
    AcceleratorGraph while tpu is the current accelerator, else PyTorch's
    (whose C++ side has no tpu graphs); isinstance holds for both."""

    class AnyGraphType(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, (torch_graph, AcceleratorGraph))

        def __subclasscheck__(cls, sub):
            return issubclass(sub, (torch_graph, AcceleratorGraph))

    class Graph(metaclass=AnyGraphType):
        __doc__ = torch_graph.__doc__

        def __new__(cls, keep_graph=False, **settings):
            made = AcceleratorGraph if properties.tpu_is_the_accelerator() else torch_graph
            return made(keep_graph, **settings)

    Graph.__module__, Graph.__qualname__ = torch_graph.__module__, torch_graph.__qualname__
    return Graph


_OPTIMIZER_CHECKED = False


def _install_optimizer_check():
    """Optimizers whose state steps live on the host unless capturable=True
    (Adam, AdamW, ...) check for capture on CUDA and XPU only: make the same
    check raise on tpu, since their host-side bias corrections would be
    captured as constants and every replay would use the first step's. A
    global step pre-hook (public since torch 2.0), not the optimizers'
    private health check, so that other torch versions keep it."""
    global _OPTIMIZER_CHECKED
    if _OPTIMIZER_CHECKED:
        return
    _OPTIMIZER_CHECKED = True
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def check(optimizer, args, kwargs):
        if _capturing is not None and not all(g.get("capturable", True)
                                              for g in optimizer.param_groups):
            raise RuntimeError("Attempting TPU graph capture of step() for an instance of "
                               f"{type(optimizer).__name__} but param_groups' capturable is False.")

    register_optimizer_step_pre_hook(check)


def make_graphed_callables(callables, sample_args, num_warmup_iters=3, allow_unused_input=False,
                           pool=None):
    """torch.cuda.make_graphed_callables for tpu: each callable (a function
    or an nn.Module) becomes one whose forward and backward are each a
    replayed graph, captured after num_warmup_iters eager runs on
    sample_args (a tuple of tensors per callable)."""
    just_one = not isinstance(callables, tuple)
    if just_one:
        callables, sample_args = (callables,), (sample_args,)
    graphed = tuple(_graphed(fn, tuple(args), num_warmup_iters, allow_unused_input)
                    for fn, args in zip(callables, sample_args))
    return graphed[0] if just_one else graphed


def _graphed(fn, args, num_warmup_iters, allow_unused_input):
    import torch
    if not all(isinstance(a, torch.Tensor) for a in args):
        raise TypeError("In the beta API, sample_args for each callable must contain only Tensors. "
                        "Other types are not allowed.")
    module = fn if isinstance(fn, torch.nn.Module) else None
    params = tuple(module.parameters()) if module is not None else ()
    static_inputs = args + params
    grad_inputs_of = [t for t in static_inputs if t.requires_grad]

    def backward_of(outputs, grad_outputs):
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
        if not pairs or not grad_inputs_of:
            return ()
        return torch.autograd.grad([o for o, _ in pairs], grad_inputs_of, [g for _, g in pairs],
                                   allow_unused=allow_unused_input)

    def flat_outputs(out):
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)

    for _ in range(num_warmup_iters):
        outs = flat_outputs(fn(*args))
        backward_of(outs, [torch.ones_like(o) for o in outs])
    del outs
    forward = TPUGraph()
    with graph(forward):
        out = fn(*args)
    static_outputs = flat_outputs(out)
    static_grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in static_outputs]
    backward = TPUGraph()
    with graph(backward):
        grads = iter(backward_of(static_outputs, static_grad_outputs))
    static_grad_inputs = [next(grads) if t.requires_grad else None for t in static_inputs]
    n_args = len(args)

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for static, given in zip(static_inputs[:n_args], inputs[:n_args]):
                if given is not static:
                    static.copy_(given)
            forward.replay()
            return tuple(o.detach() for o in static_outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grad_outputs):
            for static, given in zip(static_grad_outputs, grad_outputs):
                if static is not None and given is not None:
                    static.copy_(given)
            backward.replay()
            # Copies: autograd may keep a returned gradient as .grad, and the
            # next replay writes the captured storages again.
            return tuple(g.clone() if g is not None else None for g in static_grad_inputs)

    def functional(*user_args):
        if len(user_args) != n_args:
            raise TypeError(f"the graphed callable takes {n_args} tensors, got {len(user_args)}")
        outs = Graphed.apply(*(tuple(user_args) + params))
        return outs[0] if isinstance(out, torch.Tensor) else outs

    if module is None:
        return functional
    module.forward = functional
    return module


NAMES = ("TPUGraph", "graph", "graph_pool_handle", "is_current_stream_capturing",
         "make_graphed_callables")

__all__ = list(NAMES)
