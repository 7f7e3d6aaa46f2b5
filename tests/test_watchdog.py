"""The watchdog (torchtpu/distributed/watchdog.py): under torch.distributed,
a rank that has not come to a collective within TORCHTPU_WATCHDOG seconds
is named by the ranks waiting in it, which raise; it prints its Python
stack and ends, so the job ends with the diagnosis."""
import re
import textwrap
import time

import pytest
from processes import finish, start_ranks

from torchtpu import config
from torchtpu.distributed import watchdog

STALLING_WORKER = textwrap.dedent("""\
    import datetime, sys, time
    import torch, torch.distributed as dist
    import torchtpu
    dist.init_process_group(timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    t = torch.ones(3, device="tpu")
    x = torch.tensor([float(rank)], device="tpu")
    for step in range(3):
        if step == 1 and x.item() > 0:  # a data-dependent branch: rank 1 only
            time.sleep(120)  # STALLS
        dist.all_reduce(t); total = t.sum().item()  # WAITS
        print("step", step, "done", total, flush=True)
    print("finished", flush=True)
""")


def _line(marker):
    return next(i for i, ln in enumerate(STALLING_WORKER.splitlines(), 1) if marker in ln)


# What each rank enters, per mode: in fused mode the first all_reduce agrees
# at once and the step's read flushes the graph holding it (a second
# exchange); later all_reduces are recorded and agreed at the flush.
EXPECTED = {"strict": ("#1 all_reduce", "#2 all_reduce"),
            "fused": ("#2 a fused graph holding collectives", "#3 all_reduce")}


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_a_stalled_rank_is_named_and_the_job_ends(tmp_path, mode):
    start = time.monotonic()
    procs, _ = start_ranks(tmp_path, STALLING_WORKER, 2, env={
        "TORCHTPU_WATCHDOG": "3", "TORCHTPU_EAGER_MODE": mode,
        "TORCHTPU_HEARTBEAT_TIMEOUT": "5"})
    waiting, stalled = finish(procs, timeout=120)
    took = time.monotonic() - start
    # Rank 1 ends itself; rank 0 raises, then JAX's coordination service
    # ends it at exit (rank 1 is gone: -6, SIGABRT), as after any dead rank.
    assert procs[1].returncode == 1 and procs[0].returncode != 0, (waiting, stalled)
    assert "finished" not in waiting and "step 0 done 6.0" in waiting, waiting
    assert "step 1" not in stalled, stalled
    at = f"at {tmp_path / 'worker.py'}:{_line('WAITS')}"
    done, waits = EXPECTED[mode]
    # The waiting rank raises, naming the missing rank and where each is.
    error = next((ln for ln in waiting.splitlines() if "DistBackendError: " in ln), None)
    assert error is not None, waiting
    assert error.split("DistBackendError: ", 1)[1] == (
        "all_reduce: the watchdog (TORCHTPU_WATCHDOG=3 s) found rank 1 missing after 3 s: "
        f"rank 1 has not reached it; its last collective entered: {done} {at}. "
        f"Rank 0 waits at {waits} {at}; its last completed collective: {done} {at}. "
        "Rank 1 printed its Python stack to its stderr and ended."), error
    # The stalled rank says so and prints its stack (faulthandler's form).
    assert "torchtpu watchdog: rank 1 is missing from a collective" in stalled, stalled
    script = re.escape(str(tmp_path / "worker.py"))
    assert re.search(rf'File "{script}", line {_line("STALLS")} in <module>', stalled), stalled
    # Within the watchdog's 3 s, the start-up and JAX's 5 s heartbeat.
    assert took < 60, (took, waiting, stalled)


def test_the_timeout_reads_seconds_or_off(monkeypatch):
    monkeypatch.delenv(config.WATCHDOG.name, raising=False)
    assert watchdog.seconds() == 600
    for value, want in (("2.5", 2.5), ("0", None), ("off", None)):
        monkeypatch.setenv(config.WATCHDOG.name, value)
        assert watchdog.seconds() == want
    monkeypatch.setenv(config.WATCHDOG.name, "soon")
    with pytest.raises(ValueError, match="TORCHTPU_WATCHDOG='soon' is not a number of seconds"):
        watchdog.seconds()
