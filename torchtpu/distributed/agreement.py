"""What the ranks tell each other before an XLA collective: its description
(kind, reduction, root, shapes and dtypes), which must agree, and each
rank's device, which places it in the group's mesh.

XLA's collectives trust every process to run the same program: over
tensors of different shapes they return wrong values or hang. So the ranks
first swap a small fixed-size message on the host through gloo (the group's
timeout applies) and raise on every rank when the descriptions differ.
A rank that has died, or does not come within the timeout, fails the swap:
the others raise DistBackendError naming the collective (and, past the
watchdog's timeout, the missing rank: watchdog.py).
"""
import hashlib

import torch
from torch.distributed import DistBackendError

from . import watchdog

_BYTES = 512  # one message: "device id;extra;description", padded
FUSED_GRAPH = "fused graph"  # how a fused graph's collectives' digest begins
_FUSED_HINT = (
    " In fused mode every rank must flush a graph holding collectives at the same "
    "point: a value read on some ranks only (`if rank == 0: print(loss.item())`) that "
    "depends on a pending collective flushes the graph there alone (one that does not "
    "is computed on its own). Call torchtpu.sync() on every rank before such a read.")


def graph_extra(whole, why):
    """What a rank adds to a fused graph's description: the digest of its
    whole graph and why and where it flushes it (for the message)."""
    return f"{whole}|{why.replace(';', ',')}"


def graph_whole(extra):
    return extra.split("|", 1)[0]


def _note(description, extra):
    if description.startswith(FUSED_GRAPH) and "|" in extra:
        return f"flushed for {extra.split('|', 1)[1]}"
    return ""


def _encode(device_id, extra, description):
    text = f"{device_id};{extra};{description}".encode()
    if len(text) > _BYTES:
        digest = hashlib.blake2b(text, digest_size=16).hexdigest().encode()
        text = text[:_BYTES - len(digest) - 1] + b"#" + digest
    return torch.frombuffer(bytearray(text.ljust(_BYTES, b"\0")), dtype=torch.uint8)


def _decode(buf):
    raw = buf.numpy().tobytes().rstrip(b"\0").decode(errors="replace")
    device_id, extra, description = raw.split(";", 2)
    return int(device_id), extra, description


def _check(name, descriptions, ranks, notes=None):
    """RuntimeError on every rank unless all gave the same description;
    notes: what each rank adds to the message (why it flushed its graph)."""
    if len(set(descriptions)) > 1:
        notes = notes or [""] * len(descriptions)
        said = "; ".join(f"rank {r}: {d}{f' ({n})' if n else ''}"
                         for r, d, n in zip(ranks, descriptions, notes))
        fused = [d.startswith(FUSED_GRAPH) for d in descriptions]
        # Graphs flushed at different points (a read on one rank) or a
        # graph on some ranks against a collective on others.
        hint = _FUSED_HINT if any(fused) and (not all(fused) or len(set(notes)) > 1) else ""
        raise RuntimeError(f"{name}: the ranks called it with different arguments ({said})."
                           + hint)


def _swap(gloo, name, *works, peer=None):
    """Run gloo's works (functions returning a Work) in turn, waiting for
    each (under the group's watchdog, if it has one: watchdog.py)."""
    w = watchdog.of(gloo)
    try:
        if w is not None:
            w.wait(name, works, peer)
        else:
            for work in works:
                work().wait()
    except DistBackendError:  # the watchdog's, naming the missing ranks
        raise
    except RuntimeError as e:
        raise DistBackendError(
            f"{name}: a rank of the group did not take part (it died, or did not call "
            f"{name} within the process group's timeout): {e}") from e


def exchange(gloo, name, device_id, description, extra=""):
    """Every rank's (device id, extra) in group-rank order, after checking
    that every rank gave the same description (RuntimeError on all if not)."""
    mine = _encode(device_id, extra, description)
    everyone = torch.empty(gloo.size() * _BYTES, dtype=torch.uint8)
    _swap(gloo, name, lambda: gloo._allgather_base(everyone, mine))
    decoded = [_decode(b) for b in everyone.view(-1, _BYTES)]
    _check(name, [d for _, _, d in decoded], range(len(decoded)),
           [_note(d, e) for _, e, d in decoded])
    return [(dev, ext) for dev, ext, _ in decoded]


def exchange_pair(gloo, name, device_id, description, peer, sending, tag):
    """send/recv: the peer's device id, after checking that its description
    matches (the sender speaks first)."""
    mine = _encode(device_id, "", description)
    theirs = torch.empty_like(mine)
    send = lambda: gloo.send([mine], peer, tag)  # noqa: E731
    recv = lambda: gloo.recv([theirs], peer, tag)  # noqa: E731
    _swap(gloo, name, *((send, recv) if sending else (recv, send)), peer=peer)
    their_device, _, their_description = _decode(theirs)
    me = gloo.rank()
    _check(name, [description, their_description], [me, peer])
    return their_device
