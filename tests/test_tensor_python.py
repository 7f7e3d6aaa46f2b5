"""What a PyTorch program does to a tpu tensor or module outside the op
table, as on CPU: deepcopy, storages, `.to("meta")`, inference mode,
checkpointing with dropout, torch.func; and no path that crashes the
process (those run in a child process)."""
import copy
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torchtpu

from conftest import assert_same

CHILD_TIMEOUT = 300  # seconds: a hang fails the test instead of stalling the suite


# ---- deepcopy ---------------------------------------------------------------

def test_deepcopy_tensor_and_views_share_as_on_cpu(mode):
    cpu = torch.arange(12.).reshape(3, 4)
    tpu = cpu.to("tpu")
    for base in (cpu, tpu):
        base.tag = {"k": [1]}
    c_copy, c_view = copy.deepcopy((cpu, cpu[1:, ::2]))
    t_copy, t_view = copy.deepcopy((tpu, tpu[1:, ::2]))
    assert t_copy.is_tpu and t_view.is_tpu
    assert t_copy.tag == {"k": [1]} and t_copy.tag is not tpu.tag
    # The copies of a tensor and its view share one new storage.
    c_copy[1, 0] = 100.
    t_copy[1, 0] = 100.
    assert_same(t_view, c_view)
    assert_same(tpu, cpu)  # the originals are untouched
    assert t_view.storage_offset() == c_view.storage_offset() and t_view.stride() == c_view.stride()
    tpu[0, 0] = -1.  # and writes to the original do not reach the copy
    assert t_copy[0, 0].item() == 0.


def test_deepcopy_parameter_as_parameters_own(mode):
    # Parameter.__deepcopy__ copies the data only: no grad, no attributes.
    cpu = nn.Parameter(torch.randn(3))
    tpu = nn.Parameter(cpu.detach().to("tpu"))
    for p in (cpu, tpu):
        p.grad = torch.ones(3, device=p.device)
        p.note = "not kept"
    c, q = copy.deepcopy(cpu), copy.deepcopy(tpu)
    assert isinstance(q, nn.Parameter) and q.requires_grad and q.is_leaf
    assert_same(q, c.detach())
    assert (q.grad, c.grad) == (None, None)
    assert not hasattr(q, "note") and not hasattr(c, "note")
    with torch.no_grad():
        q.add_(1)
    assert_same(tpu, cpu.detach())  # the original is untouched
    plain = torch.ones(2, device="tpu", requires_grad=True)
    plain.grad = torch.full((2,), 3., device="tpu")
    assert_same(copy.deepcopy(plain).grad, torch.full((2,), 3.))  # a tensor's grad is copied
    frozen = copy.deepcopy(nn.Parameter(torch.zeros(2, device="tpu"), requires_grad=False))
    assert isinstance(frozen, nn.Parameter) and not frozen.requires_grad


def test_deepcopy_of_a_non_leaf_raises_cpus_error():
    y = torch.randn(2, device="tpu", requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(y)


def test_deepcopy_of_a_pending_value_in_fused_mode():
    with torchtpu.eager_mode("fused"):
        x = torch.arange(4., device="tpu") * 3
        y = copy.deepcopy(x)
        x.add_(1)
        assert_same(y, torch.arange(4.) * 3)
        assert_same(x, torch.arange(4.) * 3 + 1)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.head(self.bn(self.lin(x)).relu())


def test_deepcopy_module_optimizer_and_averaged_model(mode):
    torch.manual_seed(0)
    cpu = _Net()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(5, 3)
    opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (cpu, tpu)]
    for m, opt, inp in ((cpu, opts[0], x), (tpu, opts[1], x.to("tpu"))):
        m(inp).square().mean().backward()
        opt.step()
    tpu_copy, opt_copy = copy.deepcopy((tpu, opts[1]))
    assert all(p.is_tpu for p in tpu_copy.parameters()) and tpu_copy.bn.running_mean.is_tpu
    assert_same(tpu_copy(x.to("tpu")), cpu(x), atol=1e-5, rtol=1e-5)
    # The optimizer's copy holds the module copy's parameters and its state.
    assert set(map(id, opt_copy.param_groups[0]["params"])) == set(map(id, tpu_copy.parameters()))
    state = opt_copy.state[tpu_copy.lin.weight]
    assert_same(state["exp_avg"], opts[0].state[cpu.lin.weight]["exp_avg"], atol=1e-6, rtol=1e-5)
    # Stepping the copy leaves the original alone.
    before = tpu.lin.weight.detach().cpu()
    tpu_copy(x.to("tpu")).sum().backward()
    opt_copy.step()
    assert torch.equal(tpu.lin.weight.detach().cpu(), before)
    # torch.optim.swa_utils deep-copies the model it averages.
    averaged = [torch.optim.swa_utils.AveragedModel(m) for m in (cpu, tpu)]
    for a, m in zip(averaged, (cpu, tpu)):
        a.update_parameters(m)
        a.update_parameters(m)
    assert_same(averaged[1](x.to("tpu")), averaged[0](x), atol=1e-5, rtol=1e-5)


