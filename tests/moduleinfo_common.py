"""How one ModuleInfo entry is run on CPU and on tpu and compared.

Shared by tests/test_module_db.py and scripts/modules_report.py so the
survey and the test suite judge a module the same way, as
tests/opinfo_common.py does for ops.

check(name, kind, samples) -> Result, status as for ops: "pass" (matches CPU,
nothing ran on the CPU fallback), "fallback" (matches, but some aten op ran
on the CPU fallback), "fail" (raised on tpu or differed; error: one line),
"skip" (nothing to check). Each kind builds the CPU module from the
sample's constructor input and the tpu one the same way under the same seed
(then `.to("tpu")`), so both start from the same state:

  train, eval   forward and backward of up to `samples` samples, strict mode,
                module in train() / eval(): outputs, gradients of the inputs
                and of every parameter, buffers after the step.
  debug, fused  the same for the first training sample in that eager mode.
  noncontig     the first training sample with non-contiguous (strided,
                offset, transposed) inputs and output gradients.
  train_eval    one module switched train -> eval -> train, a step in each.
  to            `.to("tpu")` keeps each Parameter object (as CUDA does) and
                its values; `.to(float64)` (gradients too) and back to
                float32 exactly, then a step; `.cpu()`; a lazy module moved
                before its first forward.
  meta          `.to("meta")`, then `.to_empty(device="tpu")`: shapes, dtypes,
                devices, Parameters; usable once CPU's values are copied in.
  state_dict    CPU state into a tpu module by load_state_dict (in place) and
                the tpu state_dict back into a CPU module.
  deepcopy      copy.deepcopy, pickle.dumps / loads and torch.save / load
  pickle        of a tpu module after a step: its state and gradients as
  save_load     the same round trip gives on CPU, on tpu, sharing no
                storage with the original, then a step; save_load also
                loads a saved state_dict.
The round-trip kinds (to .. save_load) use the first eval-mode sample.
check_isolated runs a check in a child process (for one that crashes).

Random modules (CPU's output differs between two seeds) are compared by
shapes and dtypes against CPU, and by values against the same tpu
computation repeated under the same seed. module_db has none, so the suite
adds the dropout family and RReLU (EXTRA_MODULES).
"""
import contextlib
import copy
import dataclasses
import functools
import io
import multiprocessing
import os
import pickle
import warnings
import zlib

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils._pytree import tree_flatten, tree_map

import torchtpu
from torchtpu import config, metrics

from conftest import platform_tol

from torch.testing import make_tensor
from torch.testing._internal.common_modules import (  # noqa: E402
    FunctionInput, ModuleInfo, ModuleInput, module_db)
from opinfo_common import short_error, time_limit  # noqa: E402

TPU = torch.device("tpu", 0)


def _random_module_inputs(module_info, device, dtype, requires_grad, training, **kwargs):
    ctor, shape = RANDOM_SAMPLES[module_info.module_cls]
    return [ModuleInput(constructor_input=FunctionInput(*ctor), forward_input=FunctionInput(
        make_tensor(shape, device=device, dtype=dtype, requires_grad=requires_grad)))]


# module_db has no module whose samples are random; these entries of the
# suite's own (the dropout family and RReLU, random while training) run the
# same checks: class -> (constructor args, input shape).
RANDOM_SAMPLES = {
    nn.Dropout: ((0.5,), (4, 6)),
    nn.Dropout2d: ((0.5,), (2, 3, 4, 4)),
    nn.AlphaDropout: ((0.5,), (4, 6)),
    nn.FeatureAlphaDropout: ((0.5,), (2, 3, 4, 4)),
    nn.RReLU: ((0.1, 0.3), (4, 6)),
}
EXTRA_MODULES = [ModuleInfo(cls, module_inputs_func=_random_module_inputs, train_and_eval_differ=True)
                 for cls in RANDOM_SAMPLES]
MODULES = {mi.name: mi for mi in [*module_db, *EXTRA_MODULES]}
KINDS = ("train", "eval", "debug", "fused", "noncontig", "train_eval", "to", "meta",
         "state_dict", "deepcopy", "pickle", "save_load")

