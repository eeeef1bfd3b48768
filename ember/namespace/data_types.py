"""Data type functions (the standard's data type section) and the dtype objects."""

from __future__ import annotations

from .. import dtypes as dt
from ..array import Array, bind, prefixed
from ..devices import device as as_device
from ..dtypes import finfo, iinfo, isdtype  # noqa: F401  (re-exported)
from ..errors import DTypeError
from ..ops import OPS

__all__ = ["astype", "can_cast", "finfo", "iinfo", "isdtype", "result_type"]


@prefixed("astype")
def astype(x, dtype, /, *, copy=True, device=None) -> Array:
    """x cast to ``dtype`` (a new array unless ``copy=False`` and nothing changes), on ``device``."""
    if not isinstance(x, Array):
        raise DTypeError(f"expected an ember array, got {type(x).__name__}")
    if not isinstance(dtype, dt.DType):
        raise DTypeError(f"dtype must be an ember dtype, got {dtype!r}")
    if device is not None:
        x = x.to_device(as_device(device))
    if dtype is x.dtype and not copy:
        return x
    return bind(OPS["astype"], (x,), {"dtype": dtype, "copy": copy})


def can_cast(from_, to, /) -> bool:
    """Whether ``from_`` (a dtype or an array) casts to ``to`` under the promotion rules."""
    if isinstance(from_, Array):
        from_ = from_.dtype
    if not isinstance(from_, dt.DType) or not isinstance(to, dt.DType):
        raise DTypeError(f"can_cast: expected ember dtypes or arrays, got {from_!r} and {to!r}")
    return dt.can_cast(from_, to)


@prefixed("result_type")
def result_type(*arrays_and_dtypes) -> dt.DType:
    """The dtype that arrays, dtypes and Python scalars promote to."""
    dtypes = [a.dtype if isinstance(a, Array) else a for a in arrays_and_dtypes if not dt.is_python_scalar(a)]
    scalars = [a for a in arrays_and_dtypes if dt.is_python_scalar(a)]
    for d in dtypes:
        if not isinstance(d, dt.DType):
            raise DTypeError(f"expected arrays, dtypes or Python scalars, got {d!r}")
    if not dtypes:
        raise DTypeError("at least one array or dtype is required")
    result = dtypes[0]
    for d in dtypes[1:]:
        result = dt.promote(result, d)
    for s in scalars:
        result = dt.scalar_dtype(result, s)
    return result
