"""custom_jax_kernel: a function of JAX arrays (plain JAX or a Pallas
kernel) as a PyTorch op on tpu tensors.

Each decorated function becomes a `torch.library` op in the
`torchtpu_kernels` namespace, one overload per kind of call (which
arguments are tensors, None, numbers, ...), defined at its first call:
- its Meta kernel runs `jax.eval_shape` of the function, so shapes, dtypes
  and the function's own errors are known before anything runs, and the
  dispatcher raises them at the caller's line;
- its tpu lowering (`@lower` on the overload) is the function itself, so
  the dispatcher caches, runs and fuses it like an aten op;
- its gradient is a second kernel of the same kind, `<name>_backward`,
  whose function is `jax.vjp` of the first (or the user's vjp=): that
  kernel has a backward of its own in turn, so double backward works.
Python floats and ints are traced (a new value compiles nothing) unless
named static; bools, strings and tuples are static.
"""
import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import errors, runtime
from .compat import traceback_filtering as _traceback_filtering
from .ops.registry import lower

NAMESPACE = "torchtpu_kernels"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_NAMES = set()  # op names defined in this process

# Argument kinds: the schema type of each, and whether a value of it may be
# traced (fed to the kernel) rather than compiled in.
_SCHEMA = {"Tensor": "Tensor", "None": "Tensor?", "bool": "bool", "int": "int",
           "float": "float", "str": "str", "int[]": "int[]", "float[]": "float[]",
           "bool[]": "bool[]"}
_TRACEABLE = ("int", "float")
_JAX_DIRS = errors._JAX


def _kind(value, name):
    """The argument kind of one value (TypeError for one no op can take)."""
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if value is None:
        return "None"
    for t in (bool, int, float, str):
        if type(value) is t:
            return t.__name__
    if isinstance(value, (tuple, list)):
        for t in (bool, int, float):
            if all(type(v) is t for v in value):
                return t.__name__ + "[]"
    raise TypeError(f"custom_jax_kernel: argument '{name}' is a {type(value).__name__}; a kernel "
                    "takes tensors, None, bools, ints, floats, strings and tuples of numbers")


def _unique_name(base):
    if not base.isidentifier():
        raise ValueError(f"custom_jax_kernel: name {base!r} is not a Python identifier")
    name = base
    for i in itertools.count(2):
        if name not in _NAMES:
            break
        # The same function decorated again (a notebook cell run twice).
        name = f"{base}_{i}"
    _NAMES.add(name)
    return name


def custom_jax_kernel(fn=None, *, name=None, static_argnames=(), vjp=None):
    """Turn fn, a function of JAX arrays, into a function of tpu tensors that
    runs as one op (`torch.ops.torchtpu_kernels.<name>`) in every eager mode.

    Usable bare (`@custom_jax_kernel`) or with options:
    - name: the op's name (default: fn's name);
    - static_argnames: arguments compiled in, one kernel per value (Python
      ints and floats are otherwise traced, so a new value compiles
      nothing; bools, strings and tuples are always static);
    - vjp: vjp(grad, *args) -> one gradient per tensor argument (None for
      one without), given the same arguments as fn, grad shaped as fn's
      result; default: jax.vjp of fn.
    fn returns one array or a tuple of arrays; tensors arrive as arrays,
    None as None, static lists as tuples."""
    if fn is None:
        return lambda f: custom_jax_kernel(f, name=name, static_argnames=static_argnames, vjp=vjp)
    if isinstance(static_argnames, str):
        static_argnames = (static_argnames,)
    params = list(inspect.signature(fn).parameters.values())
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"custom_jax_kernel: {fn.__name__} takes *{p.name}; a kernel's "
                            "arguments are named")
    unknown = set(static_argnames) - {p.name for p in params}
    if unknown:
        raise ValueError(f"custom_jax_kernel: static_argnames {sorted(unknown)} are not "
                         f"arguments of {fn.__name__}")
    kernel = JaxKernel(fn, _unique_name(name or fn.__name__), params, tuple(static_argnames), vjp)
    try:
        kernel.__wrapped__ = fn
        kernel.__doc__ = fn.__doc__
    except AttributeError:  # pragma: no cover
        pass
    return kernel


class JaxKernel:
    """A decorated function: binds a call's arguments, picks the op overload
    for their kinds (defining it at first use) and calls it, through
    autograd when an input requires grad."""

    def __init__(self, fn, name, params, static, vjp):
        self.fn = fn
        self.name = name
        self.signature = inspect.Signature(params)
        self.params = [p.name for p in params]
        self.static = static
        self.vjp = vjp
        self._overloads = {}

    def __repr__(self):
        return f"<custom_jax_kernel {NAMESPACE}::{self.name}>"

    def __call__(self, *args, **kwargs):
        try:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = [bound.arguments[p] for p in self.params]
            kinds = tuple(_kind(v, p) for v, p in zip(values, self.params))
            overload = self._overloads.get(kinds)
            if overload is None:
                overload = self._overloads[kinds] = Overload(self, kinds, values)
            return overload(values)
        except Exception as e:
            # At the caller's line, as the dispatcher raises its errors.
            raise errors.user_error(e, f"{NAMESPACE}.{self.name}", args, kwargs)


