"""torch.distributed's collectives on tpu tensors as XLA collectives: two
processes started with torchrun's environment (so jax.distributed joins
them), each collective and ReduceOp on tpu tensors against the same
collective through gloo on CPU tensors in the same processes."""
import textwrap

import pytest
from processes import run_ranks

WORKER = textwrap.dedent("""\
    import datetime, json, sys, warnings
    import jax, torch, torch.distributed as dist, torch.nn.functional as F
    import torchtpu
    warnings.simplefilter("ignore", FutureWarning)  # reduce_scatter_tensor's rename
    out = sys.argv[1]
    backend = dist.get_default_backend_for_device(torch.device("tpu"))
    device = torch.device("tpu", torch.tpu.current_device())
    dist.init_process_group(backend, device_id=device, timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    R = dist.ReduceOp
    result = {"processes": jax.process_count(), "backend": dist.get_backend_config(),
              "tpu_backend": type(dist.group.WORLD._get_backend(device)).__name__,
              "failures": [], "checked": 0}

    def bits(t):
        t = torch.view_as_real(t) if t.is_complex() else t
        if t.is_floating_point():
            return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        return t

    def outcome(fn, dev, group):
        try:
            got = fn(dev, group)
            return [t.cpu() for t in got]
        except Exception as e:
            return e

    def same(name, fn):
        # fn(device, group) -> the tensors a collective wrote; on tpu through
        # the default (tpu) group, on CPU through gloo.
        result["checked"] += 1
        got, want = outcome(fn, "tpu", None), outcome(fn, "cpu", gloo)
        if isinstance(want, Exception) or isinstance(got, Exception):
            if type(got) is not type(want) or \\
                    str(got).splitlines()[:1] != str(want).splitlines()[:1]:
                result["failures"].append(f"{name}: tpu {got!r} gloo {want!r}")
            return
        for g, w in zip(got, want, strict=True):
            if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(bits(g), bits(w)):
                result["failures"].append(f"{name}: tpu {g!r} gloo {w!r}")

    def expect(name, got, want):
        result["checked"] += 1
        if got != want:
            result["failures"].append(f"{name}: {got} != {want}")

    def data(dtype, dev, n=4):
        if dtype == torch.bool:
            return torch.tensor([rank == 0, True, False, rank == 1][:n], device=dev)
        if dtype.is_floating_point or dtype.is_complex:
            v = torch.tensor([1.5 * (rank + 1), -2.25, 0.125 * rank, 3.0][:n], dtype=torch.float64)
            v = v.to(dtype) if not dtype.is_complex else torch.complex(v, v * (rank - 1)).to(dtype)
            return v.to(dev)
        return torch.tensor([rank + 1, -(rank + 2), 3 * rank + 1, 7][:n]).to(dtype).to(dev)

    def all_reduce(dtype, op):
        def fn(dev, group):
            t = data(dtype, dev)
            dist.all_reduce(t, op, group=group)
            return [t]
        return fn

    DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64]
    OPS = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
    for dtype in DTYPES:
        for op in OPS:
            if op == R.AVG and not dtype.is_floating_point:
                continue  # gloo refuses; NCCL's truncated mean and error, below
            same(f"all_reduce {dtype} {op}", all_reduce(dtype, op))
    # AVG of integers as NCCL gives it: the sum over the ranks divided by
    # their number, truncated toward zero (rank r holds r+1, -(r+2), 3r+1, 7
    # in the dtype).
    for dtype in (torch.uint8, torch.int8, torch.int32, torch.int64):
        t = data(dtype, "tpu")
        dist.all_reduce(t, R.AVG)
        total = torch.zeros(4, dtype=dtype)
        for r in range(world):  # summed in the dtype (wrapping), as NCCL does
            total += torch.tensor([r + 1, -(r + 2), 3 * r + 1, 7]).to(dtype)
        want = torch.div(total, world, rounding_mode="trunc")
        expect(f"all_reduce {dtype} AVG", (t.dtype, t.cpu().tolist()), (dtype, want.tolist()))
    t = data(torch.bool, "tpu")
    try:
        dist.all_reduce(t, R.AVG)
        expect("all_reduce bool AVG raises", "no error", "TypeError")
    except TypeError as e:
        expect("all_reduce bool AVG raises", str(e), "Cannot use ReduceOp.AVG with boolean inputs")
    # Complex tensors reach the group as view_as_real views of them.
    for op in OPS:  # SUM and AVG; the rest refused before the backend
        same(f"all_reduce complex64 {op}", all_reduce(torch.complex64, op))

    def broadcast_complex(dev, group):
        t = data(torch.complex128, dev)
        dist.broadcast(t, src=1, group=group)
        return [t]
    same("broadcast complex128", broadcast_complex)

    # dtypes gloo lacks, against values computed here.
    for op, want in [(R.SUM, [3, -5, 5, 14]), (R.MAX, [2, -2, 4, 7]), (R.BXOR, [3, 3, 5, 0])]:
        t = data(torch.int16, "tpu")
        dist.all_reduce(t, op)
        expect(f"all_reduce int16 {op}", (t.dtype, t.cpu().tolist()), (torch.int16, want))
    t = torch.tensor([1, 2 ** 31 + rank], dtype=torch.uint32, device="tpu")
    dist.all_reduce(t, R.MAX)
    expect("all_reduce uint32 MAX", t.cpu().to(torch.int64).tolist(), [1, 2 ** 31 + 1])

    def scalar(dev, group):
        t = torch.tensor(rank + 2.0, device=dev)
        dist.all_reduce(t, R.PRODUCT, group=group)
        return [t]
    same("all_reduce 0-d", scalar)

    def through_view(dev, group):
        base = torch.arange(6.0, device=dev).reshape(2, 3) * (rank + 1)
        dist.all_reduce(base[1], group=group)
        return [base]
    same("all_reduce of a view writes its base", through_view)

    def async_op(dev, group):
        t = data(torch.float32, dev)
        work = dist.all_reduce(t, async_op=True, group=group)
        work.wait()
        return [t]
    same("all_reduce async_op", async_op)

    def coalesced(dev, group):
        ts = [data(torch.float32, dev), data(torch.float32, dev) * 2]
        (group or dist.group.WORLD).allreduce_coalesced(ts, dist.AllreduceCoalescedOptions()).wait()
        return ts
    same("all_reduce coalesced", coalesced)

    for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.bool]:
        def broadcast(dev, group, dtype=dtype):
            t = data(dtype, dev)
            if dtype.is_floating_point and rank == 1:  # bits survive: -0.0 and NaN
                t[2:] = torch.tensor([-0.0, float("nan")], dtype=dtype)
            dist.broadcast(t, src=1, group=group)
            return [t]
        same(f"broadcast {dtype}", broadcast)

    for dtype in [torch.float32, torch.int64]:
        def all_gather(dev, group, dtype=dtype):
            parts = [torch.empty(2, 2, dtype=dtype, device=dev) for _ in range(world)]
            dist.all_gather(parts, data(dtype, dev).reshape(2, 2), group=group)
            return parts
        same(f"all_gather {dtype}", all_gather)

    def into_tensor(dev, group):
        t = torch.empty(8, device=dev)
        dist.all_gather_into_tensor(t, data(torch.float32, dev), group=group)
        return [t]
    same("all_gather_into_tensor", into_tensor)
    stacked = torch.empty(2, 4, device="tpu")  # as NCCL takes it (gloo does not)
    dist.all_gather_into_tensor(stacked, data(torch.float32, "tpu"))
    expect("all_gather_into_tensor stacked", stacked.cpu().tolist(),
           [[1.5, -2.25, 0.0, 3.0], [3.0, -2.25, 0.125, 3.0]])

    for op, dtype in [(R.SUM, torch.float32), (R.AVG, torch.float32), (R.MAX, torch.int64),
                      (R.PRODUCT, torch.float64), (R.BOR, torch.int32), (R.SUM, torch.bool)]:
        def rs_tensor(dev, group, op=op, dtype=dtype):
            t = torch.empty(2, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(t, data(dtype, dev), op, group=group)
            return [t]
        same(f"reduce_scatter_tensor {dtype} {op}", rs_tensor)

        def rs_list(dev, group, op=op, dtype=dtype):
            t = torch.empty(2, dtype=dtype, device=dev)
            dist.reduce_scatter(t, list(data(dtype, dev).split(2)), op, group=group)
            return [t]
        same(f"reduce_scatter {dtype} {op}", rs_list)

    def coalesced_tensors(dev, group):  # as FSDP2's collectives call them
        pg = group or dist.group.WORLD
        gathered, scattered = [torch.empty(8, device=dev)], [torch.empty(2, device=dev)]
        pg.allgather_into_tensor_coalesced(gathered, [data(torch.float32, dev)]).wait()
        pg.reduce_scatter_tensor_coalesced(scattered, [data(torch.float32, dev)],
                                           dist.ReduceScatterOptions()).wait()
        return gathered + scattered
    same("all_gather_into_tensor and reduce_scatter_tensor coalesced", coalesced_tensors)

    def a2a_even(dev, group):
        t = torch.empty(4, 2, device=dev)
        dist.all_to_all_single(t, torch.arange(8.0, device=dev).reshape(4, 2) + 10 * rank,
                               group=group)
        return [t]
    same("all_to_all_single even", a2a_even)

    def a2a_uneven(dev, group):
        ins = [1, 3] if rank == 0 else [2, 2]
        outs = [1, 2] if rank == 0 else [3, 2]
        t = torch.empty(sum(outs), device=dev)
        dist.all_to_all_single(t, torch.arange(4.0, device=dev) + 10 * rank, outs, ins,
                               group=group)
        return [t]
    same("all_to_all_single uneven splits", a2a_uneven)

    def a2a_lists(dev, group):
        outs = [torch.empty(2, 3, dtype=torch.int32, device=dev) for _ in range(world)]
        ins = [torch.full((2, 3), 10 * rank + i, dtype=torch.int32, device=dev)
               for i in range(world)]
        dist.all_to_all(outs, ins, group=group)
        return outs
    same("all_to_all", a2a_lists)

    def reduce(dev, group):
        t = data(torch.float32, dev)
        dist.reduce(t, dst=0, op=R.MAX, group=group)
        return [t]
    same("reduce", reduce)

    def gather(dev, group):
        parts = [torch.empty(4, device=dev) for _ in range(world)] if rank == 1 else None
        dist.gather(data(torch.float32, dev), parts, dst=1, group=group)
        return parts or []
    same("gather", gather)

    def scatter(dev, group):
        t = torch.empty(3, dtype=torch.int64, device=dev)
        parts = [torch.arange(3, device=dev) + 10 * i for i in range(world)]
        dist.scatter(t, parts if rank == 0 else None, src=0, group=group)
        return [t]
    same("scatter", scatter)

    def send_recv(dev, group):
        t = data(torch.float64, dev) if rank == 0 else torch.zeros(4, dtype=torch.float64,
                                                                  device=dev)
        if rank == 0:
            dist.send(t, dst=1, group=group)
        else:
            dist.recv(t, src=0, group=group)
        return [t]
    same("send/recv", send_recv)

    def batch(dev, group):
        # Every rank lists its sends first; two to the same peer pair up with
        # its receives in order.
        peer = 1 - rank
        got = [torch.zeros(4, device=dev), torch.zeros(2, 2, dtype=torch.int64, device=dev)]
        ops = [dist.P2POp(dist.isend, data(torch.float32, dev), peer, group),
               dist.P2POp(dist.isend, torch.arange(4, device=dev).reshape(2, 2) + 10 * rank,
                          peer, group),
               dist.P2POp(dist.irecv, got[0], peer, group),
               dist.P2POp(dist.irecv, got[1], peer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return got
    same("batch_isend_irecv", batch)

    def batch_functional(dev, group):
        got = torch.zeros(4, dtype=torch.float64, device=dev)
        name = (group or dist.group.WORLD).group_name
        sent, received = torch.ops._c10d_functional.batch_p2p_ops(
            ["isend", "irecv"], [1 - rank] * 2, [0, 0], [data(torch.float64, dev), got], name)
        return [torch.ops._c10d_functional.wait_tensor(received), got,
                torch.tensor(sent.shape)]
    same("batch_p2p_ops", batch_functional)

    def own_group(dev, group):
        # One single-rank group per rank: the collective's mesh is one device.
        groups = [dist.new_group([r], backend=None if dev == "tpu" else "gloo")
                  for r in range(world)]
        t = data(torch.float32, dev)
        dist.all_reduce(t, group=groups[rank])
        return [t]
    same("all_reduce in a subgroup", own_group)

    dist.barrier()
    c = torch.tensor([rank + 1.0])  # a CPU tensor through the tpu group goes to gloo
    dist.all_reduce(c)
    expect("cpu tensor through the tpu group", c.tolist(), [3.0])

    torchtpu.set_eager_mode("fused")  # pending values go in, results come out pending
    t = data(torch.float32, "tpu") * 2
    dist.all_reduce(t)
    expect("fused all_reduce", (t + 1).cpu().tolist(), [10.0, -8.0, 1.25, 13.0])
    torchtpu.set_eager_mode("strict")

    # Mismatches raise on every rank, then the group goes on.
    for name, t in [("shape", torch.ones(3 + rank, device="tpu")),
                    ("dtype", torch.ones(3, device="tpu", dtype=[torch.float32,
                                                                 torch.int32][rank]))]:
        try:
            dist.all_reduce(t)
            expect(f"mismatched {name} raises", "no error", "RuntimeError")
        except RuntimeError as e:
            expect(f"mismatched {name} raises", "different arguments" in str(e), True)
    try:
        parts = [torch.empty(5, device="tpu")] if rank == 1 else None
        dist.gather(torch.ones(4, device="tpu"), parts, dst=1)
        expect("refused on one rank raises", "no error", "an error")
    except (RuntimeError, ValueError) as e:
        expect("refused on one rank raises", type(e).__name__,
               "ValueError" if rank == 1 else "RuntimeError")
    t = torch.ones(2, device="tpu")
    dist.all_reduce(t)
    expect("after the errors", t.cpu().tolist(), [2.0, 2.0])

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    def train(dev, group, mode):
        torchtpu.set_eager_mode(mode)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 2)).to(dev)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        xs, ys = x[4 * rank:4 * rank + 4].to(dev), y[4 * rank:4 * rank + 4].to(dev)
        for _ in range(2):
            F.mse_loss(ddp(xs), ys).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().cpu() for p in model.parameters()]
    want = train("cpu", gloo, "strict")
    for mode in ("strict", "fused"):
        got = train("tpu", None, mode)
        result["checked"] += 1
        for a, b in zip(got, want):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                result["failures"].append(f"DDP {mode}: {a} != {b}")
    torchtpu.set_eager_mode("strict")
    dist.destroy_process_group()
    json.dump(result, open(out, "w"))
""")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each rank's report from one run of WORKER in two processes."""
    return run_ranks(tmp_path_factory.mktemp("xla"), WORKER, 2)