# ---- storages ----------------------------------------------------------------

def test_storage_of_a_temporary_tensor_stays_readable():
    storage = (torch.arange(3., device="tpu") * 2).untyped_storage()
    assert storage.device.type == "tpu" and storage.nbytes() == 12
    assert bytes(storage.cpu()) == bytes((torch.arange(3.) * 2).untyped_storage())
    assert storage.tolist() == (torch.arange(3.) * 2).untyped_storage().tolist()
    t = torch.arange(4., device="tpu")
    assert t.untyped_storage() is t.untyped_storage()
    assert t[1:].data_ptr() - t.data_ptr() == 4
    assert t.clone().data_ptr() != t.data_ptr()


def test_storage_clone_deepcopy_and_copy_are_new_storages():
    t = torch.arange(4., device="tpu")
    for made in (t.untyped_storage().clone(), copy.deepcopy(t.untyped_storage()),
                 copy.copy(t.untyped_storage())):
        assert made.device.type == "tpu" and made.data_ptr() != t.data_ptr()
        view = torch.empty(0, device="tpu").set_(made)
        view.add_(1)
        assert_same(view, torch.arange(4.) + 1)
    assert_same(t, torch.arange(4.))
    typed = t.storage()
    assert typed.double().tolist() == [0., 1., 2., 3.] and typed.tolist() == [0., 1., 2., 3.]
    assert t.untyped_storage().to(device="cpu").tolist() == torch.arange(4.).untyped_storage().tolist()


def test_storage_byte_writes_raise_python_errors():
    storage = torch.arange(4., device="tpu").untyped_storage()
    for write in (lambda: storage.fill_(0), lambda: storage.byteswap(torch.float32),
                  lambda: storage.copy_(torch.zeros(16, dtype=torch.uint8).untyped_storage()),
                  lambda: storage.__setitem__(0, 1), lambda: storage[0:4],
                  lambda: storage.to(device="tpu:1")):
        with pytest.raises(RuntimeError, match="tpu storage"):
            write()
    with pytest.raises(TypeError, match="only CPU memory can be pinned"):
        storage.pin_memory()
    assert not storage.is_pinned()


def test_set_onto_a_tensor_or_nothing_and_as_strided_bounds(mode):
    cpu, tpu = torch.arange(6.), torch.arange(6., device="tpu")
    for t in (cpu, tpu):
        alias = torch.empty(0, device=t.device).set_(t)
        alias.add_(1)  # writes reach the tensor it was set to
        assert alias.data_ptr() == t.data_ptr()
        empty = t.clone().set_()
        assert empty.shape == (0,) and empty.stride() == (1,)
        with pytest.raises(RuntimeError, match="Could not set tensor of type"):
            torch.empty(0, dtype=torch.int64, device=t.device).set_(t)
        with pytest.raises(RuntimeError, match="out of bounds for storage of size 24"):
            t.as_strided((10,), (1,))
    assert_same(tpu, cpu)
    assert_same(tpu.view(torch.uint8)[4:8], cpu.view(torch.uint8)[4:8])
    assert_same(tpu[2:].as_strided((2,), (3,), 1), cpu[2:].as_strided((2,), (3,), 1))


_CRASH_PATHS = """
import copy, pickle, torch, torchtpu
from torch import nn
t = torch.arange(6., device="tpu")
s = t.untyped_storage()
copy.deepcopy(t); copy.deepcopy(t[2:]); copy.copy(t)
s.clone(); copy.deepcopy(s); copy.copy(s); pickle.loads(pickle.dumps(s))
t.storage().double(); t.storage().cpu(); s.cpu(); bytes(s)
# TypedStorage (deprecated) clones only storages of its own C++ class.
for bad in (lambda: t.storage().clone(), lambda: t.storage().float(), lambda: s.byteswap(torch.float32), lambda: s.fill_(1),
            lambda: torch.zeros(3).set_(s, 0, (3,), (1,)), lambda: t.set_(torch.zeros(3).untyped_storage()),
            lambda: t.__dlpack__(), lambda: torch.from_dlpack(t), lambda: t.numpy()):
    try:
        bad()
    except Exception:
        pass
m = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to("tpu")
copy.deepcopy(m)
torch.optim.swa_utils.AveragedModel(m)
print("done")
"""


def test_no_storage_path_crashes_the_process():
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(_CRASH_PATHS)],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("done")


# ---- devices: meta ------------------------------------------------------------

