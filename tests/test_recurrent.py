"""Recurrent modules on tpu as on CPU, forward and backward (inputs, initial
states and every parameter), in each eager mode: nn.RNN (tanh, relu),
nn.GRU and nn.LSTM (with proj_size), stacked, bidirectional, batch_first,
unbatched, with and without initial states; their cells; packed sequences.

Off the CPU, PyTorch runs the GRU and LSTM cells through the CUDA-only
_thnn_fused_*_cell ops (torchtpu.ops.nn.recurrent), and pack_padded_sequence
keeps batch_sizes on the host (torchtpu.packed_sequences).

Shapes are few and tiny (input 4, hidden 2, 3 steps, batch 2): each new
shape compiles kernels.
"""
import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from conftest import compare, make

IN, HIDDEN, STEPS, BATCH = 4, 2, 3, 2

MODULES = {
    "rnn_tanh": lambda **kw: nn.RNN(IN, HIDDEN, nonlinearity="tanh", **kw),
    "rnn_relu": lambda **kw: nn.RNN(IN, HIDDEN, nonlinearity="relu", **kw),
    "gru": lambda **kw: nn.GRU(IN, HIDDEN, **kw),
    "lstm": lambda **kw: nn.LSTM(IN, HIDDEN, **kw),
}

CELLS = {
    "rnn_tanh": lambda: nn.RNNCell(IN, HIDDEN, nonlinearity="tanh"),
    "rnn_relu": lambda: nn.RNNCell(IN, HIDDEN, nonlinearity="relu"),
    "gru": lambda: nn.GRUCell(IN, HIDDEN),
    "lstm": lambda: nn.LSTMCell(IN, HIDDEN),
}


def _flat(out):
    """A module's results as one flat tuple (an LSTM's (h, c) unpacked), so
    that compare weights and differentiates each."""
    if isinstance(out, torch.Tensor):
        return (out,)
    return tuple(t for o in out for t in _flat(o))


def compare_module(module, forward, *inputs):
    """compare() of forward(call, *inputs), where call(*args) runs module
    with the parameters compare hands in: the gradients of the inputs and of
    every parameter are checked against CPU's."""
    names = [n for n, _ in module.named_parameters()]
    params = [p.detach() for _, p in module.named_parameters()]

    def fn(*args):
        weights = dict(zip(names, args[len(inputs):]))
        return _flat(forward(lambda *a: functional_call(module, weights, a), *args[:len(inputs)]))

    return compare(fn, *inputs, *params)


def _state(kind, layers_dirs, batch, hidden=HIDDEN, seed=1):
    """An initial state: h0 (or (h0, c0) for an LSTM) as a list of tensors."""
    shape = (layers_dirs, batch, hidden) if batch else (layers_dirs, hidden)
    h0 = make(torch.float32, shape, seed=seed)
    if kind != "lstm":
        return [h0]
    return [h0, make(torch.float32, shape[:-1] + (HIDDEN,), seed=seed + 1)]


def _with_state(kind):
    """forward(call, x, *state): the module given its initial state."""
    if kind == "lstm":
        return lambda call, x, h, c: call(x, (h, c))
    return lambda call, x, h: call(x, h)


@pytest.mark.parametrize("kind", list(MODULES))
def test_module(mode, kind):
    # One layer, sequence first, no initial state.
    x = make(torch.float32, (STEPS, BATCH, IN))
    compare_module(MODULES[kind](), lambda call, x: call(x), x)


@pytest.mark.parametrize("kind", list(MODULES))
def test_module_stacked_bidirectional_batch_first(mode, kind):
    # Two layers, both directions, batch first, with an initial state.
    module = MODULES[kind](num_layers=2, bidirectional=True, batch_first=True)
    x = make(torch.float32, (BATCH, STEPS, IN))
    compare_module(module, _with_state(kind), x, *_state(kind, 4, BATCH))


