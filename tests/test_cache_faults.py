"""The disk cache under faults: a size limit (eviction of the least recently
used entries), a full disk and a writer killed in the middle of a write,
each on real files."""
import errno
import os
import signal
import subprocess
import sys
import time
import warnings

from torchtpu import cache, cache_files


def test_a_write_past_the_limit_evicts_the_least_recently_used_entries(monkeypatch, tmp_path):
    """On real files: entries past TORCHTPU_CACHE_MAX_BYTES go oldest first,
    where a read makes an entry new again; each goes whole (entry and
    check), and an evicted entry reads as a miss."""
    monkeypatch.setenv("TORCHTPU_CACHE_MAX_BYTES", "10K")
    d = tmp_path / "c"
    d.mkdir(mode=0o700)
    disk = cache.open_disk(str(d), read_only=False)
    before = cache.STATS.disk_evicted
    for i in range(3):
        disk.put(f"k{i}", bytes([i]) * 3000)
        time.sleep(0.02)  # (distinct modification times)
    assert disk.get("k0") == bytes([0]) * 3000  # k0 is now the most recent
    time.sleep(0.02)
    disk.put("k3", b"3" * 3000)  # past 10 KiB: k1, then k2 go (down to 80%)
    left = sorted(n for n in os.listdir(d) if n.endswith((cache.ENTRY_SUFFIX, cache.CHECK_SUFFIX)))
    assert left == ["k0-cache", "k0-check", "k3-cache", "k3-check"]
    assert disk.get("k1") is None and disk.get("k3") == b"3" * 3000
    assert cache.STATS.disk_evicted - before == 2
    assert cache._main(["info", "--dir", str(d)]) == 0


class _FullDisk:
    """A file whose writes fail as on a full disk, after part of the data."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, data):
        self.f.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_warns_once_and_leaves_nothing_half_written(monkeypatch, tmp_path):
    d = tmp_path / "c"
    d.mkdir(mode=0o700)
    disk = cache.open_disk(str(d), read_only=False)
    disk.put("kept", b"k" * 100)
    real_fdopen = os.fdopen
    monkeypatch.setattr(cache_files.os, "fdopen", lambda fd, mode: _FullDisk(real_fdopen(fd, mode)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache_files._warned.discard("write")
        disk.put("new", b"n" * 1000)
        disk.put("newer", b"m" * 1000)  # not tried again
    assert len([w for w in caught if "cannot write the compilation cache" in str(w.message)]) == 1
    assert sorted(os.listdir(d)) == sorted(["kept-cache", "kept-check", cache.LOCK_NAME])
    monkeypatch.undo()
    assert disk.get("new") is None and disk.get("kept") == b"k" * 100


_KILLED_WRITER = """
import os, sys, time
from torchtpu import cache_files
disk = cache_files.open_disk(sys.argv[1], read_only=False)
real_fdopen = os.fdopen

class Slow:
    def __init__(self, f): self.f = f
    def __enter__(self): return self
    def __exit__(self, *exc): self.f.close()
    def write(self, data):
        self.f.write(data[:10]); self.f.flush()
        print("writing", flush=True)
        time.sleep(60)  # killed here

cache_files.os.fdopen = lambda fd, mode: Slow(real_fdopen(fd, mode))
disk.put("k", b"x" * 1000)
"""


def test_a_writer_killed_mid_write_leaves_a_miss_not_a_half_entry(tmp_path):
    d = tmp_path / "c"
    d.mkdir(mode=0o700)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(d)], stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, TORCHTPU_CACHE_DIR="off"))
    try:
        assert child.stdout.readline().strip() == "writing"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    names = os.listdir(d)
    assert not [n for n in names if n.endswith((cache.ENTRY_SUFFIX, cache.CHECK_SUFFIX))], names
    disk = cache.open_disk(str(d), read_only=False)
    assert disk.get("k") is None  # a miss, then written whole by the next writer
    disk.put("k", b"y" * 1000)
    assert disk.get("k") == b"y" * 1000
