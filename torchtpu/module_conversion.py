"""Module conversion (`.to()`, `.tpu()`, `.cpu()`, `to_empty()`) to or from
tpu keeps each Parameter the same object, as CUDA does.

Module._apply changes a parameter in place (`param.data = new`) only when
the new tensor has a compatible C++ tensor type; a tpu tensor is a Python
subclass on another backend, so PyTorch would give each module a new
Parameter (and one parameter shared by two modules would become two).
Instead the conversion swaps the converted tensor into the Parameter
object (torch.utils.swap_tensors: its class, C++ tensor and handle), so
`m.weight is w` still holds after `m.to("tpu")`, an optimizer built before
the move trains the moved parameters, and ties stay tied. Its Python
attributes, gradient hooks and `.grad` (moved too) are kept.

A parameter that cannot be swapped (a weak reference to it, or its C++
tensor held elsewhere, as by a live autograd graph) is replaced instead:
within one conversion each original becomes one new Parameter, put in
every module that held it, with the original's hooks. An optimizer still
holding such a replaced parameter would train nothing, so its step raises.
"""
import weakref

import torch
from torch import nn

from .dispatch.lengths import uploads_as_they_are
from .tensor import DEVICE, HANDLE, TpuTensor

_module_apply = nn.Module._apply
# Parameters some conversion replaced, while anything still holds them:
# id -> weak reference (a dict of ids: optimizers look each parameter up).
_replaced = {}


def _note_replaced(p):
    key = id(p)
    _replaced[key] = weakref.ref(p, lambda _, key=key: _replaced.pop(key, None))


class _ConvertOnce:
    """The conversion function of one `_apply` call, tree-wide: a parameter
    met again (in another module) is not converted again, and records which
    new Parameter each converted parameter became."""
    __slots__ = ("fn", "converted", "replaced")

    def __init__(self, fn):
        self.fn = fn
        # id(original parameter) -> (original, its conversion); the original
        # is held so that its id is not reused during the call.
        self.converted = {}
        self.replaced = {}  # id(original parameter) -> its one new Parameter

    def __call__(self, t):
        # A module's tensors, moved one by one, differ in shape, not length:
        # none is padded as a batch whose length varies.
        with uploads_as_they_are():
            return self._convert(t)

    def _convert(self, t):
        if not isinstance(t, nn.Parameter):
            return self.fn(t)
        seen = self.converted.get(id(t))
        if seen is not None:
            return seen[1]
        out = self.fn(t)
        if (isinstance(t, TpuTensor) or isinstance(out, TpuTensor)) and out is not t:
            if _swap_in(t, out, self.fn):
                out = t
            self.converted[id(t)] = (t, out)
        return out


def _swap_in(param, new, fn):
    """Make Parameter `param` the converted tensor `new` in place; False
    (nothing changed) when it cannot be swapped."""
    if type(param) is not TpuTensor and type(param) is not nn.Parameter:
        return False  # a Parameter subclass of another layout
    attrs = {k: v for k, v in param.__dict__.items() if k not in HANDLE and k != "_is_param"}
    hooks, post_hooks = param._backward_hooks, param._post_accumulate_grad_hooks
    grad = param.grad
    param.grad = None  # the grad's reference would block the swap
    new = nn.Parameter(new, requires_grad=param.requires_grad)
    new.__dict__.update(attrs)
    try:
        torch.utils.swap_tensors(param, new)
    except RuntimeError:
        param.grad = grad
        return False
    param._backward_hooks, param._post_accumulate_grad_hooks = hooks, post_hooks
    if grad is not None:
        param.grad = fn(grad)
    return True


def _apply(self, fn, recurse=True):
    if isinstance(fn, _ConvertOnce):
        return _apply_tree(self, fn, recurse)
    convert = _ConvertOnce(fn)
    if not (torch.__future__.get_swap_module_params_on_conversion() and _to_or_from_tpu(self, convert)):
        return _apply_tree(self, convert, recurse)
    # Swapping cannot turn a parameter into a tpu tensor or back (their
    # classes' slots differ): such a conversion replaces parameters instead.
    torch.__future__.set_swap_module_params_on_conversion(False)
    try:
        return _apply_tree(self, convert, recurse)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(True)


def _to_or_from_tpu(module, convert):
    """Whether the conversion takes the module's first parameter to or from
    tpu (converting it once, for the call to reuse)."""
    p = next(module.parameters(), None)
    if p is None:
        return False
    with torch.no_grad():
        convert(p)
    return id(p) in convert.converted


def _apply_tree(self, convert, recurse):
    before = list(self._parameters.items())
    result = _module_apply(self, convert, recurse)
    for key, old in before:
        new = self._parameters.get(key)
        if old is None or new is old or id(old) not in convert.converted:
            continue
        # The first module to hold this parameter made its new Parameter;
        # every later holder takes that one.
        first = convert.replaced.get(id(old))
        if first is None:
            convert.replaced[id(old)] = new
            _carry_hooks(old, new)
            _note_replaced(old)
        elif first is not new:
            self._parameters[key] = first
    return result


def _carry_hooks(old, new):
    """Gradient hooks registered on the parameter run on its replacement, as
    on CUDA, where the parameter itself is kept (their handles still remove
    them: they hold the same dicts)."""
    if old._backward_hooks:
        new._backward_hooks = old._backward_hooks
    if old._post_accumulate_grad_hooks:
        new._post_accumulate_grad_hooks = old._post_accumulate_grad_hooks


def _refuse_replaced_parameters(optimizer, args, kwargs):
    """A global optimizer step pre-hook: a step over parameters a module
    conversion replaced would train nothing, silently."""
    if not _replaced:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            held = _replaced.get(id(p))
            if held is not None and held() is p:
                raise RuntimeError(
                    f"torchtpu: {type(optimizer).__name__} holds parameters that a module's .to() "
                    f"replaced (moving a module to or from {DEVICE.type} makes new Parameter "
                    f"objects: a {DEVICE.type} tensor is another Python class), so its step would "
                    "train nothing; build the optimizer after moving the model")


_tensor_data = torch._C.TensorBase.data


def _set_parameter_data(self, value):
    """`param.data = t`, t on tpu and param not (FSDP's move to its
    device_id): set_data would refuse the other tensor class, where CUDA
    moves the Parameter in place. t's values are swapped into the Parameter
    object instead, as by .to(); it then aliases t, as set_data makes it."""
    if isinstance(value, TpuTensor) and not isinstance(self, TpuTensor):
        if not _swap_in(self, value.detach(), lambda g: g.to(value.device)):
            raise RuntimeError(
                f"torchtpu: `param.data = t` cannot move this {self.device.type} Parameter to "
                f"{DEVICE.type} in place: something holds it (a weak reference, or an autograd "
                f"graph alive); move its module with .to(\"{DEVICE.type}\") instead")
        return
    _tensor_data.__set__(self, value)


def install():
    nn.Module._apply = _apply
    nn.Parameter.data = property(_tensor_data.__get__, _set_parameter_data)
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    register_optimizer_step_pre_hook(_refuse_replaced_parameters)


__all__ = ["install"]
