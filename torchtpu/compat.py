"""What differs between the torch and JAX releases torchtpu supports
(torch 2.11-2.13, JAX 0.10-0.12), in one place: the aten ops a torch may
lack, and the JAX internals torchtpu reaches.

`aten` stands for torch.ops.aten everywhere in the package. An op or overload
that this torch lacks is a `MissingOp`: registering a lowering for it does
nothing and comparing an op with it is False, so the families can name the
newest ops without an attribute error at import on an older torch.
"""
import contextlib

import torch


class MissingOp:
    """An aten op (or one of its overloads) that this torch does not have."""
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return MissingOp(f"{self.name}.{attr}")

    def overloads(self):
        return []

    def __repr__(self):
        return f"<{self.name}: not in torch {torch.__version__}>"


class OpNamespace:
    """A torch.ops namespace (torch.ops.aten), with MissingOp for what this
    torch lacks. Each name is looked up once, then read as a plain attribute."""

    def __init__(self, namespace):
        self._namespace = namespace

    def __getattr__(self, name):
        try:
            value = getattr(getattr(torch.ops, self._namespace), name)
        except AttributeError:
            if name.startswith("__") and name.endswith("__"):
                raise
            value = MissingOp(f"{self._namespace}.{name}")
        setattr(self, name, value)
        return value


aten = OpNamespace("aten")
c10d_functional = OpNamespace("_c10d_functional")


def has_op(op):
    """Whether op (from `aten`) exists in this torch."""
    return not isinstance(op, MissingOp)


# ---- JAX's internals that torchtpu reaches (each moved between releases) ----------

def traceback_filtering(value):
    """JAX's traceback_filtering config as a context manager (a no-op where
    this JAX keeps it elsewhere)."""
    try:
        from jax._src.config import traceback_filtering as setting
    except ImportError:
        return contextlib.nullcontext()
    return setting(value)


def no_jax_cache_write():
    """A context manager under which JAX writes no persistent cache entry
    for what this thread compiles (a no-op where this JAX keeps the setting
    elsewhere). JAX serializes and compresses an executable before its cache
    store sees it: for a small kernel, twice the compile's own time."""
    try:
        from jax._src.config import persistent_cache_min_compile_time_secs as setting
    except ImportError:
        return contextlib.nullcontext()
    return setting(float("inf"))


def compilation_cache():
    """(JAX's compilation_cache module, its CacheInterface class), or
    (None, object) where this JAX has neither: the disk cache then holds
    torchtpu's own records only."""
    try:
        from jax._src import compilation_cache as module
        from jax._src.compilation_cache_interface import CacheInterface
    except ImportError:
        return None, object
    return module, CacheInterface


def tpu_chip_count():
    """The TPU chips on this host's PCI bus, read without starting the TPU
    runtime (0 off TPU hosts, or where this JAX cannot tell)."""
    try:
        from jax._src import hardware_utils
        return hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except (ImportError, AttributeError, OSError):
        return 0


def jax_extension():
    """JAX's C++ extension module, where it starts the distributed runtime's
    service (get_distributed_runtime_service), or None where this JAX keeps
    that elsewhere."""
    try:
        from jax._src.lib import _jax
    except ImportError:
        return None
    return _jax if hasattr(_jax, "get_distributed_runtime_service") else None


def initialize_lapack():
    """Set up the LAPACK handlers that JAX installs while lowering a linear
    algebra op (a deserialized executable calls them too)."""
    from jax._src.lax import linalg
    linalg.initialize_lapack()
