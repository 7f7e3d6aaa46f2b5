"""The `tpu` process group: torch.distributed's collectives on tpu tensors.

With jax.distributed up (torchtpu started under torchrun's environment,
runtime/bootstrap.py), each collective on tpu tensors runs as one XLA
collective over the devices of the group's ranks (xla.py), after the ranks
have agreed on what they call (agreement.py); the results are written into
the tensors through the dispatcher's copy, so they never pass through host
memory. CPU tensors, and tpu tensors without jax.distributed, go through
gloo on the host (host.py).

Each call returns a finished Work: the collective has been issued (in
strict mode asynchronously: a read of the result waits for it; in fused
mode all but gather, scatter and send/recv are recorded into the pending
graph, in_graph.py).
"""
import math

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions,
                                       AllreduceOptions, AllToAllOptions, BarrierOptions,
                                       BroadcastOptions, GatherOptions, ReduceOptions,
                                       ReduceScatterOptions, ScatterOptions)

from .. import runtime
from . import agreement, fsdp_ops, host, in_graph, watchdog, xla

NAME = "tpu"
_BITWISE = ("band", "bor", "bxor")


def _describe(*groups):
    return " ".join(",".join(f"{tuple(t.shape)}:{t.dtype}" for t in ts) for ts in groups)


def _device_id(tensors):
    """The JAX id of the one device the tpu tensors are on."""
    ids = {runtime.DEVICES[t.device.index].id for t in tensors}
    if len(ids) != 1:
        raise ValueError("a collective's tpu tensors must all be on one device")
    return ids.pop()


def _write(t, result):
    """t (a tpu tensor) gets result's values (a tpu tensor of t's numel on
    t's device), through the dispatcher's copy."""
    host.assign(t, result.reshape(t.shape))


def _reduction(opts, tensors):
    """The xla.py name of opts.reduceOp, once it is known to apply to the
    tensors' dtype (the errors PyTorch's CPU and CUDA backends give
    otherwise: AVG of integers is NCCL's, truncated; gloo refuses it)."""
    op = opts.reduceOp.op.name.lower()
    if op not in xla.REDUCTIONS:
        raise RuntimeError(f"ReduceOp.{op.upper()} is not supported by the {NAME} backend")
    for t in tensors:
        if op == "avg" and t.dtype == torch.bool:
            raise TypeError("Cannot use ReduceOp.AVG with boolean inputs")  # as NCCL
        if op in _BITWISE and (t.is_floating_point() or t.is_complex()):
            raise RuntimeError(f"Cannot use ReduceOp.{op.upper()} with non-integral dtype")
    return op


def _check_numel(name, output, input, factor):
    """output and input: tensors or shapes."""
    out_numel, in_numel = (math.prod(t.shape) if hasattr(t, "shape") else math.prod(t)
                           for t in (output, input))
    if out_numel * factor != in_numel:
        raise ValueError(f"{name}: the output has {out_numel} elements, the input "
                         f"{in_numel}; one must be {factor} times the other")


