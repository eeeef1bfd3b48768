"""Creation operations: arrays made from attributes alone (no array inputs).

``asarray`` and ``from_dlpack`` are not rows: they bring host data onto a device through the
engine's upload. The ``*_like`` functions, ``zeros``/``ones`` and ``meshgrid`` are namespace
compositions of these rows. None has array inputs, so none carries a gradient.
"""

from __future__ import annotations

import math

from .. import dtypes as dt
from ..errors import ArgumentError, DTypeError
from .table import NO_GRADIENT, REQUIRED, Meta, Op, as_int, as_shape, define


def arange_length(start, stop, step) -> int:
    """Number of elements of ``arange(start, stop, step)`` (NumPy's formula)."""
    return max(math.ceil((stop - start) / step), 0)


def _arange_canon(start, stop, step, dtype):
    if stop is None:
        start, stop = 0, start
    for name, value in (("start", start), ("stop", stop), ("step", step)):
        if not dt.is_python_scalar(value) or isinstance(value, complex):
            raise ArgumentError(f"{name} must be a real Python number, got {value!r}")
    if step == 0:
        raise ArgumentError(f"step must not be zero, got {step!r}")
    if dtype is None:
        dtype = dt.default_int if all(isinstance(v, int) for v in (start, stop, step)) else dt.default_float
    return {"start": start, "stop": stop, "step": step, "dtype": dtype}


def _arange_meta(start, stop, step, dtype):
    if dtype.kind not in (dt.SIGNED, dt.UNSIGNED, dt.REAL):
        raise DTypeError(f"dtype must be a real numeric dtype, got {dtype}")
    if dtype.kind != dt.REAL and any(v != int(v) for v in (start, stop, step)):  # NumPy and torch round differently
        raise DTypeError(f"start {start!r}, stop {stop!r} and step {step!r} must be whole numbers for dtype {dtype}")
    length = arange_length(start, stop, step)
    if length and dtype.kind != dt.REAL:
        info = dt.iinfo(dtype)
        first, last = start, start + (length - 1) * step
        if not (info.min <= min(first, last) and max(first, last) <= info.max):
            raise DTypeError(f"values from {first} to {last} do not fit dtype {dtype}")
    return Meta((length,), dtype)


define(Op("arange", (), {"start": REQUIRED, "stop": None, "step": 1, "dtype": None}, _arange_meta, _arange_canon,
          family="creation", positional=("start", "/", "stop", "step"), grad=NO_GRADIENT,
          doc="Evenly spaced values in [start, stop)."))


def _check_fill(fill_value, dtype: dt.DType):
    if not dt.is_python_scalar(fill_value):
        raise ArgumentError(f"fill_value must be a Python scalar, got {fill_value!r}")
    target = dt.scalar_dtype(dtype, fill_value)  # raises for ints out of range
    if target is not dtype:
        raise DTypeError(f"fill_value {fill_value!r} does not fit dtype {dtype}")


def _full_canon(shape, fill_value, dtype):
    dtype = dtype or dt.python_scalar_dtype(fill_value)
    _check_fill(fill_value, dtype)
    return {"shape": as_shape(shape), "dtype": dtype}


define(Op("full", (), {"shape": REQUIRED, "fill_value": REQUIRED, "dtype": None},
          lambda shape, fill_value, dtype: Meta(shape, dtype), _full_canon, family="creation", grad=NO_GRADIENT,
          doc="An array of shape filled with fill_value."))

define(Op("empty", (), {"shape": REQUIRED, "dtype": None}, lambda shape, dtype: Meta(shape, dtype),
          lambda shape, dtype: {"shape": as_shape(shape), "dtype": dtype or dt.default_float}, family="creation",
          determined=(), grad=NO_GRADIENT,
          doc="An uninitialised array of shape."))


def _eye_canon(n_rows, n_cols, k, dtype):
    n_rows = as_int(n_rows, "n_rows")
    n_cols = n_rows if n_cols is None else as_int(n_cols, "n_cols")
    if n_rows < 0 or n_cols < 0:
        raise ArgumentError(f"n_rows and n_cols must be non-negative, got {n_rows}, {n_cols}")
    return {"n_rows": n_rows, "n_cols": n_cols, "k": as_int(k, "k"), "dtype": dtype or dt.default_float}


define(Op("eye", (), {"n_rows": REQUIRED, "n_cols": None, "k": 0, "dtype": None},
          lambda n_rows, n_cols, k, dtype: Meta((n_rows, n_cols), dtype), _eye_canon, family="creation",
          positional=("n_rows", "/", "n_cols"), grad=NO_GRADIENT,
          doc="Ones on the k-th diagonal, zeros elsewhere."))


def _linspace_canon(start, stop, num, dtype, endpoint):
    num = as_int(num, "num")
    if num < 0:
        raise ArgumentError(f"num must be non-negative, got {num}")
    for name, value in (("start", start), ("stop", stop)):
        if not dt.is_python_scalar(value):
            raise ArgumentError(f"{name} must be a Python number, got {value!r}")
    if dtype is None:
        dtype = dt.default_complex if isinstance(start, complex) or isinstance(stop, complex) else dt.default_float
    if dtype.kind not in (dt.REAL, dt.COMPLEX):
        raise DTypeError(f"dtype must be floating, got {dtype}")
    return {"num": num, "dtype": dtype}


define(Op("linspace", (), {"start": REQUIRED, "stop": REQUIRED, "num": REQUIRED, "dtype": None, "endpoint": True},
          lambda start, stop, num, dtype, endpoint: Meta((num,), dtype), _linspace_canon, family="creation",
          positional=("start", "stop", "/", "num"), grad=NO_GRADIENT,
          doc="num evenly spaced values from start to stop."))