class Overload:
    """One overload of a kernel's op: its schema, Meta kernel and lowering."""

    def __init__(self, kernel, kinds, values):
        self.kernel = kernel
        self.kinds = kinds
        self.tensor_positions = [i for i, k in enumerate(kinds) if k == "Tensor"]
        self.traced = {p for p, k in zip(kernel.params, kinds)
                       if k in _TRACEABLE and p not in kernel.static}
        self._backward = {}  # number of outputs -> the backward kernel
        _require_tpu(kernel.name, [values[i] for i in self.tensor_positions])
        # The result's structure (one array or several) fixes the schema's returns.
        self.single = not isinstance(self._eval_shape(values, meta=False), (tuple, list))
        overload = "default" if not kernel._overloads else f"k{len(kernel._overloads)}"
        args = ", ".join(f"{_SCHEMA[k]} {p}" for p, k in zip(kernel.params, kinds))
        qualified = kernel.name if overload == "default" else f"{kernel.name}.{overload}"
        _LIB.define(f"{qualified}({args}) -> {'Tensor' if self.single else 'Tensor[]'}")
        _LIB.impl(qualified, self._meta, "Meta")
        self.op = getattr(getattr(torch.ops, NAMESPACE), kernel.name).__getattr__(overload)

        def lowering(*values):
            out = self._call_fn(values)
            return out if self.single else list(out)
        # Tensors and traced numbers are fed to the kernel; others compile in.
        lowering.dynamic_args = tuple(self.traced)
        lowering.static_args = tuple(p for p, k in zip(kernel.params, kinds)
                                     if k in _TRACEABLE and p not in self.traced)
        # The kernel runs the user's code, which torchtpu's source digest does
        # not cover: fused graphs holding it are not stored across processes.
        lowering.process_local = True
        lower(self.op)(lowering)

    def __call__(self, values):
        tensors = [values[i] for i in self.tensor_positions]
        _require_tpu(self.kernel.name, tensors)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            out = _KernelFunction.apply(self, *values)
        else:
            out = self.op(*values)
        return out if self.single or not isinstance(out, list) else tuple(out)

    # ---- running the user's function -------------------------------------------

    def _call_fn(self, values):
        """The user's function on JAX values in parameter order."""
        kwargs = {p: tuple(v) if isinstance(v, list) else v
                  for p, v in zip(self.kernel.params, values)}
        return self.kernel.fn(**kwargs)

    def _eval_shape(self, values, meta=True):
        """jax.eval_shape of the function for torch values (tensors, meta or
        not), traced numbers abstract; the function's errors as PyTorch
        raises them, naming the op."""
        fed = [i for i, (p, k) in enumerate(zip(self.kernel.params, self.kinds))
               if k == "Tensor" or p in self.traced]
        abstract = [_abstract(values[i]) for i in fed]

        def run(*leaves):
            full = list(values)
            for i, leaf in zip(fed, leaves):
                full[i] = leaf
            return self._call_fn(full)
        try:
            # Unfiltered tracebacks tell JAX's errors from the function's own.
            with _traceback_filtering("off"):
                out = jax.eval_shape(run, *abstract)
        except Exception as e:
            raise self._error(e, values) from None
        leaves = out if isinstance(out, (tuple, list)) else [out]
        for leaf in leaves:
            if not isinstance(leaf, jax.ShapeDtypeStruct):
                raise TypeError(f"{self._describe(values)}: the kernel returned a "
                                f"{type(leaf).__name__}; it must return an array or a tuple of arrays")
        if meta and isinstance(out, (tuple, list)) == self.single:
            raise TypeError(f"{self._describe(values)}: the kernel returned "
                            f"{'several arrays' if self.single else 'one array'} where its "
                            f"first call returned {'one' if self.single else 'several'}")
        return out

    def _meta(self, *values):
        out = self._eval_shape(values)
        device = next(values[i].device for i in self.tensor_positions) if self.tensor_positions \
            else torch.device("meta")
        leaves = [torch.empty(s.shape, dtype=runtime.torch_dtype(s.dtype), device=device)
                  for s in (out if isinstance(out, (tuple, list)) else [out])]
        return leaves[0] if self.single else leaves

    def _describe(self, values):
        return errors.describe_call(self.op if hasattr(self, "op") else
                                    f"{NAMESPACE}.{self.kernel.name}", values)

    def _error(self, e, values):
        """e, raised while tracing the function, as the error to raise: the
        user's own exception keeps its type; JAX's shape and dtype errors are
        RuntimeErrors, as PyTorch's are."""
        where = _raised_in(e)
        what = f"{type(e).__name__}: {errors._first_line(e)}"
        msg = f"torchtpu: {self._describe(values)}: {what}"
        if self.traced and (isinstance(e, errors._TRACER_ERRORS) or "Tracer" in what):
            # A traced number used where JAX needs a Python value (a shape).
            return RuntimeError(f"{msg} (traced arguments: {', '.join(sorted(self.traced))}; "
                                "name those the kernel needs as Python values in static_argnames=)")
        if where is not None and not where.startswith(_JAX_DIRS):
            try:
                return type(e)(msg)
            except Exception:
                return RuntimeError(msg)
        return RuntimeError(msg)

    # ---- autograd ----------------------------------------------------------------

    def backward_kernel(self, n_out):
        """The kernel computing this one's input gradients: given the n_out
        output gradients then the same arguments, it returns one gradient
        per floating-point tensor argument."""
        backward = self._backward.get(n_out)
        if backward is None:
            kernel = self.kernel
            grad_names = [f"grad_{i}" for i in range(n_out)]
            while any(g in kernel.params for g in grad_names):
                grad_names = ["_" + g for g in grad_names]

            def fn(**kw):
                return self._vjp([kw[g] for g in grad_names], [kw[p] for p in kernel.params])
            params = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                      for p in grad_names + kernel.params]
            backward = self._backward[n_out] = JaxKernel(
                fn, _unique_name(kernel.name + "_backward"), params, kernel.static, None)
        return backward

    def _vjp(self, grads, values):
        values = list(values)
        diff = [i for i in self.tensor_positions if jnp.issubdtype(values[i].dtype, jnp.inexact)]
        if self.kernel.vjp is not None:
            given = self.kernel.vjp(grads[0] if self.single else tuple(grads),
                                    *[tuple(v) if isinstance(v, list) else v for v in values])
            given = list(given) if isinstance(given, (tuple, list)) else [given]
            tensors = self.tensor_positions
            if len(given) != len(tensors):
                raise TypeError(f"{NAMESPACE}::{self.kernel.name}: vjp returned {len(given)} "
                                f"gradients for {len(tensors)} tensor arguments")
            by_position = dict(zip(tensors, given))
            return tuple(jnp.zeros_like(values[i]) if by_position[i] is None else
                         jnp.asarray(by_position[i]).astype(values[i].dtype) for i in diff)

        def f(*inputs):
            full = list(values)
            for i, x in zip(diff, inputs):
                full[i] = x
            return self._call_fn(full)
        try:
            out, pull = jax.vjp(f, *[values[i] for i in diff])
        except Exception as e:
            # pallas_call, for one, has no reverse-mode rule.
            raise type(e)(f"jax.vjp of {self.kernel.name} failed ({errors._first_line(e)}); "
                          "give its gradient with custom_jax_kernel(vjp=...)") from None
        outs = [out] if self.single else list(out)
        cotangents = [g.astype(o.dtype) if jnp.issubdtype(o.dtype, jnp.inexact)
                      else np.zeros(o.shape, jax.dtypes.float0) for g, o in zip(grads, outs)]
        return tuple(pull(cotangents[0] if self.single else type(out)(cotangents)))


