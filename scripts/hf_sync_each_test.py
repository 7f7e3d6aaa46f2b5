"""A pytest plugin for scripts/hf_model_tests.sh's tpu runs: torchtpu.sync()
at the end of each test's call, so that a device-side check (an index out of
range) is raised in the test whose op failed, not at the next sync point in
whichever test comes next on the same process (docs/debugging.md,
"Out-of-range indices"; CUDA's device-side assert is likewise raised later).
A test that never reads its output (`_ = model(**inputs)`) then fails where
its bad op ran. Loaded with `-p hf_sync_each_test` ($ROOT/scripts on
PYTHONPATH); HF_SYNC_EACH_TEST=0 leaves it out."""

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    import torchtpu  # imported by transformers' testing_utils already

    torchtpu.sync()
    return result
