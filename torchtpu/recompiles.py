"""Why it compiled: each new kernel (debug and strict mode) and each new
fused graph (fused mode) is compared with the nearest earlier one of the
same op, or flushed at the same line, and what differs is kept with the
user's line: an argument's shape, dtype, layout or static value, or an op
of the sequence. `torchtpu.explain_compiles()` reports them (and so does
TORCHTPU_DEBUG's advisor). Inside `torchtpu.no_recompiles()` a new kernel
or graph raises RecompileError at that line instead; with
TORCHTPU_RECOMPILES=error, everywhere, what compiles again does (a kernel
of an op that has one, a graph at a line that flushed one).

Only what is new to the process counts (a kernel or graph then compiled,
or loaded from the disk cache); the cost is paid on such misses alone."""
import collections
import contextlib
import threading

from . import config, errors, metrics

_ALWAYS = config.RECOMPILES.text().lower() == "error"
_local = threading.local()
_HISTORY = 16
_kernels = collections.defaultdict(lambda: collections.deque(maxlen=_HISTORY))
# Per flush line (the last _SITES lines), and under None the last anywhere:
# each graph as (name, specs, id) per kernel, not the kernels (nor their
# executables, which the memory cache may have dropped).
_SITES = 256
_graphs = collections.OrderedDict()
_events = collections.deque(maxlen=256)


class RecompileError(RuntimeError):
    """Something would compile where compilations are refused."""


@contextlib.contextmanager
def no_recompiles():
    """Refuse new kernels and graphs in this block: whatever would compile
    raises RecompileError at its line, naming what differs from the
    nearest earlier one. For a loop after its warm-up."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


# ---- kernels ---------------------------------------------------------------

def note_kernel(op, pos_specs, kw_specs, precision=None):
    """A new kernel of op for these argument specs (and float32 matmul
    precision, for a matrix product): a miss in debug or strict mode.
    Raises RecompileError where refused."""
    earlier = _kernels[op]
    specs = (pos_specs, kw_specs, precision)
    difference = _nearest(earlier, specs, _kernel_differences)
    earlier.append(specs)
    _note(op, difference, f"a new kernel of {op}", again=difference is not None)


def _kernel_differences(a, b):
    """What differs between two calls' (pos_specs, kw_specs, precision): a
    list of phrases, 'argument 0: shape [4, 8] -> [5, 8]'."""
    out = []
    (pa, ka, qa), (pb, kb, qb) = a, b
    if qa != qb:
        out.append(f"float32 matmul precision {qa!r} -> {qb!r}")
    if len(pa) != len(pb):
        out.append(f"{len(pa)} -> {len(pb)} arguments")
    for i, (x, y) in enumerate(zip(pa, pb)):
        out += [f"argument {i}: {d}" for d in _spec_differences(x, y)]
    da, db = dict(ka), dict(kb)
    for name in sorted(set(da) | set(db)):
        if name not in da or name not in db:
            out.append(f"keyword {name}: {'given' if name in db else 'not given'}")
        else:
            out += [f"keyword {name}: {d}" for d in _spec_differences(da[name], db[name])]
    return out


def _spec_differences(x, y):
    # (The dispatcher's argument records name what differs between them.)
    return [] if x == y else x.differences(y)


# ---- fused graphs ----------------------------------------------------------

def note_graph(site, kernels, same_ops_text="the same ops; where their values come from, or "
                                            "which are kept, differs"):
    """A new fused graph flushed at site (file:line), of these kernels in
    order. Raises RecompileError where refused."""
    graph = [(k.name, getattr(k, "specs", None), id(k)) for k in kernels]
    at_site, anywhere = _history(site), _history(None)
    again = bool(at_site)
    # The graphs flushed at the same line, and the last ones anywhere.
    difference = _nearest(list(at_site) + list(anywhere), graph,
                          lambda a, b: _graph_differences(a, b, same_ops_text), _graph_distance)
    at_site.append(graph)
    anywhere.append(graph)
    _note(f"a fused graph of {len(kernels)} ops", difference,
          f"a new fused graph of {len(kernels)} ops", again, site)


def _history(site):
    found = _graphs.get(site)
    if found is None:
        found = _graphs[site] = collections.deque(maxlen=_HISTORY // 2)
        if len(_graphs) > _SITES:
            _graphs.popitem(last=False)
    else:
        _graphs.move_to_end(site)
    return found


def _graph_distance(a, b):
    """How two graphs differ: 1 per op of the same name and another
    kernel (other shapes, say), 2 per op of another name or missing."""
    return (sum(0 if x[2] == y[2] else 1 if x[0] == y[0] else 2 for x, y in zip(a, b))
            + 2 * abs(len(a) - len(b)))


def _graph_differences(a, b, same_ops_text):
    for i, ((name, specs, ident), (new_name, new_specs, new_ident)) in enumerate(zip(a, b)):
        if ident == new_ident:
            continue
        if name != new_name:
            return [f"op {i}: {name} -> {new_name}"]
        found = _kernel_differences(specs, new_specs) if specs and new_specs else []
        return [f"op {i} ({name}) " + ("; ".join(found) if found else "differs")]
    if len(a) != len(b):
        longer = b if len(b) > len(a) else a
        return [f"{len(a)} -> {len(b)} ops (from op {min(len(a), len(b))}, "
                f"{longer[min(len(a), len(b))][0]})"]
    return [same_ops_text]


# ---- shared ----------------------------------------------------------------

def _nearest(earlier, new, differences, distance=None):
    """The differences from the nearest earlier entry (by distance(old,
    new), else by how many differences; the latest of equals), or None."""
    best, best_distance = None, None
    for old in earlier:
        d = distance(old, new) if distance is not None else len(differences(old, new))
        if best_distance is None or d <= best_distance:
            best, best_distance = old, d
    return None if best is None else differences(best, new)


def _note(what, difference, new_text, again, line=None):
    """Keep what differs; raise where refused: everything new inside
    no_recompiles(), with TORCHTPU_RECOMPILES=error what compiles again
    (an op's kernel for new arguments, a graph at a line that had one)."""
    line = line or errors.user_line()
    if difference is not None:
        _events.append((line, what, "; ".join(difference), metrics.M.steps))
    if getattr(_local, "depth", 0) > 0 or (_ALWAYS and again):
        because = ("it differs from the nearest earlier one in " + "; ".join(difference)
                   if difference is not None else "nothing like it was compiled before")
        raise RecompileError(f"torchtpu: {new_text} would compile at {line} (refused by "
                             f"no_recompiles / TORCHTPU_RECOMPILES=error): {because}")


def events():
    """(line, what, why, training steps done then) of each compilation
    again, oldest first."""
    return list(_events)


def explain_compiles():
    """What compiled again, and why: one line per new kernel or graph that
    had an earlier one of the same op (or line), oldest first, naming the
    user's line and what differs."""
    if not _events:
        return "torchtpu: nothing compiled again"
    return "\n".join(f"{line}: {what}: {why}" for line, what, why, _ in _events)


metrics.register_provider(lambda: {"recompiles": len(_events)}, _events.clear)
