"""Recipes for the elementwise rows (ember/ops/elementwise.py): each family's rows by the dtype
category they accept (the row's lift, else its category) and the value range their inputs need."""

from __future__ import annotations

from ember import dtypes as dt
from ember.errors import DTypeError

from . import samples

EXAMPLES = {}
BAD_EXAMPLES = {}


def unary(name, accepted, low=None, high=None):
    """Recipes for ``name(x)`` accepting the dtype category ``accepted``."""
    EXAMPLES[name] = samples.unary(accepted, low, high)
    if (wrong := samples.wrong_kind(accepted, 1)) is not None:
        BAD_EXAMPLES[name] = wrong


def binary(name, accepted, low=None, high=None, nonzero=False):
    """Recipes for ``name(x1, x2)`` accepting the dtype category ``accepted``."""
    bad = [samples.mismatched_shapes(accepted)]
    if (wrong := samples.wrong_kind(accepted, 2)) is not None:
        bad.append(wrong)
    EXAMPLES[name] = samples.binary(accepted, low, high, nonzero)
    BAD_EXAMPLES[name] = lambda g: g.choice(bad)(g)


FLOATING = "floating"
for _name in ("acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "exp", "expm1", "log",
              "log1p", "log2", "log10", "sin", "sinh", "sqrt", "tan", "tanh", "reciprocal"):
    unary(_name, FLOATING)

unary("abs", "numeric")
unary("bitwise_invert", "integral or bool")
for _name in ("ceil", "floor", "trunc"):
    unary(_name, "real numeric")
unary("conj", "numeric")
unary("real", "numeric")
unary("imag", "numeric")
for _name in ("isfinite", "isinf", "isnan"):
    unary(_name, "numeric")
unary("logical_not", "bool")
unary("negative", "numeric")
unary("positive", "numeric")
unary("round", "numeric")
unary("sign", "numeric")
unary("signbit", "real floating")
unary("square", "numeric")

for _name in ("add", "subtract", "multiply"):
    binary(_name, "numeric")
binary("divide", FLOATING)
binary("pow", "numeric", low=0, high=4)
binary("equal", "any")
binary("not_equal", "any")
for _name in ("greater", "greater_equal", "less", "less_equal"):
    binary(_name, "real")
binary("floor_divide", "real numeric", nonzero=True)
binary("remainder", "real numeric", nonzero=True)
binary("maximum", "real numeric")
binary("minimum", "real numeric")
for _name in ("atan2", "copysign", "hypot", "nextafter", "logaddexp"):
    binary(_name, "real floating")
for _name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
    binary(_name, "integral or bool")
for _name in ("bitwise_left_shift", "bitwise_right_shift"):
    binary(_name, "integral", low=0, high=7)
for _name in ("logical_and", "logical_or", "logical_xor"):
    binary(_name, "bool")


def _where_examples(g):
    dtype = g.dtype("any")
    shape = g.shape()
    return (g.array(g.broadcastable(shape), dt.bool_), g.array(shape, dtype), g.array(g.broadcastable(shape), dtype)), {}


def _triangle_examples(g):
    return (g.array(g.shape(min_dims=2, max_dims=4), g.dtype("any")),), {"k": g.integer(-3, 3)}


EXAMPLES["where"] = _where_examples
BAD_EXAMPLES["where"] = samples.refusal([(3,), (3,), (3,)], {}, DTypeError, [dt.float64, dt.float64, dt.float64])  # condition
for _name in ("tril", "triu"):
    EXAMPLES[_name] = _triangle_examples
