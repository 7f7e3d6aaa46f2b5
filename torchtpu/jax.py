"""A tpu tensor and a jax.Array, each seen as the other without a copy.

to_jax(t) gives the JAX array holding t's values: t's own buffer when t is
its whole storage (a view is read into a new array). JAX arrays are
immutable, so a later in-place op on t gives t a new buffer and leaves the
array as it was. from_jax(a) gives a tpu tensor over a's buffer.

functionalize(model) gives a module as a pure JAX function of its
parameters, and export(model, args) its forward as a StableHLO program that
a process with JAX alone runs."""
import contextlib
import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import bounds, properties, runtime
from .compiled import traced_ops
from .dispatch import device_array
from .ops import random as rng
from .tensor import DEVICE, Storage, TpuTensor, read_view, whole_tensor, wrap


def to_jax(t):
    """t's values as a jax.Array on t's device (in fused mode, computing
    t's pending value first)."""
    if not isinstance(t, TpuTensor):
        raise TypeError(f"to_jax() takes a tpu tensor, not a {getattr(t, 'device', type(t).__name__)} "
                        "one (move it with .to('tpu') first)")
    if t.dtype == torch.complex32:
        raise TypeError("to_jax(): JAX has no complex32; convert with .to(torch.complex64) first")
    return device_array(t, "to_jax")


def from_jax(a):
    """A tpu tensor holding a (a jax.Array on one device), over a's own
    buffer when a is on one of torchtpu's devices, else copied to the
    current tpu device."""
    if not isinstance(a, jax.Array):
        raise TypeError(f"from_jax() takes a jax.Array, not {type(a).__name__}")
    devices = a.devices()
    if len(devices) != 1:
        raise ValueError(f"from_jax(): the array is sharded over {len(devices)} devices; "
                         "give it one device's array")
    (dev,) = devices
    if dev in runtime.DEVICES:
        index = runtime.DEVICES.index(dev)
    else:
        index = properties.current_index()
        a = jax.device_put(a, runtime.DEVICES[index])
    return wrap(a, device=index)


# ---- a module as a JAX function ---------------------------------------------------

def functionalize(model):
    """(params, fn): model as a pure JAX function of its state.

    params: {name: jax.Array} of the module's parameters and buffers, by their
    state_dict names (a tied parameter once, under its first name).
    fn(params, *args, rng_key=None, **kwargs) -> (outputs, updated): the
    module's forward on JAX arrays (args may also hold numpy arrays and
    Python values), its tensors as JAX arrays in the same nested structure
    (a dict for a mapping such as a Hugging Face ModelOutput), and updated:
    {name: new array} of the buffers (or parameters) the forward wrote
    in place, such as BatchNorm's running statistics, which the caller
    merges into params as it chooses. Random ops draw from rng_key (a
    jax.random key), and raise without one.

    fn is traceable by jax.jit, jax.grad, jax.vmap and lax.scan: each aten op
    adds its torchtpu lowering to the JAX function being traced, as in
    torch.compile(backend="tpu") (torchtpu.compiled). Index checks are not
    made inside it (JAX clamps an out-of-range index), and an op that reads
    values on the host (.item(), a data-dependent shape) cannot be traced.
    The module's own tensors are untouched: it runs on the arrays given."""
    if isinstance(model, torch.export.ExportedProgram):
        model = model.module()
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    params = {name: _array_of(t) for name, t in state.items()}

    def fn(params, *args, rng_key=None, **kwargs):
        device = properties.current_index()
        tensors = {name: _tensor_of(a, device) for name, a in params.items()}
        given = {name: t._storage.array for name, t in tensors.items()}
        args, kwargs = jax.tree_util.tree_map(lambda x: _tensor_of(x, device) if _is_array(x) else x,
                                              (args, kwargs))
        flag_in = jnp.zeros_like(bounds.flag_input(False, device).array)
        seed = None if rng_key is None else jax.random.bits(rng_key, (), jnp.uint32).astype(jnp.int64)
        with traced_ops(device, flag_in), rng.drawn_from(seed), _math_attention():
            out = torch.func.functional_call(model, tensors, args, kwargs)
        updated = {name: read_view(t._storage.array, t._view) for name, t in tensors.items()
                   if t._storage.array is not given[name]}
        return _as_jax_tree(out), updated

    return params, fn


@contextlib.contextmanager
def _math_attention():
    """nn.MultiheadAttention and the Transformer layers on their math path:
    their inference fast path is one fused CPU or CUDA kernel."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _is_array(x):
    return isinstance(x, (jax.Array, np.ndarray))


def _array_of(t):
    """A module's tensor as a jax.Array (a CPU one copied to the device)."""
    t = t.detach()
    return to_jax(t if isinstance(t, TpuTensor) else t.to(DEVICE))


def _tensor_of(a, device):
    """A tpu tensor over a (a JAX array, perhaps a tracer, or a numpy one)."""
    a = jnp.asarray(a)
    return whole_tensor(Storage(a, device), tuple(a.shape), runtime.torch_dtype(a.dtype))


