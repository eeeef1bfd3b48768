"""Recipes for the main namespace's linear algebra rows (ember/ops/linear_algebra.py): matmul, tensordot
and vecdot."""

from __future__ import annotations

from ember.errors import ArgumentError, AxisError, ShapeError

from . import samples


def _matmul_examples(g):
    dtype = g.dtype("numeric")
    m, k, n = g.integer(1, 4), g.integer(0, 4), g.integer(1, 4)
    batch = g.shape(max_dims=2)
    first = g.choice([(k,), (m, k), batch + (m, k)])
    second = g.choice([(k,), (k, n), g.broadcastable(batch) + (k, n)])
    return (g.array(first, dtype, low=-5, high=5), g.array(second, dtype, low=-5, high=5)), {}


def _misaligned(g):
    dtype = g.dtype("floating")
    return (g.array((3, 4), dtype), g.array((5, 2), dtype)), {}, ShapeError


def _tensordot_examples(g):
    dtype = g.dtype("numeric")
    shared = g.shape(max_dims=2)
    count = len(shared)
    # x2's contracted axes in x1's order, or crossed (x1's last pairs with x2's first): the rule must follow the
    # pairing, not the positions
    crossed = count == 2 and g.flag()
    first = g.array(g.shape(max_dims=2) + shared, dtype, low=-5, high=5)
    second = g.array((shared[::-1] if crossed else shared) + g.shape(max_dims=2), dtype, low=-5, high=5)
    pairs = [(first.ndim - count + k, count - 1 - k if crossed else k) for k in range(count)]
    # axes as a count, as a pair of sequences (listed in either order), or as a pair of bare ints
    listed = (tuple(a for a, _ in pairs), tuple(b for _, b in pairs))
    choices = ([] if crossed else [count]) + [listed, tuple(seq[::-1] for seq in listed)] + ([pairs[0]] if count == 1 else [])
    return (first, second), {"axes": g.choice(choices)}


def _vecdot_examples(g):
    dtype = g.dtype("numeric")
    shape = g.shape(min_dims=1)
    other = g.array(g.broadcastable(shape[:-1]) + shape[-1:], dtype, low=-5, high=5)
    return (g.array(shape, dtype, low=-5, high=5), other), {"axis": -1}


_bad = samples.refusal


EXAMPLES = {
    "matmul": _matmul_examples,
    "tensordot": _tensordot_examples,
    "vecdot": _vecdot_examples,
}

BAD_EXAMPLES = {
    "matmul": [_misaligned, _bad([(3, 4), ()], {}, ShapeError), _bad([(2, 3, 4), (3, 4, 5)], {}, ShapeError)],
    "tensordot": [_bad([(2, 3), (4, 2)], {"axes": 1}, ShapeError), _bad([(2, 3), (3, 2)], {"axes": -1}, AxisError),
                  _bad([(2, 3), (3,)], {"axes": 2}, AxisError), _bad([(2, 3), (3, 2)], {"axes": 1.5}, ArgumentError),
                  _bad([(2, 3), (3, 2)], {"axes": ((0, 1), (0,))}, ArgumentError)],
    "vecdot": [_bad([(3,), (4,)], {"axis": -1}, ShapeError), _bad([(2, 3), (2, 1)], {"axis": -1}, ShapeError),
               _bad([(), ()], {"axis": -1}, ShapeError), _bad([(2, 3), (2, 3)], {"axis": 0}, AxisError),
               _bad([(2, 3), (2, 3)], {"axis": -3}, AxisError)],
}
