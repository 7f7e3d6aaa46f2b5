"""DTensor, FSDP2 (`fully_shard`) and tensor parallelism (`parallelize_module`)
on tpu tensors, in processes started with torchrun's environment (two; four
for a 2-D mesh): the functional collectives against the same calls through
gloo on CPU tensors, and each training run against a single process
training on the whole batch on CPU."""
import textwrap

import pytest
import torch
from processes import run_ranks

# What both workers share: set-up, comparisons, the model and its training
# on one CPU process.
COMMON = textwrap.dedent("""\
    import datetime, json, sys, warnings
    import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
    import torch.distributed._functional_collectives as funcol
    import torchtpu
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    warnings.simplefilter("ignore", FutureWarning)
    out = sys.argv[1]
    device = torch.device("tpu", torch.tpu.current_device())
    dist.init_process_group(device_id=device, timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"sections": {}}

    def section(name):
        result["sections"][name] = []
        return result["sections"][name]

    def close(failures, name, got, want, atol):
        got = got.detach().cpu()
        if got.dtype != want.dtype or got.shape != want.shape:
            failures.append(f"{name}: {got.dtype} {tuple(got.shape)} != "
                            f"{want.dtype} {tuple(want.shape)}")
        elif not torch.allclose(got, want, rtol=1e-5, atol=atol):
            failures.append(f"{name}: off by {(got - want).abs().max().item():.3g}")

    # ---- training: 3 AdamW steps against one process on the whole batch ----
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def reference(losses=None):
        # losses: where each step's loss on the first half of the batch
        # (rank 0's in 2 processes) goes.
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for _ in range(3):
            if losses is not None:
                with torch.no_grad():
                    losses.append(F.mse_loss(model(X[:4]), Y[:4]).item())
            F.mse_loss(model(X), Y).backward()
            opt.step()
            opt.zero_grad()
        return list(model.parameters())

    def reference_mixed():
        # FSDP2's MixedPrecisionPolicy(bf16, fp32) in torch ops on CPU: each
        # rank's half of the batch through bf16 copies of the parameters,
        # the bf16 gradients averaged in fp32, the fp32 parameters stepped.
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for _ in range(3):
            grads = []
            for r in range(world):
                low = {n: p.detach().bfloat16().requires_grad_()
                       for n, p in model.named_parameters()}
                rows = slice(4 * r, 4 * r + 4)
                out = torch.func.functional_call(model, low, (X[rows].bfloat16(),))
                F.mse_loss(out.float(), Y[rows]).backward()
                grads.append([low[n].grad.float() for n, _ in model.named_parameters()])
            for p, *gs in zip(model.parameters(), *grads):
                p.grad = sum(gs) / world
            opt.step()
            opt.zero_grad()
        return list(model.parameters())

    def train(model, x, y):
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for _ in range(3):
            F.mse_loss(model(x.to("tpu")).float(), y.to("tpu")).backward()
            opt.step()
            opt.zero_grad()
        return list(model.parameters())

    def compare(failures, got, want, atol):
        for i, (p, q) in enumerate(zip(got, want, strict=True)):
            close(failures, f"parameter {i}", p.full_tensor(), q.detach(), atol)

""")

END = textwrap.dedent("""\
    result["training_fallbacks"] = dict(torchtpu.metrics.M.cpu_fallbacks)
    dist.destroy_process_group()
    json.dump(result, open(out, "w"))
""")

