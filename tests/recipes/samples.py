"""Recipes that many rows share: elementwise families, reductions, wrong dtypes, bad axes (see __init__.py)."""

from __future__ import annotations

from ember import dtypes as dt
from ember.errors import AxisError, DTypeError, ShapeError

# dtype categories whose complement is easy to draw from, for "wrong dtype kind" recipes
_OUTSIDE = {
    "bool": "numeric",
    "integral": "floating",
    "integral or bool": "floating",
    "real floating": "complex floating",
    "real numeric": "complex floating",
    "real": "complex floating",
    "floating": None,  # lifted ops accept every kind below
    "numeric": "bool",
    "any": None,
}


def unary(category, low=None, high=None):
    """One array of any shape, dtype from ``category``, values in [low, high]."""
    def recipe(g):
        dtype = g.dtype(category)
        return (g.array(g.shape(), dtype, low=low, high=high),), {}
    return recipe


def binary(category, low=None, high=None, nonzero=False):
    """Two broadcast-compatible arrays of one dtype from ``category``."""
    def recipe(g):
        dtype = g.dtype(category)
        shape = g.shape()
        other = g.broadcastable(shape)
        first, second = (shape, other) if g.flag() else (other, shape)
        return (g.array(first, dtype, low=low, high=high),
                g.array(second, dtype, low=low, high=high, nonzero=nonzero)), {}
    return recipe


def wrong_kind(category, arity):
    """Arrays whose dtype lies outside ``category`` — a DTypeError."""
    outside = _OUTSIDE.get(category)
    if outside is None:
        return None

    def recipe(g):
        dtype = g.dtype(outside)
        shape = g.shape(max_dims=2)
        return tuple(g.array(shape, dtype) for _ in range(arity)), {}, DTypeError
    return recipe


def mismatched_shapes(category):
    """Two arrays whose shapes cannot broadcast — a ShapeError."""
    def recipe(g):
        dtype = g.dtype(category)
        n = g.integer(2, 4)
        return (g.array((n,), dtype), g.array((n + 1,), dtype)), {}, ShapeError
    return recipe


def reduction(category, axis_kind="axes", extra=None, min_side=0):
    """One array and an ``axis`` (None, an int, or a tuple when ``axis_kind="axes"``), ``keepdims``."""
    def recipe(g):
        shape = g.shape(min_dims=1 if axis_kind == "axis" else 0, min_side=min_side)
        ndim = len(shape)
        if ndim == 0 or (axis_kind != "axis" and g.flag()):
            axis = None
        elif axis_kind == "axis" or g.flag():
            axis = g.integer(-ndim, ndim - 1)
        else:
            axis = tuple(sorted({g.integer(0, ndim - 1) for _ in range(g.integer(1, ndim))}))
        attrs = {"axis": axis, "keepdims": g.flag(), **(extra(g) if extra else {})}
        return (g.array(shape, g.dtype(category)),), attrs
    return recipe


def bad_axis(category):
    """An axis beyond the array's rank — an AxisError."""
    def recipe(g):
        shape = g.shape(min_dims=1, max_dims=3)
        return (g.array(shape, g.dtype(category)),), {"axis": len(shape) + g.integer(0, 2)}, AxisError
    return recipe


def refusal(shapes, attrs, error, dtypes=(), default=dt.float64):
    """A recipe for one fixed refusal: arrays of ``shapes`` (``dtypes`` for the first ones, ``default``
    for the rest; values in [0, 1], valid as indices), ``attrs`` and the error the row must raise."""
    def recipe(g):
        kinds = list(dtypes) + [default] * (len(shapes) - len(dtypes))
        return tuple(g.array(shape, dtype, low=0, high=1) for shape, dtype in zip(shapes, kinds)), attrs, error
    return recipe
