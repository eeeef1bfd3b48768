"""Recipes for the indexing rows (ember/ops/indexing.py)."""

from __future__ import annotations

from ember import dtypes as dt
from ember.errors import ArgumentError, DTypeError, IndexingError, ShapeError
from ember.ops.indexing import ELLIPSIS

from . import samples


def _getitem_examples(g):
    shape = g.shape(min_dims=1, min_side=1)
    k = g.integer(1, len(shape))
    leading_ellipsis = g.flag()  # "..., items" index the last k axes; "items, ..." the first k
    key = []
    for size in (shape[-k:] if leading_ellipsis else shape[:k]):
        a_slice = ("s", g.choice([None, 0, 1]), g.choice([None, size, -1]), g.choice([None, 1, 2, -1]))
        key.append(g.choice([g.integer(-size, size - 1), a_slice]))
    for _ in range(g.integer(0, 2)):
        key.insert(g.integer(0, len(key)), None)
    if leading_ellipsis:
        key.insert(0, ELLIPSIS)
    elif g.flag():
        key.append(ELLIPSIS)
    return (g.array(shape, g.dtype("any")),), {"key": tuple(key)}


def _take_examples(g):
    shape = g.shape(min_dims=1, min_side=1)
    axis = g.integer(-len(shape), len(shape) - 1)
    n = shape[axis]
    if len(shape) == 1 and g.flag():
        axis = None  # a 1-d x needs no axis
    return (g.array(shape, g.dtype("any")), g.array((g.integer(0, 4),), dt.int64, low=-n, high=n - 1)), {"axis": axis}


def _take_along_examples(g):
    shape = g.shape(min_dims=1, min_side=1)
    axis = g.integer(-len(shape), len(shape) - 1)
    n = shape[axis]
    # beside the axis, x and indices match, or either has a side of 1 that broadcasts against the other's
    sides = [None if i == axis % len(shape) else g.choice([(s, s), (s, 1), (1, s)]) for i, s in enumerate(shape)]
    xshape = tuple(s if side is None else side[0] for s, side in zip(shape, sides))
    ishape = tuple(g.integer(0, 3) if side is None else side[1] for side in sides)
    return (g.array(xshape, g.dtype("any")), g.array(ishape, dt.int64, low=-n, high=n - 1)), {"axis": axis}


def _scatter_add_examples(g):
    n, k = g.integer(1, 6), g.integer(0, 8)
    dtype = g.dtype("numeric")
    return (g.array((n,), dtype), g.array((k,), dt.int64, low=0, high=n - 1), g.array((k,), dtype)), {}


EXAMPLES = {
    "getitem": _getitem_examples,
    # no "setitem": drawn by the indexing tests, which compare against NumPy's x[key] = value
    "take": _take_examples,
    "take_along_axis": _take_along_examples,
    "scatter_add": _scatter_add_examples,
}

_bad = samples.refusal


BAD_EXAMPLES = {
    "getitem": [_bad([(2, 3)], {"key": (5,)}, IndexingError), _bad([(2, 3)], {"key": (0, -4)}, IndexingError),
                _bad([(2, 3)], {"key": (ELLIPSIS, 0, ELLIPSIS)}, IndexingError),
                _bad([(2, 3)], {"key": (0, 0, 0)}, IndexingError),
                _bad([(2, 3)], {"key": (("s", None, None, 0),)}, IndexingError),
                _bad([(2, 3), (3,)], {"key": (("a", 0),)}, IndexingError, [dt.float64, dt.bool_]),
                _bad([(2, 3), (2,)], {"key": (("a", 0),)}, IndexingError, [dt.float64, dt.float32]),
                _bad([(2, 3), (2,), (3,)], {"key": (("a", 0), ("a", 1))}, IndexingError,
                     [dt.float64, dt.int64, dt.int64])],
    "setitem": lambda g: ((g.array((2, 3), dt.float64), g.array((4,), dt.float64)), {"key": (0,)}, ShapeError),
    "take": [_bad([(2, 3), (2,)], {"axis": 2}, IndexError, [dt.float32, dt.int64]),
             _bad([(2, 3), (2, 1)], {"axis": 0}, ShapeError, [dt.float32, dt.int64]),
             _bad([(2, 3), (2,)], {"axis": None}, ArgumentError, [dt.float32, dt.int64]),
             _bad([(2, 3), (2,)], {"axis": 0}, DTypeError, [dt.float32, dt.float32])],
    "take_along_axis": [_bad([(2, 3), (2,)], {"axis": -1}, ShapeError, [dt.float32, dt.int64]),
                        _bad([(2, 3), (3, 1)], {"axis": -1}, ShapeError, [dt.float32, dt.int64]),
                        _bad([(2, 3), (2, 1)], {"axis": 2}, IndexError, [dt.float32, dt.int64]),
                        _bad([(2, 3), (2, 1)], {"axis": -1}, DTypeError, [dt.float32, dt.float32])],
    "scatter_add": [_bad([(3,), (2,), (3,)], {}, ShapeError, [dt.float64, dt.int64]),
                    _bad([(3, 1), (2,), (2,)], {}, ShapeError, [dt.float64, dt.int64]),
                    _bad([(3,), (2,), (2,)], {}, DTypeError, [dt.float64, dt.float64]),
                    _bad([(3,), (2,), (2,)], {}, DTypeError, [dt.float64, dt.int64, dt.float32])],
}
