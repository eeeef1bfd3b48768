"""Utility functions (the standard's utility section)."""

from __future__ import annotations

from ..array import Array
from ._generate import from_row, require_array

all = from_row("all")
any = from_row("any")
_diff = from_row("diff")

__all__ = ["all", "any", "diff"]


def diff(x, /, *, axis=-1, n=1, prepend=None, append=None) -> Array:
    """The n-th discrete difference along axis, with optional arrays prepended/appended first."""
    if prepend is not None or append is not None:
        from .manipulation import concat
        require_array(x, "diff")
        parts = [p for p in (prepend, x, append) if p is not None]
        x = concat(parts, axis=axis)
    return _diff(x, axis=axis, n=n)
