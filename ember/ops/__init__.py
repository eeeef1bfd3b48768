"""Layer 2 — the op table. ``OPS`` maps every operation's name to its row (see table.py)."""

from . import (  # noqa: F401  (rows register on import)
    creation,
    elementwise,
    fft,
    indexing,
    linalg,
    linear_algebra,
    manipulation,
    nn,
    reductions,
)
from .table import NO_GRADIENT, OPS, Meta, Op

__all__ = ["OPS", "Op", "Meta", "NO_GRADIENT"]
