"""TpuTensor: a handle to shared storage plus how this tensor views it.

A Storage holds one JAX array (or, in fused mode, a pending value with the
same .shape and .dtype) in the shape of the tensor that created it. Every
tensor that aliases it (views, detach, the base) holds the same Storage; a
write replaces Storage.array, so all of them see it.

A tensor's view is None when it *is* the storage array (same shape,
contiguous, offset 0), else a View (shape, stride, offset) in elements over
the flattened storage, or a DtypeView over its bytes read as another dtype.
read_view/write_view turn that into JAX code; they run at trace time, inside
the one jitted kernel of each op.
"""
import math
import re
import typing
import weakref

import jax.numpy as jnp
import torch
from jax import lax

from . import errors, runtime

# tpu:N for each device index (a tensor's device is its storage's).
DEVICES = [torch.device("tpu", i) for i in range(len(runtime.DEVICES))]
DEVICE = DEVICES[0]


class Pending:
    """A value a recorded (fused-mode) op will produce: shape and dtype now,
    the array at the next flush. owner is a weak reference to the Storage
    that holds it: the flush materializes only pending values still held."""
    __slots__ = ("shape", "dtype", "owner", "ref", "__weakref__")

    def __init__(self, shape, dtype, ref):
        self.shape = shape
        self.dtype = dtype
        self.ref = ref
        self.owner = None


class Lost:
    """The value of a storage whose op failed where the error could not be
    raised at once: in a fused graph run at a flush, or in a backward pass
    (which cannot stop mid-way on a PyTorch device; the error is raised when
    the pass ends). Using the tensor raises that error."""
    __slots__ = ("error", "shape", "dtype")

    def __init__(self, error, shape, dtype):
        self.error = error
        self.shape = shape
        self.dtype = dtype

    def exception(self):
        why = str(self.error).removeprefix("torchtpu: ")
        return RuntimeError("torchtpu: this tensor has no value: the op that computes it "
                            f"failed ({type(self.error).__name__}: {why})")

    def fail(self):
        raise self.exception()


# While torch.tpu.memory._record_memory_history() is on: each storage made
# since -> the user's line that made it (torch.tpu.memory_snapshot()).
CREATION_LINES = None

# name -> fn(storage), called after each storage is made (_made) or given a
# new array (_assigned), while any is set (watch_storages).
_made = {}
_assigned = {}


def watch_storages(name, made=None, assigned=None):
    """Call made(storage) after each Storage is made and assigned(storage)
    after each Storage.assign, under name (both None: stop). Storage takes
    an __init__ and an assign that call them only while some are set: the
    dispatcher makes a storage for every op, and a check there would cost
    every op."""
    for table, fn in ((_made, made), (_assigned, assigned)):
        table.pop(name, None)
        if fn is not None:
            table[name] = fn
    Storage.__init__ = Storage._init_watched if _made else Storage._init
    Storage.assign = Storage._assign_watched if _assigned else Storage._assign


def _note_line(storage):
    CREATION_LINES[storage] = errors.user_line()


def record_creation_lines(on):
    """Note, or stop noting, the user's line that makes each storage."""
    global CREATION_LINES
    if not on:
        CREATION_LINES = None
        watch_storages("lines")
    elif CREATION_LINES is None:
        CREATION_LINES = weakref.WeakKeyDictionary()
        watch_storages("lines", made=_note_line)


class Storage:
    """The shared data of a tensor and its views: a JAX array (a Pending or
    Lost value) on device tpu:`device`."""
    # marks: the unread index checks its value depends on (torchtpu.bounds).
    __slots__ = ("array", "device", "marks", "__weakref__")

    def _init(self, array, device=0):
        self.array = array
        self.device = device
        self.marks = None
        if type(array) is Pending:
            array.owner = weakref.ref(self)

    __init__ = _init

    def _init_watched(self, array, device=0):
        self._init(array, device)
        for fn in list(_made.values()):
            fn(self)

    def _assign(self, array):
        """Replace the data (a write through any view of this storage)."""
        self.array = array
        if type(array) is Pending:
            array.owner = weakref.ref(self)

    assign = _assign

    def _assign_watched(self, array):
        self._assign(array)
        for fn in list(_assigned.values()):
            fn(self)


