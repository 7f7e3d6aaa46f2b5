"""torch.compile with tpu tensors: what Dynamo, fake tensors and Inductor
need to be told about the device.

- Dynamo wraps a tpu tensor as a plain tensor (its fake tensor is a plain
  FakeTensor on the device), so ops on tpu tensors are not graph breaks;
  fake tensor mode makes no real tpu tensor while tracing; a tpu tensor
  stands for the plain tangent AOTAutograd expects.
- Dynamo must not trace torchtpu's or JAX's own Python code (it would rewrite
  the dispatcher's frames and break JAX's tracing): both are on its skip list.
- The `tpu` backend, `torch.compile(model, backend="tpu")`, gives each graph
  on tpu tensors to AOTAutograd, whose forward, backward and inference
  graphs become one XLA computation each (torchtpu.compiled); a graph on
  other devices only runs as eager code.
- Inductor, the default backend, cannot generate code for this device. A graph
  that makes or takes tpu tensors given to `torch.compile`'s Inductor goes
  to the `tpu` backend instead, with one warning per process; every other
  graph is Inductor's as before.
- Any other way into Inductor's code generation for the device (its own `tpu`
  code generator is for another package's tensors) fails with an error
  naming the `tpu` backend, instead of a missing module.
"""
import sys
import warnings

import torch
from torch.utils import _pytree as pytree

from .errors import is_internal
from .integrations.after_import import when_imported
from .tensor import DEVICE, TpuTensor, on_device

_routing_warned = False


# AOTAutograd backends by whether they replay (mode="reduce-overhead").
_aot_backends = {}


# torch.compile's modes. Each compiled graph is one computation whatever the
# mode; "reduce-overhead" (CUDA graphs' replay on CUDA) captures each graph's
# call once and replays it (torchtpu.compiled), which updates what the graph
# writes in place; the others run each graph as a kernel of the eager mode.
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
REPLAYING = ("reduce-overhead",)


def tpu_backend(gm, example_inputs, mode=None, options=None):
    """Dynamo backend: a graph on tpu tensors becomes one XLA computation
    per AOTAutograd graph (forward, backward); any other graph runs as
    eager code. options: Inductor's; "triton.cudagraphs" asks for replay,
    as mode="reduce-overhead" does, and the others have no meaning here."""
    if mode not in MODES:
        raise RuntimeError(f"torchtpu: unknown torch.compile mode {mode!r} for the "
                           f"{DEVICE.type} backend; valid modes: "
                           f"{', '.join(m for m in MODES if m)}")
    if not graph_uses_device(gm, example_inputs):
        return gm.forward
    replay = bool((options or {}).get("triton.cudagraphs", mode in REPLAYING))
    backend = _aot_backends.get(replay)
    if backend is None:
        import functools

        from torch._dynamo.backends.common import aot_autograd
        from .compiled import compile_graph
        compiler = functools.partial(compile_graph, replay=replay)
        backend = _aot_backends[replay] = aot_autograd(
            fw_compiler=compiler, bw_compiler=compiler, keep_inference_input_mutations=True)
    return backend(gm, example_inputs)


def _dynamo_wraps_tpu_tensors(builder, fake_tensor):
    """Dynamo's VariableBuilder treats a tpu tensor as a plain tensor.

    Dynamo puts in its graphs only plain tensors and traceable wrapper
    subclasses (__tensor_flatten__ over inner tensors; a tpu tensor's data is
    a JAX array, not a tensor); any other tensor subclass is an opaque
    object, and each op on one a graph break. A tpu tensor needs no more
    than a plain tensor does: its fake tensor (FakeTensorMode.from_tensor) is
    a plain FakeTensor on the tpu device, with its shape, strides and dtype,
    and PyTorch's meta kernels run on it. So Dynamo wraps it as it wraps a
    plain tensor, guarded on its type as on its other properties."""
    wrap, infer = builder.VariableBuilder._wrap, builder.infer_subclass_type

    def _wrap(self, value):
        if type(value) is TpuTensor:
            return self.wrap_tensor(value)
        return wrap(self, value)

    def infer_subclass_type(value):
        return None if type(value) is TpuTensor else infer(value)

    builder.VariableBuilder._wrap = _wrap
    builder.infer_subclass_type = infer_subclass_type
    # Fake tensor mode must not make real tpu tensors while tracing: as for
    # a CUDA it cannot use, torch.tensor(..., device=...) then makes a CPU
    # tensor and moves its fake to the device, and small tensors are not
    # kept as real constants across device moves. (Real tpu tensors inside
    # fake tensors' ops are something neither side can serve.)
    fake_tensor.FakeTensorMode.avoid_device_init = property(lambda self: True)
    # AOTAutograd, having traced plain (fake) tensors, expects plain tangents
    # in backward; a tpu tensor is the tangent it means.
    TpuTensor.__coerce_same_metadata_as_tangent__ = _same_tangent


