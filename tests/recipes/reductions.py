"""Recipes for the reduction, scan, searching, sorting and set rows (ember/ops/reductions.py)."""

from __future__ import annotations

import numpy as np

from ember import dtypes as dt
from ember.errors import ArgumentError, DTypeError, ShapeError
from ember.ops import OPS

from . import samples

EXAMPLES = {}
BAD_EXAMPLES = {}


def reduction(name, accepted, nonempty=False):
    """Recipes for a reduction accepting the dtype category ``accepted`` (its lift, else its category);
    ``nonempty`` for a reduction without an identity (max, min)."""
    EXAMPLES[name] = samples.reduction(accepted, extra=_extra_examples(OPS[name].attrs), min_side=int(nonempty))
    BAD_EXAMPLES[name] = samples.bad_axis(accepted)


def _extra_examples(extra_attrs):
    if "correction" in extra_attrs:
        return lambda g: {"correction": g.choice([0.0, 1.0])}
    return None


reduction("sum", "numeric")
reduction("prod", "numeric")
reduction("max", "real numeric", nonempty=True)
reduction("min", "real numeric", nonempty=True)
reduction("mean", "floating")
reduction("std", "real floating")
reduction("var", "real floating")
reduction("all", "any")
reduction("any", "any")
reduction("count_nonzero", "any")


def _arg_examples(g):
    shape = g.shape(min_dims=1, min_side=1)
    axis = g.choice([None, g.integer(-len(shape), len(shape) - 1)])
    return (g.array(shape, g.dtype("real numeric")),), {"axis": axis, "keepdims": g.flag()}


_bad = samples.refusal


for _name in ("argmax", "argmin"):
    EXAMPLES[_name] = _arg_examples
    BAD_EXAMPLES[_name] = [samples.bad_axis("real numeric"), _bad([(2, 0)], {"axis": 1, "keepdims": False}, ShapeError),
                           _bad([(0, 3)], {"axis": None, "keepdims": False}, ShapeError)]


def _scan_examples(g):
    shape = g.shape(min_dims=1)
    axis = g.integer(-len(shape), len(shape) - 1) if len(shape) > 1 or g.flag() else None  # None: a 1-d input's axis
    return (g.array(shape, g.dtype("numeric"), low=-3, high=3),), {"axis": axis, "include_initial": g.flag()}


for _name in ("cumulative_sum", "cumulative_prod"):
    EXAMPLES[_name] = _scan_examples
    BAD_EXAMPLES[_name] = [samples.bad_axis("numeric"),
                           _bad([(2, 3)], {"axis": None, "dtype": None, "include_initial": False}, ArgumentError)]


def _diff_examples(g):
    shape = g.shape(min_dims=1)
    axis = g.integer(-len(shape), len(shape) - 1)
    n = g.integer(0, 2) if g.flag() else shape[axis] + g.integer(0, 2)  # from the axis' length on the result is empty
    return (g.array(shape, g.dtype("real numeric"), low=-100, high=100),), {"axis": axis, "n": n}


EXAMPLES["diff"] = _diff_examples
BAD_EXAMPLES["diff"] = [samples.bad_axis("numeric"), _bad([(3,)], {"axis": -1, "n": -1}, ArgumentError),
                        _bad([(3,)], {"axis": -1, "n": 1.5}, ArgumentError)]


def _sort_examples(g):
    shape = g.shape(min_dims=1)
    axis = g.integer(-len(shape), len(shape) - 1)
    return (g.array(shape, g.dtype("real numeric")),), {"axis": axis, "descending": g.flag(), "stable": True}


for _name in ("sort", "argsort"):
    EXAMPLES[_name] = _sort_examples
    BAD_EXAMPLES[_name] = samples.bad_axis("real numeric")


def _searchsorted_examples(g):
    dtype = g.dtype("real numeric")
    return (np.sort(g.array((g.integer(0, 6),), dtype)), g.array(g.shape(), dtype)), {"side": g.choice(["left", "right"])}


EXAMPLES["searchsorted"] = _searchsorted_examples
BAD_EXAMPLES["searchsorted"] = [_bad([(2, 2), (3,)], {"side": "left"}, ShapeError),
                                _bad([(3,), (3,)], {"side": "middle"}, ArgumentError)]


def _isin_examples(g):
    dtype = g.dtype("real")  # small values, so that elements of x1 are found in x2 and others are not
    return (g.array(g.shape(), dtype, low=0, high=5), g.array(g.shape(), dtype, low=0, high=5)), {"invert": g.flag()}


EXAMPLES["isin"] = _isin_examples
BAD_EXAMPLES["isin"] = [_bad([(2,), (3,)], {"invert": 1}, ArgumentError),
                        samples.refusal([(2,), (3,)], {"invert": False}, DTypeError, dtypes=(dt.complex128, dt.complex128))]
EXAMPLES["nonzero"] = lambda g: ((g.array(g.shape(min_dims=1), g.dtype("any")),), {})
BAD_EXAMPLES["nonzero"] = _bad([()], {}, ShapeError)
for _name in ("unique_values", "unique_counts", "unique_inverse", "unique_all"):
    EXAMPLES[_name] = lambda g: ((g.array(g.shape(), g.dtype("real numeric"), low=0, high=5),), {})
