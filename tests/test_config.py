"""torchtpu.config: how a TORCHTPU_* variable's value reads."""
import pytest

from torchtpu import config
from torchtpu.modes import fused


@pytest.mark.parametrize("value,on", [
    ("1", True), ("yes", True), ("ON", True), ("true", True), (" 1 ", True),
    ("0", False), ("off", False), ("False", False), ("no", False), ("", False)])
def test_a_switch_is_on_unless_empty_or_off(monkeypatch, value, on):
    monkeypatch.setenv("TORCHTPU_FULL_TRACEBACK", value)
    assert config.FULL_TRACEBACK.on() is on


def test_an_unset_or_empty_variable_reads_as_its_default(monkeypatch):
    monkeypatch.delenv("TORCHTPU_INDEX_CHECKS", raising=False)
    assert config.INDEX_CHECKS.on() is True
    monkeypatch.setenv("TORCHTPU_INDEX_CHECKS", "  ")
    assert config.INDEX_CHECKS.on() is True
    monkeypatch.setenv("TORCHTPU_INDEX_CHECKS", "off")
    assert config.INDEX_CHECKS.on() is False
    assert config.TPU_PROCESS_PORT.number({}) == 8476
    assert config.TPU_PROCESS_PORT.number({"TORCHTPU_TPU_PROCESS_PORT": "9000"}) == 9000


def test_a_variable_read_at_each_use_follows_a_change_at_run_time(monkeypatch):
    monkeypatch.setenv("TORCHTPU_FUSE_MAX_OPS", "7")
    assert fused.max_ops() == 7
    monkeypatch.setenv("TORCHTPU_FUSE_MAX_OPS", "9")
    assert fused.max_ops() == 9
    monkeypatch.setenv("TORCHTPU_FUSE_MAX_OPS", "many")
    with pytest.raises(ValueError):
        fused.max_ops()
