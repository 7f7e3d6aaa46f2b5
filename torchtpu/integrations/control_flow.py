"""torch.cond, torch.while_loop, map, scan and PyTorch's other control-flow
higher-order ops on tpu tensors, eagerly.

A tensor subclass reaches a higher-order op at the Python key, where each
subclass must be registered or the call raises "There was no rule registered
for HOP". Called eagerly on CPU or CUDA tensors, these ops run their dense
implementation: Python control flow over ordinary aten ops (cond reads its
predicate, as CUDA does; while_loop reads its condition each trip). A tpu
tensor runs the same implementation, so each aten op inside is one of
torchtpu's and autograd's kernels for the ops (cond's, map's, scan's) work
unchanged. Ops tied to CPU or CUDA state (RNG state, compiled kernels,
delegates) are not in the list.
"""
from torch._C import DispatchKey

from ..tensor import TpuTensor
from .after_import import when_imported

# Module -> the ops in it served with their dense implementation.
_OPS = {
    "torch._higher_order_ops.cond": ("cond",),
    "torch._higher_order_ops.while_loop": ("while_loop", "while_loop_stack_output"),
    "torch._higher_order_ops.map": ("map_impl",),
    "torch._higher_order_ops.scan": ("scan",),
    "torch._higher_order_ops.associative_scan": ("associative_scan",),
    "torch._higher_order_ops.hints_wrap": ("hints_wrapper",),
    "torch._higher_order_ops.out_dtype": ("out_dtype",),
    "torch._higher_order_ops.strict_mode": ("strict_mode",),
    "torch._higher_order_ops._invoke_quant": ("invoke_quant", "invoke_quant_packed"),
}


# Every op above, by name (torch.compile's graphs holding one run op by op).
NAMES = frozenset(name for names in _OPS.values() for name in names)


def pass_aot_analyzer(ops):
    """Let ops() (higher-order ops) through AOTAutograd's first run of a
    compiled graph, which watches custom ops for aliasing under a dispatch
    mode that answers NotImplemented for tensor subclasses: a higher-order
    op returns that answer as its result (torch 2.13) instead of going on to
    the TpuTensor kernel. The mode checks no higher-order op."""
    def passing(module):
        analyzer = getattr(module, "_AnalyzeCustomOpInputOutputMode", None)
        if analyzer is None:
            return
        for op in ops():
            if analyzer not in op.python_key_table:
                op.py_impl(analyzer)(lambda mode, *args, op=op, **kwargs: op(*args, **kwargs))
    when_imported("torch._functorch._aot_autograd.runtime_wrappers", passing)


def _register(names):
    def register(module):
        for op in list(vars(module).values()):
            if not hasattr(op, "py_kernels") or not callable(getattr(op, "name", None)) or op.name() not in names:
                continue
            dense = op.py_kernels.get(DispatchKey.CompositeExplicitAutograd) or op.py_kernels.get(DispatchKey.CPU)
            if dense is not None and TpuTensor not in op.python_key_table:
                op.py_impl(TpuTensor)(dense)
                pass_aot_analyzer(lambda op=op: (op,))  # torch.compile's graphs run them eagerly
    return register


def install():
    for module, names in _OPS.items():
        when_imported(module, _register(names))
