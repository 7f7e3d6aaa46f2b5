"""Random ops: a device generator keyed from torch.manual_seed.

State is (seed, offset) on the host. Each random lowering is registered with
@lower(..., random=True): the dispatcher passes the state as two dynamic
kernel inputs and hands the lowering key=, a JAX key derived from them inside
the kernel, so no op recompiles per call. Every call advances the offset.
Streams are reproducible under torch.manual_seed, not equal to CPU's.
"""
import contextlib
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .registry import ctx, lower
from .util import ctx_dtype

from ..compat import aten

_state = {"seed": 67280421310721, "offset": 0}


def _signed64(v):
    """A 64-bit seed as a signed int64 value (what a kernel input can hold)."""
    v = int(v) & 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= (1 << 63) else v


def manual_seed(seed):
    _state["seed"] = _signed64(seed)
    _state["offset"] = 0


def seed():
    import random
    manual_seed(random.getrandbits(63))
    return _state["seed"]


def initial_seed():
    return _state["seed"] & 0xFFFFFFFFFFFFFFFF


def _state_tensor(state):
    """A generator's (seed, offset) as the uint8 tensor get_state gives."""
    return torch.tensor([state["seed"], state["offset"]], dtype=torch.int64).view(torch.uint8)


def _load_state(state, new_state):
    seed_, offset = new_state.cpu().contiguous().view(torch.int64).tolist()
    state.update(seed=_signed64(seed_), offset=offset)


def get_rng_state(device="tpu"):
    return _state_tensor(_state)


def set_rng_state(new_state, device="tpu"):
    _load_state(_state, new_state)


def position():
    """(seed, offset): the key the next random op draws (next_key moves it on)."""
    return _state["seed"], _state["offset"]


def tpu_generator(generator):
    """The tpu torch.Generator that an op's generator argument is, or None
    (an op receives a new Python object for the generator it was given)."""
    return None if generator is None else _TPU_GENERATORS.get(generator._cdata)


def next_key(generator=None, op=None, replayed=False):
    """(seed, offset) for the next random op, as kernel inputs (seed None:
    inside drawn_from(None), where no op may draw): from generator, a tpu
    torch.Generator, or else from the device's default generator. op: the
    op's name; replayed: it is recorded into a graph that replays it."""
    tpu = tpu_generator(generator)
    if generator is not None:
        if tpu is None:
            # As CUDA's kernels refuse another device's generator (its
            # stream cannot drive this device's draws).
            raise RuntimeError("Expected a 'tpu' device type for generator but found "
                               f"'{generator.device.type}'")
        if replayed:
            raise RuntimeError(f"torchtpu: {op} draws from a torch.Generator of its own inside "
                               "torch.tpu.graph capture, which replay cannot advance: draw from the "
                               "default generator there (torch.manual_seed)")
    state = _state if tpu is None else tpu._tpu_state
    offset = state["offset"]
    state["offset"] = offset + 1
    return state["seed"], offset


_TPU_GENERATORS = weakref.WeakValueDictionary()  # C++ generator address -> tpu Generator


class _GeneratorType(type(torch._C.Generator)):
    def __instancecheck__(cls, obj):
        # Every generator (those torch._C.Generator makes for other devices)
        # stays an instance of torch.Generator.
        if cls is Generator:
            return isinstance(obj, torch._C.Generator)
        return super().__instancecheck__(obj)

    def __subclasscheck__(cls, sub):
        if cls is Generator:
            return issubclass(sub, torch._C.Generator)
        return super().__subclasscheck__(sub)


