"""The TPU tier's list (tests/tpu_tier.txt) names tests that exist, covering
each area the tier promises. (Its parametrized cases are checked where the
tier runs: `pytest --tpu-tier` stops with a usage error naming any entry that
matches nothing.)"""
import ast
import os

import conftest

TESTS = os.path.dirname(os.path.abspath(__file__))


def _test_names(path):
    tree = ast.parse(open(path).read())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_entry_names_an_existing_test():
    entries = conftest.tpu_tier_entries()
    assert entries
    for entry in entries:
        path, _, rest = entry.partition("::")
        assert path.startswith("tests/") and os.path.exists(os.path.join(TESTS, "..", path)), entry
        if rest:
            assert rest.split("[")[0] in _test_names(os.path.join(TESTS, "..", path)), entry


def test_the_tier_covers_each_area():
    files = {e.partition("::")[0] for e in conftest.tpu_tier_entries()}
    for area in ("test_modes.py", "test_fused.py", "test_opinfo.py", "test_module_db.py", "test_training.py",
                 "test_amp.py", "test_hf.py", "test_generate.py", "test_compile.py", "test_graphs.py",
                 "test_custom_kernels.py", "test_device_module.py", "test_observability.py",
                 "test_serialization.py", "test_data_loader.py"):
        assert "tests/" + area in files, area
