"""Collectives through the host: each tensor copied to the host, the
collective run there by gloo, the results written back. The path for CPU
tensors, and for tpu tensors when jax.distributed is not up. Also what both
paths share: `assign`, which writes a result into a collective's tensor, and
`done`, the finished Work a call returns."""
import torch
from torch.futures import Future


def done(result):
    """A finished Work holding result (each call waits for its collective)."""
    fut = Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _host(tensors):
    return [t.detach().cpu() for t in tensors]


def assign(t, values):
    """t.copy_(values) outside autograd (a complex tensor arrives as its
    view_as_real view, which writes through to it)."""
    with torch.no_grad():
        t.copy_(values)


def _write_back(tensors, hosts):
    for t, h in zip(tensors, hosts):
        assign(t, h)


def in_place(gloo, method, tensors, *rest):
    """gloo's method(host copies of tensors, *rest); tensors get the results."""
    hosts = _host(tensors)
    getattr(gloo, method)(hosts, *rest).wait()
    _write_back(tensors, hosts)
    return done(tensors)


def scattering(gloo, method, outputs, input_lists, opts):
    """reduce_scatter and scatter: lists of inputs, one output per list."""
    return in_place(gloo, method, outputs, [_host(ins) for ins in input_lists], opts)


def lists(gloo, method, output_lists, inputs, opts):
    """gloo's method into host copies of lists of output tensors."""
    hosts = [_host(outs) for outs in output_lists]
    getattr(gloo, method)(hosts, _host(inputs), opts).wait()
    _write_back([t for outs in output_lists for t in outs], [h for hs in hosts for h in hs])
    return done(output_lists)


def lists_to_lists(gloo, method, outputs, inputs, opts):
    """gloo's method(host outputs, host inputs, opts): all_to_all's lists."""
    hosts = _host(outputs)
    getattr(gloo, method)(hosts, _host(inputs), opts).wait()
    _write_back(outputs, hosts)
    return done(outputs)


def single(gloo, method, output, input, *rest):
    """gloo's method(host output, host input, *rest); output gets the result."""
    host = output.detach().cpu()
    getattr(gloo, method)(host, input.detach().cpu(), *rest).wait()
    _write_back([output], [host])
    return done(output)


def send(gloo, tensors, dst, tag):
    # Nothing comes back: the tensors are left as they are.
    gloo.send(_host(tensors), dst, tag).wait()
    return done(tensors)