class Generator(torch._C.Generator, metaclass=_GeneratorType):
    """torch.Generator once torchtpu is imported: torch.Generator(device="tpu")
    is a generator of its own (seed, offset), drawn from by the random ops
    given it as generator= (PyTorch asks a C++ backend's hooks for a device
    generator, which a Python backend cannot register). Other devices get
    PyTorch's own generator. Its stream under a seed is the default tpu
    generator's under torch.manual_seed(seed)."""
    _tpu_index = None  # a tpu generator's device index

    def __new__(cls, device=None):
        dev = device if device is None or isinstance(device, torch.device) else torch.device(device)
        if dev is None or dev.type != "tpu":
            if cls is Generator:
                return torch._C.Generator() if device is None else torch._C.Generator(device)
            return torch._C.Generator.__new__(cls, *(() if device is None else (device,)))
        from .. import properties
        self = torch._C.Generator.__new__(cls)  # (a CPU generator underneath, unused)
        self._tpu_index = properties.checked_index(dev)
        self._tpu_state = {"seed": _signed64(67280421310721), "offset": 0}  # CUDA's default seed
        # An op given it receives another Python object for the same C++
        # generator: its address finds this one.
        _TPU_GENERATORS[self._cdata] = self
        return self

    def __init__(self, device=None):
        pass

    @property
    def device(self):
        if self._tpu_index is None:
            return torch._C.Generator.device.__get__(self)
        return torch.device("tpu", self._tpu_index)

    def manual_seed(self, seed):
        if self._tpu_index is None:
            return super().manual_seed(seed)
        self._tpu_state.update(seed=_signed64(seed), offset=0)
        return self

    def seed(self):
        if self._tpu_index is None:
            return super().seed()
        import random
        self.manual_seed(random.getrandbits(63))
        return self.initial_seed()

    def initial_seed(self):
        if self._tpu_index is None:
            return super().initial_seed()
        return self._tpu_state["seed"] & 0xFFFFFFFFFFFFFFFF

    def get_state(self):
        if self._tpu_index is None:
            return super().get_state()
        return _state_tensor(self._tpu_state)

    def set_state(self, new_state):
        if self._tpu_index is None:
            return super().set_state(new_state)
        _load_state(self._tpu_state, new_state)
        return self

    def get_offset(self):
        if self._tpu_index is None:
            return super().get_offset()
        return self._tpu_state["offset"]

    def set_offset(self, offset):
        if self._tpu_index is None:
            return super().set_offset(offset)
        self._tpu_state["offset"] = int(offset)
        return self

    def clone_state(self):
        if self._tpu_index is None:
            return super().clone_state()
        return Generator(self.device).set_state(self.get_state())

    def graphsafe_get_state(self):
        if self._tpu_index is None:
            return super().graphsafe_get_state()
        return self.clone_state()

    def graphsafe_set_state(self, state):
        if self._tpu_index is None:
            return super().graphsafe_set_state(state)
        return self.set_state(state.get_state())

    def __reduce__(self):
        if self._tpu_index is None:
            return super().__reduce__()
        return _generator_from_state, (self._tpu_index, self.get_state())


def _generator_from_state(index, state):
    """A pickled tpu generator's restore."""
    return Generator(torch.device("tpu", index)).set_state(state)


@contextlib.contextmanager
def drawn_from(seed_):
    """Random ops inside the block draw from seed_ (a traced int64 scalar: a
    JAX function's key argument), at offsets from 0; seed_ None: they raise.
    The generator's state is restored after."""
    before = dict(_state)
    _state["seed"], _state["offset"] = seed_, 0
    try:
        yield
    finally:
        _state.update(before)


def key_from(seed_, offset):
    """The JAX key of one op call (seed_, offset are traced int64 scalars)."""
    key = jax.random.key(jnp.asarray(seed_, jnp.int64))
    return jax.random.fold_in(key, jnp.asarray(offset, jnp.int64).astype(jnp.uint32))


# ---- helpers ---------------------------------------------------------------

def _out():
    """Shape and jax dtype of output 0 (from PyTorch's meta kernel)."""
    return tuple(ctx.out[0].shape), ctx_dtype()


