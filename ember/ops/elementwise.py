"""Elementwise operations: rows made by two family factories, plus where, tril and triu.

Binary rows receive operands of one dtype: the namespace casts mixed dtypes and Python scalars
beforehand (explicit casts in the IR, so every backend sees the same op), and ``lift`` tells it
to cast lower kinds up first (NumPy's ``sqrt(int)`` is float64).
"""

from __future__ import annotations

from .. import dtypes as dt
from . import samples
from .table import Meta, Op, broadcast_shapes, define, require, require_ndim

SAME, BOOL, REAL = "same", "bool", "real"
_RESULT = {SAME: lambda d: d, BOOL: lambda d: dt.bool_, REAL: dt.real_of}


def unary(name, category, result=SAME, lift=None, low=None, high=None, doc=""):
    """Define ``name(x)``: accepts ``category``, returns the same shape and the ``result`` dtype."""
    to_result = _RESULT[result]

    def meta(x):
        require(x.dtype, category)
        return Meta(x.shape, to_result(x.dtype))

    accepted = lift or category
    return define(Op(
        name, ("x",), {}, meta, family="elementwise unary", doc=doc,
        examples=samples.unary(accepted, low, high),
        bad_examples=samples.wrong_kind(accepted, 1),
        lift=lift,
    ))


def binary(name, category, result=SAME, lift=None, low=None, high=None, nonzero=False, doc=""):
    """Define ``name(x1, x2)``: broadcasting, operands of one dtype from ``category``."""
    to_result = _RESULT[result]

    def meta(x1, x2):
        dtype = dt.promote(x1.dtype, x2.dtype)
        require(dtype, category)
        return Meta(broadcast_shapes(x1.shape, x2.shape), to_result(dtype))

    accepted = lift or category
    bad = [samples.mismatched_shapes(accepted)]
    if (wrong := samples.wrong_kind(accepted, 2)) is not None:
        bad.append(wrong)
    return define(Op(
        name, ("x1", "x2"), {}, meta, family="elementwise binary", doc=doc,
        examples=samples.binary(accepted, low, high, nonzero),
        bad_examples=lambda g: g.choice(bad)(g),
        lift=lift,
    ))


FLOATING = "floating"
for _name in ("acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "exp", "expm1", "log",
              "log1p", "log2", "log10", "sin", "sinh", "sqrt", "tan", "tanh", "reciprocal"):
    unary(_name, FLOATING, lift=FLOATING, doc=f"Elementwise {_name}; integer and bool inputs lift to float64.")

unary("abs", "numeric", REAL, doc="Absolute value (the modulus of a complex number).")
unary("bitwise_invert", "integral or bool", doc="Bitwise NOT (logical NOT for bool).")
for _name in ("ceil", "floor", "trunc"):
    unary(_name, "real numeric", doc=f"Elementwise {_name}; integers are returned unchanged.")
unary("conj", "numeric", doc="Complex conjugate; real inputs are returned unchanged.")
unary("real", "numeric", REAL, doc="Real component.")
unary("imag", "numeric", REAL, doc="Imaginary component (zero for real inputs).")
for _name in ("isfinite", "isinf", "isnan"):
    unary(_name, "numeric", BOOL, doc=f"Elementwise {_name} test.")
unary("logical_not", "bool", doc="Logical NOT.")
unary("negative", "numeric", doc="Numerical negative.")
unary("positive", "numeric", doc="Numerical positive (a copy).")
unary("round", "numeric", doc="Round half to even.")
unary("sign", "numeric", doc="Sign (x/|x| for complex).")
unary("signbit", "real floating", BOOL, doc="Whether the sign bit is set.")
unary("square", "numeric", doc="x * x.")

for _name in ("add", "subtract", "multiply"):
    binary(_name, "numeric", doc=f"Elementwise {_name}.")
binary("divide", FLOATING, lift=FLOATING, doc="True division; integer inputs lift to float64.")
binary("pow", "numeric", low=0, high=4, doc="x1 raised to x2.")
binary("equal", "any", BOOL, doc="x1 == x2.")
binary("not_equal", "any", BOOL, doc="x1 != x2.")
for _name in ("greater", "greater_equal", "less", "less_equal"):
    binary(_name, "real", BOOL, doc=f"Elementwise {_name} comparison.")
binary("floor_divide", "real numeric", nonzero=True, doc="Floor of x1 / x2.")
binary("remainder", "real numeric", nonzero=True, doc="x1 - floor_divide(x1, x2) * x2, with the sign of x2.")
binary("maximum", "real numeric", doc="Larger of the two (NaN propagates).")
binary("minimum", "real numeric", doc="Smaller of the two (NaN propagates).")
for _name in ("atan2", "copysign", "hypot", "nextafter", "logaddexp"):
    binary(_name, "real floating", lift="real floating", doc=f"Elementwise {_name}.")
for _name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
    binary(_name, "integral or bool", doc=f"Elementwise {_name}.")
for _name in ("bitwise_left_shift", "bitwise_right_shift"):
    binary(_name, "integral", low=0, high=7, doc=f"Elementwise {_name}; shifts must be non-negative.")
for _name in ("logical_and", "logical_or", "logical_xor"):
    binary(_name, "bool", doc=f"Elementwise {_name}.")


def _where_meta(condition, x1, x2):
    require(condition.dtype, "bool", "condition")
    return Meta(broadcast_shapes(condition.shape, x1.shape, x2.shape), dt.promote(x1.dtype, x2.dtype))


def _where_examples(g):
    dtype = g.dtype("any")
    shape = g.shape()
    return (g.array(g.broadcastable(shape), dt.bool_), g.array(shape, dtype), g.array(g.broadcastable(shape), dtype)), {}


define(Op("where", ("condition", "x1", "x2"), {}, _where_meta, family="searching",
          examples=_where_examples, doc="Elements of x1 where condition holds, else of x2."))


def _triangle_meta(x, k):
    require_ndim(x, 2)
    return Meta(x.shape, x.dtype)


def _triangle_examples(g):
    return (g.array(g.shape(min_dims=2, max_dims=4), g.dtype("any")),), {"k": g.integer(-3, 3)}


for _name in ("tril", "triu"):
    define(Op(_name, ("x",), {"k": 0}, _triangle_meta, family="creation", examples=_triangle_examples,
              doc=f"{'Lower' if _name == 'tril' else 'Upper'} triangle of the last two axes, from diagonal k."))
