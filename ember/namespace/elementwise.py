"""Elementwise functions (the standard's elementwise section), generated from the rows.

Binary functions take two arrays or an array and a Python scalar. Their operands reach the
engine with one dtype: arrays are promoted explicitly (an astype in the IR) and a scalar takes
the array's dtype, lifting it first when the scalar is of a higher kind (``int_array * 0.5``).
"""

from __future__ import annotations

from .. import dtypes as dt
from ..array import SCALAR_METAS, Array, apply, bind
from ..errors import DTypeError, EmberError, with_prefix
from ..ops import OPS
from ._generate import astype_raw, signature

_LOWER_KINDS = (dt.BOOL, dt.SIGNED, dt.UNSIGNED)
_EMPTY: dict = {}


def _unary(op):
    lifts = op.lift

    def function(x, /):
        if type(x) is not Array:
            raise DTypeError(f"{op.name}: expected an ember array, got {type(x).__name__}")
        if lifts and x._meta.dtype.kind in _LOWER_KINDS:
            x = astype_raw(x, dt.default_float)
        return apply(op, x._device, (x._handle,), (x._meta,), _EMPTY)

    function.__name__ = function.__qualname__ = op.name
    function.__doc__ = op.doc
    function.__signature__ = signature(op)  # the row's input names, as every generated function shows them
    return function


def operands(name: str, x1, x2, lifts: bool = False):
    """``(x1, x2, literal_dtype)`` with arrays cast to their common dtype (see module doc)."""
    try:
        a1, a2 = isinstance(x1, Array), isinstance(x2, Array)
        if a1 and a2:
            d1, d2 = x1._meta.dtype, x2._meta.dtype
            common = d1 if d1 is d2 else dt.promote(d1, d2)
            if lifts and common.kind in _LOWER_KINDS:
                common = dt.default_float
            return astype_raw(x1, common), astype_raw(x2, common), None
        if a1 or a2:
            array, scalar = (x1, x2) if a1 else (x2, x1)
            if not dt.is_python_scalar(scalar):
                raise DTypeError(f"expected an ember array or a Python scalar, got {type(scalar).__name__}")
            common = dt.scalar_dtype(array._meta.dtype, scalar)
            if lifts and common.kind in _LOWER_KINDS:
                common = dt.default_float
            array = astype_raw(array, common)
            return (array, scalar, common) if a1 else (scalar, array, common)
        raise DTypeError(f"at least one argument must be an ember array, got {type(x1).__name__} and {type(x2).__name__}")
    except EmberError as error:
        raise with_prefix(error, name) from None


# dtypes a Python float or int scalar joins without a cast or a range check (the fast path)
_KEEPS = {float: frozenset((dt.float32, dt.float64, dt.complex64, dt.complex128)),
          int: frozenset((dt.float32, dt.float64, dt.complex64, dt.complex128))}


def _binary(op):
    lifts = op.lift

    def function(x1, x2, /):
        # the fast paths: operands of one dtype already, on one device, gathered here for apply
        if type(x1) is Array:
            meta = x1._meta
            t2 = type(x2)
            if t2 is Array:
                if meta.dtype is x2._meta.dtype and x1._device is x2._device and not (lifts and meta.dtype.kind in _LOWER_KINDS):
                    return apply(op, x1._device, (x1._handle, x2._handle), (meta, x2._meta), _EMPTY)
            elif (t2 is float or t2 is int) and meta.dtype in _KEEPS[t2]:
                return apply(op, x1._device, (x1._handle, x2), (meta, SCALAR_METAS[meta.dtype]), _EMPTY)
        elif type(x2) is Array and (type(x1) is float or type(x1) is int) and x2._meta.dtype in _KEEPS[type(x1)]:
            meta = x2._meta
            return apply(op, x2._device, (x1, x2._handle), (SCALAR_METAS[meta.dtype], meta), _EMPTY)
        x1, x2, literal = operands(op.name, x1, x2, lifts)
        return bind(op, (x1, x2), _EMPTY, literal_dtype=literal)

    function.__name__ = function.__qualname__ = op.name
    function.__doc__ = op.doc
    function.__signature__ = signature(op)
    return function


__all__ = []
for _op in OPS.values():
    if _op.family in ("elementwise unary", "elementwise binary"):
        globals()[_op.name] = (_unary if _op.family == "elementwise unary" else _binary)(_op)
        __all__.append(_op.name)


def clip(x, /, min=None, max=None):
    """Clamp x to [min, max]; either bound may be None, a Python scalar or an array.

    The result has x's dtype and the broadcast shape of x and the bounds; integer bounds beyond
    the dtype's range are saturated.
    """
    if not isinstance(x, Array):
        raise DTypeError(f"clip: expected an ember array, got {type(x).__name__}")
    if x.dtype.kind == dt.COMPLEX:
        raise DTypeError(f"clip: input must have a real dtype, got {x.dtype}")
    result = x
    for bound, function in ((min, maximum), (max, minimum)):  # noqa: F821  (generated above)
        if bound is None:
            continue
        if isinstance(bound, Array):
            bound = astype_raw(bound, x.dtype)
        elif isinstance(bound, float) and x.dtype.kind in _LOWER_KINDS:
            raise DTypeError(f"clip: a float bound {bound} does not fit the {x.dtype} input")
        elif isinstance(bound, int) and not isinstance(bound, bool) and x.dtype.kind in (dt.SIGNED, dt.UNSIGNED):
            info = dt.iinfo(x.dtype)
            bound = info.min if bound < info.min else info.max if bound > info.max else bound
        result = function(result, bound)
    if result is x:  # a copy, so that an in-place update of the result leaves x alone
        return bind(OPS["astype"], (x,), {"dtype": x.dtype, "copy": True})
    return result


__all__.append("clip")
