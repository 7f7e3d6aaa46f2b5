"""Kernel keys: each argument of an op call as a record, part of the key
its kernel is cached under. A tpu tensor is its storage's slot in the call
and its own key (dtype, shape, view, device); a dynamic scalar is fed at run
time and keyed by its type; anything else is keyed by its value.

Records compare and hash as tuples (a key hashes in C). Two kinds never make
one key: they differ in length, or (TensorArg and FedArg) in their view's
type, since a Window is never None, a View or a DtypeView."""
import itertools
import typing

import torch

from .. import errors, properties
from ..tensor import DEVICES, GrownStorage, TpuTensor, View, Window, grown_view
from .host import to_tpu
from .plans import _DYNAMIC_SCALAR_TYPES, _INDICES, _SCALARS

# A record from a tuple, without NamedTuple's Python-level __new__: the
# dispatcher makes one for every tensor argument of every op.
record = tuple.__new__


class TensorArg(typing.NamedTuple):
    """A tpu tensor, read through its view. A call's key holds it as a plain
    tuple of these fields until the call compiles (named)."""
    slot: int           # its storage's index among the call's storages
    dtype: torch.dtype
    shape: tuple
    view: object        # None (the whole storage), a View or a DtypeView
    device: int

    def differences(self, other):
        return _differences(self, other)


class FedArg(typing.NamedTuple):
    """A tensor viewing its storage at an offset the kernel takes at run
    time (a dynamic scalar): one kernel serves every offset (data[i:i + n]
    at a moving i; a view of a grown storage, read from its padded array)."""
    slot: int
    dtype: torch.dtype
    shape: tuple        # the tensor's; a grown storage's padded shape
    window: Window
    device: int

    def differences(self, other):
        return _differences(self, other)


class ScalarArg(typing.NamedTuple):
    """A dynamic scalar, fed at run time."""
    type: type

    def differences(self, other):
        return _differences(self, other)


class ListArg(typing.NamedTuple):
    """A list holding tensors (a foreach op's, an index list): its items'
    records."""
    items: tuple

    def differences(self, other):
        return _differences(self, other)


class Const(typing.NamedTuple):
    """A static value, which the kernel's code depends on. Its type is keyed
    too: 4, 4.0 and True are equal, but arange(4) is int64, arange(4.0)
    float32."""
    value: object
    type: type

    def differences(self, other):
        return _differences(self, other)


_TENSORS = (TensorArg, FedArg)


def whole_shape(specs):
    """The shape of the first argument that is a whole tensor, or None (the
    advisor's churn hint)."""
    return next((s.shape for s in specs if type(s) is TensorArg and s.view is None), None)


class Call:
    """One op call split into what keys its kernel and what feeds it: the
    storages (and their arrays, in slot order) and the dynamic scalars."""
    __slots__ = ("storages", "arrays", "slots", "dynamic", "args", "reads_grown")

    def __init__(self, storages, arrays, slots, dynamic, args, reads_grown=False):
        self.storages = storages
        self.arrays = arrays
        self.slots = slots  # storage -> slot (Storage hashes by identity)
        self.dynamic = dynamic  # the dynamic scalars, in order
        self.args = args  # (args, kwargs) of the op
        # Whether views of grown storages may be read from their padded
        # arrays (not for an op that writes: it writes the exact array).
        self.reads_grown = reads_grown

    def device(self):
        """Where a CPU scalar argument goes (see first_device)."""
        return first_device(*self.args)

    def slot(self, storage):
        """storage's slot in this call, added if new."""
        slot = self.slots.get(storage)
        if slot is None:
            slot = self.slots[storage] = len(self.storages)
            self.storages.append(storage)
            self.arrays.append(storage.array)
        return slot