# Two processes: the functional collectives, DTensor, FSDP2, TP.
WORKER = COMMON + textwrap.dedent("""\
    gloo = dist.new_group(backend="gloo")
    mesh = init_device_mesh("tpu", (world,))
    result["mesh"] = [mesh.device_type, mesh.size()]
    half = slice(4 * rank, 4 * rank + 4)

    # ---- the functional collectives: tpu tensors against gloo on CPU -------
    failures = section("functional")
    fallbacks = dict(torchtpu.metrics.M.cpu_fallbacks)

    def data(dev, n=4, dtype=torch.float32):
        return (torch.arange(n * 2, dtype=torch.float64).reshape(n, 2) * (rank + 1)
                - 3.25 * rank).to(dtype).to(dev)

    def name_of(group):
        return group.group_name if isinstance(group, dist.ProcessGroup) else \
            group.get_group().group_name

    CALLS = {
        "all_reduce sum": lambda d, g: funcol.all_reduce(data(d), "sum", g),
        "all_reduce avg": lambda d, g: funcol.all_reduce(data(d), "avg", g),
        "all_reduce max int64": lambda d, g: funcol.all_reduce(
            data(d, dtype=torch.int64), "max", g),
        "all_reduce_coalesced": lambda d, g: torch.cat(funcol.all_reduce_coalesced(
            [data(d), data(d, 2) * 2], "sum", g)),
        "all_reduce_inplace": lambda d, g: funcol.all_reduce_inplace(data(d), "min", g),
        "all_gather_tensor dim 0": lambda d, g: funcol.all_gather_tensor(data(d), 0, g),
        "all_gather_tensor dim 1": lambda d, g: funcol.all_gather_tensor(data(d), 1, g),
        "all_gather_tensor_autograd": lambda d, g: funcol.all_gather_tensor_autograd(
            data(d), 0, g),
        "all_gather_into_tensor_coalesced": lambda d, g: torch.cat(
            funcol.all_gather_into_tensor_coalesced([data(d), data(d, 2)], g)),
        "reduce_scatter_tensor sum": lambda d, g: funcol.reduce_scatter_tensor(
            data(d), "sum", 0, g),
        "reduce_scatter_tensor avg dim 1": lambda d, g: funcol.reduce_scatter_tensor(
            data(d), "avg", 1, g),
        "reduce_scatter_tensor_coalesced": lambda d, g: torch.cat(
            funcol.reduce_scatter_tensor_coalesced([data(d), data(d) * 3], "sum", [0, 0], g)),
        "all_to_all_single even": lambda d, g: funcol.all_to_all_single(
            data(d), None, None, g),
        "all_to_all_single uneven": lambda d, g: funcol.all_to_all_single(
            data(d, 4), [1, 3] if rank == 0 else [3, 1], [1, 3] if rank == 0 else [3, 1], g),
        "broadcast": lambda d, g: funcol.broadcast(data(d), 1, g),
        "isend and irecv": lambda d, g: funcol.wait_tensor(
            torch.ops._c10d_functional.isend(data(d), 1, 0, name_of(g)) if rank == 0 else
            torch.ops._c10d_functional.irecv(data(d) * 0, 0, 0, name_of(g))),
        "all_reduce of an unknown reduce_op": lambda d, g: funcol.all_reduce(data(d), "bogus", g),
        "reduce_scatter_tensor of rows the group does not divide": lambda d, g:
            torch.ops._c10d_functional.reduce_scatter_tensor(data(d, 3), "sum", world,
                                                             name_of(g)),
    }
    for name, fn in CALLS.items():
        try:
            want = fn("cpu", gloo)
            if isinstance(want, funcol.AsyncCollectiveTensor):
                want = want.wait()
        except Exception as e:
            want = e
        try:
            got = fn("tpu", mesh)
            got = got.cpu()
        except Exception as e:
            got = e
        if isinstance(got, Exception) or isinstance(want, Exception):
            if type(got) is not type(want):
                failures.append(f"{name}: tpu {got!r} gloo {want!r}")
        elif got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            failures.append(f"{name}: tpu {got} gloo {want}")
    x = data("tpu")
    if funcol.wait_tensor(x) is not x:
        failures.append("wait_tensor does not return its input")
    result["functional_fallbacks"] = {k: v - fallbacks.get(k, 0)
                                      for k, v in torchtpu.metrics.M.cpu_fallbacks.items()
                                      if v != fallbacks.get(k, 0)}

    # ---- DTensor -----------------------------------------------------------
    failures = section("dtensor")
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, 6, generator=g), torch.randn(6, 4, generator=g)
    da = distribute_tensor(a.to("tpu"), mesh, [Shard(0)])
    close(failures, "to_local Shard(0)", da.to_local(), a.chunk(world)[rank], 0)
    close(failures, "full_tensor", da.full_tensor(), a, 0)
    close(failures, "redistribute Shard(1)", da.redistribute(mesh, [Shard(1)]).to_local(),
          a.chunk(world, 1)[rank], 0)
    close(failures, "redistribute Replicate", da.redistribute(mesh, [Replicate()]).to_local(),
          a, 0)
    close(failures, "pointwise", ((da * 2 + 1).relu()).full_tensor(), (a * 2 + 1).relu(), 0)
    close(failures, "sum", da.sum().full_tensor(), a.sum(), 1e-6)
    a1 = distribute_tensor(a.to("tpu"), mesh, [Shard(1)])
    b0 = distribute_tensor(b.to("tpu"), mesh, [Shard(0)])
    prod = a1 @ b0  # Shard(1) @ Shard(0): a partial sum on each rank
    if not isinstance(prod.placements[0], Partial):
        failures.append(f"mm placements {prod.placements}")
    close(failures, "mm", prod.full_tensor(), a @ b, 1e-6)
    leaf = distribute_tensor(a.to("tpu"), mesh, [Shard(0)]).requires_grad_()
    (leaf.full_tensor() * torch.arange(6.0, device="tpu")).sum().backward()
    close(failures, "backward through full_tensor", leaf.grad.full_tensor(),
          torch.arange(6.0).expand(4, 6).contiguous(), 0)

    failures = section("fsdp")
    model = make().to("tpu")
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shards = [tuple(p.to_local().shape) for p in model.parameters()]
    if shards != [(8, 8), (8,), (2, 16), (2,)]:
        failures.append(f"local shards {shards}")
    compare(failures, train(model, X[half], Y[half]), reference(), 1e-6)

    failures = section("fsdp1")
    # FullyShardedDataParallel as its docs call it: a CPU model moved to its
    # device_id by `param.data = param.to(device)`.
    model = FSDP(make(), device_id=device)
    trained = train(model, X[half], Y[half])
    if [p.device.type for p in trained] != ["tpu"]:
        failures.append(f"flat parameters on {[p.device for p in trained]}")
    with FSDP.summon_full_params(model):
        full = [model.module[0].weight, model.module[0].bias,
                model.module[2].weight, model.module[2].bias]
        for i, (p, q) in enumerate(zip(full, reference(), strict=True)):
            close(failures, f"parameter {i}", p, q.detach(), 1e-6)

    failures = section("fsdp_fused_prefetch")
    torchtpu.set_eager_mode("fused")
    model = make().to("tpu")
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model[0].set_modules_to_forward_prefetch([model[2]])
    model[2].set_modules_to_backward_prefetch([model[0]])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    # fully_shard's sharding (each rank slices its own chunk) issued first:
    # left pending, it would join the first collective's graph, which would
    # then differ between the ranks and run op by op.
    torchtpu.sync()
    steps = result["fused_steps"] = []
    read = []
    for _ in range(3):
        before = torchtpu.metrics.snapshot()
        loss = F.mse_loss(model(X[half].to("tpu")), Y[half].to("tpu"))
        loss.backward()
        opt.step()
        if rank == 0:
            # Read on rank 0 alone, as CUDA scripts log it: the optimizer's
            # step issued the graph, so the value is there.
            read.append(loss.item())
        opt.zero_grad()
        torchtpu.sync()
        after = torchtpu.metrics.snapshot()
        steps.append({k: after[k] - before[k] for k in (
            "collectives_in_graphs", "collectives_issued", "mesh_graphs_compiled",
            "mesh_graphs_run_op_by_op", "fused_fallbacks")})
        steps[-1]["flushes"] = {k: v - before["flushes"].get(k, 0)
                                for k, v in after["flushes"].items()
                                if v != before["flushes"].get(k, 0)}
    want_losses = []
    compare(failures, list(model.parameters()), reference(want_losses), 1e-6)
    if rank == 0 and not torch.allclose(torch.tensor(read), torch.tensor(want_losses),
                                        rtol=1e-5, atol=1e-6):
        failures.append(f"losses read on rank 0 {read} != {want_losses}")
    torchtpu.set_eager_mode("strict")

    failures = section("fsdp_fused_compile_fails")
    # Every graph holding collectives fails as XLA's compile would (its
    # trace raises, on every rank): each falls back to its ops one by one,
    # collectives included, and training goes on as on CPU.
    import torchtpu.modes.graph as graph_module
    inlined = graph_module.call_inlined

    def fails(kernel, args):
        raise RuntimeError("a compile failure")

    graph_module.call_inlined = fails
    torchtpu.set_eager_mode("fused")
    try:
        model = make().to("tpu")
        fully_shard(model, mesh=mesh)
        torchtpu.sync()
        before = torchtpu.metrics.snapshot()["fused_fallbacks"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = train(model, X[half], Y[half])
            torchtpu.sync()
        result["compile_fails"] = {
            "fallbacks": torchtpu.metrics.snapshot()["fused_fallbacks"] - before,
            "warned": sum("a compile failure" in str(w.message) for w in caught)}
        compare(failures, got, reference(), 1e-6)
    finally:
        graph_module.call_inlined = inlined
        torchtpu.set_eager_mode("strict")

    failures = section("fsdp_mixed")
    model = make().to("tpu")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append((m.weight.dtype, o.dtype)))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    got = train(model, X[half], Y[half])
    if set(seen) != {(torch.bfloat16, torch.bfloat16)}:
        failures.append(f"forward dtypes {seen}")
    if {p.dtype for p in got} != {torch.float32}:
        failures.append(f"sharded parameters' dtypes {[p.dtype for p in got]}")
    # The reference runs the same bf16 math on CPU, so only the kernels
    # differ: XLA's and CPU's bf16 matmuls may round a result to the other
    # neighbouring bf16 value (2**-8 relative). A gradient off by that
    # changes an AdamW step, at most lr = 0.01 in size, by about 2**-8 of it:
    # 3 steps * 0.01 * 2**-7 (two such roundings a step) ~ 2.3e-4 bounds it,
    # against the 1e-3 a wrong reduction or the fp32 math would be off.
    compare(failures, got, reference_mixed(), 3 * 0.01 * 2 ** -7)

    failures = section("tp")
    model = make().to("tpu")
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    shards = [tuple(p.to_local().shape) for p in model.parameters()]
    if shards != [(8, 8), (8,), (4, 8), (4,)]:
        failures.append(f"local shards {shards}")
    compare(failures, train(model, X, Y), reference(), 1e-6)

    failures = section("tp_fused")
    torchtpu.set_eager_mode("fused")
    model = make().to("tpu")
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    torchtpu.sync()  # the sharding (each rank its own slices) issued first
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    steps = result["tp_fused_steps"] = []
    for _ in range(3):
        before = torchtpu.metrics.snapshot()
        F.mse_loss(model(X.to("tpu")), Y.to("tpu")).backward()
        opt.step()
        opt.zero_grad()
        torchtpu.sync()
        after = torchtpu.metrics.snapshot()
        steps.append([sum(after["flushes"].values()) - sum(before["flushes"].values())] +
                     [after[k] - before[k] for k in ("collectives_in_graphs", "collectives_issued",
                                                     "mesh_graphs_run_op_by_op")])
    compare(failures, list(model.parameters()), reference(), 1e-6)
    torchtpu.set_eager_mode("strict")

    failures = section("sequence_parallel")
    # SequenceParallel reads each rank's input as its shard of the sequence.
    xs = [torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).to("tpu")
    parallelize_module(model, mesh, {"0": SequenceParallel(),
                                     "1": ColwiseParallel(input_layouts=Shard(1)),
                                     "3": RowwiseParallel(output_layouts=Shard(1))})
    torch.manual_seed(0)
    ref = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    got = model(xs[rank].to("tpu"))
    want = ref(torch.cat(xs, 1))
    close(failures, "output", got, want.detach().chunk(world, 1)[rank], 1e-6)
    got.pow(2).sum().backward()
    want.pow(2).sum().backward()
    for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters(), strict=True)):
        close(failures, f"gradient {i}", p.grad.full_tensor(), q.grad, 1e-5)

    failures = section("tp_attention")
    # Heads split by tensor parallelism, as pytorch/examples' Llama lays them
    # out (q, k, v ColwiseParallel giving DTensors, the output RowwiseParallel):
    # scaled_dot_product_attention of DTensors, causal and with a float mask.
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(8, 8, bias=False) for _ in range(4))

        def forward(self, x, mask=None):
            b, s, _ = x.shape
            q, k, v = (p(x).view(b, s, -1, 2).transpose(1, 2) for p in (self.q, self.k, self.v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            return self.o(out.transpose(1, 2).reshape(b, s, -1))

    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    float_mask = torch.randn(5, 5, generator=torch.Generator().manual_seed(4))
    for name, mask in (("causal", None), ("float mask", float_mask)):
        torch.manual_seed(0)
        ref = Attention()
        torch.manual_seed(0)
        model = Attention().to("tpu")
        parallelize_module(model, mesh, {"q": ColwiseParallel(use_local_output=False),
                                         "k": ColwiseParallel(use_local_output=False),
                                         "v": ColwiseParallel(use_local_output=False),
                                         "o": RowwiseParallel()})
        tpu_mask = None if mask is None else distribute_tensor(mask.to("tpu"), mesh, [Replicate()])
        got = model(x.to("tpu"), tpu_mask)
        want = ref(x, mask)
        close(failures, f"{name}: output", got, want.detach(), 1e-6)
        got.pow(2).sum().backward()
        want.pow(2).sum().backward()
        for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters(), strict=True)):
            close(failures, f"{name}: gradient {i}", p.grad.full_tensor(), q.grad, 1e-5)

""") + END

