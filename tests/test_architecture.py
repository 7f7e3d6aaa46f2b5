"""The package's shape (docs/architecture.md): no import cycles in torchtpu/,
deferred imports included, and no file a reader cannot hold."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "torchtpu"
MAX_LINES = 800
MAX_DISPATCH_CORE_LINES = 600


def _modules():
    """Dotted module name -> path, for every .py file under torchtpu/."""
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph():
    """Module -> the torchtpu modules it imports anywhere in its text.
    `from pkg import name` depends on pkg.name where that is a module, else on
    pkg itself; a package's own __init__ run first by Python is not counted."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                deps.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                            for a in node.names)
        graph[name] = sorted(d for d in deps if d in mods and d != name)
    return graph


def find_cycle(graph):
    """One import cycle as a list of modules (first == last), or None."""
    state = {}  # module -> "open" while on the path, "done" after

    def visit(module, path):
        state[module] = "open"
        path.append(module)
        for dep in graph[module]:
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, path)
                if found:
                    return found
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [])
            if found:
                return found
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


def test_the_import_graph_reads_relative_imports():
    graph = import_graph()
    assert "torchtpu.ops.registry" in graph["torchtpu.ops"]
    assert "torchtpu.tensor" in graph["torchtpu.dispatch.core"]
    assert "torchtpu.modes.checks" in graph["torchtpu.modes.fused"]  # `from . import checks`


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_file_over_800_lines():
    long = {str(p.relative_to(ROOT.parent)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_dispatch_core_is_small():
    core = ROOT / "dispatch" / "core.py"
    assert len(core.read_text().splitlines()) <= MAX_DISPATCH_CORE_LINES


MODE_NAMES = {"debug", "strict", "fused", "capture"}


def mode_rule_breaks(path, text):
    """Outside torchtpu/modes/: (line, what) for each comparison of an
    executor's name with a mode's, each use of modes._current, and each read
    of a frame's locals (f_locals). Code asks an executor what it does
    (records, fuses, waits_each_op) and passes what it needs as arguments."""
    breaks = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            names = any(isinstance(p, ast.Attribute) and p.attr == "name" for p in parts)
            modes = any(isinstance(p, ast.Constant) and p.value in MODE_NAMES for p in parts)
            if names and modes:
                breaks.append((node.lineno, "a mode's name compared"))
        elif isinstance(node, ast.Attribute) and node.attr == "_current" and \
                isinstance(node.value, ast.Name) and node.value.id == "modes":
            breaks.append((node.lineno, "modes._current"))
        elif isinstance(node, ast.Attribute) and node.attr == "f_locals":
            breaks.append((node.lineno, "a frame's locals read"))
    return breaks


def test_the_mode_rule_finder_finds_what_it_forbids():
    text = ("if ex.name == 'fused': pass\n"
            "modes._current = x\n"
            "v = frame.f_locals.get('g')\n"
            "if ex.fuses and other.name == 'x': pass\n")
    assert [line for line, _ in mode_rule_breaks("t.py", text)] == [1, 2, 3]


def test_modes_are_asked_what_they_do_not_named_and_no_frame_locals_read():
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "modes":
            continue
        # Hiding internal frames from a traceback writes a frame's locals
        # (__tracebackhide__, for pytest and IPython); it reads none.
        found += [f"{rel}:{line}: {what}" for line, what in mode_rule_breaks(path, path.read_text())
                  if not (rel.name == "errors.py" and what == "a frame's locals read"
                          and "__tracebackhide__" in path.read_text().splitlines()[line - 1])]
    assert not found, found


def test_torchtpu_variables_are_read_in_config_alone_and_documented():
    """Every TORCHTPU_* variable is a torchtpu.config.Variable, no other
    module names one to os.environ, and docs/configuration.md's table lists
    exactly those variables, in config's order, with config's defaults."""
    import re

    from torchtpu import config
    readers = []
    for path in ROOT.rglob("*.py"):
        if path.name == "config.py" and path.parent == ROOT:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"TORCHTPU_[A-Z_]+", node.value):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not readers, readers
    table = (ROOT.parent / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `(TORCHTPU_[A-Z_]+)` \| ([^|]*) \|", table, re.M)
    assert [name for name, _ in rows] == list(config.VARIABLES)
    for name, default in rows:
        want = config.VARIABLES[name].default
        if want:  # (a computed default is described in words)
            assert default.strip() in (f"`{want}`", want), (name, default)
