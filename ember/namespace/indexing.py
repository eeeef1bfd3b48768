"""Indexing: ``take``, ``take_along_axis``, and the keys of ``x[key]`` / ``x[key] = value``."""

from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..array import Array, bind
from ..errors import DTypeError, EmberError, IndexingError, with_prefix
from ..ops import OPS
from ._generate import from_row

take = from_row("take")
take_along_axis = from_row("take_along_axis")
scatter_add = from_row("scatter_add")  # not in the standard: the adjoint of gathers, used by gradients

__all__ = ["take", "take_along_axis", "scatter_add"]

_GETITEM, _SETITEM = OPS["getitem"], OPS["setitem"]


def _bound(value, what):
    if value is None or isinstance(value, int):
        return value
    if hasattr(value, "__index__"):
        return value.__index__()
    raise IndexingError(f"slice {what} must be an int or None, got {value!r}")


def encode_key(x: Array, key) -> tuple[tuple, tuple]:
    """``key`` as the plain-data template of the getitem row, and its index arrays."""
    items = key if type(key) is tuple else (key,)
    template = []
    arrays = []
    for item in items:
        if type(item) is int:
            template.append(item)
        elif type(item) is slice:
            template.append(("s", _bound(item.start, "start"), _bound(item.stop, "stop"), _bound(item.step, "step")))
        elif item is None:
            template.append(None)
        elif item is Ellipsis:
            template.append("...")
        elif isinstance(item, Array):
            template.append(("a", len(arrays)))
            arrays.append(item)
        elif isinstance(item, (bool, np.bool_)):
            from .creation import asarray
            template.append(("a", len(arrays)))
            arrays.append(asarray(bool(item), device=x.device))
        elif hasattr(item, "__index__"):
            template.append(item.__index__())
        elif isinstance(item, (list, np.ndarray)):
            from .creation import asarray
            template.append(("a", len(arrays)))
            arrays.append(asarray(item, device=x.device))
        else:
            raise IndexingError(f"getitem: unsupported index {item!r} of type {type(item).__name__}")
    return tuple(template), tuple(arrays)


def getitem(x: Array, key) -> Array:
    """``x[key]``: basic, integer-array and boolean indexing."""
    template, arrays = encode_key(x, key)
    return bind(_GETITEM, (x, *arrays), {"key": template})


def setitem(x: Array, key, value) -> Array:
    """A copy of x with ``x[key]`` replaced by ``value`` (the array then rebinds to it)."""
    template, arrays = encode_key(x, key)
    dtype = x._meta.dtype
    try:
        if isinstance(value, Array):
            if value.dtype is not dtype:
                if dt.promote(value.dtype, dtype) is not dtype:
                    raise DTypeError(f"cannot assign {value.dtype} values to a {dtype} array without a cast")
                value = bind(OPS["astype"], (value,), {"dtype": dtype, "copy": True})
        elif dt.is_python_scalar(value):
            if dt.scalar_dtype(dtype, value) is not dtype:
                raise DTypeError(f"cannot assign {type(value).__name__} {value!r} to a {dtype} array without a cast")
        else:
            raise DTypeError(f"value must be an ember array or a Python scalar, got {type(value).__name__}")
    except EmberError as error:
        raise with_prefix(error, "setitem") from None
    return bind(_SETITEM, (x, value, *arrays), {"key": template}, literal_dtype=dtype)