# Four processes: a 2-D mesh, FSDP2 over "dp" and TP over "tp".
WORKER_2D = COMMON + textwrap.dedent("""\
    mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    half = slice(4 * dp, 4 * dp + 4)
    failures = section("fsdp_tp_2d")
    model = make().to("tpu")
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = [p.placements for p in model.parameters()]
    if [ps[1] for ps in placements] != [Shard(0), Shard(0), Shard(1), Replicate()] or \
            any(type(ps[0]).__name__ not in ("Shard", "_StridedShard")  # dp: sharded
                for ps in placements):
        failures.append(f"placements {placements}")
    compare(failures, train(model, X[half], Y[half]), reference(), 1e-6)
""") + END


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("fsdp_tp"), WORKER, 2)


def _section(results, name):
    for r in results:
        assert r["sections"][name] == [], "\n".join(r["sections"][name])


def test_functional_collectives_match_gloo_without_the_cpu_fallback(results):
    for r in results:
        assert r["mesh"] == ["tpu", 2]
        assert r["functional_fallbacks"] == {}
    _section(results, "functional")


def test_dtensor_shards_redistributes_and_computes_as_on_cpu(results):
    _section(results, "dtensor")


def test_fsdp2_trains_as_one_process_on_the_whole_batch(results):
    _section(results, "fsdp")
    for r in results:  # FSDP2's copy-in and copy-out ops run on tpu too
        assert r["training_fallbacks"] == {}