def _float_dtype(dtype):
    """The dtype to draw floats in: low precision types draw in float32."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype in (jnp.float32, jnp.float64) else jnp.dtype(jnp.float32)


def _flat(draw, key, shape, *args):
    """draw(key, shape, *args) drawn as one row and reshaped: the same bits
    (JAX's threefry counts elements in row-major order), but XLA compiles a
    draw of 2 or more dimensions 3 to 5 times slower (1.3 s against 0.3 s
    on CPU for a (3, 2, 3, 3) randn), and every new shape compiles one."""
    return draw(key, (math.prod(shape),), *args).reshape(shape)


def _uniform(key, shape, dtype):
    """Uniform in [0, 1)."""
    return _flat(jax.random.uniform, key, shape, _float_dtype(dtype))


def _normal(key, shape, dtype):
    return _flat(jax.random.normal, key, shape, _float_dtype(dtype))


# ---- lowerings -------------------------------------------------------------

@lower(aten.uniform.default, random=True)
def uniform(x, from_=0.0, to=1.0, *, generator=None, key, **kw):
    from_ = kw.pop("from", from_)
    u = _uniform(key, x.shape, x.dtype)
    out = u * (to - from_) + from_
    # Rounding (or a low precision cast) may reach `to`; the range is [from, to).
    out = out.astype(x.dtype)
    return jnp.where(out >= jnp.asarray(to, x.dtype), jnp.asarray(from_, x.dtype), out) \
        if to > from_ else out


@lower(aten.normal_functional.default, random=True)
def normal_functional(x, mean=0.0, std=1.0, *, generator=None, key):
    return (_normal(key, x.shape, x.dtype) * std + mean).astype(x.dtype)


@lower(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor,
       aten.normal.float_float, random=True)
def normal(mean, std=1.0, *args, generator=None, key, **kw):
    shape, dtype = _out()
    z = _normal(key, shape, dtype)
    mean = jnp.asarray(mean)
    std = jnp.asarray(std)
    return (z * std.astype(z.dtype) + mean.astype(z.dtype)).astype(dtype)


@lower(aten.bernoulli.default, random=True)
def bernoulli(x, *, generator=None, key):
    return (_uniform(key, x.shape, jnp.float64 if x.dtype == jnp.float64 else jnp.float32)
            < x).astype(x.dtype)


@lower(aten.bernoulli.p, random=True)
def bernoulli_p(x, p=0.5, *, generator=None, key):
    return (_uniform(key, x.shape, jnp.float64) < p).astype(x.dtype)


@lower(aten.bernoulli.Tensor, random=True)
def bernoulli_tensor(x, p, *, generator=None, key):
    u = _uniform(key, x.shape, jnp.float64 if p.dtype == jnp.float64 else jnp.float32)
    return (u < jnp.broadcast_to(p, x.shape)).astype(x.dtype)


@lower(aten.exponential.default, random=True)
def exponential(x, lambd=1.0, *, generator=None, key):
    u = _uniform(key, x.shape, x.dtype)
    # 1 - u lies in (0, 1]: the sample is finite and >= 0.
    return (-jnp.log1p(-u) / lambd).astype(x.dtype)


@lower(aten.geometric.default, random=True)
def geometric(x, p, *, generator=None, key):
    u = _uniform(key, x.shape, jnp.float64)
    # Number of trials to the first success: ceil(log(1-u) / log(1-p)), >= 1.
    k = jnp.maximum(jnp.ceil(jnp.log1p(-u) / math.log1p(-p)), 1.0) if p < 1 else jnp.ones_like(u)
    return k.astype(x.dtype)


@lower(aten.log_normal.default, random=True)
def log_normal(x, mean=1.0, std=2.0, *, generator=None, key):
    return jnp.exp(_normal(key, x.shape, x.dtype) * std + mean).astype(x.dtype)


@lower(aten.cauchy.default, random=True)
def cauchy(x, median=0.0, sigma=1.0, *, generator=None, key):
    u = _uniform(key, x.shape, x.dtype)
    return (median + sigma * jnp.tan(math.pi * (u - 0.5))).astype(x.dtype)


def _random_bounds(dtype):
    """random_()'s default range [0, hi] for a dtype (PyTorch's rule: floats
    get the integers their mantissa holds exactly)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return 1
    if dtype.kind == "f":
        return 2 ** (jnp.finfo(dtype).nmant + 1)
    return int(jnp.iinfo(dtype).max)


def _randint(key, shape, lo, hi_exclusive, dtype):
    """Integers in [lo, hi_exclusive), drawn in int64 so every range is exact."""
    # int64 max itself is out of reach of an exclusive int64 bound (odds 2**-63).
    hi = min(hi_exclusive, np.iinfo(np.int64).max)
    return _flat(jax.random.randint, key, shape, lo, hi, jnp.int64).astype(dtype)


@lower(aten.random.default, random=True)
def random_(x, *, generator=None, key):
    return _randint(key, x.shape, 0, _random_bounds(x.dtype) + 1, x.dtype)


@lower(aten.random.to, random=True)
def random_to(x, to, *, generator=None, key):
    return _randint(key, x.shape, 0, to, x.dtype)


