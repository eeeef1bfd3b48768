"""Recipes for the linalg extension's rows (ember/ops/linalg.py): well-conditioned, symmetric and
positive-definite matrices where a row needs them."""

from __future__ import annotations

import numpy as np

from ember import dtypes as dt
from ember.errors import ArgumentError, AxisError, DTypeError, ShapeError
from ember.ops.linalg import _MATRIX_ORDS

from . import samples


def _matrices(category="floating", square=False, low=-3, high=3):
    def recipe(g):
        n = g.integer(1, 4)
        shape = g.shape(max_dims=2) + ((n, n) if square else (n, g.integer(1, 4)))
        return (g.array(shape, g.dtype(category), low=low, high=high),), {}
    return recipe


def _not_square(g):
    return (g.array((2, 3), g.dtype("real floating")),), {}, ShapeError


def _positive_definite(g):
    n = g.integer(1, 4)
    a = g.array(g.shape(max_dims=2) + (n, n), g.dtype("real floating"), low=-2, high=2)
    return (a @ np.swapaxes(a, -1, -2) + n * np.eye(n, dtype=a.dtype),), {"upper": g.flag()}


def _well_conditioned(g):
    n = g.integer(1, 4)
    a = g.array(g.shape(max_dims=2) + (n, n), g.dtype("real floating"), low=-1, high=1)
    return (a + 4 * n * np.eye(n, dtype=a.dtype),), {}


def _symmetric(g):
    (a,), _ = _well_conditioned(g)
    return (a + np.swapaxes(a, -1, -2),), {}


def _distinct_eigenvalues(g):
    """A square matrix whose Gershgorin discs are disjoint (radius under 1.5n, centres 3n apart): n distinct eigenvalues,
    real for a real matrix, each differentiable; with a complex dtype, complex ones."""
    n = g.integer(1, 4)
    a = g.array(g.shape(max_dims=1) + (n, n), g.dtype("floating"), low=-1, high=1)
    return (a + np.diag(3.0 * n * np.arange(n)).astype(a.dtype),), {}


def _solve_examples(g):
    (a,), _ = _well_conditioned(g)
    n = a.shape[-1]
    # b a vector, a stack of matrices with a's batch, with more batch dimensions than a, or one matrix (broadcast)
    k = g.integer(1, 3)
    b = g.array(g.choice([(n,), a.shape[:-1] + (k,), (2,) + a.shape[:-1] + (k,), (n, k)]), g.dtype_of(a), low=-3, high=3)
    return (a, b), {}


def _cross_examples(g):
    dtype = g.dtype("real numeric")
    batch = g.shape(max_dims=2)
    if g.flag():  # the vectors last, the other input broadcast from fewer dimensions
        other = g.array(g.broadcastable(batch) + (3,), dtype, low=-5, high=5)
        first = g.array(batch + (3,), dtype, low=-5, high=5)
        back = 1
    else:  # the vectors along an earlier axis, the other input with some sides of 1
        back = g.integer(1, len(batch) + 1)
        shape = batch[:len(batch) + 1 - back] + (3,) + batch[len(batch) + 1 - back:]
        first = g.array(shape, dtype, low=-5, high=5)
        other = g.array(tuple(s if i == len(shape) - back or g.flag() else 1 for i, s in enumerate(shape)), dtype,
                        low=-5, high=5)
    # the vectors' axis counted from the end, or from the front of the broadcast shape
    return (first, other), {"axis": g.choice([-back, max(first.ndim, other.ndim) - back])}


def _vector_norm_examples(g):
    ord_ = g.choice([2, 1, 0, float("inf"), float("-inf"), 3])
    shape = g.shape(min_side=1 if ord_ in (float("inf"), float("-inf")) else 0)  # a max or min of nothing is undefined
    axes = None if not shape or g.flag() else (g.integer(0, len(shape) - 1),)
    return (g.array(shape, g.dtype("floating")),), {"axis": axes, "keepdims": g.flag(), "ord": ord_}


_bad = samples.refusal


EXAMPLES = {
    "cholesky": _positive_definite,
    "inv": _well_conditioned,
    "det": _matrices(square=True),
    "slogdet": _well_conditioned,
    "eig": _distinct_eigenvalues,
    "eigvals": _distinct_eigenvalues,
    "eigh": _symmetric,
    "eigvalsh": _symmetric,
    "matrix_power": lambda g: ((_well_conditioned(g)[0][0],), {"n": g.integer(-2, 3)}),
    "qr": lambda g: (_matrices()(g)[0], {"mode": g.choice(["reduced", "complete"])}),
    "svd": lambda g: (_matrices()(g)[0], {"full_matrices": g.flag()}),
    "svdvals": _matrices(),
    "pinv": lambda g: (_matrices()(g)[0], {"rtol": None}),
    "solve": _solve_examples,
    "cross": _cross_examples,
    "diagonal": lambda g: (_matrices("any")(g)[0], {"offset": g.integer(-3, 3)}),
    "trace": lambda g: (_matrices("numeric")(g)[0], {"offset": g.integer(-2, 2)}),
    "matrix_norm": lambda g: (_matrices()(g)[0], {"keepdims": g.flag(), "ord": g.choice(_MATRIX_ORDS)}),
    "vector_norm": _vector_norm_examples,
}

BRANCHES = {
    "vector_norm": [{"ord": o} for o in (2, 1, 0, float("inf"), float("-inf"), 3, -1.5)],
    "matrix_norm": [{"ord": o, "keepdims": keep} for o in _MATRIX_ORDS for keep in (False, True)],
    "matrix_power": [{"n": n} for n in (-2, -1, 0, 1, 3)],
}

BAD_EXAMPLES = {
    **{name: _not_square for name in ("cholesky", "inv", "det", "slogdet", "eig", "eigvals", "eigh",
                                                 "eigvalsh")},
    "matrix_power": [lambda g: (*_not_square(g)[:1], {"n": 2}, ShapeError),
                     _bad([(2, 2)], {"n": -1}, DTypeError, [dt.int64])],  # an integer matrix has no inverse power
    "solve": [lambda g: ((g.array((3, 3), dt.float64), g.array((4,), dt.float64)), {}, ShapeError),
              _bad([(3, 3), (4, 2)], {}, ShapeError)],
    "qr": _bad([(3, 3)], {"mode": "full"}, ArgumentError),
    "cross": [_bad([(2,), (2,)], {"axis": -1}, ShapeError), _bad([(2, 3), (2, 1)], {"axis": -1}, ShapeError),
              _bad([(2, 3), (2, 3)], {"axis": -3}, AxisError), _bad([(2, 3), (2, 3)], {"axis": 2}, AxisError),
              _bad([(2, 3), (2, 3)], {"axis": 0.5}, ArgumentError)],
    "diagonal": lambda g: ((g.array((3,), dt.float64),), {"offset": 0}, ShapeError),
    "trace": lambda g: ((g.array((3,), dt.float64),), {}, ShapeError),
    "matrix_norm": [_bad([(3,)], {}, ShapeError), _bad([(2, 2)], {"ord": 3}, ArgumentError)],
    "vector_norm": [_bad([(2, 3)], {"axis": 3}, AxisError), _bad([(2, 3)], {"ord": "fro"}, ArgumentError),
                    _bad([(2, 3)], {"ord": True}, ArgumentError),
                    _bad([(2, 0)], {"ord": float("inf"), "axis": (1,)}, ShapeError)],
}