# TestModule's own float32 comparison (its precision and rel_tol); a
# ModuleInfo's float32 toleranceOverride for these CPU tests widens it.
TOL = dict(rtol=1e-5, atol=1e-5)
_TOL_TESTS = ("test_forward", "test_cpu_gpu_parity", "test_non_contiguous_tensors")

# Per-module float32 tolerances where a sample's sums are ill-conditioned, so
# a different (correct) summation order moves the result beyond TOL:
# name -> (rtol, atol, reason). Keep this short.
TOLERANCES = {
    "nn.LazyConvTranspose3d": (
        1e-5, 1e-4,
        "each weight gradient sums 120 products whose absolute sum is ~500 (inputs up to 9): "
        "float32 rounding of such a sum is up to ~1e-4 (against float64, CPU's error at a 2.38 "
        "entry is 1e-5, tpu's 3e-5); PyTorch's own CPU-vs-device module test allows atol 5e-2"),
}

# Kinds that use the eval-mode samples.
EVAL_KINDS = {"eval", "to", "meta", "state_dict", "deepcopy", "pickle", "save_load"}

SEED = 1234        # module initialization
STEP_SEED = 4321   # the random stream a forward sees
COT_SEED = 7       # output gradients


@dataclasses.dataclass
class Result:
    module: str
    kind: str
    status: str
    error: str = ""
    fallbacks: tuple = ()
    samples: int = 0

    def as_dict(self):
        return dataclasses.asdict(self)


class Failure(Exception):
    """A check's finding; the message says which part and what differed."""


def tolerance(name):
    tol = dict(TOL)
    if name in TOLERANCES:
        tol = dict(rtol=TOLERANCES[name][0], atol=TOLERANCES[name][1])
    for info in MODULES[name].decorators:
        if (getattr(info, "cls_name", None) != "TestModule" or info.test_name not in _TOL_TESTS
                or info.device_type not in (None, "cpu") or not info.active_if):
            continue
        for dec in info.decorators:
            t = getattr(dec, "d", {}).get(torch.float32)
            if t is not None:
                tol = dict(rtol=max(tol["rtol"], t.rtol), atol=max(tol["atol"], t.atol))
    # A module's forward, backward and optimizer step go through exp, tanh,
    # sigmoid, ...: on a TPU their measured error comes on top.
    return platform_tol(**tol)


@functools.lru_cache(maxsize=4)
def samples_of(name, training):
    """The entry's samples with a forward input (cached: some entries take a
    second to make; checks copy what they use and never write to these)."""
    mi = MODULES[name]
    torch.manual_seed(zlib.crc32(name.encode()) & 0x7FFFFFFF)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = mi.module_inputs_func(mi, device="cpu", dtype=torch.float32,
                                     requires_grad=True, training=training)
    return tuple(s for s in made if s.forward_input is not None)


# ---- building modules and inputs -------------------------------------------

def build(name, sample, training, seed=SEED, first_forward=True):
    """A CPU module from the sample's constructor input, initialized under
    seed; a lazy module also gets its first forward (on CPU, so both sides
    draw the same initial values)."""
    ci = sample.constructor_input
    # Float tensors among the arguments in the dtype under test, as the
    # module's own would be (FractionalMaxPool's _random_samples come as
    # float64, which CPU refuses beside float32 inputs).
    args, kwargs = tree_map(
        lambda v: v.detach().float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v,
        copy.deepcopy((ci.args, ci.kwargs)))
    torch.manual_seed(seed)
    m = MODULES[name].module_cls(*args, **kwargs)
    if is_lazy(name) and first_forward:
        with torch.no_grad():
            a, k = inputs(sample)
            m(*a, **k)
    return m.train(training)


def is_lazy(name):
    return issubclass(MODULES[name].module_cls, LazyModuleMixin)