def test_fsdp1_from_a_cpu_model_with_device_id_trains_as_one_process(results):
    _section(results, "fsdp1")


def test_fsdp2_mixed_precision_trains_as_the_same_bf16_math_on_cpu(results):
    _section(results, "fsdp_mixed")


def test_fsdp2_fused_mode_with_explicit_prefetching(results):
    _section(results, "fsdp_fused_prefetch")
    for r in results:
        steps = r["fused_steps"]
        for step in steps:
            # Its all-gathers and reduce-scatters are nodes of the graphs, and
            # the ranks' graphs are the same program: none runs op by op.
            assert step["collectives_in_graphs"] >= 4 and step["collectives_issued"] == 0, steps
            assert step["mesh_graphs_run_op_by_op"] == 0, steps
        # A step is one graph, issued at the optimizer's step: not at
        # FSDP2's stream events (a plain event's record issues nothing), a
        # collective, or rank 0's read of the loss after the step. The first
        # step's graph is its own (AdamW makes its state there); the
        # second's is every later step's, compiled once.
        assert [s["mesh_graphs_compiled"] for s in steps] == [1, 1, 0], steps
        for step in steps:
            assert step["flushes"] == {"optimizer_step": 1}, steps
        assert steps[2]["fused_fallbacks"] == 0, steps


