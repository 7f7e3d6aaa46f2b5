"""torch.nn.attention.flex_attention on tpu tensors, eagerly.

Called without torch.compile, flex_attention (torch 2.13) checks its inputs,
then runs the `flex_attention` higher-order op through Dynamo with the
"eager" backend (Dynamo turns score_mod and mask_mod into graphs and lifts
the tensors they capture into arguments). The op's Autograd kernel builds
score_mod's joint graph and saves what backward needs; below autograd the
op reaches the tensors' own kernel, which for plain tensors is its dense
implementation: the full scores matrix from ordinary aten ops, score_mod
and mask_mod applied by vmap. Backward is the `flex_attention_backward` op,
dense the same way. So a tpu tensor needs four things:

- `_validate_device` lets the device through (it names the devices it
  knows; every other device keeps its checks and errors);
- both ops run their dense implementations for a TpuTensor (a tensor
  subclass reaches a higher-order op at the Python key, where each subclass
  must be registered), so each of their aten ops is one of torchtpu's;
- score_mod's joint graph is traced on fake tensors only: PyTorch makes the
  gradient example with a real tensor of the query's device, which a fake
  tensor op refuses when it is a tensor subclass;
- autocast for the device casts q, k and v as CUDA's autocast does.

torch.compile(flex_attention) with the `tpu` backend (or Inductor, which
sends tpu graphs there: transformers' way) runs the same kernels inside its
graphs, once AOTAutograd's first-call check lets the op through
(control_flow.pass_aot_analyzer), in every mode: torchtpu.compiled traces a
graph with the dispatch keys of a new thread (fused mode may trace it at a
flush inside another op, where vmap cannot run), and keeps its inputs'
requires_grad (the backward op returns the gradient of a tensor score_mod
reads only for one that requires grad).

score_mod and mask_mod index the tensors they read as CPU does: an index
past a dim of size 1 (T5's relative position bias, batch size 1, read at
each batch index) raises CPU's IndexError. Only Inductor's CUDA kernel,
with its bounds asserts compiled out, reads element 0 there instead
(pytorch/pytorch#172225).

An error inside the backward op is raised when the backward pass ends: an
exception leaving a backward node on this device aborts the process
(torchtpu.errors.raise_after_backward).
"""
import importlib

import torch
from torch._C import DispatchKey

from . import control_flow
from .. import errors
from ..tensor import DEVICE, TpuTensor, on_device
from .after_import import when_imported

_HOP_MODULE = "torch._higher_order_ops.flex_attention"


def _patch_validation(module):
    torch_validate = module._validate_device

    def _validate_device(query, key, value):
        # q, k and v share a device (checked before); tpu, as CUDA, serves
        # forward and backward: nothing to refuse.
        if query.device.type != DEVICE.type:
            torch_validate(query, key, value)

    _validate_device.__doc__ = torch_validate.__doc__
    _validate_device.__wrapped__ = torch_validate
    module._validate_device = _validate_device

    def traced_by_dynamo(dynamo):
        # Dynamo skips torchtpu's code: it would break the graph of every
        # compiled flex_attention here (fullgraph=True fails), on any device.
        if module._validate_device is _validate_device:  # (not replaced since)
            module._validate_device = dynamo.dont_skip_tracing(_validate_device)
    when_imported("torch._dynamo", traced_by_dynamo)


def _backward_stand_ins(query, key, value, score_mod_other_buffers):
    """What the backward op returns after an error: zero gradients of the
    right shapes, so that the pass can end and raise the error."""
    return (torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value),
            tuple(torch.zeros_like(b) if isinstance(b, torch.Tensor) and b.requires_grad else None
                  for b in score_mod_other_buffers))


def _register_kernels(hop):
    @hop.flex_attention.py_impl(TpuTensor)
    def flex_attention_tpu(*args, **kwargs):
        return hop.sdpa_dense(*args, **kwargs)

    @hop.flex_attention_backward.py_impl(TpuTensor)
    def flex_attention_backward_tpu(query, key, value, *args, **kwargs):
        try:
            return hop.sdpa_dense_backward(query, key, value, *args, **kwargs)
        except Exception as e:
            if not errors.in_backward():
                raise
            errors.raise_after_backward(e)
            buffers = args[9] if len(args) > 9 else kwargs.get("score_mod_other_buffers", ())
            return _backward_stand_ins(query, key, value, buffers)

    @hop.flex_attention.py_impl(DispatchKey.AutocastPrivateUse1)
    def flex_attention_autocast_tpu(query, key, value, *args, **kwargs):
        from torch.amp.autocast_mode import _cast
        device = query.device.type
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (_cast(t, device, dtype) for t in (query, key, value))
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(DispatchKey.AutocastPrivateUse1)):
            return hop.flex_attention(query, key, value, *args, **kwargs)

    # As for CPU and CUDA, whose autocast keys every higher-order op passes by.
    hop.flex_attention_backward.fallthrough(DispatchKey.AutocastPrivateUse1)

    torch_create = hop.create_fw_bw_graph

    def create_fw_bw_graph(score_mod, index_values, other_buffers):
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode
        if not any(map(on_device, index_values)) or detect_fake_mode(index_values) is not None:
            return torch_create(score_mod, index_values, other_buffers)
        # Inside a fake tensor mode the gradient example PyTorch makes is fake
        # too; the graph is the same (the values are never read).
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = tuple(mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                          for v in index_values)
            try:
                return torch_create(score_mod, fakes, other_buffers)
            except TypeError as e:
                if isinstance(score_mod, torch.fx.GraphModule):
                    raise
                # Not traced by Dynamo (_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG):
                # a tensor the function captures stays a real tpu tensor,
                # which fake tensor ops refuse.
                raise NotImplementedError(
                    f"torchtpu: flex_attention's backward on {DEVICE.type} cannot trace a score_mod "
                    f"that reads a {DEVICE.type} tensor it captures when Dynamo does not trace it "
                    "(torch.nn.attention.flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is "
                    "set); unset it, or call flex_attention under torch.no_grad()") from e

    create_fw_bw_graph.__wrapped__ = torch_create
    hop.create_fw_bw_graph = create_fw_bw_graph


def _offer_to_transformers(import_utils):
    """transformers asks once, of the host's accelerator, whether
    flex_attention can run, and answers no where that accelerator is `tpu`
    (torch_xla's, whose tensors flex_attention refuses); torchtpu's tpu runs
    it. The answer is primed, once, as for a host without that accelerator;
    nothing else of transformers changes. A transformers without these
    names keeps its own answer."""
    available = getattr(import_utils, "is_torch_flex_attn_available", None)
    device_type = getattr(import_utils, "get_device_type", None)
    if device_type is None or not hasattr(available, "cache_clear"):
        return
    available.cache_clear()
    import_utils.get_device_type = lambda device=None: "cpu" if device is None else device_type(device)
    try:
        available()
    finally:
        import_utils.get_device_type = device_type


def install():
    when_imported("transformers.utils.import_utils", _offer_to_transformers)
    when_imported(_HOP_MODULE, _register_kernels)
    when_imported("torch.nn.attention.flex_attention", _patch_validation)
    # torch.compile(flex_attention) on tpu tensors: the `tpu` backend runs
    # the op's graph through these same kernels.
    control_flow.pass_aot_analyzer(lambda: (importlib.import_module(_HOP_MODULE).flex_attention,
                                            importlib.import_module(_HOP_MODULE).flex_attention_backward))