def inputs(sample, device=None, noncontig=False):
    """(args, kwargs) of the sample's forward input: fresh leaf copies on
    device (CPU if None), optionally non-contiguous. A tensor given twice
    stays one tensor."""
    memo = {}

    def copy_one(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in memo:
            x = t.detach()
            x = make_noncontig(x, device) if noncontig else (
                x.to(device) if device is not None else x.clone())
            memo[id(t)] = x.requires_grad_(t.requires_grad)
        return memo[id(t)]
    fi = sample.forward_input
    return tree_map(copy_one, (fi.args, fi.kwargs))


def make_noncontig(x, device=None):
    """x's values as a non-contiguous tensor with a storage offset: a strided
    slice of a bigger buffer, transposed back and forth for 2+ dims."""
    if x.dim() == 0 or x.numel() == 0:
        return x.to(device) if device is not None else x.clone()
    src = x.transpose(-1, -2) if x.dim() >= 2 else x
    big = torch.stack([torch.zeros_like(src), src], dim=-1)
    v = (big.to(device) if device is not None else big)[..., 1]
    return v.transpose(-1, -2) if x.dim() >= 2 else v


def state_of(m):
    return dict(m.named_parameters()) | dict(m.named_buffers())


def copy_state(dst, values):
    """values ({name: tensor}) into dst's own parameters and buffers, in place."""
    with torch.no_grad():
        for n, t in state_of(dst).items():
            t.copy_(values[n])


def pair(name, sample, training):
    """(CPU module, tpu module) in the same state."""
    return build(name, sample, training), build(name, sample, training).to(TPU)


# ---- a step and its comparison ---------------------------------------------

def _call(f, *args, **kwargs):
    return f(*args, **kwargs)


def step(m, ins, cots=None, seed=STEP_SEED, noncontig=False, call=_call):
    """Forward under seed, then backward from the differentiable outputs,
    each made through call. Returns ({what: value}, the output gradients
    used). cots (CPU tensors) None: made here, reproducibly, from the
    outputs."""
    args, kwargs = ins
    torch.manual_seed(seed)
    out = call(m, *args, **kwargs)
    leaves = tree_flatten(out)[0]
    got = {f"output {i}": o for i, o in enumerate(leaves)}
    outs = [o for o in leaves if isinstance(o, torch.Tensor) and o.requires_grad]
    if cots is None:
        g = torch.Generator().manual_seed(COT_SEED)
        cots = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    if len(cots) != len(outs):
        raise AssertionError(f"{len(outs)} differentiable outputs, CPU has {len(cots)}")
    if outs:
        dev = outs[0].device
        grads = [make_noncontig(c, dev) if noncontig else c.to(dev) for c in cots]
        call(torch.autograd.backward, outs, grads)
    call(torchtpu.sync)
    ins_leaves = [t for t in tree_flatten(ins)[0] if isinstance(t, torch.Tensor)]
    for i, t in enumerate(ins_leaves):
        if t.requires_grad:
            got[f"gradient of input {i}"] = t.grad
    for n, p in m.named_parameters():
        got[f"gradient of {n}"] = p.grad
    for n, b in m.named_buffers():
        got[f"buffer {n}"] = b
    return got, cots


@functools.lru_cache(maxsize=None)
def site(name):
    """_call, as code of a file of its own per module. Fused mode runs a
    flush site's graphs op by op once most of its recent flushes brought a
    new graph (churn); in a program each module's step is a site of its own,
    so here too, or the fused check would soon test op-by-op runs only."""
    ns = {}
    exec(compile("def call(f, *args, **kwargs):\n    return f(*args, **kwargs)\n",
                 f"<{name} step>", "exec"), ns)
    return ns["call"]


def to_cpu(x, where):
    """A tpu result as a CPU tensor; a result elsewhere is a finding."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "tpu":
            raise Failure(f"{where} is on {x.device}, expected tpu")
        return x.detach().cpu()
    return x


def compare(actual, expected, tol, what="", on_tpu=True):
    """{what: value} of a tpu run (on_tpu: its tensors must be tpu tensors)
    against CPU's, entry by entry."""
    if set(actual) != set(expected):
        diff = sorted(set(actual) ^ set(expected))
        raise Failure(f"{what}entries differ from CPU's: {diff[:4]}")
    for key, e in expected.items():
        a = to_cpu(actual[key], f"{what}{key}") if on_tpu else actual[key]
        if isinstance(e, torch.Tensor):
            e = e.detach()
        try:
            torch.testing.assert_close(a, e, equal_nan=True, check_device=False,
                                       check_stride=False, **tol)
        except (AssertionError, TypeError) as err:
            # How far off, so that a run on another platform says what it measured.
            greatest = [ln.strip() for ln in str(err).splitlines() if ln.strip().startswith("Greatest")]
            raise Failure(f"{what}{key}: {short_error(err)} {' '.join(greatest)}".rstrip()) from err


def _meta(d):
    """Shapes and dtypes only (a random module's values are its own)."""
    return {k: (torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v)
            for k, v in d.items()}


def _as_cpu(d):
    return {k: to_cpu(v, k) for k, v in d.items()}


def _finite_where_cpu_is(actual, expected, what):
    for key, e in expected.items():
        a = actual[key]
        if (isinstance(e, torch.Tensor) and e.is_floating_point() and e.isfinite().all()
                and not a.detach().cpu().isfinite().all()):
            raise Failure(f"{what}{key}: non-finite values where CPU's are finite")


@functools.lru_cache(maxsize=8)
def is_random(name, training):
    """Whether the first sample's CPU output depends on the random stream."""
    sample = samples_of(name, training)[0]
    m = build(name, sample, training)
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        args, kwargs = inputs(sample)
        with torch.no_grad():
            outs.append(tree_flatten(m(*args, **kwargs))[0])
    try:
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, equal_nan=True)
    except AssertionError:
        return True
    return False


