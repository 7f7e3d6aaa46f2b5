"""Per-op plans: what the dispatcher knows about one OpOverload, read once
from its schema (which arguments it writes and which results alias them,
whether it is a view, its lowering and functional variant), and SPECIAL,
the ops the dispatcher hands to a handler of its own (torchtpu.dispatch's
handler modules fill it)."""
import torch

from ..ops import LOWERINGS

from ..compat import aten

_DYNAMIC_SCALAR_TYPES = (int, float, complex)
_TENSORISH = ("Tensor", "Optional[Tensor]", "number", "Optional[number]")
# Index lists (Tensor?[]) may hold CPU tensors, as with CUDA tensors.
_INDICES = "indices"
# Scalar[] elements are dynamic like Scalars (optimizers' per-step lists).
_SCALARS = "scalars"

# Op -> handler(*args, **kwargs), for ops a lowering cannot express.
SPECIAL = {}

# Op -> rule(func, args, kwargs) for the op on tensors padded along a length
# that varies (torchtpu.dispatch.lengths fills it): its result computed on
# the padded arrays, or NotImplemented.
PADDED = {}


# ---- per-op plans ----------------------------------------------------------

class Plan:
    """What the dispatcher needs to know about one OpOverload, made once."""
    __slots__ = ("func", "name", "kind", "lowering", "functional", "written",
                 "n_plain", "result_sources", "tensorish", "view_cache", "random", "matmul",
                 "accepts", "special", "custom_default", "pos_flags", "handler", "padded")

    def __init__(self, func):
        self.func = func
        self.name = str(func)
        schema = func._schema
        self.tensorish = {}
        for i, a in enumerate(schema.arguments):
            t = str(a.type)
            flag = (_INDICES if t == "List[Optional[Tensor]]" else _SCALARS if t == "List[number]"
                    else t in _TENSORISH)
            self.tensorish[i] = flag
            self.tensorish[a.name] = flag
        qualified = schema.name + ("." + schema.overload_name if schema.overload_name else "")
        self.written = [a.name for a in schema.arguments
                        if a.alias_info is not None and a.alias_info.is_write]
        returns = [r.alias_info for r in schema.returns]
        self.n_plain = sum(1 for r in returns if r is None)
        # Each result of an op that writes arguments: None (a plain result)
        # or the (position, name) of the argument it returns (self, out=).
        writers = {}
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                for alias in a.alias_info.before_set:
                    writers[alias] = (i, a.name)
        self.result_sources = [None if r is None else writers.get(next(iter(r.before_set)))
                               for r in returns] if self.written else None
        self.functional = None
        self.lowering = LOWERINGS.get(func)
        self.view_cache = {}
        aliased = [r for r in returns if r is not None]
        if self.written:
            self.functional = _functional_variant(func)
            fl = LOWERINGS.get(self.functional) if self.functional else None
            self.kind = "mutate" if fl is not None else "other"
            self.lowering = fl
            if fl is None and self.functional is not None and Plan(self.functional).kind == "view":
                # transpose_, t_, unsqueeze_, squeeze_, as_strided_: only the
                # tensor's metadata changes.
                self.kind = "view_inplace"
        elif aliased and self.lowering is None and not torch._C._dispatch_has_kernel_for_dispatch_key(
                qualified, "CompositeImplicitAutograd"):
            self.kind = "view"
        elif self.lowering is not None:
            self.kind = "lower"
        else:
            self.kind = "other"
        self.random = getattr(self.lowering, "random", False)
        self.padded = PADDED.get(func) if self.kind == "lower" else None
        self.matmul = getattr(self.lowering, "matmul", False)
        # A library's custom op with a kernel for this device or for any
        # (FSDP2's copy-in and copy-out ops register Python ones): the key
        # of the kernel to run, else None.
        self.custom_default = None
        if schema.name.split("::")[0] not in ("aten", "prims"):
            for key in ("PrivateUse1", "CompositeExplicitAutograd"):
                if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key):
                    self.custom_default = getattr(torch._C.DispatchKey, key)
                    break
        # accepts(*args, **kwargs) -> False sends a call the lowering cannot
        # take (a value-dependent shape: boolean-mask indexing) down the
        # decomposition / CPU-fallback path.
        self.accepts = getattr(self.lowering, "accepts", None)
        # Scalars a lowering must branch on (a norm's ord) are static; float
        # arguments it names dynamic (an optimizer's learning rate) are traced.
        for i, a in enumerate(schema.arguments):
            if a.name in getattr(self.lowering, "static_args", ()):
                self.tensorish[i] = self.tensorish[a.name] = False
            elif a.name in getattr(self.lowering, "dynamic_args", ()):
                self.tensorish[i] = self.tensorish[a.name] = True
        self.pos_flags = tuple(self.tensorish[i] for i in range(len(schema.arguments)))


def _functional_variant(func):
    """The functional op whose outputs are func's plain outputs followed by the
    new values of the arguments func writes (functionalization's convention)."""
    schema = func._schema
    name = schema.name.split("::")[1]
    inputs = [(a.name, str(a.type).replace("(a!)", ""))
              for a in schema.arguments if not a.is_out]
    base = name[:-1] if name.endswith("_") else name
    candidates = [base, base + "_functional", name]
    # Exact argument match first; then a functional op that only adds
    # defaulted keyword arguments (randperm.generator_out -> randperm.generator).
    for exact in (True, False):
        for cand in candidates:
            packet = getattr(aten, cand, None)
            if packet is None:
                continue
            for ov in packet.overloads():
                op = getattr(packet, ov)
                s = op._schema
                if any(a.alias_info is not None and a.alias_info.is_write for a in s.arguments):
                    continue
                args = [(a.name, str(a.type)) for a in s.arguments]
                if args == inputs:
                    return op
                if (not exact and args[:len(inputs)] == inputs
                        and all(a.kwarg_only and a.has_default_value()
                                for a in s.arguments[len(inputs):])):
                    return op
    return None