def test_collectives_on_xla_match_gloo_across_two_processes(results):
    for r in results:
        assert r["processes"] == 2  # jax.distributed joined them
        assert "tpu:tpu" in r["backend"], r["backend"]
        assert r["tpu_backend"] == "ProcessGroupGloo"  # pg._get_backend(tpu) answers
        assert r["failures"] == [], "\n".join(r["failures"])
        assert r["checked"] == 128, r["checked"]


# Four ranks: collectives whose ordering two ranks cannot show (which rank's
# part lands where, roots other than 0 and 1, rings, groups of some ranks),
# in each eager mode against gloo on CPU tensors.
WORKER_4 = textwrap.dedent("""\
    import datetime, json, sys
    import torch, torch.distributed as dist
    import torchtpu
    out = sys.argv[1]
    device = torch.device("tpu", torch.tpu.current_device())
    dist.init_process_group(dist.get_default_backend_for_device(device), device_id=device,
                            timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    # The same pairs of ranks as groups of each backend (every rank makes every group).
    pairs = {b: [dist.new_group(p, backend=b) for p in ([0, 2], [1, 3])] for b in (None, "gloo")}
    R = dist.ReduceOp
    result = {"failures": [], "checked": 0}

    def data(dtype, dev, n=4):
        v = torch.tensor([rank + 1, -(2 * rank + 1), 3 * rank, 5 - rank, 7, rank * rank][:n])
        return (v * 1.25 if dtype.is_floating_point else v).to(dtype).to(dev)

    CASES = []
    def case(fn):
        CASES.append(fn)
        return fn

    for op, dtype in [(R.SUM, torch.float32), (R.AVG, torch.float32), (R.PRODUCT, torch.int64),
                      (R.MIN, torch.float32), (R.MAX, torch.int64), (R.BAND, torch.int64),
                      (R.BOR, torch.int32), (R.BXOR, torch.int64)]:
        @case
        def all_reduce(dev, group, op=op, dtype=dtype):
            t = data(dtype, dev)
            dist.all_reduce(t, op, group=group)
            return [t]

    @case
    def broadcast_from_rank_2(dev, group):
        t = data(torch.float32, dev)
        dist.broadcast(t, src=2, group=group)
        return [t]

    @case
    def all_gather(dev, group):
        parts = [torch.empty(2, 2, device=dev) for _ in range(world)]
        dist.all_gather(parts, data(torch.float32, dev).reshape(2, 2), group=group)
        return parts

    @case
    def all_gather_into_tensor(dev, group):
        t = torch.empty(4 * world, dtype=torch.int64, device=dev)
        dist.all_gather_into_tensor(t, data(torch.int64, dev), group=group)
        return [t]

    for op in (R.SUM, R.MAX):
        @case
        def reduce_scatter_tensor(dev, group, op=op):
            t = torch.empty(2, device=dev)
            dist.reduce_scatter_tensor(t, torch.arange(8.0, device=dev) * (rank + 1) - rank,
                                       op, group=group)
            return [t]

    @case
    def reduce_scatter_list(dev, group):
        t = torch.empty(3, dtype=torch.int64, device=dev)
        ins = [torch.arange(3, device=dev) * (i + 1) + 10 * rank for i in range(world)]
        dist.reduce_scatter(t, ins, group=group)
        return [t]

    @case
    def all_to_all_single_even(dev, group):
        t = torch.empty(8, 2, device=dev)
        dist.all_to_all_single(t, torch.arange(16.0, device=dev).reshape(8, 2) + 100 * rank,
                               group=group)
        return [t]

    @case
    def all_to_all_single_uneven(dev, group):
        # rank r sends (r + j) % 3 + 1 rows to rank j.
        ins = [(rank + j) % 3 + 1 for j in range(world)]
        outs = [(j + rank) % 3 + 1 for j in range(world)]
        t = torch.empty(sum(outs), 2, device=dev)
        src = torch.arange(2.0 * sum(ins), device=dev).reshape(-1, 2) + 100 * rank
        dist.all_to_all_single(t, src, outs, ins, group=group)
        return [t]

    @case
    def all_to_all(dev, group):
        outs = [torch.empty(2, dtype=torch.int32, device=dev) for _ in range(world)]
        ins = [torch.tensor([10 * rank + i, -i], dtype=torch.int32, device=dev)
               for i in range(world)]
        dist.all_to_all(outs, ins, group=group)
        return outs

    @case
    def reduce_to_rank_3(dev, group):
        t = data(torch.float32, dev)
        dist.reduce(t, dst=3, op=R.SUM, group=group)
        return [t] if rank == 3 else []  # (what the others hold after it is unspecified)

    @case
    def gather_to_rank_2(dev, group):
        parts = [torch.empty(4, device=dev) for _ in range(world)] if rank == 2 else None
        dist.gather(data(torch.float32, dev), parts, dst=2, group=group)
        return parts or []

    @case
    def scatter_from_rank_3(dev, group):
        t = torch.empty(3, dtype=torch.int64, device=dev)
        parts = [torch.arange(3, device=dev) + 10 * i for i in range(world)]
        dist.scatter(t, parts if rank == 3 else None, src=3, group=group)
        return [t]

    @case
    def ring_of_sends(dev, group):
        # Each rank sends to the next and receives from the one before.
        got = torch.zeros(4, device=dev)
        ops = [dist.P2POp(dist.isend, data(torch.float32, dev), (rank + 1) % world, group),
               dist.P2POp(dist.irecv, got, (rank - 1) % world, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return [got]

    @case
    def send_recv_3_to_1(dev, group):
        t = data(torch.float32, dev) if rank == 3 else torch.zeros(4, device=dev)
        if rank == 3:
            dist.send(t, dst=1, group=group)
        elif rank == 1:
            dist.recv(t, src=3, group=group)
        return [t]

    @case
    def pair_groups(dev, group):
        # all_reduce within [0, 2] and [1, 3], then broadcast from each pair's
        # higher rank (global ranks 2 and 3).
        mine = pairs[None if group is None else "gloo"][rank % 2]
        t = data(torch.float32, dev)
        dist.all_reduce(t, group=mine)
        u = data(torch.int64, dev)
        dist.broadcast(u, src=2 + rank % 2, group=mine)
        return [t, u]

    def run(dev, group):
        got = []
        for fn in CASES:
            got.append([t.cpu() for t in fn(dev, group)])
        return got

    want = run("cpu", gloo)
    for mode in ("strict", "fused", "debug"):
        torchtpu.set_eager_mode(mode)
        got = run("tpu", None)
        torchtpu.sync()
        for fn, g, w in zip(CASES, got, want, strict=True):
            result["checked"] += 1
            if len(g) != len(w) or any(a.dtype != b.dtype or not torch.equal(a, b)
                                       for a, b in zip(g, w)):
                result["failures"].append(f"{mode} {fn.__name__}: tpu {g} gloo {w}")
    torchtpu.set_eager_mode("strict")
    result["cases"] = len(CASES)
    dist.destroy_process_group()
    json.dump(result, open(out, "w"))
""")


