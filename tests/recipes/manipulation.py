"""Recipes for the manipulation rows (ember/ops/manipulation.py)."""

from __future__ import annotations

import math

from ember import dtypes as dt
from ember.errors import ArgumentError, AxisError, ShapeError

from . import samples


def _astype_examples(g):
    return (g.array(g.shape(), g.dtype("real numeric"), low=0, high=100),), {"dtype": g.dtype("numeric"), "copy": True}


def _broadcast_to_examples(g):
    shape = g.shape()
    target = tuple(g.choice([s, 1]) for s in shape)[g.integer(0, len(shape)):] if shape else ()
    return (g.array(target, g.dtype("any")),), {"shape": shape}


def _concat_examples(g):
    shape = g.shape(min_dims=1)
    axis = g.integer(-len(shape), len(shape) - 1)
    dtype = g.dtype("any")
    arrays = []
    for _ in range(g.integer(1, 3)):
        s = list(shape)
        s[axis] = g.integer(0, 3)
        arrays.append(g.array(tuple(s), dtype))
    flat = g.flag()  # axis=None: the arrays flattened, then joined (their shapes may differ)
    return (tuple(g.array(g.shape(), dtype) for _ in arrays) if flat else tuple(arrays)), {"axis": None if flat else axis}


def _stack_examples(g):
    shape, dtype = g.shape(), g.dtype("any")
    return tuple(g.array(shape, dtype) for _ in range(g.integer(1, 3))), {"axis": g.integer(-len(shape) - 1, len(shape))}


def _expand_dims_examples(g):
    shape = g.shape(max_dims=3)
    count = g.integer(1, 3)  # an int, or a tuple of positions in the result (2025.12), negative ones among them
    positions = g.permutation(range(len(shape) + count))[:count]
    axes = tuple(p - (len(shape) + count) * g.flag() for p in positions)
    return (g.array(shape, g.dtype("any")),), {"axis": axes if count > 1 or g.flag() else g.integer(-len(shape) - 1, len(shape))}


def _axis_recipe(g, category):
    """One array and an axis that is None, an int or a tuple."""
    shape = g.shape()
    ndim = len(shape)
    several = tuple(sorted({g.integer(0, ndim - 1) for _ in range(2)})) if ndim else ()
    axis = None if not ndim or g.flag() else g.choice([g.integer(-ndim, ndim - 1), several])
    return (g.array(shape, g.dtype(category)),), {"axis": axis}


def _moveaxis_examples(g):
    shape = g.shape(min_dims=1)
    n = len(shape)
    return (g.array(shape, g.dtype("any")),), {"source": g.integer(-n, n - 1), "destination": g.integer(-n, n - 1)}


def _permute_examples(g):
    shape = g.shape()
    axes = list(range(len(shape)))
    # negative axes count from the end (2025.12)
    return (g.array(shape, g.dtype("any")),), {"axes": tuple(a - len(shape) * g.flag() for a in g.permutation(axes))}


def _repeat_examples(g):
    shape = g.shape(min_dims=1)
    axis = g.integer(0, len(shape) - 1)
    repeats = g.choice([g.integer(0, 3), (g.integer(0, 3),), tuple(g.integer(0, 3) for _ in range(shape[axis]))])
    return (g.array(shape, g.dtype("any")),), {"repeats": repeats, "axis": axis}


def _reshape_examples(g):
    shape = g.shape()
    size = math.prod(shape)
    # an int, or a tuple with or without one -1 beside other sizes
    beside = shape[:1] + (-1,) if shape and shape[0] else (-1,)  # -1 beside a zero is ambiguous (refused)
    target = g.choice([(size,), size, (-1,), tuple(reversed(shape)), shape + (1,), beside])
    return (g.array(shape, g.dtype("any")),), {"shape": target, "copy": None}


def _roll_examples(g):
    (x,), attrs = _axis_recipe(g, "any")
    axis = attrs["axis"]
    shift = g.integer(-5, 5) if not isinstance(axis, tuple) else tuple(g.integer(-5, 5) for _ in axis)
    return (x,), {"shift": shift, "axis": axis}


def _squeeze_examples(g):
    shape = g.shape(min_dims=1)
    i = g.integer(0, len(shape) - 1)
    shape = shape[:i] + (1,) + shape[i + 1:]
    return (g.array(shape, g.dtype("any")),), {"axis": g.choice([i, i - len(shape), (i,)])}


def _unstack_examples(g):
    shape = g.shape(min_dims=1)
    return (g.array(shape, g.dtype("any")),), {"axis": g.integer(-len(shape), len(shape) - 1)}


