"""Saving and loading tpu tensors as PyTorch saves device tensors.

torch.save writes a CUDA tensor as `_rebuild_tensor_v2(storage, offset, size,
stride, requires_grad, ...)` with its storage's bytes tagged "cuda:0", and
torch.load restores the storage on the location (after map_location) and
views it. tpu tensors are written the same way, tagged "tpu:N": views of one
storage stay views of one storage, weights_only=True loads them with
PyTorch's own allowlist, and map_location moves them as it moves CUDA ones.

A tpu tensor's data is a JAX array, not a C++ storage, so two UntypedStorage
subclasses stand in for one:
- TpuStorage, what `t.untyped_storage()` returns: the face of a live
  storage (nbytes, a stable device address for `data_ptr()`, `.cpu()`
  downloads it, `resize_(0)` frees it and `resize_(nbytes)` gives it back
  zeroed, as FSDP2 does with unsharded parameters), which torch.save writes
  and safetensors and Hugging Face use to find tensors that share memory;
- LoadedStorage: a checkpoint's bytes restored for the tpu device, which
  `set_` (the rebuild's way of viewing a storage) uploads once per dtype.
"""
import collections
import copy
import importlib.util
import io
import math
import re
import weakref
from multiprocessing.reduction import ForkingPickler

import jax
import jax.numpy as jnp
import torch

from . import dispatch, properties, runtime
from .tensor import (DEVICE, DEVICES, HANDLE, Lost, Pending, Storage, TpuTensor, check_in_storage,
                     contiguous_strides, storage_dtype, view_tensor, whole_tensor)

from .compat import aten

# Between CPU's location tag (10) and CUDA's (20): ahead of PyTorch's generic
# one for the renamed PrivateUse1 device (23), whose restore would allocate
# a storage on a device that has no C++ allocator.
_PACKAGE_PRIORITY = 15
_LOCATION = re.compile(r"^tpu(:(\d+))?$")


class _OnTpu(torch.UntypedStorage):
    """An UntypedStorage that says it lives on the tpu device; it stands for
    data held elsewhere, so its own (C++) storage is empty."""

    _index = 0  # the device index of the data it stands for

    @property
    def device(self):
        return DEVICES[self._index]

    def _refuse(self, *args, **kwargs):
        raise RuntimeError("torchtpu: a tpu storage has no host memory; read or write "
                           "it through a tensor (torch.empty(0, device='tpu').set_(storage))")

    # Its C++ storage is empty: nothing may read or write that (PyTorch's
    # own clone, for one, would allocate a tpu storage in C++ and crash).
    # What reads values goes through cpu(); what writes bytes is refused.
    (__setitem__, copy_, fill_, resize_, byteswap, _byteswap, _share_cuda_, _share_fd_cpu_,
     _share_filename_cpu_, _get_shared_fd, _get_filename, _shared_incref, _shared_decref,
     _swap_data_ptr_, _resize_with_addr_, _set_from_file) = (_refuse,) * 16

    def __getitem__(self, index):
        if not isinstance(index, int):
            raise RuntimeError("torchtpu: a tpu storage cannot be sliced; slice a tensor over "
                               "it (torch.empty(0, device='tpu', dtype=torch.uint8).set_(storage))")
        return self.cpu()[index]

    def tolist(self):
        return self.cpu().tolist()

    def __iter__(self):
        return iter(self.tolist())

    def is_pinned(self, device=None):
        return False

    def pin_memory(self, device=None):
        raise TypeError(f"cannot pin '{torch.typename(self)}' only CPU memory can be pinned")

    def to(self, *, device, non_blocking=False):
        device = torch.device(device)
        if device.type == "cpu":
            return self.cpu()
        if device == self.device or (device.type == self.device.type and device.index is None
                                     and self._index == 0):
            return self
        raise RuntimeError(f"torchtpu: a tpu storage moves only to the CPU; move a tensor "
                           f"over it to {device} instead")

    def __deepcopy__(self, memo):
        found = memo.get(id(self))
        if found is None:
            found = memo[id(self)] = self.clone()
            memo.setdefault(id(memo), []).append(self)
        return found

    def __copy__(self):
        return self.clone()

    def __reduce__(self):
        # As UntypedStorage pickles itself (a legacy torch.save), through a
        # TypedStorage: torch.save knows storage subclasses only inside one.
        buffer = io.BytesIO()
        typed = torch.storage.TypedStorage(wrap_storage=self, dtype=torch.uint8, _internal=True)
        torch.save(typed, buffer, _use_new_zipfile_serialization=False)
        return _untyped_from_bytes, (buffer.getvalue(),)