class TpuProcessGroup(dist.ProcessGroup):
    """Collectives on tpu tensors: XLA's over the group's devices, or gloo's
    on host copies (see the module's docstring)."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        watchdog.watch(self._gloo, store, rank, size)
        # init_process_group(device_id=tpu:N) and pg._get_backend(device) look
        # a C++ backend up by device: gloo is the one this group has.
        for device in ("cpu", NAME):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO,
                                   self._gloo)

    def getBackendName(self):
        return NAME

    # ---- which path, and the ranks' agreement -----------------------------

    def _on_xla(self, *groups):
        """Whether this call runs on XLA: jax.distributed is up and the tensors
        are tpu tensors (all of them: a call mixing devices is refused)."""
        if not xla.available():
            return False
        kinds = {t.device.type for ts in groups for t in ts}
        if len(kinds) > 1:
            self._refuse("a collective", ValueError(
                f"a collective's tensors must all be on one device type, not {sorted(kinds)}"))
        return kinds == {NAME}

    def _run(self, kind, devices, t, rooted=False, **params):
        """Collective kind of t over devices, a new tpu tensor (in fused mode
        a node of the pending graph, see in_graph.py); rooted: some rank
        drops the result."""
        return in_graph.run(self._gloo, kind, devices, t, rooted=rooted, **params)

    def _agree(self, name, tensors, description, extra="", check=None):
        """(the devices of the group's ranks in group-rank order, each one's
        extra, check()'s value) once every rank has seen the others call
        `name` with the same description. A check that raises here is told
        to the others first, so that every rank raises instead of waiting."""
        problem = value = None
        try:
            value = check() if check is not None else None
        except (ValueError, RuntimeError, TypeError) as e:
            problem = e
        if problem is not None:
            description = f"refused by rank {self.rank()}: {problem}"
        device = _device_id(tensors) if tensors else self._current_device().id
        try:
            found = agreement.exchange(self._gloo, name, device, f"{name} {description}", extra)
        except RuntimeError:
            if problem is not None:
                raise problem from None
            raise
        if problem is not None:
            raise problem
        return tuple(d for d, _ in found), [e for _, e in found], value

    def _refuse(self, name, error):
        """Tell the other ranks that this call is refused here, then raise error."""
        def check():
            raise error
        self._agree(name, [], "", check=check)

    def _current_device(self):
        bound = self.bound_device_id
        index = bound.index if bound is not None and bound.index is not None \
            else torch.tpu.current_device()
        return runtime.DEVICES[index]

    def _agree_host(self, name, *groups):
        """Under jax.distributed, a call through gloo agrees too, so that no
        rank takes one path while another takes the other."""
        if xla.available():
            agreement.exchange(self._gloo, name, -1, f"{name} host {_describe(*groups)}")

    # ---- the collectives ---------------------------------------------------

    def allreduce(self, tensors, opts=AllreduceOptions()):
        if not self._on_xla(tensors):
            self._agree_host("all_reduce", tensors)
            return host.in_place(self._gloo, "allreduce", tensors, opts)
        return self._all_reduce("all_reduce", tensors, opts)

    def _all_reduce(self, name, tensors, opts, root=None):
        # reduce too: every rank writes (the others get their own values
        # back), so that the ranks' fused graphs are the same.
        for t, result in zip(tensors, self.reduced(name, tensors, opts, root)):
            host.assign(t, result)
        if root is not None or all(t.numel() == 1 for t in tensors):
            # What a reduce hands its root, and a one-element all_reduce
            # (a loss or a count, for logging), is read on one rank alone
            # (`if rank == 0: print(t)`): issue it, as a broadcast does.
            in_graph.settle(name)
        return host.done(tensors)

    # The XLA paths' results as new tensors, which the functional
    # collectives (functional.py) return as they are.

    def reduced(self, name, tensors, opts, root=None):
        """On XLA: the reductions of tensors over the group, new tensors."""
        devices, _, op = self._agree(name, tensors,
                                     f"{opts.reduceOp.op.name} {root} {_describe(tensors)}",
                                     check=lambda: _reduction(opts, tensors))
        kind, params = ("all_reduce", {}) if root is None else ("reduce", {"root": root})
        return [self._run(kind, devices, t, op=op, **params).reshape(t.shape) for t in tensors]

    def gathered(self, name, input, shape):
        """On XLA: the inputs of the group's ranks concatenated, a new tensor
        of shape."""
        devices, _, _ = self._agree(name, [input], f"{tuple(shape)} {_describe([input])}",
                                    check=lambda: _check_numel(name, input, shape, self.size()))
        return self._run("all_gather", devices, input).reshape(shape)

    def scattered(self, name, input, opts, shape):
        """On XLA: this rank's part of the inputs' reduction, a new tensor of
        shape."""
        def check():
            _check_numel(name, shape, input, self.size())
            return _reduction(opts, [input])

        devices, _, op = self._agree(
            name, [input], f"{opts.reduceOp.op.name} {tuple(shape)} {_describe([input])}",
            check=check)
        return self._run("reduce_scatter", devices, input, op=op).reshape(shape)

    def allreduce_coalesced(self, tensors, opts=AllreduceCoalescedOptions()):
        if not self._on_xla(tensors):
            self._agree_host("all_reduce_coalesced", tensors)
            return host.in_place(self._gloo, "allreduce_coalesced", tensors, opts)
        return self._all_reduce("all_reduce_coalesced", tensors, opts)

    def reduce(self, tensors, opts=ReduceOptions()):
        if not self._on_xla(tensors):
            self._agree_host("reduce", tensors)
            return host.in_place(self._gloo, "reduce", tensors, opts)
        return self._all_reduce("reduce", tensors, opts, root=opts.rootRank)

    def broadcast(self, tensors, opts=BroadcastOptions()):
        if not self._on_xla(tensors):
            self._agree_host("broadcast", tensors)
            return host.in_place(self._gloo, "broadcast", tensors, opts)
        root = opts.rootRank
        devices, _, _ = self._agree("broadcast", tensors, f"{root} {_describe(tensors)}")
        for t in tensors:
            # root too gets its own bits back: the ranks' graphs are the same.
            _write(t, self._run("broadcast", devices, t, root=root))
        in_graph.settle("broadcast")
        return host.done(tensors)

    def _check_list(self, name, tensors, like):
        if len(tensors) != self.size() or any(t.shape != like.shape or t.dtype != like.dtype
                                              for t in tensors):
            raise ValueError(f"{name}: expected a list of {self.size()} tensors of shape "
                             f"{tuple(like.shape)} and dtype {like.dtype}")

    def _gather(self, name, output_lists, inputs, root=None):
        """all_gather (root None) or gather: inputs' rows into output lists."""
        writes = root is None or root == self.rank()

        def check():
            for outs, x in zip(output_lists if writes else [], inputs):
                self._check_list(name, outs, x)

        devices, _, _ = self._agree(name, inputs, f"{root} {_describe(inputs)}", check=check)
        for i, x in enumerate(inputs):
            result = self._run("all_gather", devices, x, rooted=root is not None)
            if writes:
                rows = result.reshape((self.size(),) + tuple(x.shape))
                for j, out in enumerate(output_lists[i]):
                    host.assign(out, rows[j])
        if root is not None:
            in_graph.settle()
        return host.done(output_lists)

    def allgather(self, output_lists, inputs, opts=AllgatherOptions()):
        if not self._on_xla(inputs, *output_lists):
            self._agree_host("all_gather", inputs, *output_lists)
            return host.lists(self._gloo, "allgather", output_lists, inputs, opts)
        return self._gather("all_gather", output_lists, inputs)

    def gather(self, output_lists, inputs, opts=GatherOptions()):
        if not self._on_xla(inputs, *output_lists):
            self._agree_host("gather", inputs)
            return host.lists(self._gloo, "gather", output_lists, inputs, opts)
        return self._gather("gather", output_lists, inputs, root=opts.rootRank)

    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        if not self._on_xla([output, input]):
            self._agree_host("all_gather_into_tensor", [output, input])
            return host.single(self._gloo, "_allgather_base", output, input, opts)
        host.assign(output, self.gathered("all_gather_into_tensor", input, output.shape))
        return host.done(output)

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        if not self._on_xla([output, input]):
            self._agree_host("reduce_scatter_tensor", [output, input])
            return host.single(self._gloo, "_reduce_scatter_base", output, input, opts)
        return self._reduce_scatter("reduce_scatter_tensor", output, input, opts)

    def _reduce_scatter(self, name, output, input, opts):
        host.assign(output, self.scattered(name, input, opts, output.shape))
        return host.done(output)

    def reduce_scatter(self, outputs, input_lists, opts=ReduceScatterOptions()):
        if not self._on_xla(outputs, *input_lists):
            self._agree_host("reduce_scatter", outputs, *input_lists)
            return host.scattering(self._gloo, "reduce_scatter", outputs, input_lists, opts)
        for out, ins in zip(outputs, input_lists):
            try:
                self._check_list("reduce_scatter", ins, out)
            except ValueError as e:
                self._refuse("reduce_scatter", e)
            self._reduce_scatter("reduce_scatter", out, torch.stack(ins), opts)
        return host.done(outputs)

    def scatter(self, outputs, input_lists, opts=ScatterOptions()):
        root = opts.rootRank
        if not self._on_xla(outputs, *input_lists):
            self._agree_host("scatter", outputs)
            return host.scattering(self._gloo, "scatter", outputs, input_lists, opts)
        for i, out in enumerate(outputs):
            check = None
            if self.rank() == root:
                ins = input_lists[i]
                check = lambda: self._check_list("scatter", ins, out)  # noqa: E731
            devices, _, _ = self._agree("scatter", [out],
                                        f"{root} {_describe([out])}", check=check)
            if self.rank() == root:
                rows = torch.stack(input_lists[i])
            else:  # only root's rows are read
                rows = torch.zeros((self.size(),) + tuple(out.shape), dtype=out.dtype,
                                   device=out.device)
            _write(out, self._run("scatter", devices, rows, root=root))
        in_graph.settle()
        return host.done(outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=AllToAllOptions()):
        if not self._on_xla([output, input]):
            self._agree_host("all_to_all_single", [output, input])
            return host.single(self._gloo, "alltoall_base", output, input,
                               output_split_sizes, input_split_sizes, opts)
        n = self.size()
        outs = list(output_split_sizes) or [output.shape[0] // n] * n
        ins = list(input_split_sizes) or [input.shape[0] // n] * n

        def check():
            if output.shape[1:] != input.shape[1:] or output.dtype != input.dtype:
                raise ValueError(f"all_to_all_single: the output ({tuple(output.shape)}, "
                                 f"{output.dtype}) and the input ({tuple(input.shape)}, "
                                 f"{input.dtype}) differ in their rows")
            if (sum(outs), sum(ins), len(outs), len(ins)) != (output.shape[0], input.shape[0],
                                                               n, n):
                raise ValueError(f"all_to_all_single: split sizes {ins} (input) and {outs} "
                                 f"(output) do not cut {tuple(input.shape)} and "
                                 f"{tuple(output.shape)} into {n}")

        devices, extras, _ = self._agree(
            "all_to_all_single", [input], f"{tuple(input.shape[1:])}:{input.dtype}",
            extra=str(max(ins + outs, default=0)), check=check)
        width = max(int(e) for e in extras)
        if set(ins) == set(outs) == {width}:
            _write(output, self._run("all_to_all", devices, input))
            return host.done(output)
        # Uneven splits: every rank sends n blocks of `width` rows, padded.
        padded = torch.zeros((n, width) + tuple(input.shape[1:]), dtype=input.dtype,
                             device=input.device)
        with torch.no_grad():
            for i, block in enumerate(input.split(ins)):
                padded[i, :ins[i]] = block
            blocks = self._run("all_to_all", devices, padded).reshape(padded.shape)
        host.assign(output, torch.cat([blocks[i, :outs[i]] for i in range(n)]))
        return host.done(output)

    def alltoall(self, outputs, inputs, opts=AllToAllOptions()):
        if not self._on_xla(outputs, inputs):
            self._agree_host("all_to_all", outputs, inputs)
            return host.lists_to_lists(self._gloo, "alltoall", outputs, inputs, opts)

        def check():  # tensors of one shape: rows of one all_to_all
            if inputs:
                self._check_list("all_to_all", inputs, inputs[0])
                self._check_list("all_to_all", outputs, inputs[0])
            else:
                raise ValueError("all_to_all: no tensors")

        devices, _, _ = self._agree("all_to_all", inputs[:1], _describe(inputs, outputs),
                                    check=check)
        rows = self._run("all_to_all", devices, torch.stack(inputs)).reshape(
            (len(outputs),) + tuple(inputs[0].shape))
        for i, out in enumerate(outputs):
            host.assign(out, rows[i])
        return host.done(outputs)

    def send(self, tensors, dst, tag=0):
        if not self._on_xla(tensors):
            return host.send(self._gloo, tensors, dst, tag)
        return self._point_to_point(tensors, dst, tag, sending=True)

    def recv(self, tensors, src, tag=0):
        if not self._on_xla(tensors):
            return host.in_place(self._gloo, "recv", tensors, src, tag)
        return self._point_to_point(tensors, src, tag, sending=False)

    def recv_anysource(self, tensors, tag=0):
        if not self._on_xla(tensors):
            return host.in_place(self._gloo, "recv_anysource", tensors, tag)
        raise RuntimeError(f"recv without src is not supported by the {NAME} backend on "
                           "XLA: name the sending rank")

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        for output, input in zip(outputs, inputs):
            self.all_gather_single(output, input, opts)
        return host.done(outputs)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=ReduceScatterOptions()):
        for output, input in zip(outputs, inputs):
            self.reduce_scatter_single(output, input, opts)
        return host.done(outputs)

    def _point_to_point(self, tensors, peer, tag, sending):
        mine = _device_id(tensors)
        theirs = agreement.exchange_pair(self._gloo, "send/recv", mine,
                                         f"send/recv {tag} {_describe(tensors)}", peer,
                                         sending, tag)
        devices = (mine, theirs) if sending else (theirs, mine)
        for t in tensors:
            # A ppermute from the sender (mesh position 0) to the receiver.
            result = self._run("permute", devices, t, pairs=((0, 1),))
            if not sending:
                _write(t, result)
        in_graph.settle()
        return host.done(tensors)

    def barrier(self, opts=BarrierOptions()):
        if not xla.available():
            self._gloo.barrier(opts).wait()
            return host.done(None)
        devices, _, _ = self._agree("barrier", [], "")
        xla.barrier(devices, self._current_device())
        return host.done(None)

    # The names PyTorch's C++ code (DistributedDataParallel, FSDP) calls.
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single


def _create(store, rank, size, timeout):
    # FSDP2 and DTensor need a process group first: FSDP2's copy-in gets its
    # handler now, and DTensor its rules for torchtpu's attention ops, not
    # at torchtpu's import (their modules take a while to import).
    fsdp_ops.register()
    from . import sharding
    sharding.register()
    return TpuProcessGroup(store, rank, size, timeout)


def register():
    """The `tpu` backend, picked for tpu (and CPU) tensors by default."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=[NAME, "cpu"])