class GrownStorage(Storage):
    """The storage of a tensor that grows along one axis, step by step (a
    key/value cache or the token ids extended by torch.cat in a loop). Its
    values are the first `extent` along `axis` of `grown`, a tpu tensor
    padded along that axis to a bucket (zeros past the extent), so each step
    compiles nothing new until the bucket fills (torchtpu.dispatch.growth).
    `array`, what every op that does not know about growth reads, is the
    exact array, cut from `grown` on first use by cut(storage, op) (the
    dispatcher's, which makes it); a write replaces it and ends the growth."""
    __slots__ = ("grown", "axis", "extent", "cut", "_exact")

    def __init__(self, grown, axis, extent, cut, exact=None):
        self.grown = grown
        self.axis = axis
        self.extent = extent
        self.cut = cut
        self.device = grown._storage.device
        self.marks = None
        self._exact = None
        if exact is not None:
            self._own(exact)

    def _own(self, array):
        self._exact = array
        if type(array) is Pending:
            array.owner = weakref.ref(self)

    @property
    def array(self):
        return self.read_by("a read")

    def read_by(self, op):
        """array, for op (its name) that reads it whole: the advisor names
        the op that made the cut."""
        if self._exact is None:
            self._own(self.cut(self, op))
        return self._exact

    @array.setter
    def array(self, value):
        if type(self._exact) is not Pending or type(value) is Pending:
            # A write. (A pending value replaced by its array is fused
            # mode's flush resolving it: no write.)
            self.grown = None
        self._own(value)

    def assign(self, array):
        self.array = array

def contiguous_strides(shape):
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def _is_contiguous(shape, stride):
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


class View(typing.NamedTuple):
    """The elements a tensor views of its storage, flattened."""
    shape: tuple
    stride: tuple
    offset: int


class DtypeView(typing.NamedTuple):
    """The storage's bytes read as another dtype (x.view(torch.uint8),
    view_as_real), then viewed as a View does (torch dtypes)."""
    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    storage_dtype: torch.dtype


class Window(typing.NamedTuple):
    """A View whose offset a kernel takes at run time (a dynamic scalar):
    one kernel serves every position (data[i:i + n] at a moving i)."""
    shape: tuple
    stride: tuple


def make_view(storage_shape, shape, stride, offset):
    """The view of a tensor over a storage array of storage_shape: None
    when it is the whole array, else a View."""
    shape, stride = tuple(shape), tuple(stride)
    if offset == 0 and shape == tuple(storage_shape) and _is_contiguous(shape, stride):
        return None
    return View(shape, stride, offset)



