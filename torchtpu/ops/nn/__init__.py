"""Neural-network lowerings (one module for now)."""
from . import pool  # noqa: F401
from .pool import scaled_dot_product_attention  # noqa: F401
