"""Collectives in fused mode are nodes of the graph, not sync points: a DDP
training step over two processes is one compiled graph per step (asserted
through metrics) and ends with the parameters gloo's DDP gets on CPU; ranks
whose graphs hold different collectives raise on every rank instead of
hanging."""
import json
import textwrap

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

    def train(dev, group, steps):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 2)).to(dev)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                        bucket_cap_mb=0.0001)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        xs, ys = x[4 * rank:4 * rank + 4].to(dev), y[4 * rank:4 * rank + 4].to(dev)
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

    # A local op more on one rank is fine: only the collectives must agree.
    t = torch.ones(3, device="tpu")
    t = t * 2 if rank == 0 else t
    dist.all_reduce(t)
    report["local ops differ"] = t.cpu().tolist()
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


def test_fused_ddp_step_is_one_graph_with_its_collectives(tmp_path):
    procs, outs = start_ranks(tmp_path, WORKER, 2)
    logs = finish(procs, timeout=300)
    for out, log in zip(outs, logs):
        assert out.exists(), log
    for r in [json.load(open(out)) for out in outs]:
        assert r["close"], r["diff"]
        # DDP rebuilds its buckets after the first step (broadcasting their
        # layout, run at once); from the third step on, each step is one
        # flush (the sync) with its all_reduces inside, compiled once.
        for step in r["steps"][2:]:
            assert step["flushes"] == 1, r["steps"]
            assert step["collectives"] >= 2 and step["issued"] == 0, r["steps"]
        assert [s["compiled"] for s in r["steps"][3:]] == [0, 0], r["steps"]
        assert r["local ops differ"] == [3.0] * 3
        assert "the ranks called it with different arguments" in r["mismatch"], r["mismatch"]