def grown_view(t):
    """t's view over its GrownStorage's exact array, as the same view over
    the padded array (padded along the storage's axis to its bucket):
    (Window, offset), or None when a view dim does
    not step along one storage axis within it (then the exact array is
    read). The offset varies from step to step (x[:, -1]), so kernels take
    it as a dynamic scalar. The storage's padded tensor must be alive."""
    view, shape, axis = t._view, t._key[1], t._storage.axis
    capacity = t._storage.grown.shape[axis]
    if type(view) is not View:
        return None  # a dtype view
    vshape, vstride, offset = view
    logical = contiguous_strides(shape)
    padded = list(shape)
    padded[axis] = capacity
    physical = contiguous_strides(padded)
    index, rest = [], offset
    for size, st in zip(shape, logical):
        index.append(rest // st if size else 0)
        rest = rest % st if size else rest
    used, strides = set(), []
    for size, st in zip(vshape, vstride):
        if size == 1 or st == 0:
            strides.append(0)
            continue
        for j, lst in enumerate(logical):
            if shape[j] > 1 and st % lst == 0 and st // lst < shape[j]:
                break
        else:
            return None
        step = st // lst
        if j in used or index[j] + (size - 1) * step >= shape[j]:
            return None
        used.add(j)
        strides.append(step * physical[j])
    return Window(tuple(vshape), tuple(strides)), sum(i * p for i, p in zip(index, physical))

def storage_dtype(t):
    """The dtype of t's storage array: t's, unless t views its bytes as
    another dtype (x.view(torch.uint8), view_as_real)."""
    return t.dtype if type(t._view) is not DtypeView else t._view.storage_dtype


def check_in_storage(shape, stride, offset, itemsize, nbytes):
    """CPU's error for a tensor whose elements (shape, stride, offset, in
    elements of itemsize bytes) reach past a storage of nbytes."""
    end = offset + sum((n - 1) * st for n, st in zip(shape, stride)) + 1
    if math.prod(shape) and end * itemsize > nbytes:
        raise RuntimeError(f"setStorage: sizes {list(shape)}, strides {list(stride)}, storage "
                           f"offset {offset}, and itemsize {itemsize} requiring a storage "
                           f"size of {end * itemsize} are out of bounds for storage of size {nbytes}")


def on_device(t):
    """Whether t is a tensor on the device: a TpuTensor, or what stands for
    one while torch.compile traces (a fake or functional tensor on tpu)."""
    return isinstance(t, torch.Tensor) and t.device.type == DEVICE.type


def whole_tensor(storage, shape, dtype, requires_grad=False, cls=None):
    """A tensor that is its whole storage array (same shape, no view); shape
    a tuple. A plain function: every op result is made here, and calling
    the class costs a quarter microsecond more."""
    index = storage.device
    r = _make_wrapper(cls or TpuTensor, shape, None, None, None, dtype, _STRIDED, DEVICES[index],
                      False, requires_grad)
    r._storage = storage
    r._view = None
    # What a kernel needs to know about this input (its cache key part).
    r._key = (dtype, shape, None, index)
    return r


def view_tensor(storage, shape, stride, offset, key, requires_grad=False, cls=None):
    """A tensor viewing storage with these shape, strides and offset; key is
    (dtype, storage shape, make_view(...), device index), which a view op
    caches."""
    r = _make_wrapper(cls or TpuTensor, shape, stride, offset, None, key[0], _STRIDED, DEVICES[key[3]],
                      False, requires_grad)
    r._storage = storage
    r._view = key[2]
    r._key = key
    return r


# Called with its arguments by position, (cls, size, strides, storage_offset,
# memory_format, dtype, layout, device, pin_memory, requires_grad): PyTorch
# parses keywords at about a quarter microsecond more per tensor made.
_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided

# The attributes that make a TpuTensor's handle on its data: not the user's
# Python attributes (which deepcopy, pickle and module conversion carry).
HANDLE = ("_storage", "_view", "_key")
# What a tpu parameter's __dict__ holds that is not the user's: the handle
# and nn.Parameter's mark.
_OWN_ATTRIBUTES = HANDLE + ("_is_param",)


def _tensor(cls, storage, shape, dtype, stride=None, offset=0, requires_grad=False):
    """TpuTensor(storage, shape, ...): a tensor viewing storage."""
    if stride is None:
        return whole_tensor(storage, tuple(shape), dtype, requires_grad, cls)
    storage_shape = storage.array.shape
    key = (dtype, storage_shape, make_view(storage_shape, shape, stride, offset), storage.device)
    return view_tensor(storage, shape, stride, offset, key, requires_grad, cls)


class TpuTensor(torch.Tensor):
    """A tensor on the tpu device. Its data lives in self._storage.

    Its handle (HANDLE: _storage, _view, _key) is in the instance __dict__,
    not in __slots__: a class with slots of its own cannot take the place of
    a Parameter's class, and torch.utils.swap_tensors, which keeps a
    Parameter the same object through `module.to("tpu")` as on CUDA, needs
    that (torchtpu.module_conversion)."""

    @staticmethod
    def __new__(cls, *args, **kwargs):
        """Two signatures, told apart by the first argument:

        - torchtpu's own, (storage, shape, dtype, stride=None, offset=0,
          requires_grad=False) with a Storage first: a tensor on it.
        - nn.Parameter's, (data=None, requires_grad=True): what
          nn.Parameter(data, requires_grad) gives. PyTorch keeps a wrapper
          subclass's class for nn.Parameter(t) (marking it _is_param), so a
          tpu parameter's type(p) is TpuTensor where a cuda one's is
          nn.Parameter, and code rebuilds parameters as
          type(p)(data, requires_grad=...): Accelerate's
          set_module_tensor_to_device (from_pretrained's device_map and
          offloading), init_on_device (as type(p)(data, **p.__dict__), whose
          handle entries are p's own and ignored here)."""
        if args and isinstance(args[0], Storage):
            return _tensor(cls, *args, **kwargs)
        for name in _OWN_ATTRIBUTES:
            kwargs.pop(name, None)
        return torch.nn.Parameter(*args, **kwargs)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value):
        # `x.data = y` swaps the C++ tensor's metadata only; take over y's
        # storage handle and view too, so x now aliases y as on CPU.
        torch._C.TensorBase.data.__set__(self, value)
        if isinstance(value, TpuTensor):
            self._storage, self._view, self._key = value._storage, value._view, value._key

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if len(types) > 1 and not all(issubclass(t, TpuTensor) for t in types):
            # Another wrapper subclass (the functional collectives'
            # AsyncCollectiveTensor) unwraps itself first, then calls again.
            return NotImplemented
        return _dispatch(func, args, kwargs or {})

    # __reduce_ex__ (torch.save and pickle), untyped_storage and data_ptr are
    # set by torchtpu.serialization, which reads values through the dispatcher.

    def __repr__(self, *, tensor_contents=None):
        # Print a CPU copy (one transfer, no device ops), then name the device
        # where PyTorch puts it: the first suffix after the data.
        text = torch._tensor_str._str(_download(self.detach(), "print"), tensor_contents=tensor_contents)
        device = f"device='{self.device}'"
        match = re.search(r",(\s+)(size=|dtype=)", text)
        if match:
            text = f"{text[:match.start()]}, {device},{match.group(1)}{text[match.start() + 1 + len(match.group(1)):]}"
        else:
            text = f"{text[:-1]}, {device})"
        if self.grad_fn is not None:
            text = f"{text[:-1]}, grad_fn=<{type(self.grad_fn).__name__}>)"
        elif self.requires_grad:
            text = f"{text[:-1]}, requires_grad=True)"
        return text

    def __format__(self, spec):
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def tolist(self):
        return self.cpu().tolist()

    def numpy(self, *, force=False):
        if not force:
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. "
                            "Use Tensor.cpu() to copy the tensor to host memory first.")
        return self.detach().cpu().numpy()

    def __dlpack__(self, *args, **kwargs):
        # Its data is an immutable JAX array that other tensors may share:
        # a consumer writing through a DLPack view would change them too.
        raise BufferError(f"a {self.device} tensor cannot be exported through DLPack: its data "
                          "is a JAX array; use Tensor.cpu() first")

    def __dlpack_device__(self):
        return self.__dlpack__()

    def record_stream(self, stream):
        """A no-op: JAX keeps a buffer alive until the work using it is done
        (CUDA's caching allocator needs to be told; this device does not)."""


