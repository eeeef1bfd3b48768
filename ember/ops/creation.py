"""Creation operations: arrays made from attributes alone (no array inputs).

``asarray`` and ``from_dlpack`` are not rows: they bring host data onto a device through the
engine's upload. The ``*_like`` functions, ``zeros``/``ones`` and ``meshgrid`` are namespace
compositions of these rows.
"""

from __future__ import annotations

import math

from .. import dtypes as dt
from ..errors import ArgumentError, DTypeError
from .table import REQUIRED, Meta, Op, as_int, as_shape, define


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
        raise ArgumentError("step must not be zero")
    if dtype is None:
        dtype = dt.default_int if all(isinstance(v, int) for v in (start, stop, step)) else dt.default_float
    return {"start": start, "stop": stop, "step": step, "dtype": dtype}


def _arange_meta(start, stop, step, dtype):
    if dtype.kind not in (dt.SIGNED, dt.UNSIGNED, dt.REAL):
        raise DTypeError(f"dtype must be a real numeric dtype, got {dtype}")
    return Meta((arange_length(start, stop, step),), dtype)


def _arange_examples(g):
    start, stop = g.integer(-10, 10), g.integer(-10, 10)
    step = g.choice([1, 2, -1, 0.5, -3])
    return (), {"start": start, "stop": stop, "step": step, "dtype": None}


define(Op("arange", (), {"start": REQUIRED, "stop": None, "step": 1, "dtype": None}, _arange_meta, _arange_canon,
          family="creation", positional=("start", "/", "stop", "step"), examples=_arange_examples,
          bad_examples=lambda g: ((), {"start": 0, "stop": 5, "step": 0, "dtype": None}, ArgumentError),
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


def _full_examples(g):
    dtype = g.dtype("any")
    fill = g.choice([True, False] if dtype.kind == dt.BOOL else [0, 1, 7])
    return (), {"shape": g.shape(), "fill_value": fill, "dtype": dtype}


define(Op("full", (), {"shape": REQUIRED, "fill_value": REQUIRED, "dtype": None},
          lambda shape, fill_value, dtype: Meta(shape, dtype), _full_canon, family="creation", examples=_full_examples,
          bad_examples=lambda g: ((), {"shape": (2,), "fill_value": 1.5, "dtype": dt.int32}, DTypeError),
          doc="An array of shape filled with fill_value."))

define(Op("empty", (), {"shape": REQUIRED, "dtype": None}, lambda shape, dtype: Meta(shape, dtype),
          lambda shape, dtype: {"shape": as_shape(shape), "dtype": dtype or dt.default_float}, family="creation",
          examples=lambda g: ((), {"shape": g.shape(), "dtype": g.dtype("any")}), determined=(),
          bad_examples=lambda g: ((), {"shape": (-1,), "dtype": None}, ValueError),
          doc="An uninitialised array of shape."))


def _eye_canon(n_rows, n_cols, k, dtype):
    n_rows = as_int(n_rows, "n_rows")
    n_cols = n_rows if n_cols is None else as_int(n_cols, "n_cols")
    if n_rows < 0 or n_cols < 0:
        raise ArgumentError(f"n_rows and n_cols must be non-negative, got {n_rows}, {n_cols}")
    return {"n_rows": n_rows, "n_cols": n_cols, "k": as_int(k, "k"), "dtype": dtype or dt.default_float}


define(Op("eye", (), {"n_rows": REQUIRED, "n_cols": None, "k": 0, "dtype": None},
          lambda n_rows, n_cols, k, dtype: Meta((n_rows, n_cols), dtype), _eye_canon, family="creation",
          positional=("n_rows", "/", "n_cols"),
          examples=lambda g: ((), {"n_rows": g.integer(0, 4), "n_cols": g.choice([None, g.integer(0, 4)]),
                                   "k": g.integer(-3, 3), "dtype": g.dtype("any")}),
          bad_examples=lambda g: ((), {"n_rows": -2, "n_cols": None, "k": 0, "dtype": None}, ArgumentError),
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
          positional=("start", "stop", "/", "num"),
          examples=lambda g: ((), {"start": g.integer(-5, 5), "stop": g.integer(-5, 5), "num": g.integer(0, 6),
                                   "dtype": g.dtype("floating"), "endpoint": g.flag()}),
          bad_examples=lambda g: ((), {"start": 0, "stop": 1, "num": -1, "dtype": None, "endpoint": True}, ArgumentError),
          doc="num evenly spaced values from start to stop."))

from .gradients import no_gradient  # noqa: E402

no_gradient("arange", "full", "empty", "eye", "linspace")  # no array inputs