def first_device(args, kwargs):
    """The device index of an op's first tpu tensor argument, else the
    current device's."""
    for a in itertools.chain(args, kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if type(t) is TpuTensor:
                return t._storage.device
    return properties.current_index()


def _tensor_spec(call, t):
    """A tpu tensor's record in this call."""
    storage = t._storage
    if type(storage) is GrownStorage and t._view is not None and call.reads_grown:
        spec = _grown_spec(call, t)
        if spec is not None:
            return spec
    # (call.slot, inline: a foreach op's lists bring dozens of tensors.)
    slot = call.slots.get(storage)
    if slot is None:
        slot = call.slots[storage] = len(call.storages)
        call.storages.append(storage)
        call.arrays.append(storage.array)
    return (slot,) + t._key  # a TensorArg's fields (see named)


def _tensor_list_specs(call, tensors):
    """The records of a foreach op's list of tpu tensors (dozens, each
    _tensor_spec's common case inline); None if one is not a tpu tensor (the
    slots already given to those before it are the ones arg_spec gives)."""
    slots, storages, arrays = call.slots, call.storages, call.arrays
    specs = []
    for t in tensors:
        if type(t) is not TpuTensor:
            return None
        storage = t._storage
        if type(storage) is GrownStorage:
            specs.append(_tensor_spec(call, t))
            continue
        slot = slots.get(storage)
        if slot is None:
            slot = slots[storage] = len(storages)
            storages.append(storage)
            arrays.append(storage.array)
        specs.append((slot,) + t._key)
    return tuple(specs)


def named(spec):
    """spec with each plain tuple in it made the TensorArg it stands for. A
    tpu tensor's record is made as a plain tuple, its fields, on every op;
    the two compare and hash alike, so a key of plain tuples finds the entry
    stored under the records, and only a call that compiles names them."""
    kind = type(spec)
    if kind is tuple:
        return record(TensorArg, spec)
    if kind is ListArg:
        return record(ListArg, (tuple([named(s) for s in spec.items]),))
    return spec


def grown_readable(t):
    """Whether a view t of a grown storage can be read from the padded array
    at a run-time offset."""
    return t._storage.grown is not None and grown_view(t) is not None


def _grown_spec(call, t):
    """A view of a grown storage, read from its padded array at an offset
    fed at run time, so each step of the growth reuses one kernel."""
    grown = t._storage.grown
    if grown is None:
        return None
    found = grown_view(t)
    if found is None:
        return None
    window, offset = found
    slot = call.slot(grown._storage)
    call.dynamic.append(offset)
    return record(FedArg, (slot, t._key[0], tuple(grown.shape), window, t._key[3]))


# One ScalarArg per type, made once (an optimizer's foreach ops take a
# learning rate or a step size at each call).
SCALAR_ARGS = {kind: ScalarArg(kind) for kind in _DYNAMIC_SCALAR_TYPES}
# The types whose values arg_spec keys as themselves (a Const), or, in a
# dynamic scalar's place, feeds at run time: the dispatcher records these
# without a Call (plain_spec), as most of an op's non-tensor arguments are.
PLAIN_TYPES = frozenset({type(None), bool, int, float, complex, str, torch.dtype,
                         torch.memory_format, torch.layout})


def plain_spec(value, kind, tensorish, dynamic):
    """arg_spec of a value whose type, kind, is in PLAIN_TYPES; a dynamic
    scalar goes onto the list dynamic."""
    if tensorish and kind in _DYNAMIC_SCALAR_TYPES:
        dynamic.append(value)
        return SCALAR_ARGS[kind]
    return record(Const, (value, kind))


def arg_spec(call, value, tensorish):
    """The record of one argument (part of the kernel key)."""
    if isinstance(value, TpuTensor):
        return _tensor_spec(call, value)
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and (value.dim() == 0 or tensorish is _INDICES):
            return arg_spec(call, to_tpu(value, device=call.device()), tensorish)
        raise device_mismatch(call.device(), value.device)
    if isinstance(value, (list, tuple)):
        if value and type(value[0]) is TpuTensor:
            specs = _tensor_list_specs(call, value)
            if specs is not None:
                return record(ListArg, (specs,))
        if value and any(isinstance(v, torch.Tensor) for v in value):
            inner = _INDICES if tensorish is _INDICES else True
            return record(ListArg, (tuple(arg_spec(call, v, inner) for v in value),))
        if tensorish is _SCALARS:
            return record(ListArg, (tuple(arg_spec(call, v, True) for v in value),))
        return record(Const, (tuple(value), tuple))
    if tensorish and type(value) in _DYNAMIC_SCALAR_TYPES:
        call.dynamic.append(value)
        return SCALAR_ARGS[type(value)]
    if type(value) is torch.device and value.type == "tpu":
        if value.index is None:
            # "tpu": the current device, which the key must name.
            return record(Const, (DEVICES[properties.current_index()], torch.device))
        properties.check_index(value.index)
    return record(Const, (value, type(value)))


def device_mismatch(index, other):
    """CUDA's error for an op given tensors of two devices."""
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two "
        f"devices, {DEVICES[index]} and {other}!")