def match(name, sample, training, m_cpu, make_tpu, noncontig=False, what=""):
    """One step of make_tpu() (a tpu module) against m_cpu's on the sample."""
    exp, cots = step(m_cpu, inputs(sample), call=site(name))
    opts = dict(noncontig=noncontig, call=site(name))
    act, _ = step(make_tpu(), inputs(sample, TPU, noncontig=noncontig), cots, **opts)
    if not is_random(name, training):
        compare(act, exp, tolerance(name), what)
        return act
    compare(_meta(_as_cpu(act)), _meta(exp), {}, what, on_tpu=False)
    _finite_where_cpu_is(act, exp, what)
    again, _ = step(make_tpu(), inputs(sample, TPU, noncontig=noncontig), cots, **opts)
    compare(again, _as_cpu(act), dict(rtol=0, atol=0), what + "same seed, ")
    return act


# ---- the kinds ---------------------------------------------------------------

@contextlib.contextmanager
def _foreground_compiles():
    """Fused graphs compiled when first met, so a step runs as its graphs
    (not op by op while they compile: tiered compilation's first run)."""
    name = config.FUSED_COMPILE.name
    previous = os.environ.get(name)
    config.FUSED_COMPILE.set("sync")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name)
        else:
            os.environ[name] = previous


def _kind_steps(name, training, n, mode=None):
    """train / eval / debug / fused: a step of each sample in a fresh pair
    (fused: as fused graphs, compiled when first met)."""
    ran = 0
    before = metrics.snapshot()
    for sample in samples_of(name, training)[:n]:
        with (torchtpu.eager_mode(mode) if mode else contextlib.nullcontext(),
              _foreground_compiles() if mode == "fused" else contextlib.nullcontext()):
            m_cpu, m_tpu = pair(name, sample, training)
            match(name, sample, training, m_cpu, _once(m_tpu, name, sample, training))
        ran += 1
    if mode == "fused":
        after = metrics.snapshot()
        graphs = sum(after[k] - before[k] for k in ("graphs_compiled", "graph_cache_hits"))
        if after["fused_fallbacks"] > before["fused_fallbacks"] or not graphs:
            raise Failure("fused mode ran the step op by op, not as fused graphs")
    return ran


def _kind_noncontig(name):
    sample = samples_of(name, True)[0]
    m_cpu, m_tpu = pair(name, sample, True)
    match(name, sample, True, m_cpu, _once(m_tpu, name, sample, True), noncontig=True,
          what="non-contiguous inputs: ")


def _once(m_tpu, name, sample, training):
    """make_tpu for an existing tpu module: itself, then (for a random module's
    repeat) a fresh module holding its starting state."""
    states = {k: v.detach().cpu() for k, v in state_of(m_tpu).items()}
    used = []

    def make():
        if not used:
            used.append(1)
            return m_tpu
        m = build(name, sample, training).to(TPU)
        copy_state(m, states)
        return m
    return make


