"""What a fused graph's ops read: each argument of a recorded op is the
result of an earlier op in the graph, one of the graph's input arrays, or one
of its dynamic scalars (a recomputed op reads the first two Fenced). Graph
keys hold them, so they compare and hash as tuples, in C. An Input and a Scalar of one index are equal tuples: they never
meet in one key (an op's argument at a given place is always an array or
always a scalar), and a table holding both keeps them apart by type."""
import typing

from jax import lax

class Result(typing.NamedTuple):
    """Output `index` of the graph's node `node` (written arguments follow
    its results)."""
    node: int
    index: int


# Refs made once for each index and kept: fused mode records one for every
# op's result and every new input, and the same indexes recur in each graph.
FIRST_RESULTS = []  # FIRST_RESULTS[n]: Result(n, 0) (most ops have one result)
_RESULT_ROWS = []   # _RESULT_ROWS[n]: (Result(n, 0), Result(n, 1), ...)


def first_result(node):
    """Result(node, 0), made once per node index."""
    if node >= len(FIRST_RESULTS):
        FIRST_RESULTS.extend(Result(n, 0) for n in range(len(FIRST_RESULTS), 2 * node + 64))
    return FIRST_RESULTS[node]


def results(node, count):
    """Result(node, j) for each j < count (and perhaps more), made once."""
    rows = _RESULT_ROWS
    if node >= len(rows):
        rows.extend(() for _ in range(len(rows), 2 * node + 64))
    row = rows[node]
    if len(row) < count:
        row = rows[node] = tuple(Result(node, j) for j in range(count))
    return row


class Input(typing.NamedTuple):
    """The graph's input array `index`."""
    index: int


class Scalar(typing.NamedTuple):
    """The graph's dynamic scalar `index`."""
    index: int


INPUTS, SCALARS = [], []  # INPUTS[i]: Input(i); SCALARS[i]: Scalar(i)


def numbered(table, kind, index):
    """kind(index) (an Input or a Scalar), made once and kept in table."""
    if index >= len(table):
        table.extend(kind(i) for i in range(len(table), 2 * index + 64))
    return table[index]


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
