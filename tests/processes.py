"""Running a worker script as the ranks of a torch.distributed job on
localhost, as torchrun starts them: each rank's JSON report, or the failing
rank's log."""
import json
import os
import socket
import subprocess
import sys


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(tmp_path, worker, n, env=None, per_host=None):
    """worker (a script's text, taking its report's path as argv[1]) started
    in n processes with torchrun's environment (plus env); (the processes,
    their reports' paths), in rank order. per_host: the processes of each
    simulated host (torchrun --nnodes n / per_host --nproc-per-node
    per_host): LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK as on those hosts."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    outs = [tmp_path / f"rank{r}.json" for r in range(n)]
    base = dict(os.environ, TORCHTPU_CACHE_DIR="off", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()), TORCHTPU_COORDINATOR_PORT=str(free_port()),
                WORLD_SIZE=str(n), **(env or {}))
    base.pop("TORCHTPU_DISTRIBUTED", None)
    local = per_host or n
    if per_host:
        base["LOCAL_WORLD_SIZE"] = str(per_host)
    procs = [subprocess.Popen([sys.executable, str(script), str(outs[r])],
                              env=dict(base, RANK=str(r), LOCAL_RANK=str(r % local),
                                       GROUP_RANK=str(r // local)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(n)]
    return procs, outs


def finish(procs, timeout):
    """Each process's output once it has ended (killed after timeout)."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()


def run_ranks(tmp_path, worker, n, timeout=300, env=None, per_host=None):
    """worker run in n processes (see start_ranks); their reports, in rank
    order, once every one has succeeded."""
    procs, outs = start_ranks(tmp_path, worker, n, env, per_host)
    logs = finish(procs, timeout)
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log
    return [json.load(open(out)) for out in outs]
