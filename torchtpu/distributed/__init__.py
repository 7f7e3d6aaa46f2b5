"""torch.distributed for tpu tensors: the `tpu` process-group backend.

Each collective copies its tensors to the host, runs there through a gloo
process group over the same store, and writes the results back, so
torch.distributed's API and DistributedDataParallel work unchanged on tpu
tensors (CPU tensors pass through to gloo as they are). `init_process_group()`
picks it when tpu is the accelerator, as it picks nccl for CUDA;
`backend="tpu"` names it.

PyTorch runs a process-group backend written in Python as the group itself,
not as a per-device backend of it, so the functional collectives (DTensor,
FSDP2), which look a backend up by device in C++, do not reach it.
"""
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions,
                                       AllreduceOptions, AllToAllOptions, BarrierOptions,
                                       BroadcastOptions, GatherOptions, ReduceOptions,
                                       ReduceScatterOptions, ScatterOptions)
from torch.futures import Future

NAME = "tpu"


def _done(result):
    fut = Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _host(tensors):
    return [t.detach().cpu() for t in tensors]


def _write_back(tensors, hosts):
    with torch.no_grad():
        for t, h in zip(tensors, hosts):
            t.copy_(h)


class TpuProcessGroup(dist.ProcessGroup):
    """Collectives on tpu tensors through gloo on host copies. Each call
    waits for its collective: the values are written back before it returns."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self):
        return NAME

    def _in_place(self, method, tensors, *rest):
        """gloo's method(host copies of tensors, *rest); tensors get the results."""
        hosts = _host(tensors)
        getattr(self._gloo, method)(hosts, *rest).wait()
        _write_back(tensors, hosts)
        return _done(tensors)

    def _lists(self, method, output_lists, inputs, opts):
        """gloo's method into host copies of lists of output tensors."""
        hosts = [_host(outs) for outs in output_lists]
        getattr(self._gloo, method)(hosts, _host(inputs), opts).wait()
        _write_back([t for outs in output_lists for t in outs], [h for hs in hosts for h in hs])
        return _done(output_lists)

    def _single(self, method, output, input, *rest):
        """gloo's method(host output, host input, *rest); output gets the result."""
        host = output.detach().cpu()
        getattr(self._gloo, method)(host, input.detach().cpu(), *rest).wait()
        _write_back([output], [host])
        return _done(output)

    def allreduce(self, tensors, opts=AllreduceOptions()):
        return self._in_place("allreduce", tensors, opts)

    def allreduce_coalesced(self, tensors, opts=AllreduceCoalescedOptions()):
        return self._in_place("allreduce_coalesced", tensors, opts)

    def broadcast(self, tensors, opts=BroadcastOptions()):
        return self._in_place("broadcast", tensors, opts)

    def reduce(self, tensors, opts=ReduceOptions()):
        return self._in_place("reduce", tensors, opts)

    def recv(self, tensors, src, tag=0):
        return self._in_place("recv", tensors, src, tag)

    def send(self, tensors, dst, tag=0):
        # Nothing comes back: the tensors are left as they are.
        self._gloo.send(_host(tensors), dst, tag).wait()
        return _done(tensors)

    def reduce_scatter(self, outputs, input_lists, opts=ReduceScatterOptions()):
        return self._in_place("reduce_scatter", outputs, [_host(ins) for ins in input_lists], opts)

    def scatter(self, outputs, input_lists, opts=ScatterOptions()):
        return self._in_place("scatter", outputs, [_host(ins) for ins in input_lists], opts)

    def allgather(self, output_lists, inputs, opts=AllgatherOptions()):
        return self._lists("allgather", output_lists, inputs, opts)

    def gather(self, output_lists, inputs, opts=GatherOptions()):
        return self._lists("gather", output_lists, inputs, opts)

    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        return self._single("_allgather_base", output, input, opts)

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        return self._single("_reduce_scatter_base", output, input, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=AllToAllOptions()):
        return self._single("alltoall_base", output, input, output_split_sizes,
                            input_split_sizes, opts)

    def barrier(self, opts=BarrierOptions()):
        self._gloo.barrier(opts).wait()
        return _done(None)

    # The names PyTorch's C++ code (DistributedDataParallel, FSDP) calls.
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single


def _create(store, rank, size, timeout):
    return TpuProcessGroup(store, rank, size, timeout)


def register():
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=[NAME, "cpu"])
