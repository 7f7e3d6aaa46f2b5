"""What a fused graph's ops read: each argument of a recorded op is the
result of an earlier op in the graph, one of the graph's input arrays, or one
of its dynamic scalars (a recomputed op reads the first two Fenced). Graph
keys hold them, so they compare and hash as tuples, in C. An Input and a Scalar of one index are equal tuples: they never
meet in one key (an op's argument at a given place is always an array or
always a scalar), and a table holding both keeps them apart by type."""
import typing

from jax import lax

# A record from a tuple, without NamedTuple's Python-level __new__ (fused
# mode makes one per recorded result).
record = tuple.__new__


class Result(typing.NamedTuple):
    """Output `index` of the graph's node `node` (written arguments follow
    its results)."""
    node: int
    index: int


# Result(n, 0) at index n: most ops have one result, and fused mode records
# one per op.
FIRST_RESULTS = []


def first_result(node):
    """Result(node, 0), made once per node index."""
    if node >= len(FIRST_RESULTS):
        FIRST_RESULTS.extend(Result(n, 0) for n in range(len(FIRST_RESULTS), 2 * node + 64))
    return FIRST_RESULTS[node]


class Input(typing.NamedTuple):
    """The graph's input array `index`."""
    index: int


class Scalar(typing.NamedTuple):
    """The graph's dynamic scalar `index`."""
    index: int


class Fenced(typing.NamedTuple):
    """ref (a Result or an Input) read by an op recomputed in a backward pass
    (activation checkpointing), through an optimization barrier it shares
    with anchor (a Result the backward pass computed before, or None). XLA
    then can neither merge the recomputation with the forward's ops (which
    would keep the activations alive, undoing the checkpoint) nor run it
    before the backward pass reaches it."""
    ref: tuple
    anchor: tuple


def arguments(refs, values, inputs, scalars, fence):
    """A recorded op's arguments from its refs: values (Result -> array) of
    the ops before it, the graph's inputs and scalars. fence: read Fenced
    refs through their optimization barriers (where the ops are traced into
    one computation; op by op, XLA merges nothing)."""
    args = []
    for r in refs:
        kind = type(r)
        if kind is Result:
            args.append(values[r])
        elif kind is Input:
            args.append(inputs[r.index])
        elif kind is Scalar:
            args.append(scalars[r.index])
        else:
            value = values[r.ref] if type(r.ref) is Result else inputs[r.ref.index]
            if fence:
                value = (lax.optimization_barrier(value) if r.anchor is None
                         else lax.optimization_barrier((value, values[r.anchor]))[0])
            args.append(value)
    return args