def kernel_device(pos_specs, kw_specs):
    """The index of the device a call runs on: its tpu tensors' (which must
    agree, as CUDA requires), else its device= argument's, else the current
    device."""
    found = None
    stack = list(pos_specs) + [s for _, s in kw_specs]
    while stack:
        s = stack.pop()
        kind = type(s)
        if kind is TensorArg or kind is FedArg:
            if found is None:
                found = s.device
            elif s.device != found:
                raise device_mismatch(min(found, s.device), DEVICES[max(found, s.device)])
        elif kind is ListArg:
            stack.extend(s.items)
        elif found is None and kind is Const and type(s.value) is torch.device and s.value.type == "tpu":
            found = s.value.index
    return properties.current_index() if found is None else found


def offsets_fed(pos_specs, kw_specs, dynamic):
    """Offsets as data: the records with each tensor argument that views its
    storage at some offset made a FedArg (as a grown storage's views are),
    and the dynamic scalars with those offsets in their places; None when no
    argument is such a view. A kernel of these records serves the op at
    every position of its views (data[i:i + n] at a moving i) with one
    compilation."""
    old, new = iter(dynamic), []

    def fed(s):
        kind = type(s)
        if kind is TensorArg:
            view = s.view
            if type(view) is not View:
                return s  # the whole storage, or a dtype view
            new.append(view.offset)
            window = record(Window, (view.shape, view.stride))
            return record(FedArg, (s.slot, s.dtype, s.shape, window, s.device))
        if kind is FedArg or kind is ScalarArg:
            new.append(next(old))
        elif kind is ListArg:
            return record(ListArg, (tuple([fed(x) for x in s.items]),))
        return s

    pos = tuple([fed(s) for s in pos_specs])
    kw = tuple([(k, fed(s)) for k, s in kw_specs])
    if len(new) == len(dynamic):
        return None
    return pos, kw, new


# ---- view ops' keys (their results' layouts, cached per op) ----------------

def view_args_key(args):
    """hashable(args[1:]) of a view op, its common arguments (dims, a list
    of sizes) looked at without recursion: this runs for every view."""
    rest = args[1:]
    key = []
    for v in rest:
        kind = type(v)
        if kind is int:
            key.append(v)
        elif kind is list or kind is tuple:
            for x in v:
                if type(x) is not int:
                    return hashable(rest)
            key.append(tuple(v))
        else:
            return hashable(rest)
    return tuple(key)


def hashable(x):
    if isinstance(x, (list, tuple)):
        # Sizes and dims are ints: only containers and tensors need a look.
        return tuple([hashable(v) if isinstance(v, (list, tuple, torch.Tensor)) else v for v in x])
    if isinstance(x, torch.Tensor):
        raise TypeError("tensor in a view op's static arguments")
    return x


# ---- what differs between two keys (the recompile log) ---------------------

def _tensor_facts(s):
    """(dtype, shape, layout) of a tensor record."""
    view = s.view if type(s) is TensorArg else s.window
    if view is None:
        return s.dtype, list(s.shape), "contiguous"
    offset = getattr(view, "offset", None)  # (a Window's is fed at run time)
    layout = f"strides {list(view.stride)}" + (f" offset {offset}" if offset is not None else "")
    return s.dtype, list(view.shape), layout


def _differences(x, y):
    """Phrases naming what differs between two argument records."""
    if x == y:
        return []
    if type(x) in _TENSORS and type(y) in _TENSORS:
        (dx, sx, lx), (dy, sy, ly) = _tensor_facts(x), _tensor_facts(y)
        out = []
        if dx != dy:
            out.append(f"dtype {errors._short_dtype(dx)} -> {errors._short_dtype(dy)}")
        if sx != sy:
            out.append(f"shape {sx} -> {sy}")
        elif lx != ly:
            out.append(f"layout {lx} -> {ly}")
        if x.device != y.device:
            out.append(f"device tpu:{x.device} -> tpu:{y.device}")
        return out or ["its storage's shape"]
    if type(x) is ListArg and type(y) is ListArg:
        if len(x.items) != len(y.items):
            return [f"a list of {len(x.items)} -> {len(y.items)}"]
        return [f"item {j}: {d}" for j, (a, b) in enumerate(zip(x.items, y.items))
                for d in _differences(a, b)]
    if type(x) is Const and type(y) is Const:
        return [f"static value {x.value!r} -> {y.value!r}"]
    return [f"{_noun(x)} -> {_noun(y)}"]


def _noun(s):
    if type(s) in _TENSORS:
        return "a tensor"
    if type(s) is ListArg:
        return "a list"
    if type(s) is ScalarArg:
        return "a scalar"
    return f"the static value {s.value!r}"