def _kind_train_eval(name):
    sample = samples_of(name, True)[0]
    m_cpu, m_tpu = pair(name, sample, True)
    for phase, training in (("train", True), ("eval", False), ("train again", True)):
        m_cpu.train(training)
        got = m_tpu.train(training)
        if got is not m_tpu:
            raise Failure(f"{phase}: train({training}) did not return the module")
        wrong = [n for n, mod in m_tpu.named_modules() if mod.training != training]
        if wrong:
            raise Failure(f"{phase}: submodules {wrong[:3]} have training={not training}")
        exp, cots = step(m_cpu, inputs(sample))
        act, _ = step(m_tpu, inputs(sample, TPU), cots)
        if is_random(name, training):  # dropout: values in eval() only
            compare(_meta(_as_cpu(act)), _meta(exp), {}, f"{phase}: ", on_tpu=False)
        else:
            compare(act, exp, tolerance(name), f"{phase}: ")
        m_cpu.zero_grad(set_to_none=True)
        m_tpu.zero_grad(set_to_none=True)


def _check_state(m_tpu, expected, what, device="tpu", dtype=None):
    """Each parameter and buffer of m_tpu: on device, CPU's value (cast to
    dtype), a Parameter where CPU has one."""
    mine = state_of(m_tpu)
    if set(mine) != set(expected):
        raise Failure(f"{what}: state names {sorted(set(mine) ^ set(expected))[:4]} differ")
    for n, e in expected.items():
        t = mine[n]
        if t.device.type != device:
            raise Failure(f"{what}: {n} is on {t.device}, expected {device}")
        if isinstance(e, nn.Parameter) != isinstance(t, nn.Parameter):
            raise Failure(f"{what}: {n} is a {type(t).__name__}, CPU has a {type(e).__name__}")
        want = e.detach().to(dtype) if dtype is not None and e.is_floating_point() else e.detach()
        try:
            torch.testing.assert_close(t.detach().cpu(), want, rtol=0, atol=0, equal_nan=True)
        except AssertionError as err:
            raise Failure(f"{what}: {n}: {short_error(err)}") from err


def _eval_pair(name):
    sample = samples_of(name, False)[0]
    return (sample, *pair(name, sample, False))


def _kind_to(name):
    sample = samples_of(name, False)[0]
    ref = build(name, sample, False)
    m = build(name, sample, False)
    before = dict(m.named_parameters())
    if m.to(TPU) is not m:
        raise Failure('.to("tpu") did not return the module')
    for n, p in m.named_parameters():
        if p is not before[n]:
            raise Failure(f'.to("tpu") replaced parameter {n} by a new object '
                          "(a module moved to CUDA keeps its Parameter objects)")
    _check_state(m, state_of(ref), '.to("tpu")')
    match(name, sample, False, ref, lambda: m, what='after .to("tpu"): ')
    grads = {n: p.grad for n, p in ref.named_parameters()}
    m.to(torch.float64)
    _check_state(m, state_of(ref), ".to(float64)", dtype=torch.float64)
    for n, p in m.named_parameters():
        if grads[n] is not None:
            if p.grad is None or p.grad.dtype != torch.float64:
                raise Failure(f".to(float64): gradient of {n} not converted along "
                              f"({None if p.grad is None else p.grad.dtype})")
            compare({"gradient": p.grad}, {"gradient": grads[n].double()}, tolerance(name),
                    f".to(float64): {n}'s ")
    ref.to(torch.float64).to(torch.float32)
    m.to(torch.float32)
    _check_state(m, state_of(ref), ".to(float64) and back")
    # A step after the round trip: what a module keeps beside its parameters
    # (an RNN's flat weights) follows the conversions.
    m.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    match(name, sample, False, ref, lambda: m, what=".to(float64) and back: ")
    m.cpu()
    for n, p in m.named_parameters():
        if p is not before[n]:
            raise Failure(f".cpu() replaced parameter {n} by a new object")
    mine = state_of(m)
    for n, t in state_of(ref).items():
        if mine[n].device.type != "cpu" or not torch.equal(mine[n].detach(), t.detach()):
            raise Failure(f".cpu(): {n} is on {mine[n].device} or its values differ")
    if is_lazy(name):
        _kind_to_lazy(name, sample, ref)


