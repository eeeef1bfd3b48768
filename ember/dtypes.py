"""Layer 1 — the dtype set of the Array API standard, its promotion lattice and scalar rules.

Dtypes are small singleton value objects shared by every device; backends map them to their
native dtypes. Promotion follows the standard's table within a kind; across kinds (which the
standard leaves unspecified) ember follows what NumPy and PyTorch users expect: the higher kind
wins (``int32 + float32 -> float32``), except ``uint64`` with a signed integer, which is refused.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass

import numpy as np

from .errors import DTypeError, ScalarOverflowError

# Kinds, ordered: a value of a lower kind converts to a higher one without surprise.
BOOL, SIGNED, UNSIGNED, REAL, COMPLEX = "bool", "signed integer", "unsigned integer", "real floating", "complex floating"
_KIND_RANK = {BOOL: 0, SIGNED: 1, UNSIGNED: 1, REAL: 2, COMPLEX: 3}


class DType:
    """An Array API dtype: ``ember.float32`` and friends. Compare with ``==``."""

    __slots__ = ("name", "kind", "bits", "itemsize")

    def __init__(self, name: str, kind: str, bits: int):
        self.name, self.kind, self.bits = name, kind, bits
        self.itemsize = max(bits // 8, 1)  # bytes per element

    def __repr__(self) -> str:
        return f"ember.{self.name}"

    def __str__(self) -> str:
        return self.name

    def __reduce__(self):  # copy/deepcopy keep the singleton
        return (from_name, (self.name,))


bool_ = DType("bool", BOOL, 8)
int8, int16, int32, int64 = (DType(f"int{b}", SIGNED, b) for b in (8, 16, 32, 64))
uint8, uint16, uint32, uint64 = (DType(f"uint{b}", UNSIGNED, b) for b in (8, 16, 32, 64))
float32, float64 = DType("float32", REAL, 32), DType("float64", REAL, 64)
complex64, complex128 = DType("complex64", COMPLEX, 64), DType("complex128", COMPLEX, 128)

ALL = (bool_, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float32, float64, complex64, complex128)
BY_NAME = {d.name: d for d in ALL}
# each dtype's NumPy dtype and back: host buffers, the wire and graph files all read this one map
NUMPY = {d: np.dtype(d.name) for d in ALL}
FROM_NUMPY = {v: k for k, v in NUMPY.items()}

default_int, default_uint, default_float, default_complex = int64, uint64, float64, complex128
default_index = int64
DEFAULT_FOR_KIND = {BOOL: bool_, SIGNED: default_int, UNSIGNED: default_int, REAL: default_float, COMPLEX: default_complex}


def from_name(name: str) -> DType:
    """The dtype called ``name`` ("float32" …); raises :class:`DTypeError` for an unknown name."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise DTypeError(f"unknown dtype {name!r}; expected one of {', '.join(BY_NAME)}") from None


# --- categories (isdtype and the op table's input checks) ---------------------------------

_CATEGORIES = {
    "bool": {BOOL},
    "signed integer": {SIGNED},
    "unsigned integer": {UNSIGNED},
    "integral": {SIGNED, UNSIGNED},
    "real floating": {REAL},
    "complex floating": {COMPLEX},
    "numeric": {SIGNED, UNSIGNED, REAL, COMPLEX},
    # categories the op table uses beyond the standard's names
    "floating": {REAL, COMPLEX},
    "real numeric": {SIGNED, UNSIGNED, REAL},
    "integral or bool": {BOOL, SIGNED, UNSIGNED},
    "real": {BOOL, SIGNED, UNSIGNED, REAL},
    "any": {BOOL, SIGNED, UNSIGNED, REAL, COMPLEX},
}


_STANDARD_KINDS = ("bool", "signed integer", "unsigned integer", "integral", "real floating", "complex floating", "numeric")


def in_category(dtype: DType, category: str) -> bool:
    """Whether ``dtype`` belongs to a named category ("numeric", "real floating", …)."""
    return dtype.kind in _CATEGORIES[category]


def isdtype(dtype: DType, kind) -> bool:
    """Array API ``isdtype``: ``kind`` is a dtype, a category name, or a tuple of either."""
    if not isinstance(dtype, DType):
        raise DTypeError(f"isdtype: expected an ember dtype, got {dtype!r}")
    if isinstance(kind, tuple):
        return any(isdtype(dtype, k) for k in kind)
    if isinstance(kind, DType):
        return dtype is kind
    if isinstance(kind, str) and kind in _STANDARD_KINDS:
        return dtype.kind in _CATEGORIES[kind]
    raise DTypeError(f"isdtype: unknown kind {kind!r}")


# --- promotion ------------------------------------------------------------------------------

def _promote_pair(a: DType, b: DType) -> DType:
    if a is b:
        return a
    ka, kb = a.kind, b.kind
    if ka == kb:
        return a if a.bits >= b.bits else b
    if {ka, kb} == {SIGNED, UNSIGNED}:
        signed, unsigned = (a, b) if ka == SIGNED else (b, a)
        if signed.bits > unsigned.bits:
            return signed
        if unsigned.bits == 64:
            raise DTypeError(f"{a} and {b} have no common dtype (no signed integer holds every uint64)")
        return BY_NAME[f"int{unsigned.bits * 2}"]
    if {ka, kb} == {REAL, COMPLEX}:
        real, cplx = (a, b) if ka == REAL else (b, a)
        return complex128 if real.bits == 64 or cplx.bits == 128 else complex64
    # across kinds: the higher kind wins (NumPy/PyTorch users' expectation, unspecified by the standard)
    return a if _KIND_RANK[ka] > _KIND_RANK[kb] else b


