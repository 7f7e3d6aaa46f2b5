"""The persistent compilation cache, across processes: warm starts in strict
and fused mode, modes sharing entries, damaged entries, concurrent writers,
disabled, read-only and unwritable directories, and trust: private modes,
directories and entries others could have written, shared read-only caches.

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
import warnings

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

result = run(os.environ.get("DEVICE", "tpu"))
result["cpu"] = run("cpu")
result["stats"] = torchtpu.cache.stats()
result["run_first_met"] = torchtpu.metrics.snapshot().get("run_first_met", 0)
result["background_compiles"] = torchtpu.metrics.snapshot().get("background_compiles", 0)
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
    for name in ("TORCHTPU_CACHE_READONLY", "TORCHTPU_CACHE_TRUSTED_UIDS", "TORCHTPU_EAGER_MODE",
                 "EXTRA"):
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


def _entries(path, values=False):
    """The entries holding executables (and with values=True, the stored
    values too: meta outcomes, start-up lists)."""
    return sorted(n for n in os.listdir(path) if n.endswith(cache.ENTRY_SUFFIX)
                  and (values or not n.startswith(cache.VALUE_PREFIX)))


def _snapshot(path):
    """Every file in path with its size and modification time."""
    return {n: (os.stat(os.path.join(path, n)).st_size, os.stat(os.path.join(path, n)).st_mtime_ns)
            for n in os.listdir(path)}


def _all_verified(path):
    for name in _entries(path, values=True):
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
    # Strict mode stores each kernel's executable in its record, fused mode
    # each graph's executable (and each kernel's abstract trace); a few
    # helpers (view reads) are JAX's own entries.
    stored = s1["disk_kernels"] if mode == "strict" else s1["disk_programs"]
    assert s1["disk_misses"] == s1["compilations"] == s1["disk_entries"] + stored
    assert s1["disk_bytes"] > 0 and s1["disk_kernels"] > 0
    warm = _run(script, d, mode)
    s2 = warm["stats"]
    assert s2["compilations"] == 0
    assert s2["disk_misses"] == 0
    assert s2["disk_hits"] == s1["disk_misses"]
    assert s2["disk_entries"] == s1["disk_entries"]
    assert s2["compile_seconds_saved"] > 0
    # Nothing is traced again: every kernel's record serves it.
    loaded, other = ("kernels_loaded", "traces_loaded")[::1 if mode == "strict" else -1]
    assert s2[loaded] == s1["disk_kernels"] == s2["disk_kernels"] and s2[other] == 0
    # Nor are PyTorch's meta kernels run: each call's outcome is a stored value.
    assert s1["values_loaded"] == 0 and s1["disk_values"] > 0
    assert s2["values_loaded"] == s1["disk_values"]
    # The executables the cold run's start-up used were loaded on a thread
    # (JAX's own entries, view reads, are not listed).
    assert s1["prefetched"] == 0
    assert 0 < s2["prefetched"] == s2["kernels_loaded"] + s2["programs_loaded"]
    _same(cold, warm)
    off = _run(script, d, mode, TORCHTPU_CACHE_PREFETCH="0")
    assert off["stats"]["prefetched"] == 0 and off["stats"]["compilations"] == 0
    assert off["stats"]["disk_hits"] == s2["disk_hits"]
    _same(cold, off)
    if mode == "fused":
        # Each fused graph's executable is stored: a warm start loads it
        # instead of tracing, lowering and compiling the graph again.
        assert s1["disk_programs"] > 0 and s1["programs_loaded"] == 0
        assert s2["programs_loaded"] == s1["disk_programs"] == s2["disk_programs"]
        # A damaged program is a miss: compiled again, replaced, one warning.
        programs = [n for n in os.listdir(d) if n.startswith(cache.PROGRAM_PREFIX)
                    and n.endswith(cache.ENTRY_SUFFIX)]
        for name in programs:
            with open(d / name, "r+b") as f:
                f.truncate(10)
        again = _run(script, d, mode)
        s3 = again["stats"]
        assert s3["disk_corrupt"] == len(programs) and s3["programs_loaded"] == 0
        assert s3["compilations"] == s3["disk_misses"] == len(programs)
        assert _torchtpu_warnings(again, "unreadable") == 1
        assert _all_verified(d)
        _same(cold, again)
        # A stored program or trace serves only the XLA flags it was stored
        # under (this one leaves JAX's own key, and so its entries, as they are).
        flags = _run(script, d, mode, XLA_FLAGS=" ".join(  # (the device count stays)
            filter(None, [os.environ.get("XLA_FLAGS"), "--xla_dump_disable_metadata=true"])))
        s4 = flags["stats"]
        assert s4["programs_loaded"] == 0 and s4["traces_loaded"] == 0
        assert s4["compilations"] == len(programs)
        assert s4["disk_programs"] == 2 * len(programs)
        assert s4["disk_kernels"] == 2 * s1["disk_kernels"]
        _same(cold, flags)
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


@pytest.mark.parametrize("device", ["tpu:0", "tpu:1"])
def test_fused_graphs_met_first_run_op_by_op_with_stored_kernels(script, tmp_path, device):
    # A graph met for the first time runs op by op: each new kernel is
    # compiled from the trace the recorder made of it (for its device) and
    # stored; a warm start loads them all.
    d = tmp_path / "cache"
    cold = _run(script, d, "fused", TORCHTPU_FUSED_BACKGROUND_OPS="1", DEVICE=device)
    assert cold["run_first_met"] > 0
    s1 = cold["stats"]
    # (A graph met again compiles on the compile thread, not counted as waited for.)
    assert s1["disk_kernels"] > 0
    assert s1["disk_misses"] == s1["compilations"] + cold["background_compiles"]
    warm = _run(script, d, "fused", TORCHTPU_FUSED_BACKGROUND_OPS="1", DEVICE=device)
    s2 = warm["stats"]
    assert s2["compilations"] == 0 and s2["kernels_loaded"] > 0
    _same(cold, warm)


def _records(path):
    return sorted(n for n in _entries(path) if n.startswith(cache.KERNEL_PREFIX))


def _rewrite_checked(path, name, data):
    """Replace an entry and recompute its check: damage the checksum cannot see."""
    (path / name).write_bytes(data)
    key = name[:-len(cache.ENTRY_SUFFIX)]
    (path / (key + cache.CHECK_SUFFIX)).write_text(json.dumps(
        {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "compile_seconds": None}))


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_damaged_or_untrusted_kernel_records_are_recomputed(script, tmp_path, mode):
    """A kernel record that is garbled, malformed under a valid checksum,
    holds no loadable executable, or that others can write, is refused:
    that kernel is traced (and in strict mode compiled) again, its record
    replaced, one warning each kind; the rest load; results match CPU."""
    d = tmp_path / "cache"
    cold = _run(script, d, mode)
    records = _records(d)
    assert len(records) == cold["stats"]["disk_kernels"] > 4
    with open(d / records[0], "r+b") as f:  # garbled, same size
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(data)
    _rewrite_checked(d, records[1], b"torchtpu-record-1\n{not json\n")
    os.chmod(d / records[2], 0o666)
    damaged = 3
    if mode == "strict":
        # Its header intact, its executable not one (under a valid checksum).
        data = (d / records[3]).read_bytes()
        _rewrite_checked(d, records[3], data[:data.index(b"\n", 18) + 1] + b"not an executable")
        damaged += 1
    again = _run(script, d, mode)
    s = again["stats"]
    assert s["disk_corrupt"] == damaged - 1 and s["disk_untrusted"] == 1, again["stderr"][-3000:]
    loaded = s["kernels_loaded" if mode == "strict" else "traces_loaded"]
    assert loaded == len(records) - damaged
    assert s["compilations"] == (damaged if mode == "strict" else 0)
    assert _torchtpu_warnings(again, "unreadable") == 1
    assert _torchtpu_warnings(again, "not loading compilation cache entry") == 1
    _same(cold, again)
    assert _all_verified(d) and _records(d) == records
    third = _run(script, d, mode)["stats"]
    assert third["disk_corrupt"] == third["disk_untrusted"] == third["compilations"] == 0
    assert third["kernels_loaded" if mode == "strict" else "traces_loaded"] == len(records)


ERROR_SCRIPT = r"""
import torch, torchtpu
a, b = torch.ones(3, 4).to("tpu"), torch.ones(5, 2).to("tpu")
try:
    torch.mm(a, b)