def _dispatch(func, args, kwargs):
    raise RuntimeError("torchtpu.dispatch is not imported: import torchtpu")


_download = _dispatch


def set_dispatcher(fn, download):
    """The dispatcher (torchtpu.dispatch) registers itself: fn(func, args,
    kwargs) runs every aten op on a tpu tensor, and download(t, reason)
    reads one's values into a CPU tensor (printing names its reason)."""
    global _dispatch, _download
    _dispatch, _download = fn, download


def wrap(array, dtype=None, device=0):
    """A new tensor owning a fresh storage that holds array (on tpu:device)."""
    return TpuTensor(Storage(array, device), array.shape,
                     dtype if dtype is not None else runtime.torch_dtype(array.dtype))


# ---- views as JAX code (trace time) ---------------------------------------

def _dense_chain(shape, stride):
    """Dims (size>1, stride>0) ordered by decreasing stride, if each stride is a
    multiple of the next and the dims do not overlap; else None."""
    dims = sorted((d for d in range(len(shape)) if shape[d] > 1 and stride[d] > 0),
                  key=lambda d: -stride[d])
    for a, b in zip(dims, dims[1:]):
        if stride[a] % stride[b] or stride[a] < stride[b] * shape[b]:
            return None
    return dims


def _finish(core, dims, shape, stride):
    """core has dims `dims` in that order; put dims back in place and broadcast
    size-1 / stride-0 dims."""
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    core = jnp.transpose(core, order) if order != list(range(len(dims))) else core
    kept = sorted(dims)
    full = [shape[d] if d in kept else 1 for d in range(len(shape))]
    core = core.reshape(full)
    return jnp.broadcast_to(core, shape) if tuple(full) != tuple(shape) else core



