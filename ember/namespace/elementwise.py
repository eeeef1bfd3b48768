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


# the dtypes a Python float or int scalar joins without a cast or a range check (the fast path), each
# with the meta of such a literal
_KEEPS = {kind: {d: SCALAR_METAS[d] for d in (dt.float32, dt.float64, dt.complex64, dt.complex128)}
          for kind in (float, int)}
_NO_LITERAL: dict = {}  # any other type of operand


def _binary(op, operator: bool = False):
    """The namespace function of a binary row; with ``operator``, the Python operator itself
    (``Array.__mul__``), which answers NotImplemented for an operand it does not take."""
    lifts = op.lift

    def function(x1, x2, /):
        # the fast paths: operands of one dtype already, on one device, gathered here for apply
        if type(x1) is Array:
            meta = x1._meta
            t2 = type(x2)
            if t2 is Array:
                if meta.dtype is x2._meta.dtype and x1._device is x2._device and not (lifts and meta.dtype.kind in _LOWER_KINDS):
                    return apply(op, x1._device, (x1._handle, x2._handle), (meta, x2._meta), _EMPTY)
            else:
                dtype = meta.dtype
                literal_meta = _KEEPS.get(t2, _NO_LITERAL).get(dtype)
                if literal_meta is not None:
                    device = x1._device
                    return apply(op, device, (x1._handle, device.literal(x2, dtype)), (meta, literal_meta), _EMPTY)
                if operator and not is_operand(x2):
                    return NotImplemented
        elif type(x2) is Array:
            meta = x2._meta
            literal_meta = _KEEPS.get(type(x1), _NO_LITERAL).get(meta.dtype)
            if literal_meta is not None:
                device = x2._device
                return apply(op, device, (device.literal(x1, meta.dtype), x2._handle), (literal_meta, meta), _EMPTY)
        x1, x2, literal = operands(op.name, x1, x2, lifts)
        return bind(op, (x1, x2), _EMPTY, literal_dtype=literal)

    function.__name__ = function.__qualname__ = op.name
    function.__doc__ = op.doc
    function.__signature__ = signature(op)
    return function


_OPERANDS = (Array, *dt.PYTHON_SCALARS)


def is_operand(value) -> bool:
    """Whether a binary operator takes ``value`` beside an array (else NotImplemented: Python asks the other side)."""
    return isinstance(value, _OPERANDS)


__all__ = []
OPERATORS = {}  # binary row name -> its Python operator (namespace/methods.py installs them)
for _op in OPS.values():
    if _op.family in ("elementwise unary", "elementwise binary"):
        globals()[_op.name] = (_unary if _op.family == "elementwise unary" else _binary)(_op)
        __all__.append(_op.name)
        if _op.family == "elementwise binary":
            OPERATORS[_op.name] = _binary(_op, operator=True)


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
