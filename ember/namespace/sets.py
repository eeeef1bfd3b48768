"""Set functions (the standard's set section): named-tuple results like NumPy's."""

from __future__ import annotations

from typing import NamedTuple

from ..array import Array
from ._generate import from_row

__all__ = ["unique_all", "unique_counts", "unique_inverse", "unique_values"]


class UniqueAllResult(NamedTuple):
    values: Array
    indices: Array
    inverse_indices: Array
    counts: Array


class UniqueCountsResult(NamedTuple):
    values: Array
    counts: Array


class UniqueInverseResult(NamedTuple):
    values: Array
    inverse_indices: Array


unique_values = from_row("unique_values")


def _named(row: str, result: type):
    raw = from_row(row)

    def function(x, /):
        return result(*raw(x))
    function.__name__ = function.__qualname__ = row
    function.__doc__ = raw.__doc__
    return function


unique_all = _named("unique_all", UniqueAllResult)
unique_counts = _named("unique_counts", UniqueCountsResult)
unique_inverse = _named("unique_inverse", UniqueInverseResult)
