"""The tensor's Python surface outside the op table, as a table: each method
or attribute on a tpu tensor against a CPU tensor. A row gives CPU's result
(values, dtypes, shapes compared after moving to CPU), the result CUDA gives
where it differs from CPU's by device (a device name, `is_cpu`), or the
error type CUDA raises; what a tpu tensor cannot serve raises a clear
error naming what is missing."""
import copy
import pickle

import pytest
import torch

from conftest import to_cpu

SAME = "same"  # the tpu result, moved to CPU, equals CPU's


def _storage_bytes(s):
    return bytes(s.cpu())


def _hooked(t):
    seen = []
    x = t.clone().requires_grad_()
    x.register_hook(lambda g: seen.append(g * 2))
    (x * 3).sum().backward()
    return seen[0], x.grad


def _retained(t):
    x = t.clone().requires_grad_()
    y = x * 2
    y.retain_grad()
    y.square().sum().backward()
    return y.grad, y.retains_grad


def _post_accumulate(t):
    x = t.clone().requires_grad_()
    seen = []
    x.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    (x * x).sum().backward()
    return seen[0]


def _data_swap(t):
    x = t.clone()
    y = t.clone() * 2
    x.data = y
    y.add_(1)
    return x


def _set_to(t):
    x = t.clone()
    y = torch.empty(0, device=t.device, dtype=t.dtype).set_(x.untyped_storage(), 1, (2,), (2,))
    return y, y.is_set_to(x), x.is_set_to(x)