except RuntimeError as e:
    print("ERROR", type(e).__name__, e)
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    c = torch.add(a, a, out=torch.empty(2, device="tpu"))  # resized: PyTorch warns
print("WARNED", sum("resized" in str(w.message) for w in caught), tuple(c.shape))
d = torch.empty(3, 4, device="tpu")
torch.add(a, a, out=d)
print("SUM", (a.sum(0) * 2).cpu().tolist(), torchtpu.cache.stats()["values_loaded"],
      d.cpu().tolist() == (torch.ones(3, 4) * 2).tolist())
"""


def test_stored_meta_outcomes_damaged_or_failing(script, tmp_path):
    """A stored meta outcome that is damaged (under a valid checksum) or
    that others can write is refused and computed again; a start-up list
    naming keys nobody asks for changes nothing; and a call whose meta
    kernel raised stored nothing, so a warm process raises PyTorch's error
    again."""
    d = tmp_path / "cache"
    cold = _run(script, d)
    values = [n for n in _entries(d, values=True) if n.startswith(cache.VALUE_PREFIX)]
    assert len(values) == cold["stats"]["disk_values"] + 1  # and the start-up list
    metas = []
    for n in values:
        header = json.loads((d / n).read_bytes().split(b"\n")[1])
        if "value" in header:
            metas.append(n)
        else:  # the start-up list: make it name keys nobody will ask for
            _rewrite_checked(d, n, b"torchtpu-record-1\n" + json.dumps(
                {"startup": [["kernel-" + "0" * 64, 0], ["program-" + "1" * 64, 0], "junk"]}
            ).encode() + b"\n")
    assert len(metas) == len(values) - 1
    _rewrite_checked(d, metas[0], b"torchtpu-record-1\n" + json.dumps(
        {"value": {"leaves": [[[2], [1], "not_a_dtype"]], "tree": "x"}}).encode() + b"\n")
    _rewrite_checked(d, metas[1], b"torchtpu-record-1\n{\"value\": {\"leaves\": 3}}\n")
    os.chmod(d / metas[2], 0o666)
    again = _run(script, d)
    s = again["stats"]
    assert s["disk_corrupt"] == 2 and s["disk_untrusted"] == 1, again["stderr"][-3000:]
    assert s["values_loaded"] == len(metas) - 3 and s["compilations"] == 0
    assert s["prefetched"] == 0  # the list named nothing this run asked for
    _same(cold, again)
    assert _all_verified(d)

    path = tmp_path / "error.py"
    path.write_text(ERROR_SCRIPT)
    outs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(path)], env=_env(tmp_path / "cc"),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        outs.append(proc.stdout.splitlines())
    # PyTorch's meta kernel's error (its wording, not CPU's), in both runs.
    assert outs[0][0] == outs[1][0]
    assert outs[0][0].startswith("ERROR RuntimeError") and "[3, 4] X [5, 2]" in outs[0][0]
    import torch
    want = f"SUM {(torch.ones(3, 4).sum(0) * 2).tolist()}"
    for out in outs:
        # An out= tensor resized warns in every process (what warned is not stored).
        assert out[1] == "WARNED 1 (3, 4)"
        assert out[2].startswith(want) and out[2].endswith(" True")
    assert outs[1][2].split()[-2] != "0"  # the second process used stored outcomes


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


def test_writers_past_the_limit_evict_the_least_recently_used(script, tmp_path):
    """Two processes compile at once into a directory whose limit holds
    about a third of what they write: both are right, what is left is whole
    and within the limit, and a later run reloads what is left."""
    d = tmp_path / "cache"
    full = _run(script, tmp_path / "unbounded")
    total = sum(e.stat().st_size for e in os.scandir(tmp_path / "unbounded") if e.name.endswith(
        (cache.ENTRY_SUFFIX, cache.CHECK_SUFFIX)))
    limit = str(total // 3)
    a, b = (_start(script, d, "debug", TORCHTPU_CACHE_MAX_BYTES=limit) for _ in range(2))
    ra, rb = _finish(a), _finish(b)
    _same(ra, rb)
    _same(ra, full)
    assert ra["stats"]["disk_evicted"] + rb["stats"]["disk_evicted"] > 0
    assert "Error" not in ra["stderr"] + rb["stderr"]
    later = _run(script, d, "strict", TORCHTPU_CACHE_MAX_BYTES=limit)
    _same(later, full)
    assert later["stats"]["disk_hits"] > 0
    assert _all_verified(d)
    size = sum(e.stat().st_size for e in os.scandir(d) if e.name.endswith(
        (cache.ENTRY_SUFFIX, cache.CHECK_SUFFIX)))
    assert size <= int(limit)


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
    # A directory that stops being writable mid-run (here: removed): one
    # warning, then quiet.
    d = tmp_path / "cache"
    disk = cache.open_disk(str(d), read_only=False)
    os.rmdir(d)
    cache._warned.discard("write")
    try:
        with pytest.warns(UserWarning, match="cannot write") as caught:
            disk.put("k", b"value")
            disk.put("k2", b"value")
        assert len(caught) == 1
        assert disk.get("k") is None
    finally:
        os.close(disk.dir_fd)


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


@pytest.mark.skipif(cache.MAPPINGS_KEPT is None, reason="no vm.max_map_count: not Linux")
def test_memory_tier_keeps_the_process_under_its_mapping_limit(monkeypatch):
    """Each loaded XLA CPU executable holds memory mappings of its own, and
    past vm.max_map_count XLA's next compile segfaults: the memory tier sheds
    its older half once the process holds more than MAPPINGS_KEPT."""
    import gc

    import torch
    cache.clear(memory=True)
    gc.collect()
    start = cache._mappings()
    monkeypatch.setattr(cache, "MAPPINGS_KEPT", start + 150)
    monkeypatch.setattr(cache, "_MAPPINGS_EVERY", 4)
    sheds = cache.STATS.memory_sheds
    peak = 0
    for n in range(1, 81):  # 80 shapes: 160 distinct kernels, over 480 mappings kept unbounded
        x = torch.arange(float(n), device="tpu")
        got = (x * 2 + 1).cpu()
        assert torch.equal(got, torch.arange(float(n)) * 2 + 1)
        peak = max(peak, cache._mappings())
    assert cache.STATS.memory_sheds > sheds
    # at most one check's worth of kernels (4 stores, 10 mappings each at most) over
    assert peak < start + 150 + 4 * 10
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


# ---- trust: who may have written what this process loads -----------------------

OTHER_UID = 12345  # no such user here; os.chown to it needs root
needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="giving a file to another user (os.chown) needs root")


@pytest.fixture(scope="module")
def filled(script, tmp_path_factory):
    """A cache directory one strict run filled, and that run's result; tests
    work on copies of it."""
    d = tmp_path_factory.mktemp("filled") / "cache"
    return d, _run(script, d)


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def _chmod_all(path, dir_mode, file_mode):
    os.chmod(path, dir_mode)
    for n in os.listdir(path):
        os.chmod(os.path.join(path, n), file_mode)


def _chown_all(path, uid):
    os.chown(path, uid, -1)
    for n in os.listdir(path):
        os.chown(os.path.join(path, n), uid, -1)


@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_new_directories_and_files_are_private(tmp_path, umask):
    """Whatever the umask: the cache directory (and parents it makes) 0700,
    entries, checks and the lock file 0600."""
    d = tmp_path / "a" / "b" / "cache"
    old = os.umask(umask)
    try:
        disk = cache.open_disk(str(d), read_only=False)
        assert disk is not None
        disk.put("k", b"value")
    finally:
        os.umask(old)
    try:
        for p in (tmp_path / "a", tmp_path / "a" / "b", d):
            assert oct(os.stat(p).st_mode & 0o777) == oct(0o700), p
        names = sorted(os.listdir(d))
        assert names == sorted([cache.LOCK_NAME, "k" + cache.ENTRY_SUFFIX, "k" + cache.CHECK_SUFFIX])
        for n in names:
            assert oct(os.stat(d / n).st_mode & 0o777) == oct(0o600), n
        assert disk.get("k") == b"value"
    finally:
        os.close(disk.dir_fd)


def _refused_dirs():
    cases = [("group", 0o770, None, "writable by its group (mode 0770)"),
             ("others", 0o707, None, "writable by others (mode 0707)"),
             ("both", 0o777, None, "writable by its group and others (mode 0777)")]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cases.append(("owner", 0o755, OTHER_UID, f"owned by uid {OTHER_UID}"))
    return cases


@pytest.mark.parametrize("read_only", [False, True])
def test_untrusted_directory_is_refused(monkeypatch, tmp_path, read_only):
    """A directory others can write, or owned by another user: one warning
    naming it and why, nothing written, memory only."""
    monkeypatch.delenv("TORCHTPU_CACHE_TRUSTED_UIDS", raising=False)
    if read_only:
        monkeypatch.setenv("TORCHTPU_CACHE_READONLY", "1")
    else:
        monkeypatch.delenv("TORCHTPU_CACHE_READONLY", raising=False)
    for name, mode, owner, reason in _refused_dirs():
        d = tmp_path / name
        d.mkdir()
        os.chmod(d, mode)
        if owner is not None:
            os.chown(d, owner, -1)
        monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(d))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cache._configure_disk() == (None, read_only)
        assert len(caught) == 1, [str(w.message) for w in caught]
        message = str(caught[0].message)
        assert str(d) in message and reason in message and "memory only" in message
        assert os.listdir(d) == []
    # A trusted uid's directory is accepted, unless others can write it too.
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        monkeypatch.setenv("TORCHTPU_CACHE_TRUSTED_UIDS", f"777, {OTHER_UID}")
        fd, why = cache.open_dir(str(tmp_path / "owner"), read_only)
        assert why is None
        os.close(fd)
        fd, why = cache.open_dir(str(tmp_path / "group"), read_only)
        assert fd is None and "writable by its group" in why


def test_untrusted_entries_are_refused(tmp_path, recwarn):
    """In a trusted directory, an entry or check file others can write (or
    owned by another user, or a link) is not loaded: a miss, counted, one
    warning; a writer replaces it with its own."""
    d = tmp_path / "cache"
    disk = cache.open_disk(str(d), read_only=False)
    try:
        keys = ["group", "others", "link"] + (["owner"] if os.geteuid() == 0 else [])
        for k in keys:
            disk.put(k, f"value of {k}".encode())
            assert disk.get(k) == f"value of {k}".encode()
        os.chmod(d / ("group" + cache.ENTRY_SUFFIX), 0o620)
        os.chmod(d / ("others" + cache.CHECK_SUFFIX), 0o602)
        os.replace(d / ("link" + cache.ENTRY_SUFFIX), d / "elsewhere")
        os.symlink(d / "elsewhere", d / ("link" + cache.ENTRY_SUFFIX))
        if "owner" in keys:
            os.chown(d / ("owner" + cache.ENTRY_SUFFIX), OTHER_UID, -1)
        cache._warned.discard("untrusted")
        before = cache.STATS.disk_untrusted
        recwarn.clear()
        for k in keys:
            assert disk.get(k) is None, k
        assert cache.STATS.disk_untrusted - before == len(keys)
        warned = [str(w.message) for w in recwarn if "not loading" in str(w.message)]
        assert len(warned) == 1
        assert str(d / ("group" + cache.ENTRY_SUFFIX)) in warned[0]
        assert "writable by its group (mode 0620)" in warned[0]
        # A read-only reader leaves them; a writer's put replaces them.
        ro = cache.DiskCache(str(d), disk.dir_fd, read_only=True)
        ro.put("group", b"new")
        assert disk.get("group") is None
        for k in keys:
            disk.put(k, f"new {k}".encode())
            assert disk.get(k) == f"new {k}".encode()
        assert cache.STATS.disk_untrusted - before == len(keys) + 1
    finally:
        os.close(disk.dir_fd)


def test_untrusted_entries_compile_again_correctly(script, filled, tmp_path):
    """A run over a filled cache some of whose files others can write (or
    another user owns) compiles exactly those kernels again, warns once and
    matches CPU; the rest are disk hits."""
    src, cold = filled
    d = _copy(src, tmp_path / "cache")
    names = _entries(d)
    os.chmod(d / names[0], 0o666)
    key = names[1][:-len(cache.ENTRY_SUFFIX)]
    if os.geteuid() == 0:
        os.chown(d / (key + cache.CHECK_SUFFIX), OTHER_UID, -1)
    else:
        os.chmod(d / (key + cache.CHECK_SUFFIX), 0o660)
    again = _run(script, d)
    s = again["stats"]
    assert s["disk_untrusted"] == 2, (s, again["stderr"][-3000:])
    assert s["compilations"] == s["disk_misses"] == 2
    assert s["disk_hits"] == len(names) - 2
    assert _torchtpu_warnings(again, "not loading compilation cache entry") == 1
    _same(cold, again)


def test_shared_readonly_cache_compiles_nothing(script, filled, tmp_path):
    """The shared recipe: one job fills a cache, it is made read-only for
    everyone (chmod -R a+rX,go-w), and a reader elsewhere (another mount,
    simulated by a copy) with TORCHTPU_CACHE_READONLY=1 compiles nothing and
    writes nothing."""
    src, cold = filled
    d = _copy(src, tmp_path / "mnt" / "shared")
    _chmod_all(d, 0o755, 0o644)
    before = _snapshot(d)
    ro = _run(script, d, TORCHTPU_CACHE_READONLY="1")
    s = ro["stats"]
    assert s["read_only"] is True and s["dir"] == str(d)
    assert s["compilations"] == 0 and s["disk_misses"] == 0
    assert s["disk_hits"] == len(_entries(d))
    assert s["disk_untrusted"] == 0
    assert _snapshot(d) == before
    assert "torchtpu:" not in ro["stderr"]
    _same(cold, ro)


@needs_root
def test_shared_readonly_cache_of_another_user(script, filled, tmp_path):
    """A shared cache another account owns is read only when that uid is
    trusted (TORCHTPU_CACHE_TRUSTED_UIDS): zero compilations. Without it, one
    warning, memory only, results still right."""
    src, cold = filled
    d = _copy(src, tmp_path / "mnt" / "shared")
    _chmod_all(d, 0o755, 0o644)
    _chown_all(d, OTHER_UID)
    before = _snapshot(d)
    trusted = _run(script, d, TORCHTPU_CACHE_READONLY="1",
                   TORCHTPU_CACHE_TRUSTED_UIDS=str(OTHER_UID))
    s = trusted["stats"]
    assert s["compilations"] == 0 and s["disk_misses"] == 0
    assert s["disk_hits"] == len(_entries(d))
    _same(cold, trusted)
    refused = _run(script, d, TORCHTPU_CACHE_READONLY="1")
    s = refused["stats"]
    assert s["dir"] is None and s["disk_hits"] == 0
    assert s["compilations"] > 0
    assert _torchtpu_warnings(refused, f"owned by uid {OTHER_UID}") == 1
    assert _snapshot(d) == before
    _same(cold, refused)


RELOAD_SCRIPT = """
import torch, torchtpu
import torch.nn.functional as F
from torchtpu import cache
table_cpu = torch.randn(64, 16)
idx_cpu = torch.randperm(64)
table, idx = table_cpu.to("tpu"), idx_cpu.to("tpu")