EXAMPLES = {
    "astype": _astype_examples,
    "broadcast_to": _broadcast_to_examples,
    "concat": _concat_examples,
    "stack": _stack_examples,
    "expand_dims": _expand_dims_examples,
    "flip": lambda g: _axis_recipe(g, "any"),
    "moveaxis": _moveaxis_examples,
    "permute_dims": _permute_examples,
    "repeat": _repeat_examples,
    "reshape": _reshape_examples,
    "roll": _roll_examples,
    "squeeze": _squeeze_examples,
    "tile": lambda g: ((g.array(g.shape(max_dims=3), g.dtype("any")),),
                       {"repetitions": tuple(g.integer(0, 3) for _ in range(g.integer(0, 4)))}),
    "unstack": _unstack_examples,
}

def _bad(shapes, attrs, error):
    return samples.refusal(shapes, attrs, error, default=dt.int64)


# a cast between complex dtypes keeps the cotangent's imaginary part; to a real dtype it drops it
BRANCHES = {"astype": [{"dtype": dt.float64}, {"dtype": dt.complex128}]}

BAD_EXAMPLES = {
    "astype": _bad([(2,)], {"dtype": "float32", "copy": True}, ArgumentError),
    "broadcast_to": [_bad([(3,)], {"shape": (2,)}, ShapeError), _bad([(1, 3)], {"shape": (3,)}, ShapeError),
                     _bad([(3,)], {"shape": (1,)}, ShapeError)],  # a shape that would shrink x
    "concat": [_bad([(2, 3), (2, 4)], {"axis": 0}, ShapeError), _bad([(2, 3), (2,)], {"axis": 1}, ShapeError),
               _bad([(), ()], {"axis": 0}, ShapeError), _bad([(2, 3), (2, 3)], {"axis": 2}, AxisError)],
    "stack": [_bad([(2,), (3,)], {"axis": 0}, ShapeError), _bad([(2,), (2,)], {"axis": 2}, AxisError)],
    "expand_dims": [_bad([(2,)], {"axis": 3}, AxisError), _bad([(2,)], {"axis": (0, -3)}, AxisError),
                    _bad([(2,)], {"axis": (0, 3)}, AxisError)],
    "flip": samples.bad_axis("any"),
    "moveaxis": [_bad([(2, 3)], {"source": 2, "destination": 0}, AxisError),
                 _bad([(2, 3)], {"source": 0, "destination": -3}, AxisError),
                 _bad([(2, 3)], {"source": (0, 1), "destination": 0}, ArgumentError),
                 _bad([(2, 3)], {"source": (0, 0), "destination": (0, 1)}, AxisError),
                 _bad([(2, 3)], {"source": (0, 1), "destination": (1, 1)}, AxisError)],
    "permute_dims": [_bad([(2, 3)], {"axes": (0, 0)}, AxisError), _bad([(2, 3)], {"axes": (0,)}, AxisError),
                     _bad([(2, 3)], {"axes": (0, -2)}, AxisError), _bad([(2, 3)], {"axes": (-3, 0)}, AxisError)],
    "repeat": [_bad([(2, 3)], {"repeats": -1, "axis": 0}, ArgumentError),
               _bad([(2, 3)], {"repeats": 1.5, "axis": 0}, ArgumentError),
               _bad([(2, 3)], {"repeats": (1, -1), "axis": 0}, ArgumentError),
               _bad([(2, 3)], {"repeats": (1, 1.5), "axis": 0}, ArgumentError),
               _bad([(2, 3)], {"repeats": (1, 2), "axis": 1}, ShapeError)],
    "reshape": [_bad([(2, 3)], {"shape": (4,), "copy": None}, ShapeError),
                _bad([(2, 3)], {"shape": (-1, -1), "copy": None}, ShapeError),
                _bad([(2, 3)], {"shape": (-2, -1), "copy": None}, ShapeError),  # (-2, -3) would have the size
                _bad([(2, 3)], {"shape": (3, 1.5), "copy": None}, ArgumentError),
                _bad([(2, 3)], {"shape": (4, -1), "copy": None}, ShapeError),
                _bad([(2, 3)], {"shape": (0, -1), "copy": None}, ShapeError),
                _bad([(2, 3)], {"shape": (-2, 3), "copy": None}, ShapeError)],
    "roll": [_bad([(2, 3)], {"shift": 1, "axis": 2}, AxisError), _bad([(2, 3)], {"shift": (1, 2), "axis": 0}, ArgumentError),
             _bad([(2, 3)], {"shift": 1.5, "axis": 0}, ArgumentError),
             _bad([(2, 3)], {"shift": (1, 1.5), "axis": (0, 1)}, ArgumentError)],
    "squeeze": [_bad([(2, 3)], {"axis": 0}, ShapeError), _bad([(1, 3)], {"axis": 2}, AxisError)],
    "tile": _bad([(2,)], {"repetitions": (-1,)}, ArgumentError),
    "unstack": [samples.bad_axis("any"), _bad([()], {"axis": 0}, ShapeError)],
}