ROWS = [
    # (name, fn(t) -> value, expected on tpu: SAME, a value, or an exception type)
    ("__deepcopy__", lambda t: copy.deepcopy(t), SAME),
    ("__reduce_ex__ (pickle)", lambda t: pickle.loads(pickle.dumps(t)), SAME),
    ("__reduce_ex__ device", lambda t: pickle.loads(pickle.dumps(t)).device.type, "tpu"),
    ("untyped_storage bytes", lambda t: _storage_bytes(t.untyped_storage()), SAME),
    ("untyped_storage nbytes", lambda t: t.untyped_storage().nbytes(), SAME),
    ("storage tolist", lambda t: t.storage().tolist(), SAME),
    ("storage size", lambda t: t.storage().size(), SAME),
    ("data_ptr of a view", lambda t: t[1].data_ptr() - t.data_ptr(), SAME),
    ("const_data_ptr", lambda t: t[1].const_data_ptr() - t.const_data_ptr(), SAME),
    ("storage_offset", lambda t: t[1, 2:].storage_offset(), SAME),
    ("share_memory_", lambda t: t.share_memory_(), SAME),
    ("is_shared", lambda t: t.is_shared(), False),
    ("numpy", lambda t: t.numpy(), TypeError),
    ("__array__", lambda t: t.__array__(), TypeError),
    ("__dlpack__", lambda t: t.__dlpack__(), BufferError),
    ("from_dlpack", lambda t: torch.from_dlpack(t), BufferError),
    ("tolist", lambda t: t.tolist(), SAME),
    ("item", lambda t: t[0, 0].item(), SAME),
    ("__float__", lambda t: float(t[1, 1]), SAME),
    ("__int__", lambda t: int(t[1, 1]), SAME),
    ("__bool__", lambda t: bool(t[1, 1]), SAME),
    ("__index__", lambda t: [0, 1, 2, 3][t[0, 0].long()], SAME),
    ("__len__", lambda t: len(t), SAME),
    ("__iter__", lambda t: list(t), SAME),
    ("__contains__", lambda t: 2. in t, SAME),
    ("__format__", lambda t: f"{t[0, 1]:.3f}", SAME),
    ("__hash__", lambda t: hash(t) == id(t), SAME),
    ("element_size", lambda t: t.element_size(), SAME),
    ("itemsize", lambda t: t.itemsize, SAME),
    ("nbytes", lambda t: t.nbytes, SAME),
    ("is_pinned", lambda t: t.is_pinned(), False),
    ("pin_memory", lambda t: t.pin_memory(), RuntimeError),
    ("register_hook", _hooked, SAME),
    ("register_post_accumulate_grad_hook", _post_accumulate, SAME),
    ("retain_grad", _retained, SAME),
    ("requires_grad_", lambda t: t.clone().requires_grad_().requires_grad, SAME),
    ("new_zeros", lambda t: t.new_zeros(2, 3), SAME),
    ("new_ones", lambda t: t.new_ones(2), SAME),
    ("new_full", lambda t: t.new_full((2,), 7.), SAME),
    ("new_empty shape", lambda t: (t.new_empty(2, 5).shape, t.new_empty(2).dtype), SAME),
    ("new_empty device", lambda t: t.new_empty(2).device.type, "tpu"),
    ("new_tensor", lambda t: t.new_tensor([1, 2]), SAME),
    ("new", lambda t: t.new(3).shape, SAME),
    ("type()", lambda t: t.type(), "torch.tpu.FloatTensor"),
    ("type(dtype)", lambda t: t.type(torch.float64), SAME),
    ("type_as", lambda t: t.type_as(torch.zeros(1, dtype=torch.int32, device=t.device)), SAME),
    ("double", lambda t: t.double(), SAME),
    ("half", lambda t: t.half(), SAME),
    ("bfloat16", lambda t: t.bfloat16(), SAME),
    ("long", lambda t: t.long(), SAME),
    ("bool", lambda t: t.bool(), SAME),
    ("cpu", lambda t: (t.cpu().device.type, t.cpu().tolist()), SAME),
    ("to(meta)", lambda t: (t.to("meta").shape, t.to("meta").is_meta), SAME),
    ("cuda", lambda t: t.cuda(), (AssertionError, RuntimeError)),
    ("get_device", lambda t: t.get_device(), 0),
    ("device.type", lambda t: t.device.type, "tpu"),
    ("is_cpu", lambda t: t.is_cpu, False),
    ("is_cuda", lambda t: t.is_cuda, False),
    ("is_tpu", lambda t: t.is_tpu, True),
    ("is_meta", lambda t: t.is_meta, SAME),
    ("is_floating_point", lambda t: t.is_floating_point(), SAME),
    ("is_complex", lambda t: t.is_complex(), SAME),
    ("is_signed", lambda t: t.is_signed(), SAME),
    ("is_contiguous", lambda t: (t.is_contiguous(), t.t().is_contiguous()), SAME),
    ("is_contiguous channels_last", lambda t: t.reshape(1, 3, 2, 2).contiguous(
        memory_format=torch.channels_last).is_contiguous(memory_format=torch.channels_last), SAME),
    ("is_leaf", lambda t: t.is_leaf, SAME),
    ("is_inference", lambda t: t.is_inference(), SAME),
    # conj() is computed at once on tpu (no lazy conjugate bit, which CPU and
    # CUDA set): the values match (resolve_conj), the bit reads False.
    ("is_conj", lambda t: (t.is_conj(), t.to(torch.complex64).conj().is_conj()), (False, False)),
    ("conj", lambda t: t.to(torch.complex64).conj(), SAME),
    ("resolve_conj", lambda t: t.to(torch.complex64).conj().resolve_conj(), SAME),
    ("is_neg", lambda t: t.is_neg(), SAME),
    ("is_nested", lambda t: t.is_nested, SAME),
    ("is_sparse", lambda t: t.is_sparse, SAME),
    ("is_quantized", lambda t: t.is_quantized, SAME),
    ("is_nonzero", lambda t: t[1, 1].is_nonzero(), SAME),
    ("is_set_to", _set_to, SAME),
    ("layout", lambda t: t.layout, SAME),
    ("dim / ndim / ndimension", lambda t: (t.dim(), t.ndim, t.ndimension()), SAME),
    ("shape / size / stride", lambda t: (t.shape, t.size(1), t.t().stride()), SAME),
    ("numel / nelement", lambda t: (t.numel(), t.nelement()), SAME),
    ("dim_order", lambda t: t.t().dim_order(), SAME),
    ("T / mT / H / mH", lambda t: (t.T, t.mT, t.H, t.mH), SAME),
    ("data", lambda t: t.data, SAME),
    ("data =", _data_swap, SAME),
    ("detach_", lambda t: t.clone().requires_grad_().mul(2).detach_().requires_grad, SAME),
    ("output_nr", lambda t: t.unbind(0)[1].output_nr if t.requires_grad else 0, SAME),
    ("apply_", lambda t: t.clone().apply_(lambda v: v), TypeError),
    ("record_stream", lambda t: t.record_stream(torch.tpu.current_stream()), None),
    ("to_sparse", lambda t: t.to_sparse(), NotImplementedError),
    ("storage_offset after narrow_", lambda t: t.clone().narrow(1, 1, 2).storage_offset(), SAME),
]


@pytest.mark.parametrize("name,fn,expected", ROWS, ids=[r[0] for r in ROWS])
def test_tensor_surface(name, fn, expected):
    cpu = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4
    tpu = cpu.to("tpu")
    if isinstance(expected, type) and issubclass(expected, Exception) or (
            isinstance(expected, tuple) and isinstance(expected[0], type)):
        with pytest.raises(expected):
            fn(tpu)
        return
    got = fn(tpu)
    if expected is SAME:
        want = fn(cpu)
        _assert_on_tpu(got)
        got = to_cpu(got)
        if isinstance(want, torch.Tensor) or isinstance(want, (list, tuple)) and any(
                isinstance(w, torch.Tensor) for w in want):
            torch.testing.assert_close(got, to_cpu(want))
        else:
            assert got == want
    else:
        assert got == expected


def _assert_on_tpu(value):
    """Every tensor a row returns from a tpu tensor is on tpu, as on CUDA."""
    if isinstance(value, torch.Tensor):
        assert value.device.type == "tpu", value.device
    elif isinstance(value, (list, tuple)):
        for v in value:
            _assert_on_tpu(v)