def chain(fn, x, i):
    for _ in range(20):
        x = fn(x, i)
    return x

select = lambda x, i: x.index_select(0, i)
embed = lambda x, i: F.embedding(i, x)
for step in range(3):
    for fn in (select, embed):
        got = chain(fn, table, idx).cpu()
        torch.testing.assert_close(got, chain(fn, table_cpu, idx_cpu))
    cache.clear()
    x = table[: 8 * (step + 1)]  # one op's kernel for another shape each step
    torch.testing.assert_close((x * 2 + 1).cpu(), table_cpu[: 8 * (step + 1)] * 2 + 1)
print("OK", cache.stats()["programs_loaded"], cache.stats()["kernels_loaded"])
"""


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_executables_reloaded_after_clear_run(tmp_path, mode):
    # Stored executables whose code would share function names (two graphs;
    # one op's kernels for several shapes), dropped from memory and asked for
    # again in the same process: loaded executables of one module name and
    # different code failed when run on XLA's CPU runtime ("Function ... not
    # found"), so each module is named after its key.
    path = tmp_path / "reload.py"
    path.write_text(RELOAD_SCRIPT)
    for _ in range(2):  # the second process loads them all from disk
        proc = subprocess.run([sys.executable, str(path)], env=_env(tmp_path / "cc", mode),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "OK" in proc.stdout