def test_to_meta_and_back_with_to_empty(mode):
    t = torch.randn(3, 4, device="tpu", dtype=torch.float64).t()
    m = t.to("meta")
    assert m.is_meta and m.shape == t.shape and m.stride() == t.stride() and m.dtype == t.dtype
    assert t.to("meta", torch.float16).dtype == torch.float16
    model = nn.Linear(3, 2).to("tpu")
    weight = model.weight
    model.to("meta")
    assert model.weight is weight and weight.is_meta and isinstance(weight, nn.Parameter)
    model.to_empty(device="tpu")
    assert model.weight is weight and weight.is_tpu and weight.shape == (2, 3)
    with torch.no_grad():
        model.weight.fill_(1.)
        model.bias.zero_()
    assert_same(model(torch.ones(1, 3, device="tpu")), torch.full((1, 2), 3.))


# ---- inference mode -------------------------------------------------------------

def test_views_and_item_under_inference_mode(mode):
    cpu = torch.randn(3, 4)
    tpu = cpu.to("tpu")
    before = dict(torchtpu.metrics.M.cpu_fallbacks)
    results = []
    for t in (cpu, tpu):
        with torch.inference_mode():
            row, flat, tr = t[1], t.view(12), t.transpose(0, 1)
            made = t * 2
            results.append((row, flat, tr, made[1:], row.sum().item(), row.is_inference(),
                            made[1:].is_inference()))
    (cr, cf, ct, cm, ci, cinf, cminf), (tr_, tf, tt, tm, ti, tinf, tminf) = results
    for got, want in ((tr_, cr), (tf, cf), (tt, ct), (tm, cm)):
        assert_same(got, want)
    assert ti == pytest.approx(ci, rel=1e-6)
    assert (tinf, tminf) == (cinf, cminf) == (False, True)
    assert dict(torchtpu.metrics.M.cpu_fallbacks) == before
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)).to("tpu")
    with torch.inference_mode():
        out = model(tpu)
    assert out.is_inference() and out.shape == (3, 3)


def test_composite_ops_under_inference_mode_as_on_cpu(mode):
    # With autograd's keys off, ops with a composite kernel reach the device
    # whole; they run CPU's composite, which reads the op's own arguments
    # (the reduction as its enum: 'sum' had raised, or given the mean).
    a, b, y = torch.randn(6), torch.randn(6), torch.randn(6).sign()
    x, w, target = torch.randn(8, 5), torch.randn(4, 5), torch.randint(0, 4, (8,))
    cases = [lambda d: F.margin_ranking_loss(a.to(d), b.to(d), y.to(d), margin=0.1, reduction=red)
             for red in ("mean", "sum", "none")]
    cases += [lambda d: F.cosine_embedding_loss(x[:6].to(d), x[2:].to(d), y.to(d), reduction="sum"),
              lambda d: F.hinge_embedding_loss(a.to(d), y.to(d), reduction="sum"),
              lambda d: F.cross_entropy(x.to(d) @ w.to(d).T, target.to(d), reduction="sum")]
    if hasattr(nn, "LinearCrossEntropyLoss"):  # torch 2.13
        loss = nn.LinearCrossEntropyLoss(5, 4, reduction="sum")
        on_tpu = copy.deepcopy(loss).to("tpu")
        cases.append(lambda d: (loss if d == "cpu" else on_tpu)(x.to(d), target.to(d)))
    for i, case in enumerate(cases):
        with torch.inference_mode():
            want, got = case("cpu"), case("tpu")
        assert_same(got, want, atol=1e-5, rtol=1e-5, msg=f"case {i}")


# ---- random state: checkpointing with dropout, fork_rng ---------------------------

@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_with_dropout_gives_the_unchecked_gradients(mode, reentrant):
    lin = nn.Linear(8, 8).to("tpu")
    drop = nn.Dropout(0.5)

    def block(x):
        return drop(lin(x)).relu().sum(-1)

    x = torch.randn(4, 8, device="tpu", requires_grad=True)
    grads = []
    for wrap in (block, lambda x: checkpoint(block, x, use_reentrant=reentrant)):
        torch.manual_seed(1)
        out = wrap(x)
        out.sum().backward()
        grads.append((out.detach().cpu(), x.grad.cpu(), lin.weight.grad.cpu()))
        x.grad = lin.weight.grad = None
    for plain, checked in zip(*grads):
        torch.testing.assert_close(checked, plain)
    torch.manual_seed(2)  # the mask depends on the random state: a new draw differs
    assert not torch.equal(block(x).detach().cpu(), grads[0][0])


def test_fork_rng_restores_the_device_stream():
    torch.manual_seed(0)
    with torch.random.fork_rng(device_type="tpu"):
        inside = torch.rand(3, device="tpu")
    after = torch.rand(3, device="tpu")
    assert_same(after, inside.cpu())
    with torch.random.fork_rng(devices=[0], device_type="tpu"):
        torch.rand(3, device="tpu")
    assert not torch.equal(torch.rand(3, device="tpu").cpu(), after.cpu())