def read_view_at(arr, view, offset):
    """read_view of a Window at an offset known only when the kernel runs
    (a dynamic scalar): a view of a grown storage, or one whose position
    moves from call to call (data[i:i + n])."""
    return _read_flat(arr.reshape(-1), view.shape, view.stride, offset)

def _flat_indices(shape, stride, offset):
    idx = jnp.asarray(offset, dtype=jnp.int64)
    for d, (size, st) in enumerate(zip(shape, stride)):
        ax = lax.broadcasted_iota(jnp.int64, shape, d)
        idx = idx + ax * st
    return jnp.broadcast_to(idx, shape)


def reinterpret(flat, dtype):
    """A 1-D array's bytes as a 1-D array of dtype (a jnp dtype): what
    PyTorch's dtype views (x.view(torch.uint8), view_as_real, view_as_complex)
    read of their storage."""
    dtype = jnp.dtype(dtype)
    if flat.dtype == dtype:
        return flat
    if jnp.iscomplexobj(flat):
        flat = jnp.stack([jnp.real(flat), jnp.imag(flat)], axis=-1).reshape(-1)
        if flat.dtype == dtype:
            return flat
    if jnp.issubdtype(dtype, jnp.complexfloating):
        pairs = reinterpret(flat, jnp.float32 if dtype == jnp.complex64 else jnp.float64).reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    if flat.dtype == jnp.bool_:
        flat = flat.astype(jnp.uint8)
    target = jnp.dtype(jnp.uint8) if dtype == jnp.bool_ else dtype
    have, want = flat.dtype.itemsize, target.itemsize
    if have > want:
        out = lax.bitcast_convert_type(flat, target).reshape(-1)
    elif have < want:
        out = lax.bitcast_convert_type(flat.reshape(-1, want // have), target)
    else:
        out = lax.bitcast_convert_type(flat, target)
    return out != 0 if dtype == jnp.bool_ else out


def reinterpret_as(flat, storage_dtype, dtype):
    """reinterpret for torch dtypes: complex32 is stored as complex64 whose
    parts are float16 values, and its bytes are those float16 pairs."""
    if storage_dtype == torch.complex32:
        flat = jnp.stack([jnp.real(flat), jnp.imag(flat)], axis=-1).reshape(-1).astype(jnp.float16)
    if dtype == torch.complex32:
        parts = reinterpret(flat, jnp.float16).reshape(-1, 2).astype(jnp.float32)
        return lax.complex(parts[:, 0], parts[:, 1])
    return reinterpret(flat, runtime.jax_dtype(dtype))


def read_view(arr, view):
    """The elements view (None, a View or a DtypeView) selects of a storage array."""
    if view is None:
        return arr
    flat = arr.reshape(-1)
    if type(view) is DtypeView:
        flat = reinterpret_as(flat, view.storage_dtype, view.dtype)
    return _read_flat(flat, view.shape, view.stride, view.offset)


def _read_flat(flat, shape, stride, offset):
    """The elements a (shape, stride, offset) view selects of a flat array;
    offset an int, or a traced scalar (the view is in bounds either way)."""
    n = math.prod(shape)
    if n == 0:
        return jnp.zeros(shape, flat.dtype)
    static = isinstance(offset, int)
    if _is_contiguous(shape, stride):
        if n == flat.shape[0]:
            return flat.reshape(shape)
        if static:
            return lax.slice(flat, (offset,), (offset + n,)).reshape(shape)
        return lax.dynamic_slice(flat, (offset,), (n,)).reshape(shape)
    dims = _dense_chain(shape, stride)
    if dims is None:
        return flat[_flat_indices(shape, stride, offset)]
    if not dims:
        return jnp.broadcast_to(flat[offset], shape)
    top = dims[0]
    if static:
        block = _block_of(flat, shape, stride, offset, dims)
        if block is not None:
            return _finish(block, dims, shape, stride)
    need = shape[top] * stride[top]
    # The window of whole rows of the top dim may reach past the storage's
    # end (x[:, :5] of the last rows): padded there.
    reach = offset + need - flat.shape[0] if static else need - _extent(shape, stride)
    if reach > 0:
        flat = jnp.pad(flat, (0, reach))
    window = (lax.slice(flat, (offset,), (offset + need,)) if static
              else lax.dynamic_slice(flat, (offset,), (need,)))
    dense = [shape[top]] + [stride[a] // stride[b] for a, b in zip(dims, dims[1:])] + [stride[dims[-1]]]
    window = window.reshape(dense)
    index = (slice(None),) + tuple(slice(0, shape[b]) for b in dims[1:]) + (0,)
    return _finish(window[index], dims, shape, stride)


def _block_of(flat, shape, stride, offset, dims):
    """The view as a block of the whole storage reshaped by the view's
    strides (dims: its dense chain), with the view's dims in `dims` order; or
    None where the view does not fit such a block (its rows wrap around).
    No window is cut and padded from the flat array: XLA sees one reshape of
    the storage and a slice, as for `qkv.view(b, t, 3, h, e)[:, :, 1]` written
    in JAX (on a TPU, each reshape through a flat array is a copy)."""
    strides = [stride[d] for d in dims]
    if len(flat) % strides[0]:
        return None
    sizes = [len(flat) // strides[0]] + [a // b for a, b in zip(strides, strides[1:])]
    if strides[-1] != 1:
        strides.append(1)
        sizes.append(stride[dims[-1]])
    starts, rest = [], offset
    for st in strides:
        starts.append(rest // st)
        rest %= st
    counts = [shape[d] for d in dims] + [1] * (len(strides) - len(dims))
    if any(s + n > size for s, n, size in zip(starts, counts, sizes)):
        return None
    block = lax.slice(flat.reshape(sizes), starts, [s + n for s, n in zip(starts, counts)])
    return block.reshape(counts[:len(dims)])


def _extent(shape, stride):
    """How many elements from its first a non-empty view reaches."""
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


def write_view(arr, view, value):
    """arr with the elements that view selects replaced by value."""
    if view is None:
        return jnp.broadcast_to(value.astype(arr.dtype), arr.shape)
    if type(view) is DtypeView:
        # Written as the view's dtype into the storage's bytes read so.
        flat = _write_flat(reinterpret_as(arr.reshape(-1), view.storage_dtype, view.dtype),
                           view[:3], value)
        return reinterpret_as(flat, view.dtype, view.storage_dtype).reshape(arr.shape)
    return _write_flat(arr.reshape(-1), view, value).reshape(arr.shape)


def write_view_at(arr, view, offset, value):
    """write_view of a Window at an offset known only when the kernel runs
    (buf[i:i + n] = x at a moving i)."""
    return _write_flat(arr.reshape(-1), (*view, offset), value).reshape(arr.shape)


def _write_flat(flat, view, value):
    shape, stride, offset = view
    value = jnp.broadcast_to(value.astype(flat.dtype), shape)
    n = math.prod(shape)
    if n == 0:
        return flat
    if _is_contiguous(shape, stride):
        if n == flat.shape[0]:
            return value.reshape(-1)
        return lax.dynamic_update_slice(flat, value.reshape(-1), (offset,))
    idx = _flat_indices(shape, stride, offset)
    return flat.at[idx.reshape(-1)].set(value.reshape(-1))
