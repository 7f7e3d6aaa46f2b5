"""torch.tpu as a CUDA script calls torch.cuda: device selection and
information, memory statistics, streams and events."""
import gc

import jax
import pytest
import torch

import torchtpu  # noqa: F401


# ---- device selection and information ----------------------------------------

def test_device_context_manager():
    for d in (0, "tpu", "tpu:0", torch.device("tpu", 0), None, -1):
        with torch.tpu.device(d) as ctx:
            assert torch.tpu.current_device() == 0
        assert ctx.idx == (-1 if d in (None, -1) else 0)
    with torch.tpu.device(0):
        x = torch.ones(3, device="tpu")
    assert x.device == torch.device("tpu", 0)
    with pytest.raises(RuntimeError, match="tpu:1 is not available"):
        with torch.tpu.device(1):
            pass
    with pytest.raises(ValueError, match="Expected a tpu device"):
        torch.tpu.device("cpu")
    with torch.tpu.device_of(x):
        pass
    with torch.tpu.device_of(torch.ones(2)):  # a CPU tensor: no-op
        pass


def test_set_device_rejects_other_types():
    with pytest.raises(ValueError, match="Expected a tpu device"):
        torch.tpu.set_device("cpu")
    with pytest.raises(RuntimeError):
        torch.tpu.set_device("tpu:3")


def test_device_name_and_properties():
    dev = jax.devices(torch.tpu.platform)[0]
    assert torch.tpu.get_device_name() == dev.device_kind
    assert torch.tpu.get_device_name(0) == torch.tpu.get_device_name("tpu:0")
    props = torch.tpu.get_device_properties(0)
    assert props.name == dev.device_kind
    assert props.platform == dev.platform
    assert isinstance(props.total_memory, int) and props.total_memory > 0
    assert props.multi_processor_count >= 1
    assert (props.major, props.minor) == torch.tpu.get_device_capability()
    assert props.name in repr(props)
    with pytest.raises(RuntimeError):
        torch.tpu.get_device_properties(2)
    assert torch.tpu.is_bf16_supported() is True