# ---- torch.func ----------------------------------------------------------------------

def test_torch_func_transforms(mode):
    from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    params = {k: v.detach() for k, v in model.named_parameters()}
    tpu_params = {k: v.to("tpu") for k, v in params.items()}

    def loss(p, inp):
        return functional_call(model, p, (inp,)).square().sum()

    model_tpu = copy.deepcopy(model).to("tpu")

    def loss_tpu(p, inp):
        return functional_call(model_tpu, p, (inp,)).square().sum()

    g_cpu, g_tpu = grad(loss)(params, x), grad(loss_tpu)(tpu_params, x.to("tpu"))
    for k in params:
        assert_same(g_tpu[k], g_cpu[k], atol=1e-5, rtol=1e-5)
    f = lambda v: v.sin() * v  # noqa: E731
    assert_same(jacrev(f)(x[0].to("tpu")), jacrev(f)(x[0]), atol=1e-6, rtol=1e-5)
    assert_same(vmap(torch.outer)(x.to("tpu"), x.to("tpu")), vmap(torch.outer)(x, x))
    (out_c, fn_c), (out_t, fn_t) = vjp(f, x), vjp(f, x.to("tpu"))
    assert_same(out_t, out_c)
    assert_same(fn_t(torch.ones(4, 3, device="tpu"))[0], fn_c(torch.ones(4, 3))[0], atol=1e-6, rtol=1e-5)
    # Forward mode (jvp, jacfwd, hessian): its tangent checks are answered
    # on tpu, not by the CPU fallback.
    before = dict(torchtpu.metrics.M.cpu_fallbacks)
    ones = torch.ones(4, 3)
    (out_c, tan_c), (out_t, tan_t) = jvp(f, (x,), (ones,)), jvp(f, (x.to("tpu"),), (ones.to("tpu"),))
    assert_same(out_t, out_c)
    assert_same(tan_t, tan_c, atol=1e-6, rtol=1e-5)
    assert_same(jacfwd(f)(x[0].to("tpu")), jacfwd(f)(x[0]), atol=1e-6, rtol=1e-5)
    h = lambda v: (v.sin() * v).sum()  # noqa: E731
    assert_same(hessian(h)(x[0].to("tpu")), hessian(h)(x[0]), atol=1e-5, rtol=1e-5)
    assert dict(torchtpu.metrics.M.cpu_fallbacks) == before


# ---- pickle of modules -------------------------------------------------------------------

def test_pickle_and_save_of_a_module_round_trip(tmp_path):
    torch.manual_seed(0)
    cpu = _Net().eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(2, 3)
    again = pickle.loads(pickle.dumps(tpu))
    torch.save(tpu, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    for m in (again, loaded):
        assert all(p.is_tpu and isinstance(p, nn.Parameter) for p in m.parameters())
        assert_same(m(x.to("tpu")), cpu(x), atol=1e-5, rtol=1e-5)


def test_ema_and_swa_with_update_bn_as_on_cpu():
    # torch.optim.swa_utils as its docs show it: an EMA model over
    # parameters and buffers, SWALR, and update_bn over a loader.
    from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    outs = []
    for model, device in ((cpu, "cpu"), (copy.deepcopy(cpu).to("tpu"), "tpu")):
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = SWALR(opt, swa_lr=0.05)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(16, 4, generator=g).to(device), torch.randn(16, 1, generator=g).to(device)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
            ema.update_parameters(model)
        update_bn([torch.randn(16, 4, generator=g).to(device) for _ in range(2)], ema)
        outs.append(ema.eval()(torch.linspace(-1, 1, 12).reshape(3, 4).to(device)))
    assert_same(outs[1], outs[0].detach(), atol=1e-5, rtol=1e-5)


def test_a_loaded_tensor_is_its_whole_storage():
    # A tensor rebuilt by pickle or torch.load over all of its saved bytes is
    # its storage array, as one made on tpu is (same kernel key, so the
    # original's kernels serve it, not a view's). Views saved with it still
    # view the same storage.
    import io
    w = torch.randn(8, 10, device="tpu")
    buffer = io.BytesIO()
    torch.save({"w": w, "rows": w[1:3], "t": w.t()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded["w"]._view is None and loaded["w"]._key == w._key
    assert_same(loaded["w"] * 2 + 1, (w * 2 + 1).cpu())
    loaded["w"].add_(1)
    assert_same(loaded["rows"], w[1:3].cpu() + 1)
    assert_same(loaded["t"], w.t().cpu() + 1)
    alone = pickle.loads(pickle.dumps(w[2:]))  # a view pickled alone: its storage stays flat
    assert_same(alone, w[2:].cpu())
    assert pickle.loads(pickle.dumps(w))._key == w._key
