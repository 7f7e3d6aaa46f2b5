"""capture: the executor of graph capture (torch.tpu.graph). It records every
op of the captured region into one fused graph, as fused mode does, but never
flushes: a sync point inside capture (a value read on the host, printing, a
value-dependent shape, a CPU fallback, synchronize) raises, as CUDA raises
when a capturing stream is synchronized.

finish() turns the recording into a CapturedGraph: one compiled function
over the storages the region read, whose results are the new values of the
storages it wrote or created that are still alive. Nothing of the region
runs at capture (CUDA's capture does not run the work either): written
storages keep the values they had before it, and storages it created hold
zeros until the first replay.

Indexing ops keep their device-side index checks: the graph merges them
into the device's running flag, and each replay tells torchtpu.bounds, so
the next sync point raises for an out-of-range index, naming the op's line
in the captured code.

Random ops: each one's (seed, offset) is a dynamic scalar of the graph;
replay draws fresh ones from the device generator, in the order the region
drew them, so every replay advances the generator as running the region
eagerly would, and gives the same numbers as that eager run.
"""
import sys

import jax.numpy as jnp

from .. import bounds, errors, runtime
from . import checks as value_checks
from . import graph
from ..ops import random as rng
from ..tensor import Lost, Pending, Storage
from .fused import FusedExecutor


class CaptureSyncError(RuntimeError):
    """A sync point was reached while capturing (the capture is invalid)."""


def _sync_error(what):
    return CaptureSyncError(
        f"torchtpu: {what} at {errors.user_line(sys._getframe(1))} is a sync point, which is not allowed while "
        "capturing a tpu graph (operation not permitted when stream is capturing): "
        "move it out of the torch.tpu.graph block")


class CaptureExecutor(FusedExecutor):
    name = "capture"
    fuses = False  # the region is one graph, issued by its replays (no flush at the backward)
    replays = True

    def __init__(self):
        super().__init__()
        self._limit = float("inf")  # the whole region is one graph
        self._rng_seed, self._rng_offset = rng.position()
        self.random_scalars = []  # (seed position, offset position) in the graph's scalars
        self.failed = None        # the first error that invalidated the capture
        # Where the checks of the captured indexing ops start in bounds' record.
        self._checks_start = len(bounds.unread_checks())
        # Where the captured ops' lines start in the NaN checks' record.
        self._lines_start = len(value_checks.FUSED_LINES)

    def run(self, kernel, flat, storages):
        if self.failed is not None:
            raise RuntimeError("torchtpu: this graph capture is invalid (an earlier error: "
                               f"{self.failed}); leave the torch.tpu.graph block")
        seed, offset = rng.position()
        drew = offset != self._rng_offset
        if drew:
            # The dispatcher appends a random op's (seed, offset) last.
            n_scalars = len(flat) - len(storages)
            if (offset != self._rng_offset + 1 or seed != self._rng_seed
                    or n_scalars < 2 or flat[-1] != offset - 1 or flat[-2] != self._rng_seed):
                self._fail(RuntimeError(
                    f"torchtpu: the random op {kernel.name} at {errors.user_line(sys._getframe(1))} draws from the "
                    "generator in a way graph replay cannot repeat (a seed set inside "
                    "capture, or a key taken outside its kernel)"))
            self._rng_offset = offset
        result = super().run(kernel, flat, storages)
        if drew:
            n = len(self._graph.scalars)
            self.random_scalars.append((n - 2, n - 1))
        return result

    def _fail(self, error):
        if self.failed is None:
            self.failed = error
        raise error

    def concrete(self, storage, reason="read", to_host=False):
        self._fail(_sync_error("reading a tensor's value on the host"))

    def sync(self, reason="sync"):
        self._fail(_sync_error(f"a sync ({reason})"))

    def flush(self, reason):
        # Reached for a dependency across devices: a capture runs on one.
        self._fail(_sync_error(f"a flush ({reason}: ops on two devices)"))

    # -- the end of capture ---------------------------------------------------
    def finish(self):
        """The CapturedGraph of what was recorded; written storages get back
        the values they had before capture, created ones zeros."""
        g = self._graph
        self._graph = graph.Graph()
        live = graph.live_values(g)
        owners = {}
        input_storages = []
        for i, ref in enumerate(g.input_owners):
            s = ref()
            if s is None:
                # Nothing holds it any more: what the region read is a constant.
                s = Storage(g.inputs[i], g.device)
            input_storages.append(s)
            owners[id(s)] = i
        donate = tuple(False for _ in g.inputs)
        written = {id(owner) for _, owner in live}
        # Not the index checks' flag: a sync point puts back the blank flag
        # other holders share, so donating it would cost a copy per replay.
        written.discard(id(bounds.flag_input(False, g.device)))
        mask = [id(s) in written and (s.array.shape, s.array.dtype) == (x.shape, x.dtype)
                for s, x in zip(input_storages, g.inputs)]
        if any(mask):
            donate = tuple(mask)
            live = graph.donation_order(g, live, donate)
        live_refs = tuple(p.ref for p, _ in live)
        run = graph.build(g, live_refs, donate if any(donate) else None) if g.nodes else None
        checks = bounds.unread_checks()[self._checks_start:]
        device = runtime.DEVICES[g.device]
        for p, owner in live:
            i = owners.get(id(owner))
            if i is not None:
                owner.array = g.inputs[i]
            else:
                owner.array = jnp.zeros(p.shape, p.dtype, device=device)
        # The captured checks did not run: drop their record (the flag is
        # back to what it was, clear).
        bounds.check()
        del value_checks.FUSED_LINES[self._lines_start:]
        return CapturedGraph(run, input_storages, [owner for _, owner in live], donate,
                             list(g.scalars), self.random_scalars, len(g.nodes),
                             [(x.shape, x.dtype) for x in g.inputs], checks, g.device)

    def abandon(self, error):
        """A failed capture: written storages get back their values, the ones
        it created are lost (reading them raises error)."""
        g = self._graph
        self._graph = graph.Graph()
        originals = {}
        for i, ref in enumerate(g.input_owners):
            s = ref()
            if s is not None:
                originals[id(s)] = g.inputs[i]
        for p, owner in graph.live_values(g):
            original = originals.get(id(owner))
            owner.array = original if original is not None else Lost(error, p.shape, p.dtype)
        bounds.check()
        del value_checks.FUSED_LINES[self._lines_start:]