def _as_jax_tree(x):
    """x (a module's outputs) with each tpu tensor its JAX array, in
    containers JAX can trace through."""
    if isinstance(x, TpuTensor):
        return read_view(x._storage.array, x._view)
    if isinstance(x, torch.Tensor):
        raise TypeError(f"functionalize(): the module returned a {x.device} tensor; only tensors "
                        "computed from its inputs and state can be returned")
    if isinstance(x, dict):
        return {k: _as_jax_tree(v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*[_as_jax_tree(v) for v in x])
    if isinstance(x, (list, tuple)):
        return type(x)(_as_jax_tree(v) for v in x)
    return x


# ---- a module exported as StableHLO -----------------------------------------------

class Exported:
    """A module's forward as a serialized StableHLO program (jax.export) and
    its parameters. save(folder) writes program.bin and params.npz, which a
    process with JAX alone (no torch) runs:

        exported = jax.export.deserialize(open("program.bin", "rb").read())
        outputs = exported.call(dict(numpy.load("params.npz")), *inputs)
    """

    def __init__(self, program, params):
        self.program = program  # bytes: jax.export's serialization
        self.params = params    # {name: numpy array}

    def call(self, *args):
        """The program run here (as the JAX-only process would)."""
        return jax.export.deserialize(self.program).call(self.params, *args)

    def save(self, folder):
        odd = sorted(k for k, v in self.params.items() if v.dtype.kind == "V" or
                     type(v.dtype).__module__.startswith("ml_dtypes"))
        if odd:
            # numpy's .npz would store them as raw bytes, which load as void.
            raise TypeError(f"Exported.save: numpy cannot store the {self.params[odd[0]].dtype} "
                            f"parameters {', '.join(odd[:3])}; save Exported.params another way "
                            "(e.g. as float32, or their bytes and dtypes)")
        folder = os.fspath(folder)
        os.makedirs(folder, exist_ok=True)
        _write_atomically(os.path.join(folder, "program.bin"), lambda f: f.write(self.program))
        _write_atomically(os.path.join(folder, "params.npz"), lambda f: np.savez(f, **self.params))


def _write_atomically(path, write):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def export(model, args, kwargs=None, dynamic_shapes=None):
    """model's forward (an nn.Module or a torch.export.ExportedProgram) on
    inputs shaped as args (tensors, of any device) as an Exported: a
    StableHLO program of (params, *inputs) returning the forward's outputs
    as JAX arrays (see functionalize), with the parameters. kwargs: other
    arguments, fixed in the program (tensors go in args).

    dynamic_shapes, as torch.export takes it (per argument, by position or
    by the forward's parameter names: None, or {0: a name or a
    torch.export.Dim}), makes dimension 0 of those inputs a symbolic batch:
    the forward is traced for one example and mapped over the batch
    (jax.vmap), which computes what the batched forward does when its
    examples are independent, as in inference. The example args are run
    both ways, and a forward whose examples depend on each other (batch norm
    in training) is refused."""
    kwargs = dict(kwargs or {})
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        raise TypeError("torchtpu.export: give tensor inputs in args (they become the program's "
                        "inputs); kwargs are fixed in the program")
    batched = _batched_inputs(model, args, dynamic_shapes)
    params, fn = functionalize(model)
    inputs = [_array_of(a) if isinstance(a, torch.Tensor) else a for a in args]

    def forward(p, *a):
        return fn(p, *a, **kwargs)[0]

    if not any(batched):
        program, specs = jax.jit(forward), inputs
    else:
        def one(p, *a):  # one example: each batched input as a batch of one
            out = forward(p, *[x[None] if b else x for x, b in zip(a, batched)])
            return jax.tree_util.tree_map(lambda o: o[0], out)

        program = jax.jit(jax.vmap(one, in_axes=(None, *[0 if b else None for b in batched])))
        _check_independent(program(params, *inputs), jax.jit(forward)(params, *inputs))
        (batch,) = jax.export.symbolic_shape("batch")
        specs = [jax.ShapeDtypeStruct((batch, *x.shape[1:]), x.dtype) if b else x
                 for x, b in zip(inputs, batched)]
    exported = jax.export.export(program)(params, *specs)
    return Exported(bytes(exported.serialize()), {k: np.asarray(v) for k, v in params.items()})


def _batched_inputs(model, args, dynamic_shapes):
    """For each of args, whether its dimension 0 is the symbolic batch."""
    if dynamic_shapes is None:
        return [False] * len(args)
    if isinstance(dynamic_shapes, dict):
        forward = model.module() if isinstance(model, torch.export.ExportedProgram) else model
        names = list(inspect.signature(forward.forward).parameters)
        unknown = set(dynamic_shapes) - set(names[:len(args)])
        if unknown:
            raise ValueError(f"torchtpu.export: dynamic_shapes names {sorted(unknown)}, which are "
                             f"not among the forward's arguments given: {names[:len(args)]}")
        dynamic_shapes = [dynamic_shapes.get(n) for n in names[:len(args)]]
    if len(dynamic_shapes) != len(args):
        raise ValueError(f"torchtpu.export: dynamic_shapes has {len(dynamic_shapes)} entries "
                         f"for {len(args)} args")
    batched = []
    for a, dims in zip(args, dynamic_shapes):
        if not dims:
            batched.append(False)
            continue
        if not isinstance(a, torch.Tensor) or a.dim() == 0 or set(dims) != {0}:
            raise NotImplementedError("torchtpu.export: only dimension 0 of tensor inputs can be "
                                      f"symbolic (a batch); got {dims}")
        if a.shape[0] < 2:
            raise ValueError("torchtpu.export: give an example batch of 2 or more for a symbolic "
                             "batch dimension (it is checked against the batched forward)")
        batched.append(True)
    return batched


def _check_independent(mapped, whole):
    """Refuse a forward that mapped over the examples differs from itself
    run on the whole batch."""
    same = jax.tree_util.tree_structure(mapped) == jax.tree_util.tree_structure(whole) and all(
        a.shape == b.shape and np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
        for a, b in zip(jax.tree_util.tree_leaves(mapped), jax.tree_util.tree_leaves(whole)))
    if not same:
        raise ValueError("torchtpu.export: the forward's examples are not independent along the "
                         "batch dimension (each output must be per example, and no op may mix "
                         "examples, as batch norm in training does), so the batch cannot be "
                         "symbolic; export once per batch size, or in eval mode")