def test_collectives_on_xla_match_gloo_across_four_processes(tmp_path):
    for r in run_ranks(tmp_path, WORKER_4, 4):
        assert r["failures"] == [], "\n".join(r["failures"])
        assert r["cases"] == 23 and r["checked"] == 3 * 23, r



def _torchrun_env(monkeypatch, **env):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHTPU_DISTRIBUTED",
                 "TORCHTPU_COORDINATOR_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_bootstrap_reads_torchruns_environment(monkeypatch):
    from torchtpu.runtime import bootstrap
    full = dict(MASTER_ADDR="10.0.0.7", MASTER_PORT="29500", RANK="1", WORLD_SIZE="2")
    _torchrun_env(monkeypatch, **full)
    assert bootstrap._wanted()
    assert bootstrap.coordinator_address() == "10.0.0.7:29501"  # beside torch's store
    monkeypatch.setenv("TORCHTPU_COORDINATOR_PORT", "4000")
    assert bootstrap.coordinator_address() == "10.0.0.7:4000"
    monkeypatch.setenv("TORCHTPU_DISTRIBUTED", "0")
    assert not bootstrap._wanted()
    _torchrun_env(monkeypatch, **dict(full, WORLD_SIZE="1"))
    assert not bootstrap._wanted()  # one process: nothing to join
    _torchrun_env(monkeypatch, RANK="0", WORLD_SIZE="2")
    assert not bootstrap._wanted()
    assert bootstrap.initialize_from_env() is False  # this process stays on its own
    monkeypatch.setenv("TORCHTPU_DISTRIBUTED", "1")
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT"):
        bootstrap._wanted()
    monkeypatch.setenv("TORCHTPU_DISTRIBUTED", "yes")
    with pytest.raises(ValueError, match="not 0 or 1"):
        bootstrap._wanted()