def test_fsdp2_fused_graphs_that_fail_to_compile_run_op_by_op_on_every_rank(results):
    _section(results, "fsdp_fused_compile_fails")
    for r in results:
        # Each of the 3 steps' graphs failed, warned and ran its ops.
        assert r["compile_fails"]["fallbacks"] >= 3, r["compile_fails"]
        assert r["compile_fails"]["warned"] == r["compile_fails"]["fallbacks"], r["compile_fails"]


def test_tensor_parallel_trains_as_one_process_on_the_whole_batch(results):
    _section(results, "tp")


def test_tensor_parallel_fused_step_is_one_graph_with_its_collectives(results):
    _section(results, "tp_fused")
    for r in results:
        # [flushes, collectives in graphs, issued on their own, graphs run op
        # by op] per step: the sync's one flush, RowwiseParallel's all_reduce inside.
        assert r["tp_fused_steps"] == [[1, 1, 0, 0]] * 3, r["tp_fused_steps"]


def test_sequence_parallel_forward_and_backward_as_on_cpu(results):
    _section(results, "sequence_parallel")


def test_tensor_parallel_attention_splits_heads_as_on_cpu(results):
    _section(results, "tp_attention")


def test_fsdp2_and_tp_on_a_2d_mesh_of_four_processes(tmp_path):
    results = run_ranks(tmp_path, WORKER_2D, 4)
    _section(results, "fsdp_tp_2d")
    for r in results:
        assert r["training_fallbacks"] == {}