def _require_tpu(name, tensors):
    if tensors and not any(t.device.type in ("tpu", "meta") for t in tensors):
        raise RuntimeError(f"{NAMESPACE}::{name} runs on tpu tensors; its tensors are on "
                           f"{tensors[0].device}")


def _abstract(value):
    """The abstract JAX value of a tensor or a traced Python number (a
    weakly typed scalar, as the dispatcher feeds it)."""
    if isinstance(value, torch.Tensor):
        return jax.ShapeDtypeStruct(tuple(value.shape), runtime.jax_dtype(value.dtype))
    dtype = jnp.float64 if type(value) is float else jnp.int64
    return jax.ShapeDtypeStruct((), dtype, weak_type=True)


def _raised_in(e):
    """The file of the innermost frame e was raised in."""
    tb = e.__traceback__
    name = None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return name


class _KernelFunction(torch.autograd.Function):
    """Autograd for one call: backward calls the backward kernel, itself
    differentiable (under create_graph it records its own backward)."""

    @staticmethod
    def forward(ctx, overload, *values):
        tensors = [values[i] for i in overload.tensor_positions]
        ctx.save_for_backward(*tensors)
        ctx.overload = overload
        ctx.others = [None if k == "Tensor" else v for v, k in zip(values, overload.kinds)]
        out = overload.op(*values)
        outs = [out] if overload.single else out
        ctx.mark_non_differentiable(*[o for o in outs
                                      if not (o.dtype.is_floating_point or o.dtype.is_complex)])
        return out if overload.single else tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        overload = ctx.overload
        values = list(ctx.others)
        for i, t in zip(overload.tensor_positions, ctx.saved_tensors):
            values[i] = t
        result = overload.backward_kernel(len(grads))(*grads, *values)
        result = [result] if isinstance(result, torch.Tensor) else list(result)
        diff = iter(result)
        out = [None] * len(values)
        for i in overload.tensor_positions:
            if values[i].dtype.is_floating_point or values[i].dtype.is_complex:
                g = next(diff)
                out[i] = g if ctx.needs_input_grad[1 + i] else None
        return (None, *out)


__all__ = ["custom_jax_kernel", "JaxKernel", "NAMESPACE"]