def _untyped_from_bytes(data):
    return torch.load(io.BytesIO(data), weights_only=False)._untyped_storage


# The value of a storage resized to 0 bytes: what reading it raises.
_FREED = RuntimeError("its storage was freed (untyped_storage().resize_(0)) and not "
                      "resized back")


def _is_freed(storage):
    return type(storage.array) is Lost and storage.array.error is _FREED


# Device addresses for data_ptr(): one range per storage, never reused, so
# equal addresses mean shared memory, as they do for CUDA tensors.
_next_address = 1 << 44
_addresses = weakref.WeakKeyDictionary()  # tpu Storage -> its address


class TpuStorage(_OnTpu):
    """The storage of tpu tensors (all views of one tpu Storage, whose data
    it keeps alive, as a CUDA storage does); reading it downloads the
    array."""

    @classmethod
    def of(cls, storage, dtype):
        global _next_address
        self = cls(0)
        self._storage = storage
        self._index = storage.device
        self._dtype = dtype
        self._nbytes = math.prod(storage.array.shape) * dtype.itemsize
        self._address = _addresses.get(storage)
        if self._address is None:
            self._address = _addresses[storage] = _next_address
            _next_address += -(-max(self._nbytes, 1) // 4096) * 4096
        return self

    def tpu_storage(self):
        return self._storage

    def nbytes(self):
        return 0 if _is_freed(self._storage) else self._nbytes

    def size(self):
        return self.nbytes()

    def __len__(self):
        return self.nbytes()

    def resize_(self, nbytes):
        """Free the data (0 bytes) or give it back, zeroed (its full size), as
        FSDP2 frees and reallocates its unsharded parameters; reading a tensor
        of a freed storage raises."""
        storage = self.tpu_storage()
        if nbytes == 0:
            if not _is_freed(storage):
                old = storage.array
                storage.assign(Lost(_FREED, old.shape, old.dtype))
        elif nbytes == self._nbytes:
            if _is_freed(storage):
                old = storage.array
                storage.assign(jax.device_put(jnp.zeros(old.shape, old.dtype),
                                              runtime.DEVICES[storage.device]))
        else:
            raise RuntimeError(f"torchtpu: a tpu storage resizes only to 0 bytes (freed) or "
                               f"back to its {self._nbytes} bytes, not {nbytes}")
        return self

    def data_ptr(self):
        return self._address

    def clone(self):
        """A storage of its own with the same bytes (it holds the copy)."""
        return _face(_copied(self._storage, self._dtype), self._dtype)

    def cpu(self):
        """A CPU copy of the bytes (a sync point: torch.save writes this)."""
        storage = self.tpu_storage()
        whole = TpuTensor(storage, storage.array.shape, self._dtype)
        return dispatch.download(whole, "cpu").untyped_storage()

    def _write_file(self, *args):
        # The legacy format (and so pickle) writes the C++ bytes.
        return self.cpu()._write_file(*args)

    def __repr__(self):
        return f"torchtpu storage of {self._nbytes} bytes on {self.device}"


class LoadedStorage(_OnTpu):
    """A checkpoint's storage (its host bytes, not copied) restored for the
    tpu device; the tensors rebuilt over it share the tpu Storage each
    dtype's upload makes."""

    @classmethod
    def of(cls, host, index):
        self = cls(0)
        self._host = host
        self._index = index
        return self

    def nbytes(self):
        return self._host.nbytes()

    def size(self):
        return self._host.nbytes()

    def __len__(self):
        return self._host.nbytes()

    def data_ptr(self):
        return self._host.data_ptr()

    def cpu(self):
        return self._host

    def clone(self):
        return LoadedStorage.of(self._host.clone(), self._index)

    def _write_file(self, *args):
        return self._host._write_file(*args)

    def _array(self, dtype, shape):
        return runtime.to_device(torch.empty(0, dtype=dtype).set_(
            self._host, 0, shape, contiguous_strides(shape)), runtime.DEVICES[self._index])

    def upload(self, dtype, shape=None):
        """The tpu Storage of these bytes read as dtype; shape: that of the
        first tensor rebuilt over them, if it covers them all (then it is
        its whole storage array, not a view, as a tensor made on tpu is, and
        its kernels are those of such a tensor), else flat."""
        uploads = self.__dict__.setdefault("_uploads", {})
        storage = uploads.get(dtype)
        if storage is None:
            numel = self.nbytes() // dtype.itemsize
            if shape is None or math.prod(shape) != numel:
                shape = (numel,)
            storage = uploads[dtype] = Storage(self._array(dtype, shape), self._index)
        return storage

    def _set_from_file(self, *args):
        # The legacy format reads a storage's bytes after the tensors over
        # it are rebuilt (a CUDA storage takes them in place): upload again.
        result = self._host._set_from_file(*args)
        for dtype, storage in self.__dict__.get("_uploads", {}).items():
            storage.assign(self._array(dtype, storage.array.shape))
        return result


# tpu Storage -> a weak reference to its TpuStorage (which holds it).
_faces = weakref.WeakKeyDictionary()


def _face(storage, dtype):
    """The TpuStorage of a tpu Storage: one while anything holds it."""
    ref = _faces.get(storage)
    face = ref() if ref is not None else None
    if face is None:
        face = TpuStorage.of(storage, dtype)
        _faces[storage] = weakref.ref(face)
    return face


def untyped_storage(t):
    """t.untyped_storage() of a tpu tensor."""
    return _face(t._storage, storage_dtype(t))


def data_ptr(t):
    """The device address of t's first element."""
    return untyped_storage(t).data_ptr() + t.storage_offset() * t.element_size()


def reduce_tensor(t):
    """TpuTensor.__reduce_ex__: what torch.save and pickle write."""
    from torch.utils.hooks import warn_if_has_hooks
    warn_if_has_hooks(t)
    state = {k: v for k, v in t.__dict__.items() if k not in HANDLE}
    if state.pop("_is_param", False):
        # A Parameter, as Parameter.__reduce_ex__ writes one.
        data = t.detach()
        if state:
            return (torch._utils._rebuild_parameter_with_state,
                    (data, t.requires_grad, collections.OrderedDict(), state))
        return torch._utils._rebuild_parameter, (data, t.requires_grad, collections.OrderedDict())
    storage = torch.storage.TypedStorage(wrap_storage=untyped_storage(t), dtype=t.dtype,
                                         _internal=True)
    args = (storage, t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad,
            collections.OrderedDict())
    metadata = torch._utils.get_tensor_metadata(t)
    if metadata:
        args = args + (metadata,)
    if state:
        # Python attributes on a plain tpu tensor: loading needs TpuTensor
        # allowlisted under weights_only, as any tensor subclass does.
        return torch._tensor._rebuild_from_type_v2, (torch._utils._rebuild_tensor_v2, TpuTensor,
                                                     args, state)
    return torch._utils._rebuild_tensor_v2, args


def _copied(source, dtype):
    """A new tpu Storage with source's values (dtype: the storage's). A JAX
    array is immutable and a write replaces a storage's array, so the copy
    holds the same array: no device work."""
    array = source.array
    if type(array) is not Pending:
        return Storage(array, source.device)
    # A value fused mode has yet to compute: only its own storage receives
    # it, so the copy is a recorded clone of it.
    with torch.no_grad():
        return dispatch.dispatch(aten.clone.default, (TpuTensor(source, array.shape, dtype),),
                                 {})._storage


def deepcopy_tensor(t, memo):
    """TpuTensor.__deepcopy__, as CPU's: a leaf's copy with its own storage,
    shared by the copies of its views within one deepcopy (memo), and its
    grad and Python attributes copied too; a Parameter as Parameter's own. (PyTorch's
    own path would clone the C++ storage, which a tpu tensor does not have.)"""
    if not t.is_leaf:
        raise RuntimeError(
            "Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
            "protocol at the moment.  If you were attempting to deepcopy a module, this may be "
            "because of a torch.nn.utils.weight_norm usage, see "
            "https://github.com/pytorch/pytorch/pull/103001")
    found = memo.get(id(t))
    if found is not None:
        return found
    if t.__dict__.get("_is_param"):
        # As Parameter.__deepcopy__: a new Parameter over a copy of the data,
        # without the grad or Python attributes, sharing with nothing.
        if t._view is None:
            data = whole_tensor(_copied(t._storage, t.dtype), tuple(t.shape), t.dtype)
        else:
            with torch.no_grad():
                data = t.detach().clone(memory_format=torch.preserve_format)
        new = memo[id(t)] = torch.nn.Parameter(data, t.requires_grad)
        return new
    source = t._storage
    storage = memo.get(id(source))
    if storage is None:
        storage = memo[id(source)] = _copied(source, storage_dtype(t))
        memo.setdefault(id(memo), []).append(source)  # keeps the id from being reused
    new = view_tensor(storage, tuple(t.shape), t.stride(), t.storage_offset(), t._key,
                      requires_grad=t.requires_grad)
    with torch.no_grad():
        if t.is_conj():
            new = new.conj_physical()
        if t.is_neg():
            new = new.neg()
        if t.grad is not None:
            new.grad = deepcopy_tensor(t.grad, memo)
    new.__dict__.update(copy.deepcopy({k: v for k, v in t.__dict__.items() if k not in HANDLE}, memo))
    memo[id(t)] = new
    return new


def _set_storage(t, source, storage_offset=0, size=None, stride=None):
    """aten.set_ of a tpu tensor onto a storage: a checkpoint's (uploaded) or
    another tpu tensor's (aliased); the rebuild of every saved tensor."""
    if isinstance(source, LoadedStorage):
        whole = (storage_offset == 0 and size is not None and
                 (not stride or tuple(stride) == contiguous_strides(tuple(size))))
        storage = source.upload(t.dtype, tuple(int(s) for s in size) if whole else None)
    elif isinstance(source, TpuStorage):
        if source._dtype != t.dtype:
            # CPU would reinterpret the bytes; a tpu storage's array has
            # one dtype, and reading it as another would give wrong values.
            raise RuntimeError(f"set_: a {t.dtype} tpu tensor cannot view the storage of "
                               f"{source._dtype} tensors (use .view({t.dtype}) on a tensor)")
        storage = source.tpu_storage()
    else:
        raise RuntimeError(f"Expected a storage on {t.device} for set_ of a tpu tensor, "
                           f"got one on {source.device}")
    numel = math.prod(storage.array.shape)
    size = (numel,) if size is None else tuple(int(s) for s in size)
    stride = contiguous_strides(size) if not stride else tuple(int(s) for s in stride)
    check_in_storage(size, stride, storage_offset, t.element_size(), numel * t.element_size())
    new = TpuTensor(storage, size, t.dtype, stride, storage_offset)
    torch._C.TensorBase.data.__set__(t, new)
    t._storage, t._view, t._key = new._storage, new._view, new._key
    return t


def _set_tensor(t, source):
    """aten.set_ of a tpu tensor onto another tensor: t aliases it."""
    if not isinstance(source, TpuTensor):
        raise RuntimeError(f"Expected a tensor on {t.device} for set_ of a tpu tensor, got one on "
                           f"{source.device}")
    if source.dtype != t.dtype:
        raise RuntimeError(f"Could not set tensor of type {t.dtype} to a tensor of type {source.dtype}")
    return _set_storage(t, untyped_storage(source), source.storage_offset(), source.shape,
                        source.stride())


def _set_empty(t):
    """aten.set_ with no source: t views a new empty storage, as on CPU."""
    empty = TpuTensor(Storage(jnp.zeros((0,), runtime.jax_dtype(t.dtype)), t._storage.device), (0,),
                      t.dtype)
    return _set_tensor(t, empty)


def _tag(storage):
    if isinstance(storage, _OnTpu):
        return str(storage.device)
    return None


def _restore(storage, location):
    """torch.load's restore for locations on tpu (after map_location)."""
    match = _LOCATION.match(location)
    if match is None:
        return None
    index = int(match.group(2) or 0)
    if index >= torch.tpu.device_count():
        raise RuntimeError(f"Attempting to deserialize object on TPU device {index} but "
                           f"torch.tpu.device_count() is {torch.tpu.device_count()}. Please use "
                           "torch.load with map_location to map your storages to an existing device.")
    properties.check_index(index)
    if isinstance(storage, _OnTpu):
        return storage
    return LoadedStorage.of(storage, index)


def _safetensors_device(device):
    """safetensors' device argument for a tpu device: its index. safetensors
    parses device names itself and knows no "tpu"; an index names the
    current accelerator's device, which tpu is."""
    if isinstance(device, str) and _LOCATION.match(device):
        device = torch.device(device)
    if isinstance(device, torch.device) and device.type == DEVICE.type:
        return device.index or 0
    return device


def _patch_safetensors():
    """safe_open (and so load_file and load_model) takes device="tpu"."""
    import safetensors
    import safetensors.torch
    rust_safe_open = safetensors.safe_open
    if getattr(rust_safe_open, "__wrapped__", None) is not None:
        return

    def safe_open(filename, framework, device="cpu", *args, **kwargs):
        return rust_safe_open(filename, framework, _safetensors_device(device), *args, **kwargs)

    safe_open.__wrapped__ = rust_safe_open
    safe_open.__doc__ = rust_safe_open.__doc__
    safetensors.safe_open = safetensors.torch.safe_open = safe_open


def _refuse_to_share(t):
    """A tpu tensor sent to another process (torch.multiprocessing's
    arguments and queues pickle with ForkingPickler): a CUDA tensor arrives
    there as the same memory, so writes on either side show on both
    (Hogwild training relies on it). XLA's device memory has no handle to
    share, and a copy would drop those writes without a word: refuse."""
    raise RuntimeError(
        "torchtpu: tpu tensors cannot be shared between processes (XLA's device memory has "
        "no inter-process handle, and a copy would not see the other process's writes). "
        "Send CPU tensors (t.cpu(), or a CPU model after model.share_memory()) and move "
        "them to the device in the receiving process")


def install():
    # torch.save and pickle write a tpu tensor as PyTorch writes a CUDA one:
    # its storage's bytes, tagged with the device, and how it views them.
    TpuTensor.__reduce_ex__ = lambda t, proto: reduce_tensor(t)
    ForkingPickler.register(TpuTensor, _refuse_to_share)
    TpuTensor.__deepcopy__ = deepcopy_tensor
    TpuTensor.untyped_storage = untyped_storage
    TpuTensor.data_ptr = data_ptr
    dispatch.SPECIAL[aten.set_.source_Storage_storage_offset] = _set_storage
    dispatch.SPECIAL[aten.set_.source_Storage] = _set_storage
    dispatch.SPECIAL[aten.set_.source_Tensor] = _set_tensor
    dispatch.SPECIAL[aten.set_.default] = _set_empty
    torch.serialization.register_package(_PACKAGE_PRIORITY, _tag, _restore)
    if importlib.util.find_spec("safetensors") is not None:
        _patch_safetensors()  # importing it costs about a millisecond


__all__ = ["TpuStorage", "LoadedStorage", "install"]