@pytest.mark.parametrize("kind", list(MODULES))
def test_module_unbatched(mode, kind):
    # A 2-D input (steps, features) and 2-D initial states: the module adds
    # and drops the batch dim.
    x = make(torch.float32, (STEPS, IN))
    compare_module(MODULES[kind](), _with_state(kind), x, *_state(kind, 1, None))


def test_gru_without_biases(mode):
    # The fused GRU cell gets None for both biases; its backward returns none.
    x = make(torch.float32, (STEPS, BATCH, IN))
    compare_module(nn.GRU(IN, HIDDEN, bias=False), lambda call, x: call(x), x)
    compare_module(nn.GRUCell(IN, HIDDEN, bias=False), lambda call, x: call(x), x[0])


def test_lstm_without_biases(mode):
    # PyTorch's meta kernel of the fused LSTM cell reads the None biases'
    # .device: the lowering's own shapes serve instead.
    x = make(torch.float32, (STEPS, BATCH, IN))
    compare_module(nn.LSTM(IN, HIDDEN, bias=False), lambda call, x: call(x), x)
    compare_module(nn.LSTMCell(IN, HIDDEN, bias=False), lambda call, x: call(x), x[0])


def test_lstm_proj_size(mode):
    # The hidden state is projected to proj_size (weight_hr); c keeps HIDDEN.
    module = nn.LSTM(IN, HIDDEN, num_layers=2, bidirectional=True, proj_size=1)
    x = make(torch.float32, (STEPS, BATCH, IN))
    compare_module(module, _with_state("lstm"), x, *_state("lstm", 4, BATCH, hidden=1))


@pytest.mark.parametrize("kind", list(CELLS))
def test_cell(mode, kind):
    cell = CELLS[kind]()
    x = make(torch.float32, (BATCH, IN))
    compare_module(cell, lambda call, x: call(x), x)
    compare_module(cell, _with_state(kind), x, *[s[0] for s in _state(kind, 1, BATCH)])


@pytest.mark.parametrize("kind", list(CELLS))
def test_cell_unbatched(mode, kind):
    cell = CELLS[kind]()
    x = make(torch.float32, (IN,))
    compare_module(cell, _with_state(kind), x, *[s[0] for s in _state(kind, 1, None)])


def _packed(kind, lengths, enforce_sorted, batch_first):
    """forward(call, x, *state): pack x by lengths, run the module, pad the
    result back; returns (padded output, its lengths, final states)."""
    def forward(call, x, *state):
        packed = pack_padded_sequence(x, lengths, batch_first=batch_first,
                                      enforce_sorted=enforce_sorted)
        # batch_sizes stays on the host whatever the data's device, as on CUDA.
        assert packed.batch_sizes.device.type == "cpu"
        assert packed.data.device == x.device
        if state:
            out, hidden = call(packed, tuple(state) if kind == "lstm" else state[0])
        else:
            out, hidden = call(packed)
        padded, out_lengths = pad_packed_sequence(out, batch_first=batch_first)
        return padded, out_lengths, hidden
    return forward


@pytest.mark.parametrize("kind", list(MODULES))
def test_packed_sorted(mode, kind):
    x = make(torch.float32, (STEPS, BATCH, IN))
    compare_module(MODULES[kind](), _packed(kind, torch.tensor([3, 2]), True, False), x)


@pytest.mark.parametrize("kind", list(MODULES))
def test_packed_unsorted(mode, kind):
    # Lengths in any order (sorted and restored by index_select on tpu), both
    # directions, batch first, with an initial state.
    module = MODULES[kind](bidirectional=True, batch_first=True)
    x = make(torch.float32, (BATCH, STEPS, IN))
    compare_module(module, _packed(kind, torch.tensor([2, 3]), False, True), x,
                   *_state(kind, 2, BATCH))


def test_packed_unsorted_lengths_refused_when_sorted_is_enforced(mode):
    # PyTorch's own check, as on CPU.
    x = make(torch.float32, (STEPS, BATCH, IN)).to("tpu")
    with pytest.raises(RuntimeError, match="sorted in decreasing order"):
        pack_padded_sequence(x, torch.tensor([2, 3]))
