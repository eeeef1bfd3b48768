"""Set functions (the standard's set section): named-tuple results like NumPy's."""

from __future__ import annotations

from typing import NamedTuple

from ..array import Array
from ._generate import from_row, named_result

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


unique_all = named_result("unique_all", UniqueAllResult)
unique_counts = named_result("unique_counts", UniqueCountsResult)
unique_inverse = named_result("unique_inverse", UniqueInverseResult)
