"""Set functions (the standard's set section): named-tuple results like NumPy's."""

from __future__ import annotations

from typing import NamedTuple

from ..array import Array, bind
from ..ops import OPS
from ._generate import from_row, named_result
from .elementwise import operands

__all__ = ["isin", "unique_all", "unique_counts", "unique_inverse", "unique_values"]


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


unique_all = named_result("unique_all", UniqueAllResult)
unique_counts = named_result("unique_counts", UniqueCountsResult)
unique_inverse = named_result("unique_inverse", UniqueInverseResult)


def isin(x1, x2, /, *, invert=False) -> Array:
    """Whether each element of x1 is among the elements of x2 (is not, with ``invert=True``); either
    may be a Python scalar, the other then an array (a scalar x1 gives a 0-d result)."""
    x1, x2, literal = operands("isin", x1, x2)
    return bind(OPS["isin"], (x1, x2), {"invert": invert}, literal_dtype=literal)
