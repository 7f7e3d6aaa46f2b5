"""Run a function on a module once it is imported, without importing it.

torchtpu tells some libraries about the tpu device (Accelerate, Dynamo,
Inductor), but importing them costs time a script that never uses them should
not pay. `when_imported(name, fn)` calls fn(module) at once if the module is
already imported, else right after the module's own code first runs: a
finder at the front of sys.meta_path finds the module as the finders after
it do and wraps its loader's exec_module.
"""
import importlib.abc
import importlib.util
import sys

_waiting = {}  # module name -> functions to call with the module
_given = set()  # (module name, function) pairs given so far


def when_imported(name, fn):
    """fn(module) once module `name` is imported. A pair given again is
    ignored, so an integration installed twice patches its library once."""
    if (name, fn) in _given:
        return
    _given.add((name, fn))
    module = sys.modules.get(name)
    if module is not None:
        fn(module)
        return
    _waiting.setdefault(name, []).append(fn)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):

    def find_spec(self, name, path=None, target=None):
        if name not in _waiting:
            return None
        sys.meta_path.remove(self)  # the real spec, from the finders after this one
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            for fn in _waiting.pop(name, ()):
                fn(module)
            if not _waiting and self in sys.meta_path:
                sys.meta_path.remove(self)

        spec.loader.exec_module = exec_module
        return spec
