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

    def allreduce(self, tensors, opts=AllreduceOptions()):
        hosts = _host(tensors)
        self._gloo.allreduce(hosts, opts).wait()
        _write_back(tensors, hosts)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=AllreduceCoalescedOptions()):
        hosts = _host(tensors)
        self._gloo.allreduce_coalesced(hosts, opts).wait()
        _write_back(tensors, hosts)
        return _done(tensors)

    def broadcast(self, tensors, opts=BroadcastOptions()):
        hosts = _host(tensors)
        self._gloo.broadcast(hosts, opts).wait()
        _write_back(tensors, hosts)
        return _done(tensors)

    def allgather(self, output_lists, inputs, opts=AllgatherOptions()):
        host_outputs = [_host(outs) for outs in output_lists]
        self._gloo.allgather(host_outputs, _host(inputs), opts).wait()
        for outs, hosts in zip(output_lists, host_outputs):
            _write_back(outs, hosts)
        return _done(output_lists)

    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        host_out = output.detach().cpu()
        self._gloo._allgather_base(host_out, input.detach().cpu(), opts).wait()
        _write_back([output], [host_out])
        return _done(output)

    def reduce_scatter(self, outputs, input_lists, opts=ReduceScatterOptions()):
        hosts = _host(outputs)
        self._gloo.reduce_scatter(hosts, [_host(ins) for ins in input_lists], opts).wait()
        _write_back(outputs, hosts)
        return _done(outputs)

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        host_out = output.detach().cpu()
        self._gloo._reduce_scatter_base(host_out, input.detach().cpu(), opts).wait()
        _write_back([output], [host_out])
        return _done(output)

    def reduce(self, tensors, opts=ReduceOptions()):
        hosts = _host(tensors)
        self._gloo.reduce(hosts, opts).wait()
        _write_back(tensors, hosts)
        return _done(tensors)

    def gather(self, output_lists, inputs, opts=GatherOptions()):
        host_outputs = [_host(outs) for outs in output_lists]
        self._gloo.gather(host_outputs, _host(inputs), opts).wait()
        for outs, hosts in zip(output_lists, host_outputs):
            _write_back(outs, hosts)
        return _done(output_lists)

    def scatter(self, outputs, input_lists, opts=ScatterOptions()):
        hosts = _host(outputs)
        self._gloo.scatter(hosts, [_host(ins) for ins in input_lists], opts).wait()
        _write_back(outputs, hosts)
        return _done(outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=AllToAllOptions()):
        host_out = output.detach().cpu()
        self._gloo.alltoall_base(host_out, input.detach().cpu(), output_split_sizes,
                                 input_split_sizes, opts).wait()
        _write_back([output], [host_out])
        return _done(output)

    def send(self, tensors, dst, tag=0):
        return self._gloo.send(_host(tensors), dst, tag)

    def recv(self, tensors, src, tag=0):
        hosts = _host(tensors)
        self._gloo.recv(hosts, src, tag).wait()
        _write_back(tensors, hosts)
        return _done(tensors)

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
