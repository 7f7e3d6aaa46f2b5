"""Every TORCHTPU_* environment variable in one place: its name, its default
and how its value reads. docs/configuration.md's table documents the same
list, and tests/test_architecture.py checks that the two agree and that no
other module reads a TORCHTPU_* variable itself.

Each is read through its Variable where torchtpu uses it: some once, at
import (the eager mode to start in, growth, index checks, the advisor), the
others at each use, so that a change to os.environ takes effect from then on.
"""
import os

_OFF = ("0", "off", "false", "no")
VARIABLES = {}  # name -> Variable, in the order of docs/configuration.md's table


class Variable:
    """One TORCHTPU_* variable; `environ` (default os.environ) is where it is read."""

    def __init__(self, name, default=""):
        self.name = name
        self.default = default
        VARIABLES[name] = self

    def text(self, environ=None):
        """Its value, stripped: the default when unset or empty."""
        return (environ if environ is not None else os.environ).get(self.name, "").strip() \
            or self.default

    def on(self, environ=None):
        """A switch: on unless empty or 0, off, false or no (any case)."""
        value = self.text(environ).lower()
        return bool(value) and value not in _OFF

    def number(self, environ=None):
        return int(self.text(environ))

    def set(self, value):
        """Set it for this process (and the processes it starts)."""
        os.environ[self.name] = value


PLATFORM = Variable("TORCHTPU_PLATFORM")
EAGER_MODE = Variable("TORCHTPU_EAGER_MODE", "strict")
FUSE_MAX_OPS = Variable("TORCHTPU_FUSE_MAX_OPS", "1000")
FUSED_BACKGROUND_OPS = Variable("TORCHTPU_FUSED_BACKGROUND_OPS", "100")
FUSED_COMPILE = Variable("TORCHTPU_FUSED_COMPILE", "background")
FUSED_SPLIT_OPS = Variable("TORCHTPU_FUSED_SPLIT_OPS", "256")
FUSE_DEBUG = Variable("TORCHTPU_FUSE_DEBUG")
RECOMPILES = Variable("TORCHTPU_RECOMPILES")
GROWTH = Variable("TORCHTPU_GROWTH", "on")
GROWTH_MIN = Variable("TORCHTPU_GROWTH_MIN", "128")
LENGTHS = Variable("TORCHTPU_LENGTHS", "on")
BUCKETS = Variable("TORCHTPU_BUCKETS", "on")
INDEX_CHECKS = Variable("TORCHTPU_INDEX_CHECKS", "1")
CHECK_NANS = Variable("TORCHTPU_CHECK_NANS")
FULL_TRACEBACK = Variable("TORCHTPU_FULL_TRACEBACK")
DEBUG = Variable("TORCHTPU_DEBUG")
CHURN_THRESHOLD = Variable("TORCHTPU_CHURN_THRESHOLD", "8")
MEMORY_CACHE_ENTRIES = Variable("TORCHTPU_MEMORY_CACHE_ENTRIES", "8192")
CACHE_DIR = Variable("TORCHTPU_CACHE_DIR")
CACHE_READONLY = Variable("TORCHTPU_CACHE_READONLY")
CACHE_MAX_BYTES = Variable("TORCHTPU_CACHE_MAX_BYTES", "10G")
CACHE_TRUSTED_UIDS = Variable("TORCHTPU_CACHE_TRUSTED_UIDS")
CACHE_PREFETCH = Variable("TORCHTPU_CACHE_PREFETCH", "on")
DISTRIBUTED = Variable("TORCHTPU_DISTRIBUTED")
COORDINATOR_PORT = Variable("TORCHTPU_COORDINATOR_PORT")
COORDINATOR_PROCESS = Variable("TORCHTPU_COORDINATOR_PROCESS")
HEARTBEAT_TIMEOUT = Variable("TORCHTPU_HEARTBEAT_TIMEOUT", "100")
WATCHDOG = Variable("TORCHTPU_WATCHDOG", "600")
TPU_PROCESS_PORT = Variable("TORCHTPU_TPU_PROCESS_PORT", "8476")