def _same_tangent(self, expected_meta, expected_type=None):
    return self


def graph_uses_device(gm, example_inputs):
    """Whether a Dynamo graph takes or makes tensors on the device: an input,
    or any node's example value (Dynamo's fake tensor for it)."""
    if any(on_device(x) for x in example_inputs):
        return True
    return any(on_device(value)
               for node in gm.graph.nodes
               for value in pytree.tree_leaves(node.meta.get("example_value")))


def _user_stacklevel():
    """warnings.warn's stacklevel, for its caller, of the innermost frame
    outside torch and torchtpu: the code Dynamo is compiling."""
    frame, level = sys._getframe(2), 2
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def _routing_inductor_call(inductor_call):
    """torch.compile's Inductor entry, sending graphs on the device to the
    `tpu` backend."""

    def call(self, model_, inputs_, **kwargs):
        if not graph_uses_device(model_, inputs_):
            return inductor_call(self, model_, inputs_, **kwargs)
        global _routing_warned
        if not _routing_warned:
            _routing_warned = True
            warnings.warn(
                f"torchtpu: Inductor (torch.compile's default backend) cannot generate code for "
                f"{DEVICE.type} tensors; graphs that make or take them are compiled by "
                f"torchtpu instead, as with "
                f"torch.compile(..., backend=\"{DEVICE.type}\"), which says so explicitly",
                stacklevel=_user_stacklevel())
        # mode="reduce-overhead" sets Inductor's "triton.cudagraphs".
        return tpu_backend(model_, inputs_, options=getattr(self, "config", None))

    call.__wrapped__ = inductor_call
    return call


class _NoInductorCode:
    """Inductor's code generators for the device: each refuses, clearly."""
    supports_caching = False

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"torchtpu: Inductor cannot generate code for {DEVICE.type} tensors; compile with "
            f"torch.compile(..., backend=\"{DEVICE.type}\"), which compiles the captured graph "
            "with torchtpu's own lowerings")

    @classmethod
    def get_backend_features(cls, device):
        cls()

    @classmethod
    def create(cls, *args, **kwargs):
        cls()


def _register_with_dynamo(dynamo):
    from torch._dynamo import trace_rules
    for package in ("torchtpu", "jax", "jaxlib"):
        trace_rules.add(package)
    from torch._dynamo.variables import builder
    from torch._subclasses import fake_tensor
    _dynamo_wraps_tpu_tensors(builder, fake_tensor)
    dynamo.register_backend(tpu_backend, name=DEVICE.type)


def _refuse_inductor_codegen(common):
    # Before Inductor registers its own code generator for the device name
    # (it does so at its first compilation, not at import).
    common.register_backend_for_device(DEVICE.type, _NoInductorCode, _NoInductorCode)


def register():
    # torch.compile(model) and backend="inductor" call Inductor through this
    # wrapper's __call__ (compile_fx itself is imported only then: costly).
    wrapper = torch._TorchCompileInductorWrapper
    if hasattr(wrapper.__call__, "__wrapped__"):
        return
    wrapper.__call__ = _routing_inductor_call(wrapper.__call__)
    # Dynamo and Inductor take about a second to import; a script that never
    # compiles (or builds an optimizer, which imports Dynamo) need not pay it.
    when_imported("torch._dynamo", _register_with_dynamo)
    when_imported("torch._inductor.codegen.common", _refuse_inductor_codegen)
