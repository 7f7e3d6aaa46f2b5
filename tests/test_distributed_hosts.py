"""Processes sharing a host, and ranks that die, under torch.distributed on
tpu: with torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE, each process's own
device is tpu:LOCAL_RANK and its current device; a rank that exits before a
collective (rank 0 too, whose process starts JAX's coordination service)
makes the others fail within the group's timeout, naming it."""
import json
import textwrap
import time

import pytest
from processes import finish, run_ranks, start_ranks

LOCAL_RANK_WORKER = textwrap.dedent("""\
    import datetime, json, os, sys
    import jax, torch, torch.distributed as dist, torch.nn.functional as F
    import torchtpu
    from torchtpu.dispatch.host import device_array
    local = int(os.environ["LOCAL_RANK"])
    report = {"count": torch.tpu.device_count(), "current": torch.tpu.current_device(),
              "accelerator": torch.accelerator.current_device_index()}
    torch.tpu.set_device(local)  # as torchrun scripts call torch.cuda.set_device
    dist.init_process_group(device_id=torch.device("tpu", local),
                            timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()

    def where(t):
        (d,) = device_array(t).devices()
        mine = jax.local_devices()  # all of this host's, or this process's own one
        return [str(t.device), d.id, d == mine[local if len(mine) > 1 else 0]]

    bare = torch.full((3,), rank + 1.0, device="tpu")
    named = torch.full((3,), 10.0 * (rank + 1), device=f"tpu:{local}")
    moved = torch.arange(3.0).to("tpu")
    report["where"] = [where(bare), where(named), where(moved)]
    dist.all_reduce(bare)
    dist.all_reduce(named)
    report["sums"] = [bare.cpu().tolist(), named.cpu().tolist(), where(bare)]

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to("tpu")
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
    F.mse_loss(ddp(x[2 * rank:2 * rank + 2].to("tpu")), y[2 * rank:2 * rank + 2].to("tpu")).backward()
    report["grad"] = [where(model.weight.grad), model.weight.grad.cpu().tolist()]
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 2)
    F.mse_loss(ref(x), y).backward()
    report["want_grad"] = ref.weight.grad.tolist()
    dist.destroy_process_group()
    json.dump(report, open(sys.argv[1], "w"))
""")


@pytest.mark.parametrize("xla_flags", [None, "", "--xla_force_host_platform_device_count=1"],
                         ids=["host devices set", "host devices raised", "one device each"])
def test_local_rank_names_each_process_own_device(tmp_path, xla_flags):
    # XLA's host device count: set to 2 by conftest, or unset (torchtpu then
    # gives each process LOCAL_WORLD_SIZE host devices), or 1, as a TPU or
    # GPU process given its own chip sees one device: it is tpu:LOCAL_RANK.
    env = {"LOCAL_WORLD_SIZE": "2"} if xla_flags is None else {"LOCAL_WORLD_SIZE": "2",
                                                               "XLA_FLAGS": xla_flags}
    reports = run_ranks(tmp_path, LOCAL_RANK_WORKER, 2, env=env)
    ids = set()
    for rank, r in enumerate(reports):
        assert r["count"] == 2
        assert r["current"] == r["accelerator"] == rank  # before any set_device
        for device, jax_id, own in r["where"] + [r["sums"][2], r["grad"][0]]:
            assert device == f"tpu:{rank}" and own, r
            ids.add(jax_id)
        assert r["sums"][:2] == [[3.0] * 3, [30.0] * 3]
        got, want = r["grad"][1], r["want_grad"]
        for a, b in zip(sum(got, []), sum(want, [])):
            assert abs(a - b) <= 1e-6 + 1e-5 * abs(b), (got, want)
    assert len(ids) == 2  # each rank's own device, two devices in all