def test_freed_storage_raises_until_given_back():
    base = torch.arange(6.0, device="tpu")
    view = base[2:]
    storage = base.untyped_storage()
    storage.resize_(0)  # as FSDP2 frees an unsharded parameter
    assert (storage.size(), view.untyped_storage().nbytes()) == (0, 0)
    with pytest.raises(RuntimeError, match="freed"):
        view + 1
    storage.resize_(6 * 4)
    assert torch.equal(view.cpu(), torch.zeros(4))
    view.copy_(torch.ones(4))
    assert torch.equal(base.cpu(), torch.tensor([0.0, 0, 1, 1, 1, 1]))
    with pytest.raises(RuntimeError, match="resizes only to 0 bytes"):
        storage.resize_(8)


def test_a_libraries_privateuse1_kernel_runs_on_tpu():
    import torchtpu
    lib = torch.library.Library("torchtpu_test_pu1", "DEF")
    lib.define("affine(Tensor x) -> Tensor")
    lib.impl("affine", lambda x: x * 2 + 1, "PrivateUse1")
    lib.impl("affine", lambda x: x * 2 + 1, "CPU")
    x = torch.randn(3, 4)
    before = sum(torchtpu.metrics.M.cpu_fallbacks.values())
    got = torch.ops.torchtpu_test_pu1.affine(x.to("tpu"))
    assert got.device.type == "tpu"
    assert torch.equal(got.cpu(), torch.ops.torchtpu_test_pu1.affine(x))
    assert sum(torchtpu.metrics.M.cpu_fallbacks.values()) == before
