"""Layer 2 — the op table. ``OPS`` maps every operation's name to its row (see table.py)."""

from . import creation, elementwise, fft, indexing, linalg, manipulation, nn, reductions  # noqa: F401  (rows register on import)
from .table import NO_GRADIENT, OPS, Meta, Op

__all__ = ["OPS", "Op", "Meta", "NO_GRADIENT"]
