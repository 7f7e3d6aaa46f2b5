"""Collectives in fused mode are nodes of the graph, not sync points: a DDP
training step over two processes is one compiled graph per step (asserted
through metrics) and ends with the parameters gloo's DDP gets on CPU; each
collective (broadcast, reduce, all_to_all, the functional ones) is recorded
and matches gloo, gather and scatter are issued at once; ranks whose graphs
hold different collectives raise on every rank instead of hanging."""
import json
import textwrap

import pytest
import torch
from processes import finish, start_ranks

WORKER = textwrap.dedent("""\
    import datetime, json, os, sys
    import torch, torch.distributed as dist, torch.nn.functional as F
    import torchtpu
    from torchtpu import metrics
    dist.init_process_group(timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    report = {"steps": []}

    def setup(dev, group):
        # The same model, DDP wrapper, optimizer and this rank's half batch each run.
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 2)).to(dev)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                        bucket_cap_mb=0.0001)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        xs, ys = x[4 * rank:4 * rank + 4].to(dev), y[4 * rank:4 * rank + 4].to(dev)
        return model, ddp, opt, xs, ys

    def train(dev, group, steps):
        model, ddp, opt, xs, ys = setup(dev, group)
        for _ in range(steps):
            before = metrics.snapshot()
            F.mse_loss(ddp(xs), ys).backward()
            opt.step()
            opt.zero_grad()
            if dev == "tpu":
                torchtpu.sync()
                after = metrics.snapshot()
                report["steps"].append({
                    "flushes": sum(after["flushes"].values()) - sum(before["flushes"].values()),
                    "compiled": after["graphs_compiled"] - before["graphs_compiled"],
                    "collectives": after["collectives_in_graphs"] - before["collectives_in_graphs"],
                    "issued": after["collectives_issued"] - before["collectives_issued"]})
        return [p.detach().cpu() for p in model.parameters()]

    want = train("cpu", gloo, 5)
    torchtpu.set_eager_mode("fused")
    got = train("tpu", None, 5)
    report["close"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want))
    report["diff"] = max(float((a - b).abs().max()) for a, b in zip(got, want))

    # Rank 0 alone reads the loss, as CUDA scripts log it, with no sync:
    # before the optimizer's step on even steps (backward's all_reduces are
    # pending: a side graph of the forward computes it), after it on odd
    # ones (the step issued the graph); other reads of the third step's
    # values too. The ranks' graphs stay the same: none runs op by op.
    def train_logged(dev, group, steps):
        model, ddp, opt, xs, ys = setup(dev, group)
        losses, steps_seen = [], []
        for step in range(steps):
            before = metrics.snapshot()
            out = ddp(xs)
            loss = F.mse_loss(out, ys)
            if dev == "tpu" and rank == 0 and step == 0:
                # Before backward, in the step after DDP's constructor broadcast
                # the parameters (that broadcast issued its graph).
                report["first loss before backward"] = loss.item()
            loss.backward()
            if dev == "cpu":
                losses.append(loss.item())
            elif rank == 0 and step % 2 == 0:
                losses.append(loss.item())
                if step == 2:  # rank 0's `loss > 0` too: the ranks' graphs still alike
                    printed, values = repr(out), out.tolist()
                    report["other reads"] = [
                        printed.startswith(repr(torch.tensor(values))[:-1]), values,
                        bool(loss > 0), loss.cpu().item()]
            opt.step()
            if dev == "tpu" and rank == 0 and step % 2 == 1:
                losses.append(loss.item())
            opt.zero_grad()
            if dev == "tpu":
                after = metrics.snapshot()
                delta = {k: after[k] - before[k] for k in (
                    "graphs_compiled", "side_reads", "side_graphs_compiled",
                    "mesh_graphs_run_op_by_op", "collectives_issued")}
                delta["flushes"] = {k: v - before["flushes"].get(k, 0)
                                    for k, v in after["flushes"].items()
                                    if v != before["flushes"].get(k, 0)}
                steps_seen.append(delta)
        return [p.detach().cpu() for p in model.parameters()], losses, steps_seen

    torchtpu.set_eager_mode("strict")
    want, want_losses, _ = train_logged("cpu", gloo, 6)
    torchtpu.set_eager_mode("fused")
    got, losses, report["logged steps"] = train_logged("tpu", None, 6)
    report["logged close"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                                 for a, b in zip(got, want))
    report["logged losses"] = [losses, want_losses]

    # A side read's random values are the full graph's, and an in-place
    # write it computed is not committed by it.
    c = torch.ones(3, device="tpu") * 1
    dist.all_reduce(c)
    r = torch.rand(4, device="tpu")
    w = torch.zeros(3, device="tpu") * 1
    w.add_(1)
    before = metrics.snapshot()
    side = [r.tolist(), w.tolist()]
    w.add_(1)
    during = metrics.snapshot()
    torchtpu.sync()
    report["side read"] = {
        "side reads": during["side_reads"] - before["side_reads"],
        "flushes": sum(during["flushes"].values()) - sum(before["flushes"].values()),
        "values": side + [r.tolist(), w.tolist(), c.tolist()]}
    # An out-of-range index a side read's value depends on raises there.
    c = torch.ones(3, device="tpu") * 1
    dist.all_reduce(c)
    before = metrics.snapshot()
    try:
        F.embedding(torch.tensor([5], device="tpu"), torch.ones(3, 2, device="tpu")).sum().item()
        report["bad index"] = "no error"
    except IndexError as e:
        report["bad index"] = str(e)
    during = metrics.snapshot()
    report["bad index"] = [report["bad index"], c.tolist(),
                           during["side_reads"] - before["side_reads"],
                           sum(during["flushes"].values()) - sum(before["flushes"].values())]

    # Each collective in fused mode against gloo on CPU tensors: the call
    # flushes nothing (recorded, or for gather and scatter issued at once
    # after a flush) and the read is one flush.
    R = dist.ReduceOp

    def data(dev, n=4, dtype=torch.float32):
        v = torch.tensor([1.5 * (rank + 1), -2.25, 0.125 * rank, 3.0, -0.0, 7.0][:n],
                         dtype=torch.float64).to(dtype).to(dev)
        return v * 1 if dtype != torch.bool else v  # a pending value in fused mode

    def broadcast(dev, group):
        t = data(dev)
        t[3] = float("nan") if rank == 1 else 5.0  # bits survive: NaN, -0.0
        dist.broadcast(t, src=1, group=group)
        return [t]

    def reduce(dev, group, dtype=torch.float32):
        t = data(dev, dtype=dtype)
        dist.reduce(t, dst=0, op=R.MAX, group=group)
        return [t]

    def a2a_even(dev, group):
        t = torch.empty(4, 2, device=dev)
        dist.all_to_all_single(t, torch.arange(8.0, device=dev).reshape(4, 2) + 10 * rank,
                               group=group)
        return [t]

    def a2a_uneven(dev, group):  # splits that differ between the ranks
        ins, outs = ([1, 3], [1, 2]) if rank == 0 else ([2, 2], [3, 2])
        t = torch.empty(sum(outs), device=dev)
        dist.all_to_all_single(t, torch.arange(4.0, device=dev) + 10 * rank, outs, ins,
                               group=group)
        return [t]

    def a2a_lists(dev, group):
        outs = [torch.empty(2, 3, dtype=torch.int32, device=dev) for _ in range(2)]
        ins = [torch.full((2, 3), 10 * rank + i, dtype=torch.int32, device=dev) * 1
               for i in range(2)]
        dist.all_to_all(outs, ins, group=group)
        return outs

    def gather(dev, group):
        parts = [torch.empty(4, device=dev) for _ in range(2)] if rank == 1 else None
        dist.gather(data(dev), parts, dst=1, group=group)
        return parts or []

    def scatter(dev, group):
        t = torch.empty(3, dtype=torch.int64, device=dev)
        parts = [torch.arange(3, device=dev) + 10 * i for i in range(2)]
        dist.scatter(t, parts if rank == 0 else None, src=0, group=group)
        return [t]

    def functional(dev, group):
        name = (group or dist.group.WORLD).group_name
        c10d = torch.ops._c10d_functional
        x = data(dev)
        outs = [c10d.all_reduce(x, "sum", name), c10d.all_gather_into_tensor(x, 2, name),
                c10d.reduce_scatter_tensor(x, "avg", 2, name), c10d.broadcast(x, 0, name),
                c10d.all_to_all_single(x, [2, 2], [2, 2], name)]
        return [c10d.wait_tensor(t) for t in outs]

    CALLS = {"broadcast": broadcast, "reduce": reduce,
             "reduce bool": lambda d, g: reduce(d, g, torch.bool),
             "all_to_all_single even": a2a_even, "all_to_all_single uneven": a2a_uneven,
             "all_to_all": a2a_lists, "gather": gather, "scatter": scatter,
             "functional": functional}
    report["collectives"] = {}
    for name, fn in CALLS.items():
        want = [t.cpu() for t in fn("cpu", gloo)]
        torchtpu.sync()
        before = metrics.snapshot()
        got = fn("tpu", None)
        during = metrics.snapshot()
        got = [t.cpu() for t in got]
        after = metrics.snapshot()
        delta = lambda a, b, k: a[k] - b[k]  # noqa: E731
        flushes = lambda a, b: sum(a["flushes"].values()) - sum(b["flushes"].values())  # noqa: E731
        report["collectives"][name] = {
            "equal": len(got) == len(want) and all(
                a.dtype == b.dtype and a.shape == b.shape and
                torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                            b.view(torch.int32) if b.dtype == torch.float32 else b)
                for a, b in zip(got, want)),
            "values": [str(t) for t in got] + [str(t) for t in want],
            "flushes in the call": flushes(during, before),
            "flushes to read": flushes(after, during),
            "recorded": delta(after, before, "collectives_in_graphs"),
            "issued": delta(after, before, "collectives_issued"),
            "op by op": delta(after, before, "mesh_graphs_run_op_by_op")}

    # A local op more on one rank is fine: only the collectives must agree.
    t = torch.ones(3, device="tpu")
    t = t * 2 if rank == 0 else t
    dist.all_reduce(t)
    report["local ops differ"] = t.cpu().tolist()
    # An all_reduced loss (one element) issues the graph at the all_reduce on
    # every rank, so rank 0 reads it alone. A value that depends on a
    # pending collective of more elements, read on rank 0 alone: rank 0
    # flushes the graph at the read, rank 1 at its optimizer step with
    # backward's all_reduces in it too: both raise, saying why.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    report["reduced loss want"] = 2 * model(x[:4]).sum().item()  # (each rank has x[:4])
    model.to("tpu")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    try:
        out = ddp(x[:4].to("tpu"))
        loss = out.sum()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            report["reduced loss"] = total.item()
        per_output = out.detach().sum(0)
        dist.all_reduce(per_output)
        if rank == 0:
            per_output[0].item()
        loss.backward()
        opt.step()
        report["reduced read"] = "no error"
    except RuntimeError as e:
        report["reduced read"] = str(e)
    # Ranks whose graphs hold different collectives (rank 0 one all_reduce
    # more) raise on every rank, rather than hang.
    t = torch.ones(3, device="tpu")
    try:
        for _ in range(2 if rank == 0 else 1):
            dist.all_reduce(t)
        t.cpu()
        report["mismatch"] = "no error"
    except RuntimeError as e:
        report["mismatch"] = str(e)
    json.dump(report, open(sys.argv[1], "w"))
    # Rank 0 still holds the graph of its first all_reduce, which rank 1
    # will never flush: leave without flushing it.
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return _reports(tmp_path_factory.mktemp("fused"))


def _reports(tmp_path, env=None):
    procs, outs = start_ranks(tmp_path, WORKER, 2, env=env)
    logs = finish(procs, timeout=300)
    for out, log in zip(outs, logs):
        assert out.exists(), log
    return [json.load(open(out)) for out in outs]


def test_tiered_compilation_keeps_the_ranks_graphs_alike(tmp_path):
    """Every graph without a collective compiled in the background (tiered
    compilation, even small ones), those holding collectives at once: a DDP
    step still ends with gloo's parameters, each step from the third one
    flush with its collectives inside, and every rank's reads right."""
    for r in _reports(tmp_path, {"TORCHTPU_FUSED_BACKGROUND_OPS": "1"}):
        assert r["close"], r["diff"]
        for step in r["steps"][2:]:
            assert step["flushes"] == 1 and step["collectives"] >= 2 and step["issued"] == 0, r["steps"]
        assert r["logged close"], r["logged steps"]
    # (The same DDP steps, their losses read on rank 0 alone.)


def test_fused_ddp_step_is_one_graph_with_its_collectives(reports):
    for r in reports:
        assert r["close"], r["diff"]
        # DDP rebuilds its buckets after the first step (broadcasting their
        # layout, run at once); from the third step on, each step is one
        # flush (the sync) with its all_reduces inside, compiled once.
        for step in r["steps"][2:]:
            assert step["flushes"] == 1, r["steps"]
            assert step["collectives"] >= 2 and step["issued"] == 0, r["steps"]
        assert [s["compiled"] for s in r["steps"][3:]] == [0, 0], r["steps"]
        assert r["local ops differ"] == [3.0] * 3
        checked = r["collectives"]
        for name, c in checked.items():
            assert c["equal"], (name, c)
            if name in ("gather", "scatter"):
                # Rooted lists (only the root has one): issued at once, after
                # a flush of their inputs; what they write is issued too.
                assert c["recorded"] == 0 and c["issued"] == 1, (name, c)
                continue
            # A broadcast issues the graph it went into (what it hands out,
            # any rank may then read alone), and so does a reduce (its root
            # reads it alone): the functional ones' flush at their
            # broadcast, before their all_to_all.
            settles = name in ("broadcast", "reduce", "reduce bool")
            assert c["flushes in the call"] == (settles or name == "functional"), (name, c)
            assert c["flushes to read"] == (not settles), (name, c)
            assert c["recorded"] == (5 if name == "functional" else 1), (name, c)
            assert c["issued"] == 0, (name, c)
            # Uneven splits that differ between the ranks pad differently:
            # that graph runs op by op on both (its collective still inside).
            assert c["op by op"] == (name == "all_to_all_single uneven"), (name, c)
        assert "the ranks called it with different arguments" in r["mismatch"], r["mismatch"]


def test_fused_ddp_loss_read_on_rank_0_only(reports):
    for rank, r in enumerate(reports):
        steps = r["logged steps"]
        assert r["logged close"], steps
        # One full graph per step, issued at the optimizer's step (no read
        # flushes it), compiled once from the third step on; the ranks'
        # graphs alike (none op by op, nothing issued on its own).
        for step in steps[2:]:
            assert step["flushes"] == {"optimizer_step": 1}, steps
        assert [s["graphs_compiled"] for s in steps[3:]] == [0, 0, 0], steps
        # But the first: DDP's constructor broadcast the parameters and
        # issued that graph, so rank 0 reads the loss before backward (no
        # collective pending: it flushes its forward alone), and that step's
        # graphs, alike in collectives but not in local ops, run op by op
        # on both ranks (correct values), once.
        assert [s["mesh_graphs_run_op_by_op"] for s in steps] == [1, 0, 0, 0, 0, 0], steps
        # DDP's bucket rebuild after the first step broadcasts their layout.
        assert steps[1]["flushes"] == {"broadcast": 2, "optimizer_step": 1}, steps
        assert all(s["collectives_issued"] == 0 for s in steps[1:]), steps
        # Side graphs on rank 0 alone, at the reads before the step (the
        # forward's, compiled at the first of them and reused after).
        assert [s["side_reads"] > 0 for s in steps] == (
            [False, False] + [True, False] * 2 if rank == 0 else [False] * 6), steps
        assert all(s["side_graphs_compiled"] == 0 for s in steps[4:]), steps
        side = r["side read"]
        assert side["side reads"] == 2 and side["flushes"] == 0, side
        rand, written, rand_full, written_full, reduced = side["values"]
        assert rand == rand_full and written == [1.0] * 3, side
        assert written_full == [2.0] * 3 and reduced == [2.0] * 3, side
        error, reduced, side_reads, flushes = r["bad index"]
        assert "index 5 is out of bounds" in error and reduced == [2.0] * 3, r["bad index"]
        assert (side_reads, flushes) == (1, 0), r["bad index"]  # raised by the side read
        if r is reports[0]:
            assert r["reduced loss"] == pytest.approx(r["reduced loss want"], rel=1e-5), r
        assert "the ranks called it with different arguments" in r["reduced read"], r
        assert "flushed for item at" in r["reduced read"], r["reduced read"]
        assert "Call torchtpu.sync() on every rank" in r["reduced read"], r["reduced read"]
    # Rank 0's losses, read before and after the step, are gloo's on CPU
    # (the first also before backward).
    losses, want = reports[0]["logged losses"]
    assert reports[0]["first loss before backward"] == pytest.approx(want[0], rel=1e-5, abs=1e-6)
    assert torch.allclose(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6), \
        (losses, want)
    printed, values, positive, item = reports[0]["other reads"]
    assert printed and positive == (item > 0) and len(values) == 4, reports[0]["other reads"]


def test_a_graph_flushed_on_some_ranks_only_says_how_to_avoid_it():
    from torchtpu.distributed import agreement
    # Rank 0 read a value alone (flushing its graph), rank 1 went on to its
    # next collective: the error says what happened and what to do.
    with pytest.raises(RuntimeError, match=r"rank 0: fused graph 1f; rank 1: broadcast 0 .*"
                                           r"Call torchtpu.sync\(\) on every rank"):
        agreement._check("broadcast", ["fused graph 1f", "broadcast 0 (5,):torch.int32"], [0, 1])
    # Two graphs that differ: no such advice.
    with pytest.raises(RuntimeError) as raised:
        agreement._check("a fused graph", ["fused graph 1f", "fused graph 2e"], [0, 1])
    assert "torchtpu.sync" not in str(raised.value)
    # Two graphs flushed at different points (a read on rank 0): the advice,
    # and where each rank flushed.
    with pytest.raises(RuntimeError, match=r"rank 0: fused graph 1f \(flushed for item at a.py:3\); "
                                           r"rank 1: .*Call torchtpu.sync\(\) on every rank"):
        agreement._check("a fused graph", ["fused graph 1f", "fused graph 2e"], [0, 1],
                         ["flushed for item at a.py:3", "flushed for optimizer_step at a.py:9"])


BAD_TOKEN_WORKER = textwrap.dedent("""\
    import datetime, json, sys
    import torch, torch.distributed as dist, torch.nn.functional as F
    import torchtpu
    dist.init_process_group(timeout=datetime.timedelta(seconds=60))
    torchtpu.set_eager_mode("fused")
    torch.manual_seed(0)
    # A forward of over 100 ops (what fused mode would flush when the
    # backward starts, without collectives).
    blocks = [m for _ in range(60) for m in (torch.nn.Linear(4, 4), torch.nn.Tanh())]
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), *blocks, torch.nn.Linear(4, 2)).to("tpu")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    target = torch.tensor([0, 1]).to("tpu")
    report = {"losses": []}
    for tokens in ([1, 2], [3, 4], [5, 12]):
        loss = F.cross_entropy(ddp(torch.tensor(tokens).to("tpu")), target)
        loss.backward()
        for p in ddp.parameters():  # (by hand: no optimizer step to flush at)
            p.data.add_(p.grad, alpha=-0.1)
            p.grad = None
        try:
            report["losses"].append(loss.item())
        except IndexError as e:
            report["raised"] = str(e)
            break
    json.dump(report, open(sys.argv[1], "w"))
""")


def test_fused_ddp_step_with_a_bad_token_raises_at_its_read(tmp_path):
    """A DDP step (its backward holds all_reduces) with a long forward,
    parameters updated by hand and an out-of-range token raises at that
    step's loss.item() on every rank."""
    procs, outs = start_ranks(tmp_path, BAD_TOKEN_WORKER, 2)
    logs = finish(procs, timeout=300)
    for out, log in zip(outs, logs):
        assert out.exists(), log
        r = json.load(open(out))
        assert len(r["losses"]) == 2, r
        assert "index 12 is out of bounds for dimension 0 with size 10 (aten.embedding" in r.get("raised", ""), r