_PROMOTION = {(a, b): None for a in ALL for b in ALL}
for _a, _b in _PROMOTION:
    try:
        _PROMOTION[_a, _b] = _promote_pair(_a, _b)
    except DTypeError:
        pass


def promote(a: DType, b: DType) -> DType:
    """The dtype two arrays of dtypes ``a`` and ``b`` promote to; :class:`DTypeError` if none."""
    result = _PROMOTION[a, b]
    if result is None:
        raise DTypeError(f"{a} and {b} have no common dtype (no signed integer holds every uint64)")
    return result


def scalar_dtype(array_dtype: DType, value) -> DType:
    """The dtype an array of ``array_dtype`` must have to meet the Python scalar ``value``.

    A scalar never widens an array of its own kind or a higher one (``float32 * 2.0`` stays
    float32); a scalar of a higher kind lifts the array to that kind's default dtype, as
    NumPy does (``int_array * 0.5`` is float64). Integers must fit the integer dtype they meet.
    """
    kind = _scalar_kind(value)
    if _KIND_RANK[kind] <= _KIND_RANK[array_dtype.kind]:
        if kind == SIGNED and array_dtype.kind in (SIGNED, UNSIGNED):
            info = iinfo(array_dtype)
            if not info.min <= value <= info.max:
                raise ScalarOverflowError(f"Python integer {value} out of bounds for {array_dtype}")
        return array_dtype
    if kind == COMPLEX and array_dtype.kind == REAL:
        return complex64 if array_dtype is float32 else complex128
    return DEFAULT_FOR_KIND[kind]


def _scalar_kind(value) -> str:
    t = type(value)
    if t is builtins.bool:
        return BOOL
    if t is int:
        return SIGNED
    if t is float:
        return REAL
    if t is complex:
        return COMPLEX
    # subclasses (numpy scalars) — ordered by specificity
    if isinstance(value, builtins.bool):
        return BOOL
    if isinstance(value, int):
        return SIGNED
    if isinstance(value, float):
        return REAL
    if isinstance(value, complex):
        return COMPLEX
    raise DTypeError(f"expected an array or a Python scalar, got {type(value).__name__}")


PYTHON_SCALARS = (builtins.bool, int, float, complex)


def is_python_scalar(value) -> bool:
    """Whether ``value`` is a Python bool, int, float or complex."""
    return isinstance(value, PYTHON_SCALARS)


def python_scalar_dtype(value) -> DType:
    """The default dtype for a lone Python scalar (``True`` → bool, ``1`` → int64 …)."""
    return DEFAULT_FOR_KIND[_scalar_kind(value)]


def can_cast(from_: DType, to: DType) -> bool:
    """Whether ``from_`` promotes to ``to`` under the standard's promotion table."""
    if from_ is to:
        return True
    related = from_.kind == to.kind or {from_.kind, to.kind} in ({SIGNED, UNSIGNED}, {REAL, COMPLEX})
    return related and _PROMOTION[from_, to] is to


def real_of(dtype: DType) -> DType:
    """The real dtype of a complex one (complex64 → float32); other dtypes map to themselves."""
    return {complex64: float32, complex128: float64}.get(dtype, dtype)


def complex_of(dtype: DType) -> DType:
    """The complex dtype with ``dtype``'s precision (float32 → complex64)."""
    return {float32: complex64, float64: complex128}.get(dtype, dtype)


def accumulation_dtype(dtype: DType) -> DType:
    """The default dtype of ``sum``/``prod``/``cumulative_*``: small integers widen to 64 bits."""
    if dtype.kind == BOOL or dtype.kind == SIGNED:
        return default_int
    if dtype.kind == UNSIGNED:
        return default_uint
    return dtype


# --- finfo / iinfo ---------------------------------------------------------------------------

@dataclass(frozen=True)
class finfo_object:
    """Machine limits of a floating dtype (``ember.finfo``)."""
    bits: int
    eps: float
    max: float
    min: float
    smallest_normal: float
    dtype: DType


@dataclass(frozen=True)
class iinfo_object:
    """Machine limits of an integer dtype (``ember.iinfo``)."""
    bits: int
    max: int
    min: int
    dtype: DType


_FINFO = {
    float32: (32, 1.1920928955078125e-07, 3.4028234663852886e38, 1.1754943508222875e-38),
    float64: (64, 2.220446049250313e-16, 1.7976931348623157e308, 2.2250738585072014e-308),
}


def finfo(type, /) -> finfo_object:  # the standard names the parameter type
    """Limits of a floating dtype; complex dtypes report their real component's limits."""
    dtype = type if isinstance(type, DType) else getattr(type, "dtype", None)
    if not isinstance(dtype, DType) or dtype.kind not in (REAL, COMPLEX):
        raise DTypeError(f"finfo: expected a floating dtype or array, got {type!r}")
    bits, eps, mx, smallest = _FINFO[real_of(dtype)]
    return finfo_object(bits, eps, mx, -mx, smallest, real_of(dtype))


def iinfo(type, /) -> iinfo_object:
    """Limits of an integer dtype."""
    dtype = type if isinstance(type, DType) else getattr(type, "dtype", None)
    if not isinstance(dtype, DType) or dtype.kind not in (SIGNED, UNSIGNED):
        raise DTypeError(f"iinfo: expected an integer dtype or array, got {type!r}")
    if dtype.kind == SIGNED:
        return iinfo_object(dtype.bits, 2 ** (dtype.bits - 1) - 1, -(2 ** (dtype.bits - 1)), dtype)
    return iinfo_object(dtype.bits, 2**dtype.bits - 1, 0, dtype)