class CapturedGraph:
    """A captured region as one compiled call over storages."""

    def __init__(self, run, inputs, outputs, donate, scalars, random_scalars, n_ops, kinds,
                 checks, device):
        self._run = run
        self._checks = checks     # bounds' record of each captured indexing op
        self._device = device
        self._kinds = kinds       # each input's (shape, dtype) at capture
        self.inputs = inputs      # the storages read, in the graph's input order
        self.outputs = outputs    # the storages written or created, in its output order
        self._donated = [i for i, d in enumerate(donate) if d]
        self._scalars = scalars
        self._random = random_scalars
        self.n_ops = n_ops

    def replay(self, flush, inputs=None, outputs=None):
        """Run the graph on the storages' current values; write the results
        into the same storages. flush(reason) issues the current executor's
        recorded ops (fused mode), called when an input is still pending.
        inputs, outputs: other storages in the captured ones' places (a
        compiled graph's replay reads and writes each call's own tensors).
        Returns the result arrays."""
        if self._run is None:
            return []
        inputs = self.inputs if inputs is None else inputs
        outputs = self.outputs if outputs is None else outputs
        if any(type(s.array) is Pending for s in inputs):
            flush("graph_replay")
        arrays = [s.array for s in inputs]
        for a, kind in zip(arrays, self._kinds):
            if type(a) is Lost:
                a.fail()
            if (a.shape, a.dtype) != kind:
                raise RuntimeError(f"torchtpu: a captured tensor's storage is now {a.dtype}"
                                   f"{list(a.shape)}, it was {kind[1]}{list(kind[0])} at capture: "
                                   "capture the graph again (reset() it first)")
        a = None
        for i in self._donated:
            # Another holder (a second storage, the last issued results) would
            # see a donated buffer vanish: give the graph a copy instead.
            if sys.getrefcount(arrays[i]) > 3:
                arrays[i] = jnp.copy(arrays[i])
        scalars = self._scalars
        if self._random:
            scalars = list(scalars)
            for seed_at, offset_at in self._random:
                scalars[seed_at], scalars[offset_at] = rng.next_key()
        results = self._run(arrays, scalars)
        del arrays
        for storage, value in zip(outputs, results):
            storage.array = value
        if self._checks:
            self._note_checks(inputs, outputs)
        if value_checks.nan_checks_on() and value_checks.any_nonfinite(results):
            raise RuntimeError("torchtpu: a replayed graph produced NaN or Inf "
                               "(TORCHTPU_CHECK_NANS=1)")
        return results

    def _note_checks(self, inputs, outputs):
        """The replay merged its indexing ops' checks into the device's
        running flag (one of the outputs): tell bounds, so that the next sync
        point reads it and an out-of-range index raises, naming the op and
        its line in the captured code."""
        flag = bounds.flag_input(False, self._device)
        # What depends on the checks: the results, but for the flag itself.
        produced = [s for s in outputs if s is not flag]
        bounds.note_replayed(self._checks, flag.array, inputs, produced, self._device)
