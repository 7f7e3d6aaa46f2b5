"""The persistent compilation cache, across processes: warm starts in strict
and fused mode, modes sharing entries, damaged entries, concurrent writers,
disabled, read-only and unwritable directories.

Each run is a subprocess with its own TORCHTPU_CACHE_DIR under tmp_path,
running a few ops and two SGD steps of a tiny MLP, and comparing with the
same on CPU."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from torchtpu import cache

SCRIPT = r'''
import json, os, sys, warnings
warnings.simplefilter("always")
import torch, torchtpu
from torch import nn

def run(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g).to(device)
    y = torch.randint(0, 4, (6,), generator=g).to(device)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out = {"losses": losses,
           "params": [p.detach().cpu().flatten().tolist() for p in model.parameters()],
           "ops": ((x * 2 + 1).exp().sum(1) / 3).cpu().tolist()}
    if os.environ.get("EXTRA") == "1":  # something no earlier run compiled
        out["extra"] = torch.cumprod(x[:, :3] + 0.5, 0).cpu().tolist()
    return out

result = run("tpu")
result["cpu"] = run("cpu")
result["stats"] = torchtpu.cache.stats()
result["fallbacks"] = torchtpu.metrics.snapshot()["cpu_fallbacks"]
print("RESULT " + json.dumps(result))
'''


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache_script") / "train.py"
    path.write_text(SCRIPT)
    return str(path)


def _env(cache_dir, mode="strict", **extra):
    env = dict(os.environ)
    for name in ("TORCHTPU_CACHE_READONLY", "TORCHTPU_EAGER_MODE", "EXTRA"):
        env.pop(name, None)
    env["TORCHTPU_CACHE_DIR"] = str(cache_dir)
    env["TORCHTPU_EAGER_MODE"] = mode
    env.update(extra)
    return env


def _start(script, cache_dir, mode="strict", **extra):
    return subprocess.Popen([sys.executable, script], env=_env(cache_dir, mode, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"run failed:\n{err[-4000:]}"
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    result["stderr"] = err
    _check_against_cpu(result)
    return result


def _run(script, cache_dir, mode="strict", **extra):
    return _finish(_start(script, cache_dir, mode, **extra))


def _check_against_cpu(result):
    import torch
    cpu = result["cpu"]
    for key in ("losses", "ops", "extra"):
        if key in cpu:
            torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(cpu[key]))
    for got, want in zip(result["params"], cpu["params"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))


def _same(a, b):
    """Bitwise the same results on tpu."""
    for key in ("losses", "params", "ops"):
        assert a[key] == b[key], key


def _torchtpu_warnings(result, text):
    return sum(1 for ln in result["stderr"].splitlines() if "torchtpu:" in ln and text in ln)


def _entries(path):
    return sorted(n for n in os.listdir(path) if n.endswith(cache.ENTRY_SUFFIX))


def _snapshot(path):
    """Every file in path with its size and modification time."""
    return {n: (os.stat(os.path.join(path, n)).st_size, os.stat(os.path.join(path, n)).st_mtime_ns)
            for n in os.listdir(path)}


def _all_verified(path):
    for name in _entries(path):
        key = name[:-len(cache.ENTRY_SUFFIX)]
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        with open(os.path.join(path, key + cache.CHECK_SUFFIX)) as f:
            check = json.load(f)
        if check["sha256"] != hashlib.sha256(data).hexdigest():
            return False
    return True


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_warm_start_compiles_nothing(script, tmp_path, mode):
    d = tmp_path / "cache"
    cold = _run(script, d, mode)
    s1 = cold["stats"]
    assert s1["compilations"] > 0 and s1["disk_hits"] == 0
    assert s1["disk_misses"] == s1["compilations"] == s1["disk_entries"]
    assert s1["disk_bytes"] > 0
    warm = _run(script, d, mode)
    s2 = warm["stats"]
    assert s2["compilations"] == 0
    assert s2["disk_misses"] == 0
    assert s2["disk_hits"] == s1["disk_misses"]
    assert s2["disk_entries"] == s1["disk_entries"]
    assert s2["compile_seconds_saved"] > 0
    _same(cold, warm)
    if mode == "fused":
        # Each fused graph's traced program is stored: a warm start loads it
        # instead of tracing the graph again.
        assert s1["disk_programs"] > 0 and s1["programs_loaded"] == 0
        assert s2["programs_loaded"] == s1["disk_programs"] == s2["disk_programs"]
        # A damaged program is a miss: traced again, replaced, one warning.
        programs = [n for n in os.listdir(d) if n.startswith(cache.PROGRAM_PREFIX)
                    and n.endswith(cache.ENTRY_SUFFIX)]
        for name in programs:
            with open(d / name, "r+b") as f:
                f.truncate(10)
        again = _run(script, d, mode)
        s3 = again["stats"]
        assert s3["disk_corrupt"] == len(programs) and s3["programs_loaded"] == 0
        assert s3["compilations"] == 0   # the same program: JAX's entry still serves it
        assert _torchtpu_warnings(again, "unreadable") == 1
        assert _all_verified(d)
        _same(cold, again)
    if mode == "strict":
        # Read-only: reads what is there, compiles what is new, writes nothing
        # (not even the lock file).
        os.remove(d / cache.LOCK_NAME)
        before = _snapshot(d)
        ro = _run(script, d, mode, TORCHTPU_CACHE_READONLY="1", EXTRA="1")
        s3 = ro["stats"]
        assert s3["read_only"] is True
        assert s3["disk_hits"] == s1["disk_misses"]
        assert 0 < s3["compilations"] == s3["disk_misses"]
        assert _snapshot(d) == before
        _same(cold, ro)


def test_concurrent_debug_writers_serve_strict(script, tmp_path):
    """Two debug-mode processes compile into one empty directory at once;
    both are right, every entry is whole, and a strict-mode run afterwards
    compiles nothing: the modes share entries."""
    d = tmp_path / "cache"
    a, b = _start(script, d, "debug"), _start(script, d, "debug")
    ra, rb = _finish(a), _finish(b)
    _same(ra, rb)
    for r in (ra, rb):
        assert r["stats"]["disk_corrupt"] == 0
        assert "Error" not in r["stderr"]
        assert r["stats"]["disk_hits"] + r["stats"]["disk_misses"] == len(_entries(d))
    assert _all_verified(d)
    assert not [n for n in os.listdir(d) if n.startswith(cache.TMP_PREFIX)]
    strict = _run(script, d, "strict")
    assert strict["stats"]["compilations"] == 0
    assert strict["stats"]["disk_misses"] == 0
    assert strict["stats"]["disk_hits"] > 0
    _same(ra, strict)


def test_damaged_cache_is_a_miss_and_repaired(script, tmp_path):
    """A writer killed mid-run, truncated and garbled entries, leftover
    temporaries: the next run is correct, counts misses, warns once and
    leaves every entry verified."""
    d = tmp_path / "cache"
    d.mkdir()
    proc = _start(script, d)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and len(_entries(d)) < 10:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    names = _entries(d)
    assert len(names) >= 4, "the killed run wrote too little to damage"
    with open(os.path.join(d, names[0]), "r+b") as f:  # truncated
        f.truncate(7)
    with open(os.path.join(d, names[1]), "r+b") as f:  # garbled, same size
        data = bytearray(f.read())
        for i in range(0, len(data), 17):
            data[i] ^= 0xA5
        f.seek(0)
        f.write(data)
    open(os.path.join(d, names[2]), "wb").close()  # emptied
    key = names[3][:-len(cache.ENTRY_SUFFIX)]
    (d / (key + cache.CHECK_SUFFIX)).write_text("{not json")
    (d / (cache.TMP_PREFIX + "leftover")).write_bytes(b"\x00garbage")

    fixed = _run(script, d)
    s = fixed["stats"]
    assert s["disk_corrupt"] == 4
    assert s["disk_misses"] >= 4
    assert s["compilations"] == s["disk_misses"]
    assert s["disk_hits"] >= len(names) - 4
    assert _torchtpu_warnings(fixed, "unreadable") == 1
    assert "Error reading persistent compilation cache" not in fixed["stderr"]
    assert _all_verified(d)


def test_unwritable_directory_is_memory_only(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.delenv("TORCHTPU_CACHE_READONLY", raising=False)
    with pytest.warns(UserWarning, match="not writable") as caught:
        assert cache._configure_disk() == (None, False)
    assert len(caught) == 1
    # A directory that stops being writable mid-run: one warning, then quiet.
    disk = cache.DiskCache(str(blocker / "cache"))
    cache._warned.discard("write")
    with pytest.warns(UserWarning, match="cannot write") as caught:
        disk.put("k", b"value")
        disk.put("k2", b"value")
    assert len(caught) == 1
    assert disk.get("k") is None


def test_disabled(monkeypatch):
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", "off")
    monkeypatch.delenv("TORCHTPU_CACHE_READONLY", raising=False)
    assert cache._configure_disk() == (None, False)
    if cache.DISK_DIR is None:  # this process started with the cache off (conftest)
        import torch
        from jax._src import compilation_cache
        before = cache.stats()
        torch.testing.assert_close((torch.arange(4.0, device="tpu") * 7 - 1).cpu(),
                                   torch.arange(4.0) * 7 - 1)
        after = cache.stats()
        assert after["dir"] is None and after["disk_entries"] == 0
        assert after["disk_hits"] == before["disk_hits"]
        assert after["disk_misses"] == before["disk_misses"]
        assert compilation_cache._cache is None


def test_default_location(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHTPU_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() == str(tmp_path / "torchtpu")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert cache.cache_dir() == str(tmp_path / "h" / ".cache" / "torchtpu")
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", "OFF")
    assert cache.cache_dir() is None
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path / "x"))
    assert cache.cache_dir() == str(tmp_path / "x")


def test_stats_and_clear_memory():
    import torch
    x = torch.arange(5.0, device="tpu")
    (x * 3).cpu()
    before = cache.stats()
    for key in ("memory_hits", "memory_misses", "disk_hits", "disk_misses", "disk_entries",
                "disk_bytes", "compilations", "compile_seconds_saved"):
        assert key in before
    (x * 3).cpu()
    assert cache.stats()["memory_hits"] > before["memory_hits"]
    assert cache.stats()["memory_entries"] > 0
    cache.clear(memory=True)
    assert cache.stats()["memory_entries"] == 0
    (x * 3).cpu()  # rebuilt after clearing
    assert cache.stats()["memory_misses"] > before["memory_misses"]
    torch.testing.assert_close((x * 3).cpu(), torch.arange(5.0) * 3)


def test_memory_tier_evicts_least_recently_used(monkeypatch):
    cache.clear(memory=True)
    monkeypatch.setattr(cache, "MEMORY_ENTRIES", 3)
    for k in "abc":
        cache.store(k, k.upper())
    assert cache.lookup("a") == "A"      # a is now the most recent
    cache.store("d", "D")                # evicts b, the least recent
    assert cache.lookup("b") is None
    assert [cache.lookup(k) for k in "acd"] == ["A", "C", "D"]
    assert cache.stats()["memory_entries"] == 3
    cache.clear(memory=True)


def test_command_line_info_and_clear(tmp_path, capsys):
    d = tmp_path / "c"
    d.mkdir()
    (d / "k1-cache").write_bytes(b"x" * 100)
    (d / "k1-check").write_text("{}")
    (d / (cache.TMP_PREFIX + "t")).write_bytes(b"y")
    (d / "notes.txt").write_text("kept")
    env = dict(os.environ, TORCHTPU_CACHE_DIR="off")
    out = subprocess.run([sys.executable, "-m", "torchtpu.cache", "info", "--dir", str(d),
                          "--json"], env=env, capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    assert info["entries"] == 1 and info["temp_files"] == 1 and info["bytes"] == 102
    assert "Warning" not in out.stderr
    assert cache._main(["clear", "--dir", str(d)]) == 0
    assert "removed 3 files" in capsys.readouterr().out
    assert sorted(n for n in os.listdir(d) if n != cache.LOCK_NAME) == ["notes.txt"]
