"""Runs every fenced code block marked ```python runnable in README.md and
docs/*.md, each in a fresh process from the repository root, so that the
examples the documentation shows keep working. Plain ```python blocks are
excerpts and are not run."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python runnable[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def _blocks():
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    for path in files:
        for i, match in enumerate(FENCE.finditer(path.read_text())):
            rel = path.relative_to(ROOT).as_posix()
            yield pytest.param(rel, i, match.group(1), id=f"{rel}-{i}")


BLOCKS = list(_blocks())


def test_blocks_found():
    assert len(BLOCKS) >= 9, "every guide and the README open with a runnable example"


@pytest.mark.parametrize("path,index,code", BLOCKS)
def test_runnable_block(path, index, code):
    env = dict(os.environ, TORCHTPU_CACHE_DIR="off")
    pythonpath = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"{path}, runnable block {index} exited with {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
