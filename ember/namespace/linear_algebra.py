"""Linear algebra functions of the main namespace."""

from __future__ import annotations

from ..array import Array
from ..errors import ShapeError
from ._generate import from_row, require_array

matmul = from_row("matmul")
tensordot = from_row("tensordot")
vecdot = from_row("vecdot")
_permute_dims = from_row("permute_dims")

__all__ = ["matmul", "matrix_transpose", "tensordot", "vecdot"]


def matrix_transpose(x, /) -> Array:
    """Transpose each matrix of a stack (the last two axes)."""
    require_array(x, "matrix_transpose")
    if x.ndim < 2:
        raise ShapeError(f"matrix_transpose: input must be at least 2-d, got shape {x.shape}")
    axes = tuple(range(x.ndim - 2)) + (x.ndim - 1, x.ndim - 2)
    return _permute_dims(x, axes)