@lower(getattr(aten.random, "from"), random=True)
def random_from(x, from_, to=None, *, generator=None, key, **kw):
    hi = _random_bounds(x.dtype) + 1 if to is None else to
    return _randint(key, x.shape, from_, hi, x.dtype)


@lower(aten.randperm.default, aten.randperm.generator, random=True)
def randperm(n, *args, generator=None, key, **kw):
    shape, dtype = _out()
    return jax.random.permutation(key, n).astype(dtype)


@lower(aten.multinomial.default, random=True)
def multinomial(probs, num_samples, replacement=False, *, generator=None, key):
    p = probs.astype(jnp.float64 if probs.dtype == jnp.float64 else jnp.float32)
    logits = jnp.log(p / jnp.sum(p, axis=-1, keepdims=True))
    batch = p.shape[:-1]
    if replacement:
        draws = jax.random.categorical(key, logits, axis=-1, shape=(num_samples,) + batch)
        out = jnp.moveaxis(draws, 0, -1)
    else:
        # Gumbel top-k: sampling without replacement in proportion to p.
        g = _flat(jax.random.gumbel, key, p.shape, logits.dtype)
        _, out = jax.lax.top_k(logits + g, num_samples)
    return out.astype(jnp.int64)


# ---- the samplers of torch.distributions (Gamma, Beta, Dirichlet, Poisson,
# Binomial): each draws in float32 at least, then casts to its input's dtype.

@lower(aten._standard_gamma.default, random=True)
def standard_gamma(alpha, *args, generator=None, key, **kw):
    return jax.random.gamma(key, alpha.astype(_float_dtype(alpha.dtype))).astype(alpha.dtype)


@lower(aten._standard_gamma_grad.default)
def standard_gamma_grad(alpha, sample):
    """d sample / d alpha of a Gamma(alpha, 1) draw (its rsample's gradient)."""
    dtype = _float_dtype(alpha.dtype)
    return jax.lax.random_gamma_grad(alpha.astype(dtype), sample.astype(dtype)).astype(alpha.dtype)


@lower(aten._sample_dirichlet.default, random=True)
def sample_dirichlet(alpha, *args, generator=None, key, **kw):
    return jax.random.dirichlet(key, alpha.astype(_float_dtype(alpha.dtype))).astype(alpha.dtype)


@lower(aten.poisson.default, random=True)
def poisson(rate, *args, generator=None, key, **kw):
    return jax.random.poisson(key, rate.astype(_float_dtype(rate.dtype))).astype(rate.dtype)


@lower(aten.binomial.default, random=True)
def binomial(count, prob, *args, generator=None, key, **kw):
    dtype = _float_dtype(count.dtype)
    return jax.random.binomial(key, count.astype(dtype), prob.astype(dtype)).astype(count.dtype)


def dropout_keep(key, shape, p):
    """Which elements dropout with probability p keeps (dropout and the
    attention op's dropout)."""
    return _uniform(key, shape, jnp.float32) >= p


@lower(aten.native_dropout.default, random=True)
def native_dropout(x, p, train, *, key):
    if train is False:
        return x, jnp.ones(x.shape, jnp.bool_)
    if p >= 1:
        return jnp.zeros_like(x), jnp.zeros(x.shape, jnp.bool_)
    keep = dropout_keep(key, x.shape, p)
    scale = 1.0 / (1.0 - p)
    return (jnp.where(keep, x, 0) * jnp.asarray(scale, x.dtype)).astype(x.dtype), keep


@lower(aten.rand_like.default, aten.rand_like.generator, random=True)
def rand_like(x, *, key, **kw):
    shape, dtype = _out()
    return _uniform(key, shape, dtype).astype(dtype)


@lower(aten.randn_like.default, aten.randn_like.generator, random=True)
def randn_like(x, *, key, **kw):
    shape, dtype = _out()
    return _normal(key, shape, dtype).astype(dtype)


@lower(aten.randint_like.default, aten.randint_like.generator, aten.randint_like.Tensor,
       aten.randint_like.Tensor_generator, random=True)
def randint_like(x, high, *, key, **kw):
    shape, dtype = _out()
    return _flat(jax.random.randint, key, shape, 0, high, jnp.int64).astype(dtype)


@lower(aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype, random=True)
def randint_like_low(x, low, high, *, key, **kw):
    shape, dtype = _out()
    return _flat(jax.random.randint, key, shape, low, high, jnp.int64).astype(dtype)
