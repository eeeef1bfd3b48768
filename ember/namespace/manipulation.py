"""Manipulation functions (the standard's manipulation section)."""

from __future__ import annotations

from ..array import Array
from ..errors import EmberError, ShapeError, with_prefix
from ..ops.table import as_shape
from ..ops.table import broadcast_shapes as _broadcast_shapes
from ._generate import from_row, require_array

broadcast_to = from_row("broadcast_to")
concat = from_row("concat")
expand_dims = from_row("expand_dims")
flip = from_row("flip")
moveaxis = from_row("moveaxis")
permute_dims = from_row("permute_dims")
reshape = from_row("reshape")
roll = from_row("roll")
squeeze = from_row("squeeze")
stack = from_row("stack")
tile = from_row("tile")
unstack = from_row("unstack")
_repeat = from_row("repeat")

__all__ = ["broadcast_arrays", "broadcast_shapes", "broadcast_to", "concat", "expand_dims", "flip", "moveaxis", "permute_dims",
           "repeat", "reshape", "roll", "squeeze", "stack", "tile", "unstack"]


def broadcast_shapes(*shapes) -> tuple:
    """The shape that arrays of ``shapes`` broadcast to (``()`` for none); ShapeError, a ValueError,
    names the shapes when they do not broadcast."""
    try:
        shapes = [as_shape(s) for s in shapes]
        return _broadcast_shapes(*shapes) if shapes else ()
    except EmberError as error:
        raise with_prefix(error, "broadcast_shapes") from None


def broadcast_arrays(*arrays) -> tuple[Array, ...]:
    """The arrays broadcast against one another."""
    for a in arrays:
        require_array(a, "broadcast_arrays", "each input")
    try:
        shape = _broadcast_shapes(*(a.shape for a in arrays)) if arrays else ()
    except ShapeError as error:
        raise ShapeError(f"broadcast_arrays: {error}") from None
    return tuple(a if a.shape == shape else broadcast_to(a, shape) for a in arrays)


def repeat(x, repeats, /, *, axis=None) -> Array:
    """Repeat elements of x; ``repeats`` is an int or a 1-d integer array (read to know the shape)."""
    if isinstance(repeats, Array):
        repeats = tuple(int(r) for r in repeats._host().reshape(-1))
    return _repeat(x, repeats, axis=axis)

