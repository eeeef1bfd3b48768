"""Searching functions (the standard's searching section)."""

from __future__ import annotations

from .. import dtypes as dt
from ..array import Array, bind
from ..errors import DTypeError, EmberError, with_prefix
from ..ops import OPS
from ._generate import from_row, require_array
from .elementwise import operands

argmax = from_row("argmax")
argmin = from_row("argmin")
count_nonzero = from_row("count_nonzero")
nonzero = from_row("nonzero")
_searchsorted = from_row("searchsorted")

__all__ = ["argmax", "argmin", "count_nonzero", "nonzero", "searchsorted", "where"]


def searchsorted(x1, x2, /, *, side="left", sorter=None) -> Array:
    """Indices where x2's elements (an array, or a Python scalar) would be inserted into the 1-d x1
    (sorted, or sorted by ``sorter``)."""
    if sorter is not None:
        from .indexing import take
        x1 = take(require_array(x1, "searchsorted", "x1"), sorter)
    if isinstance(x2, Array):
        return _searchsorted(x1, x2, side=side)
    require_array(x1, "searchsorted", "x1")
    x1, x2, literal = operands("searchsorted", x1, x2)
    return bind(OPS["searchsorted"], (x1, x2), {"side": side}, literal_dtype=literal)


def where(condition, x1, x2, /) -> Array:
    """Elements of x1 where condition is true, else of x2; x1 and x2 may be Python scalars."""
    try:
        require_array(condition, "where", "condition")
        if condition.dtype is not dt.bool_:
            raise DTypeError(f"condition must be bool, got {condition.dtype}")
    except EmberError as error:
        raise error if str(error).startswith("where") else with_prefix(error, "where") from None
    x1, x2, literal = operands("where", x1, x2)
    return bind(OPS["where"], (condition, x1, x2), {}, literal_dtype=literal)