def _kind_to_lazy(name, sample, ref):
    """A lazy module moved to tpu before its first forward (as a script does
    with `model.to(device)`) stays uninitialized, and that forward creates
    its parameters on tpu with CPU's shapes and dtypes."""
    m = build(name, sample, False, first_forward=False).to(TPU)
    for n, p in m.named_parameters():
        if not isinstance(p, nn.parameter.UninitializedParameter):
            raise Failure(f'.to("tpu") of a lazy module made its uninitialized parameter {n} '
                          f"a {type(p).__name__} of shape {tuple(p.shape)}")
    with torch.no_grad():
        args, kwargs = inputs(sample, TPU)
        m(*args, **kwargs)
    expected = state_of(ref)
    for n, t in state_of(m).items():
        e = expected[n]
        if (t.device.type, t.shape, t.dtype, type(t) is nn.Parameter) != (
                "tpu", e.shape, e.dtype, type(e) is nn.Parameter):
            raise Failure(f"lazy module's first forward on tpu: {n} is {type(t).__name__} "
                          f"{t.device} {tuple(t.shape)} {t.dtype}")
    copy_state(m, expected)
    match(name, sample, False, ref, lambda: m, what="lazy module initialized on tpu: ")


def _kind_meta(name):
    sample, m_cpu, m_tpu = _eval_pair(name)
    cpu_state = state_of(m_cpu)
    m_tpu.to("meta")
    for where, dev in (('.to("meta")', "meta"), ('.to_empty(device="tpu")', "tpu")):
        if dev == "tpu":
            m_tpu.to_empty(device="tpu")
        for n, t in state_of(m_tpu).items():
            e = cpu_state[n]
            if (t.device.type, t.shape, t.dtype) != (dev, e.shape, e.dtype):
                raise Failure(f"{where}: {n} is {t.device} {tuple(t.shape)} {t.dtype}, "
                              f"expected {dev} {tuple(e.shape)} {e.dtype}")
            if isinstance(e, nn.Parameter) != isinstance(t, nn.Parameter):
                raise Failure(f"{where}: {n} is a {type(t).__name__}, expected {type(e).__name__}")
    copy_state(m_tpu, state_of(m_cpu))
    match(name, sample, False, m_cpu, lambda: m_tpu,
          what="after to_empty and copying CPU's values in: ")


def _kind_state_dict(name):
    sample, m_cpu, _ = _eval_pair(name)
    m_tpu = build(name, sample, False, seed=SEED + 1).to(TPU)
    before = state_of(m_tpu)
    m_tpu.load_state_dict(m_cpu.state_dict())
    after = state_of(m_tpu)
    for n, t in before.items():
        if after[n] is not t:
            raise Failure(f"load_state_dict replaced {n} (it copies into the module's own tensors)")
    _check_state(m_tpu, state_of(m_cpu), "load_state_dict(CPU state)")
    sd = m_tpu.state_dict()
    cpu_sd = m_cpu.state_dict()
    if list(sd) != list(cpu_sd):
        raise Failure(f"state_dict keys {list(sd)[:4]} differ from CPU's {list(cpu_sd)[:4]}")
    for k, v in sd.items():
        if v.device.type != "tpu" or v.dtype != cpu_sd[k].dtype:
            raise Failure(f"state_dict()[{k!r}] is {v.device} {v.dtype}")
    back = build(name, sample, False, seed=SEED + 1)
    back.load_state_dict(sd)
    for n, t in state_of(back).items():
        if t.device.type != "cpu" or not torch.equal(t.detach(), state_of(m_cpu)[n].detach()):
            raise Failure(f"tpu state_dict into a CPU module: {n} is on {t.device} or differs")
    match(name, sample, False, m_cpu, lambda: m_tpu, what="after load_state_dict: ")


