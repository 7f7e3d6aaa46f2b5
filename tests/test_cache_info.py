"""`python -m torchtpu.cache info`: the directory's hit rate, which the runs
that used it add to at exit (under the directory's lock), a read-only run
leaves alone and `clear` resets."""
import json
import os
import subprocess
import sys

from torchtpu import cache, cache_files

RUN = r"""
import torch, torchtpu
x = torch.arange(6.0, device="tpu").reshape(2, 3)
print("RESULT", ((x * 2 + 1).exp().sum(1) / 3).cpu().tolist(), torchtpu.cache.stats()["disk_hits"],
      torchtpu.cache.stats()["disk_misses"])
"""


def _run(cache_dir, **extra):
    env = {k: v for k, v in os.environ.items() if k != "TORCHTPU_CACHE_READONLY"}
    env.update(TORCHTPU_CACHE_DIR=str(cache_dir), TORCHTPU_EAGER_MODE="strict", **extra)
    proc = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1].split(" ", 1)[1]
    values, hits, misses = line.rsplit(" ", 2)
    return values, int(hits), int(misses)


def _info(cache_dir, as_json=True):
    proc = subprocess.run([sys.executable, "-m", "torchtpu.cache", "info", "--dir", str(cache_dir)]
                          + (["--json"] if as_json else []), capture_output=True, text=True,
                          env=dict(os.environ, TORCHTPU_CACHE_DIR="off"), timeout=300, check=True)
    return json.loads(proc.stdout) if as_json else proc.stdout


def test_info_gives_the_hit_rate_of_the_runs_that_used_the_directory(tmp_path, capsys):
    d = tmp_path / "cc"
    # (The command itself runs twice below; in between, what it reads.)
    info = cache_files.disk_info
    assert info(str(tmp_path))["hit_rate"] is None  # nothing recorded yet
    cold_values, cold_hits, cold_misses = _run(d)
    assert cold_misses > 0
    read = info(str(d))
    assert (read["hits"], read["misses"]) == (cold_hits, cold_misses)
    warm_values, warm_hits, warm_misses = _run(d)
    assert warm_values == cold_values
    assert warm_hits > 0 and warm_misses == 0  # everything loaded, nothing compiled
    shown = _info(d)
    hits, misses = cold_hits + warm_hits, cold_misses
    assert (shown["hits"], shown["misses"]) == (hits, misses)
    assert abs(shown["hit_rate"] - hits / (hits + misses)) < 1e-12
    assert f"{100 * hits / (hits + misses):.1f}% ({hits} hits, {misses} misses" in _info(d, False)
    # A read-only run writes nothing, its counts neither.
    _run(d, TORCHTPU_CACHE_READONLY="1")
    read = info(str(d))
    assert (read["hits"], read["misses"]) == (hits, misses)
    assert cache._main(["clear", "--dir", str(d)]) == 0
    assert info(str(d))["hit_rate"] is None
    capsys.readouterr()
    assert cache._main(["info", "--dir", str(d)]) == 0
    assert "no lookups recorded" in capsys.readouterr().out


def test_lookups_added_by_processes_at_once_are_all_counted(tmp_path):
    d = tmp_path / "c"
    d.mkdir(mode=0o700)
    adder = ("import os, sys\nfrom torchtpu import cache_files\n"
             "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "for _ in range(200): cache_files.add_lookups(fd, 2, 1)\n")
    env = dict(os.environ, TORCHTPU_CACHE_DIR="off")
    procs = [subprocess.Popen([sys.executable, "-c", adder, str(d)], env=env) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=300) == 0
    info = cache_files.disk_info(str(d))
    assert (info["hits"], info["misses"]) == (800, 400)
    assert not [n for n in os.listdir(d) if n.startswith(cache.TMP_PREFIX)]


def test_a_damaged_lookups_file_counts_from_zero(tmp_path):
    d = tmp_path / "c"
    d.mkdir(mode=0o700)
    (d / cache_files.LOOKUPS_NAME).write_text("{not json")
    assert cache_files.disk_info(str(d))["hit_rate"] is None
    fd = os.open(d, os.O_RDONLY)
    try:
        cache_files.add_lookups(fd, 3, 1)
    finally:
        os.close(fd)
    assert cache_files.disk_info(str(d))["hit_rate"] == 0.75
