"""torch.distributed on tpu tensors: the `tpu` process-group backend, in two
processes, against the same computation on CPU."""
import json
import os
import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401  (registers the backend)

WORKER = textwrap.dedent("""\
    import json, sys, torch, torch.distributed as dist, torch.nn.functional as F
    import torchtpu
    rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group(init_method="file://" + store, rank=rank, world_size=2)
    result = {"backend": dist.get_backend_config()}
    t = torch.tensor([1.0, 2.0], device="tpu") * (rank + 1)
    dist.all_reduce(t)
    result["all_reduce"] = t.cpu().tolist()
    b = torch.full((3,), float(rank), device="tpu")
    dist.broadcast(b, src=1)
    result["broadcast"] = b.cpu().tolist()
    parts = [torch.empty(2, device="tpu") for _ in range(2)]
    dist.all_gather(parts, torch.arange(2.0, device="tpu") + 10 * rank)
    result["all_gather"] = [p.cpu().tolist() for p in parts]
    rs = torch.empty(2, device="tpu")
    dist.reduce_scatter_tensor(rs, torch.arange(4.0, device="tpu") * (rank + 1))
    result["reduce_scatter"] = rs.cpu().tolist()
    a2a = torch.empty(4, device="tpu")
    dist.all_to_all_single(a2a, torch.arange(4.0, device="tpu") + 10 * rank)
    result["all_to_all"] = a2a.cpu().tolist()
    gathered = torch.empty(4, device="tpu")
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank), device="tpu"))
    result["all_gather_into_tensor"] = gathered.cpu().tolist()
    dist.barrier()
    red = torch.tensor([rank + 1.0], device="tpu")
    dist.reduce(red, dst=0)
    result["reduce"] = red.cpu().tolist()
    gl = [torch.empty(1, device="tpu") for _ in range(2)] if rank == 0 else None
    dist.gather(torch.tensor([rank + 5.0], device="tpu"), gl, dst=0)
    result["gather"] = [t.cpu().tolist() for t in gl] if rank == 0 else None
    sc = torch.empty(1, device="tpu")
    dist.scatter(sc, [torch.tensor([7.0], device="tpu"), torch.tensor([8.0], device="tpu")]
                 if rank == 0 else None, src=0)
    result["scatter"] = sc.cpu().tolist()
    msg = torch.tensor([42.0], device="tpu") if rank == 0 else torch.zeros(1, device="tpu")
    if rank == 0:
        version = msg._version
        dist.send(msg, dst=1)
        result["send_wrote"] = msg._version != version  # a send writes nothing
    else:
        dist.recv(msg, src=0)
    result["send_recv"] = msg.cpu().tolist()
    c = torch.tensor([rank + 1.0])  # a CPU tensor goes through the same group
    dist.all_reduce(c)
    result["cpu_all_reduce"] = c.tolist()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    for mode in ("debug", "strict", "fused"):
        torchtpu.set_eager_mode(mode)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 2)).to("tpu")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        xs, ys = x[4 * rank:4 * rank + 4].to("tpu"), y[4 * rank:4 * rank + 4].to("tpu")
        for _ in range(2):
            F.mse_loss(ddp(xs), ys).backward()
            opt.step()
            opt.zero_grad()
        result[mode] = [p.detach().cpu().tolist() for p in model.parameters()]
    dist.destroy_process_group()
    json.dump(result, open(out, "w"))
""")


def test_collectives_and_ddp_across_two_processes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    store = tmp_path / "store"
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    env = dict(os.environ, TORCHTPU_CACHE_DIR="off")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(store), str(outs[r])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    for p in procs:
        log = p.communicate(timeout=600)[0]
        assert p.returncode == 0, log
    results = [json.load(open(o)) for o in outs]

    # The same data-parallel training on CPU: the mean of the two halves'
    # gradients is the full batch's.
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    for _ in range(2):
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    expected = [p.detach() for p in ref.parameters()]

    for rank, r in enumerate(results):
        assert "tpu:tpu" in r["backend"], r["backend"]  # picked for tpu tensors by default
        assert r["all_reduce"] == [3.0, 6.0]
        assert r["broadcast"] == [1.0, 1.0, 1.0]
        assert r["all_gather"] == [[0.0, 1.0], [10.0, 11.0]]
        assert r["reduce_scatter"] == ([0.0, 3.0] if rank == 0 else [6.0, 9.0])
        assert r["all_to_all"] == ([0.0, 1.0, 10.0, 11.0] if rank == 0 else [2.0, 3.0, 12.0, 13.0])
        assert r["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert r["cpu_all_reduce"] == [3.0]
        assert r["reduce"] == ([3.0] if rank == 0 else [2.0])
        assert r["gather"] == ([[5.0], [6.0]] if rank == 0 else None)
        assert r["scatter"] == [7.0 + rank]
        assert r["send_recv"] == [42.0]
        assert r.get("send_wrote") is (False if rank == 0 else None)
        for mode in ("debug", "strict", "fused"):
            for got, want in zip(r[mode], expected):
                torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