def _round_trip(name, fn, what):
    """m_tpu after a step (so it holds gradients) through fn: the copy's state
    and gradients, a step of the copy, and no storage shared with m_tpu."""
    sample, m_cpu, m_tpu = _eval_pair(name)
    match(name, sample, False, m_cpu, lambda: m_tpu, what="before the copy: ")
    m_ref = fn(m_cpu)  # what the same round trip keeps on CPU (gradients or not)
    m2 = fn(m_tpu)
    _check_state(m2, state_of(m_ref), what)
    for n, p in m2.named_parameters():
        e = dict(m_ref.named_parameters())[n].grad
        if (p.grad is None) != (e is None):
            raise Failure(f"{what}: gradient of {n} is {'kept' if e is None else 'dropped'}"
                          f" (CPU's is {'dropped' if e is None else 'kept'})")
        if e is not None:
            compare({"g": p.grad}, {"g": e}, tolerance(name),
                    f"{what}: gradient of {n} ")
    # Writing the copy leaves the original as it was (no storage shared).
    ref_state = state_of(m_ref)
    with torch.no_grad():
        for n, t in state_of(m2).items():
            t.copy_(ref_state[n] + 1)
    _check_state(m_tpu, ref_state, f"the original after writing its {what} copy")
    copy_state(m2, ref_state)
    m2.zero_grad(set_to_none=True)
    m_cpu.zero_grad(set_to_none=True)
    match(name, sample, False, m_cpu, lambda: m2, what=f"after {what}: ")


def _torch_save(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _kind_save_load(name):
    _round_trip(name, _torch_save, "torch.save/torch.load")
    sample, m_cpu, m_tpu = _eval_pair(name)
    buf = io.BytesIO()
    torch.save(m_tpu.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)  # weights_only, as torch.load defaults to
    cpu_sd = m_cpu.state_dict()
    if list(sd) != list(cpu_sd):
        raise Failure(f"loaded state_dict keys {list(sd)[:4]} differ from {list(cpu_sd)[:4]}")
    compare(sd, cpu_sd, dict(rtol=0, atol=0), "torch.load(state_dict) ")


KIND_FNS = {
    "noncontig": _kind_noncontig,
    "train_eval": _kind_train_eval,
    "to": _kind_to,
    "meta": _kind_meta,
    "state_dict": _kind_state_dict,
    "deepcopy": lambda name: _round_trip(name, copy.deepcopy, "copy.deepcopy"),
    "pickle": lambda name: _round_trip(name, lambda m: pickle.loads(pickle.dumps(m)), "pickle"),
    "save_load": _kind_save_load,
}


def check(name, kind, samples=1, timeout=None):
    """Run one kind of check of one module; see the module docstring."""
    if not samples_of(name, kind not in EVAL_KINDS):
        return Result(name, kind, "skip", "no sample with a forward input")
    before = metrics.M.cpu_fallbacks.copy()
    status, error, ran = "pass", "", 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with time_limit(timeout), torchtpu.eager_mode("strict"):
                if kind in ("train", "eval"):
                    ran = _kind_steps(name, kind == "train", samples)
                elif kind in ("debug", "fused"):
                    ran = _kind_steps(name, True, 1, mode=kind)
                else:
                    KIND_FNS[kind](name)
            torchtpu.sync()
        except Exception as e:  # noqa: BLE001 - any failure is a finding
            status, error = "fail", short_error(e)
    after = metrics.M.cpu_fallbacks
    fallbacks = tuple(sorted(k for k in after if after[k] > before.get(k, 0)))
    if status == "pass" and fallbacks:
        status = "fallback"
    return Result(name, kind, status, error, fallbacks, ran)


# ---- a check in a child process ------------------------------------------------

# The forkserver imports these once; each isolated check forks from it and
# imports torchtpu itself (importing it starts JAX's threads, and a process
# with threads must not fork).
_PRELOAD = ["torch", "jax", "jax.numpy", "torch.testing._internal.common_modules"]


def _child(conn, name, kind, samples, timeout):
    conn.send(check(name, kind, samples, timeout).as_dict())
    conn.close()


def check_isolated(name, kind, samples=1, timeout=120):
    """check() in a child process: a crash (a segfault) or a hang becomes a
    failed Result instead of taking the caller down."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, name, kind, samples, timeout), daemon=True)
    proc.start()
    send.close()
    got = None
    try:
        if recv.poll(timeout + 60):
            got = recv.recv()
    except EOFError:
        pass
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if got is None:
        why = "timed out" if proc.exitcode in (None, -9) else f"exit code {proc.exitcode}"
        return Result(name, kind, "fail", f"process crashed ({why})")
    got["fallbacks"] = tuple(got["fallbacks"])
    return Result(**got)