def test_each_process_on_a_host_is_given_its_own_chip():
    from torchtpu.runtime.bootstrap import gpu_device_ids, tpu_environment
    # A TPU host of 4 chips, torchrun --nproc-per-node 4: rank 2's variables.
    env = tpu_environment(2, 4, 4, 4, {})
    assert env == {"TPU_VISIBLE_CHIPS": "2", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
                   "TPU_PROCESS_BOUNDS": "2,2,1",
                   "TPU_PROCESS_ADDRESSES": "localhost:8476,localhost:8477,localhost:8478,"
                                            "localhost:8479",
                   "TPU_PROCESS_PORT": "8478", "CLOUD_TPU_TASK_ID": "2",
                   "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    eight = tpu_environment(7, 8, 8, 8, {"TORCHTPU_TPU_PROCESS_PORT": "9000"})
    assert (eight["TPU_PROCESS_BOUNDS"], eight["TPU_PROCESS_PORT"], eight["TPU_VISIBLE_CHIPS"]) \
        == ("4,2,1", "9007", "7")
    # Not a TPU host, or the user's own settings: nothing is set.
    assert tpu_environment(1, 2, 2, 0, {}) == {}
    assert tpu_environment(1, 4, 4, 4, {"TPU_VISIBLE_CHIPS": "0,1"}) == {}
    # Layouts torchtpu does not make raise, rather than let the processes
    # fight over the chips.
    for args in [(0, 2, 2, 4), (0, 4, 8, 4)]:
        with pytest.raises(RuntimeError, match="set TPU_VISIBLE_CHIPS"):
            tpu_environment(*args, {})
    # GPUs: jax.distributed's local_device_ids, unless visibility is chosen.
    assert gpu_device_ids(1, 2, {}) == [1]
    assert gpu_device_ids(1, 2, {"CUDA_VISIBLE_DEVICES": "0,1"}) == [1]
    assert gpu_device_ids(1, 2, {"CUDA_VISIBLE_DEVICES": "5"}) is None  # the launcher's pick
    assert gpu_device_ids(1, 2, {"JAX_LOCAL_DEVICE_IDS": "3"}) is None


def test_local_rank_outside_the_local_world_raises(monkeypatch):
    from torchtpu.runtime import bootstrap
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"):
        bootstrap._local()
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert bootstrap._local() == (1, 2)
    # This process is not one of several JAX processes: its own device is tpu:0.
    assert bootstrap.own_device_index(2) == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert bootstrap._local() is None


DEAD_RANK_WORKER = textwrap.dedent("""\
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist
    import torchtpu
    dist.init_process_group(timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    t = torch.ones(3, device="tpu")
    dist.all_reduce(t)  # both ranks are up
    if rank == int(os.environ["DEAD_RANK"]):
        os._exit(3)  # dies, as a rank killed by the OOM killer would
    time.sleep(1)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        error = None
    except Exception as e:
        error = [type(e).__name__, isinstance(e, RuntimeError), str(e)]
    json.dump({"error": error, "seconds": time.monotonic() - start}, open(sys.argv[1], "w"))
""")


@pytest.mark.parametrize("dead", [1, 0], ids=["rank 1", "rank 0, the coordinator's"])
def test_a_dead_rank_fails_the_others_collective_naming_it(tmp_path, dead):
    # Rank 0 starts JAX's coordination service, in a process of its own, so
    # that its death is a rank's like any other. JAX's coordination service
    # ends the survivor once it takes the dead rank for dead (its heartbeat
    # timeout, made short here), after the Python error.
    procs, outs = start_ranks(tmp_path, DEAD_RANK_WORKER, 2,
                              env={"DEAD_RANK": str(dead), "TORCHTPU_HEARTBEAT_TIMEOUT": "5"})
    start = time.monotonic()
    logs = finish(procs, timeout=180)
    assert time.monotonic() - start < 120, logs
    survivor = 1 - dead
    assert procs[dead].returncode == 3, logs[dead]
    assert outs[survivor].exists(), logs[survivor]
    report = json.load(open(outs[survivor]))
    assert report["error"] is not None, report
    kind, is_runtime_error, message = report["error"]
    assert kind == "DistBackendError" and is_runtime_error, report
    assert message.startswith("all_reduce: a rank of the group did not take part"), message
    assert report["seconds"] < 20, report  # within the group's timeout


def test_a_coordination_service_that_cannot_start_raises(monkeypatch):
    from torchtpu.runtime import bootstrap, coordinator
    # JAX's service raises there, or its process crashes (JAX's failure path
    # sometimes does): either way, an error at once rather than a wait.
    with pytest.raises(RuntimeError, match="service on 256.1.1.1:99999 did not start: "
                                           "(failed .*RPC server|its process ended)"):
        coordinator.ServiceProcess("256.1.1.1:99999", 2, {"heartbeat_timeout": 5})
    monkeypatch.setenv("TORCHTPU_COORDINATOR_PROCESS", "yes")
    with pytest.raises(ValueError, match="TORCHTPU_COORDINATOR_PROCESS='yes' is not 0 or 1"):
        bootstrap._service_apart()
    monkeypatch.setenv("TORCHTPU_COORDINATOR_PROCESS", "0")
    assert bootstrap._service_apart() is False


HOSTS_WORKER = textwrap.dedent("""\
    import datetime, json, os, sys
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    import torchtpu
    local = int(os.environ["LOCAL_RANK"])
    torch.tpu.set_device(local)
    dist.init_process_group(device_id=torch.device("tpu", local),
                            timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]
    mine = slice(rank * 8 // world, (rank + 1) * 8 // world)

    def train(model, to):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches:
            loss = F.mse_loss(model(x[mine].to(to) if to else x), y[mine].to(to) if to else y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    ref = mlp()
    train(ref, None)  # one CPU process on the whole batch
    ddp = mlp().to("tpu")
    train(torch.nn.parallel.DistributedDataParallel(ddp, device_ids=[local]), "tpu")
    sharded = mlp().to("tpu")
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer)
    fully_shard(sharded)
    train(sharded, "tpu")
    report = {
        "device": str(torch.tpu.current_device()),
        "ddp": max((p.detach().cpu() - q).abs().max().item()
                   for p, q in zip(ddp.parameters(), ref.parameters())),
        "fsdp": max((p.full_tensor().detach().cpu() - q).abs().max().item()
                    for p, q in zip(sharded.parameters(), ref.parameters())),
    }
    dist.destroy_process_group()
    json.dump(report, open(sys.argv[1], "w"))
""")


def test_two_hosts_of_two_processes_train_ddp_and_fsdp2(tmp_path):
    """torchrun --nnodes 2 --nproc-per-node 2, simulated on localhost: each
    process on its host's tpu:LOCAL_RANK; DDP and FSDP2 steps give one CPU
    process's weights on the whole batch."""
    reports = run_ranks(tmp_path, HOSTS_WORKER, 4, timeout=240, per_host=2)
    assert [r["device"] for r in reports] == ["0", "1", "0", "1"]
    for r in reports:
        assert r["ddp"] < 1e-6 and r["fsdp"] < 1e-6, r
