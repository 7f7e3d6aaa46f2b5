"""torch.distributed for tpu tensors: the `tpu` process-group backend.

`register()` (run when torchtpu is imported) makes `tpu` a backend that
`init_process_group()` picks when tpu is the accelerator, as it picks nccl
for CUDA. Its collectives run as XLA collectives over the group's devices
when jax.distributed is up (torchtpu.runtime.bootstrap starts it from
torchrun's environment), else through gloo on host copies (process_group.py says
which, host.py and xla.py how).

PyTorch runs a process-group backend written in Python as the group itself,
not as a per-device backend of it, so the functional collectives (DTensor,
tensor parallelism), which look a backend up by device in C++, would not
reach it: on tpu tensors the dispatcher hands them to functional.py, which
runs the group's own collectives.
"""


def register():
    # Deferred: the process group needs the dispatcher, which needs the runtime.
    from .functional import register as register_functional
    from .process_group import register as register_backend
    register_backend()
    register_functional()
