"""torchtpu against PyTorch's ModuleInfo database (common_modules.module_db).

Every module entry runs each kind of check (tests/moduleinfo_common.py says
what each does): forward and backward in train and eval mode, the first
sample in debug and fused mode, non-contiguous inputs, train/eval switches,
`.to()` (device, dtype and back), `.to("meta")` and `to_empty`, state dicts,
deepcopy, pickle and torch.save/torch.load, each compared with CPU. Results
not a clean pass are listed in tests/moduleinfo_expected.py; the list is
strict: an entry that starts passing fails, so it only shrinks. Regenerate it
(and the Modules section of docs/ops.md) with

    .venv/bin/python scripts/modules_report.py --jobs 2 \\
        --write-expected tests/moduleinfo_expected.py --markdown docs/ops.md

TORCHTPU_MODULEINFO_SAMPLES sets the samples the train and eval checks run
(default 1, as the list was made with).
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch import nn  # noqa: E402

from moduleinfo_common import (KINDS, MODULES, SEED, TOL, TOLERANCES, Failure,  # noqa: E402
                               build, check, check_isolated, is_random, match, samples_of,
                               tolerance)
from moduleinfo_expected import EXPECTED_FAILURES, EXPECTED_FALLBACKS  # noqa: E402
from conftest import judge_expected  # noqa: E402

SAMPLES = int(os.environ.get("TORCHTPU_MODULEINFO_SAMPLES", "1"))
TIMEOUT = 120  # seconds per (module, kind); a hang is a failure, not a stuck CI

# Module-major order: xdist hands each worker runs of consecutive tests, so
# a module's checks mostly share one worker's compiled kernels.
PARAMS = [pytest.param(name, kind, id=f"{name}-{kind}") for name in MODULES for kind in KINDS]


def judge(result):
    judge_expected((result.module, result.kind), result, EXPECTED_FAILURES, EXPECTED_FALLBACKS,
                   "tests/moduleinfo_expected.py")


@pytest.mark.parametrize("name,kind", PARAMS)
def test_module(name, kind):
    # An entry known to take the process down runs in a child process, so
    # it stays strict (its fix shows as a pass) without ending the run.
    if EXPECTED_FAILURES.get((name, kind), "").startswith("crashes the process"):
        result = check_isolated(name, kind, samples=SAMPLES, timeout=TIMEOUT)
    else:
        result = check(name, kind, samples=SAMPLES, timeout=TIMEOUT)
    judge(result)


def test_expected_lists_name_real_entries():
    real = {(name, kind) for name in MODULES for kind in KINDS}
    stale = sorted((set(EXPECTED_FAILURES) | set(EXPECTED_FALLBACKS)) - real)
    assert not stale, f"not a ModuleInfo entry and check kind of this torch: {stale}"
    assert not set(EXPECTED_FAILURES) & set(EXPECTED_FALLBACKS)
    assert all(EXPECTED_FAILURES.values()), "every expected failure needs a reason"


def test_tolerances_are_pytorchs_own():
    """Float32 comparisons use TestModule's (rtol = atol = 1e-5), widened only
    where the ModuleInfo entry itself widens CPU's module tests, or by
    TOLERANCES (each with its reason, and far below PyTorch's own
    CPU-vs-device module test's atol of 5e-2)."""
    assert TOL == dict(rtol=1e-5, atol=1e-5)
    wider = {name: tolerance(name) for name in MODULES if tolerance(name) != TOL}
    from_db = {name: tol for name, tol in wider.items() if name not in TOLERANCES}
    assert from_db == {"nn.Bilinear": dict(rtol=1e-4, atol=1e-4)}, from_db
    for name, (rtol, atol, reason) in TOLERANCES.items():
        assert name in MODULES and reason and rtol < 1e-3 and atol < 1e-3, name


# ---- the comparison itself can fail -------------------------------------------

def _first(name, training):
    return samples_of(name, training)[0]


def test_a_different_tpu_module_fails_the_comparison():
    sample = _first("nn.Linear", True)
    m_cpu = build("nn.Linear", sample, True)
    other = build("nn.Linear", sample, True, seed=SEED + 1).to("tpu")
    with pytest.raises(Failure, match="output 0: AssertionError"):
        match("nn.Linear", sample, True, m_cpu, lambda: other)


def test_a_random_module_is_compared_by_shape_and_by_its_seed():
    assert is_random("nn.Dropout", True) and not is_random("nn.Dropout", False)
    sample = _first("nn.Dropout", True)
    m_cpu = build("nn.Dropout", sample, True)
    match("nn.Dropout", sample, True, m_cpu, lambda: nn.Dropout(0.5).to("tpu"))
    # Not the same values under the same seed (another p): a failure.
    made = iter([nn.Dropout(0.5), nn.Dropout(0.3)])
    with pytest.raises(Failure, match="same seed"):
        match("nn.Dropout", sample, True, m_cpu, lambda: next(made).to("tpu"))
    # Another shape: a failure (CPU's output gradient no longer fits).
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        match("nn.Dropout", sample, True, m_cpu,
              lambda: nn.Sequential(nn.Dropout(0.5), nn.Flatten(0)).to("tpu"))
