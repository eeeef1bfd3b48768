"""Sorting functions (the standard's sorting section)."""

from ._generate import from_row

argsort = from_row("argsort")
sort = from_row("sort")

__all__ = ["argsort", "sort"]
