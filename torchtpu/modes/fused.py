"""fused: not built yet; runs as strict (with a warning)."""
import warnings

from .strict import StrictExecutor


class FusedExecutor(StrictExecutor):
    name = "fused"

    def __init__(self):
        super().__init__()
        warnings.warn("torchtpu: fused mode is not available yet; running as strict", stacklevel=3)
