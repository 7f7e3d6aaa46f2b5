"""torch.compile with tpu tensors.

TorchDynamo cannot put tpu tensors in its graphs: it traces tensor subclasses
only through their inner tensors, and a TpuTensor's data is a JAX array. An op
on a tpu tensor is therefore a graph break, and Dynamo runs it as written, in
the current eager mode (fused mode fuses those ops as usual). Three things
make that work:

- Dynamo must not trace torchtpu's or JAX's own Python code (it would rewrite
  the dispatcher's frames and break JAX's tracing): both are on its skip list.
- The `tpu` backend, `torch.compile(model, backend="tpu")`, runs the graphs
  Dynamo does capture through torchtpu's dispatcher, op by op in the current
  eager mode, whatever device their tensors are on.
- Inductor, the default backend, cannot generate code for this device (its
  `tpu` code generator is for another package's tensors). A graph that makes
  tpu tensors (a factory with device="tpu" in the compiled code) fails with an
  error saying so and naming the `tpu` backend, instead of a missing module.
"""
import torch

from .tensor import DEVICE


def tpu_backend(gm, example_inputs):
    """Dynamo backend: the captured graph, run as eager code."""
    return gm.forward


class _NoInductorCode:
    """Inductor's code generators for the device: each refuses, clearly."""
    supports_caching = False

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"torchtpu: Inductor cannot generate code for {DEVICE.type} tensors; compile with "
            f"torch.compile(..., backend=\"{DEVICE.type}\"), which runs the captured graph in "
            "torchtpu's current eager mode (fused mode fuses it)")

    @classmethod
    def get_backend_features(cls, device):
        cls()

    @classmethod
    def create(cls, *args, **kwargs):
        cls()


def register():
    from torch._dynamo import trace_rules
    for package in ("torchtpu", "jax", "jaxlib"):
        trace_rules.add(package)
    torch._dynamo.register_backend(tpu_backend, name=DEVICE.type)
    from torch._inductor.codegen import common
    # Before Inductor registers its own code generator for the device name.
    common.register_backend_for_device(DEVICE.type, _NoInductorCode, _NoInductorCode)
