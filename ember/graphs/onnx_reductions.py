"""ONNX lowerings of the reductions, scans, sorts and searches (see onnx.py): integer products and
cumulative products written exactly where ONNX Runtime's operators would round or are missing."""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes as dt
from ..ops.table import Meta
from .onnx_lowering import LOWERINGS, axes_of, cast_common, lowering, mean_of, reduce, transposed


def _exact_product(b, x, meta, axes, out_shape):
    """A product of integers by halving (ONNX Runtime's ReduceProd goes through floating point and rounds
    int64 products beyond 2^53): the reduced axes moved last and flattened, then halves multiplied."""
    kept = [a for a in range(meta.ndim) if a not in axes]
    size = math.prod(meta.shape[a] for a in axes)
    if size == 0:
        return b.const(np.ones(out_shape, dt.NUMPY[meta.dtype]))
    flat = b.reshape(transposed(b, x, kept + list(axes)), tuple(meta.shape[a] for a in kept) + (size,))
    last = len(kept)
    while size > 1:
        half = size // 2
        pair = b.node("Mul", [b.node("Slice", [flat, b.ints([0]), b.ints([half]), b.ints([last])]),
                              b.node("Slice", [flat, b.ints([half]), b.ints([2 * half]), b.ints([last])])])
        if size % 2:
            pair = b.node("Concat", [pair, b.node("Slice", [flat, b.ints([2 * half]), b.ints([size]), b.ints([last])])],
                          axis=last)
        flat, size = pair, half + size % 2
    return b.reshape(flat, out_shape)


@lowering("prod")
def _prod(b, xs, ins, outs, axis, dtype, keepdims):
    x, axes = b.cast(xs[0], ins[0].dtype, dtype), axes_of(axis, ins[0].ndim)
    if dtype.kind in (dt.SIGNED, dt.UNSIGNED) and axes:
        return _exact_product(b, x, Meta(ins[0].shape, dtype), axes, outs[0].shape)
    return reduce(b, "ReduceProd", x, axes, keepdims)


for _name, _type in (("sum", "ReduceSum"),):
    LOWERINGS[_name] = (lambda op_type: lambda b, xs, ins, outs, axis, dtype, keepdims: reduce(
        b, op_type, b.cast(xs[0], ins[0].dtype, dtype), axes_of(axis, ins[0].ndim), keepdims))(_type)


for _name, _type in (("max", "ReduceMax"), ("min", "ReduceMin")):
    LOWERINGS[_name] = (lambda op_type: lambda b, xs, ins, outs, axis, keepdims: reduce(
        b, op_type, xs[0], axes_of(axis, ins[0].ndim), keepdims))(_type)


def _all_any(any_: bool):
    """Counts of true (any) or false (all) elements, so an empty axis gives the identity."""
    def lower(b, xs, ins, outs, axis, keepdims):
        truth = b.cast(xs[0], ins[0].dtype, dt.bool_)
        axes = axes_of(axis, ins[0].ndim)
        if not axes:
            return b.node("Identity", [truth])
        counted = truth if any_ else b.node("Not", [truth])
        total = reduce(b, "ReduceSum", b.cast(counted, dt.bool_, dt.int64), axes, keepdims)
        return b.node("Greater" if any_ else "Equal", [total, b.scalar(0, dt.int64)])
    return lower


LOWERINGS["all"], LOWERINGS["any"] = _all_any(False), _all_any(True)


@lowering("isin")
def _isin(b, xs, ins, outs, invert):
    """x1[..., None] == flattened x2, then whether any matched (an empty x2 matches nothing)."""
    matches = b.node("Equal", [b.node("Unsqueeze", [xs[0], b.ints([-1])]), b.reshape(xs[1], (-1,))])
    counts = reduce(b, "ReduceSum", b.cast(matches, dt.bool_, dt.int64), [ins[0].ndim], False)
    return b.node("LessOrEqual" if invert else "Greater", [counts, b.scalar(0, dt.int64)])


@lowering("count_nonzero")
def _count_nonzero(b, xs, ins, outs, axis, keepdims):
    nonzero = b.cast(b.cast(xs[0], ins[0].dtype, dt.bool_), dt.bool_, outs[0].dtype)
    return reduce(b, "ReduceSum", nonzero, axes_of(axis, ins[0].ndim), keepdims)


@lowering("mean")
def _mean_row(b, xs, ins, outs, axis, keepdims):
    return mean_of(b, xs[0], ins[0], axes_of(axis, ins[0].ndim), keepdims)


def _variance(b, x, meta, axes, correction, keepdims):
    centred = b.node("Sub", [x, mean_of(b, x, meta, axes, True)])
    return mean_of(b, b.node("Mul", [centred, centred]), meta, axes, keepdims, correction)


@lowering("var")
def _var(b, xs, ins, outs, axis, correction, keepdims):
    return _variance(b, xs[0], ins[0], axes_of(axis, ins[0].ndim), correction, keepdims)


@lowering("std")
def _std(b, xs, ins, outs, axis, correction, keepdims):
    return b.node("Sqrt", [_variance(b, xs[0], ins[0], axes_of(axis, ins[0].ndim), correction, keepdims)])


for _name, _type in (("argmax", "ArgMax"), ("argmin", "ArgMin")):
    def _arg(b, xs, ins, outs, axis, keepdims, op_type=_type):
        x = xs[0]
        if axis is None:  # of the flattened array
            x, axis = b.reshape(x, (-1,)), 0
        out = b.node(op_type, [x], axis=axis, keepdims=int(keepdims), select_last_index=0)
        return b.reshape(out, outs[0].shape) if keepdims and ins[0].ndim != 1 and xs[0] != x else out
    LOWERINGS[_name] = _arg


@lowering("cumulative_sum")
def _cumulative_sum(b, xs, ins, outs, axis, dtype, include_initial):
    out = b.node("CumSum", [b.cast(xs[0], ins[0].dtype, dtype), b.const(np.asarray(axis, np.int64))])
    if not include_initial:
        return out
    shape = list(ins[0].shape)
    shape[axis] = 1
    return b.node("Concat", [b.const(np.zeros(shape, dt.NUMPY[dtype])), out], axis=axis)


@lowering("diff")
def _diff(b, xs, ins, outs, axis, n):
    x, size = xs[0], ins[0].shape[axis]
    for _ in range(n):
        if size <= 1:
            return b.node("Slice", [x, b.ints([0]), b.ints([0]), b.ints([axis])])
        head = b.node("Slice", [x, b.ints([1]), b.ints([size]), b.ints([axis])])
        tail = b.node("Slice", [x, b.ints([0]), b.ints([size - 1]), b.ints([axis])])
        x, size = b.node("Sub", [head, tail]), size - 1
    return x if n else b.node("Identity", [x])


def _top_k(b, xs, ins, axis, descending):
    """TopK over the whole axis; ONNX's TopK breaks ties by the lower index, which is a stable sort's order."""
    if ins[0].dtype is dt.bool_:
        xs = [b.cast(xs[0], dt.bool_, dt.int32)]
    values, indices = b.node("TopK", [xs[0], b.ints([ins[0].shape[axis]])], outputs=2, axis=axis, largest=int(descending),
                             sorted=1)
    return (b.cast(values, dt.int32, dt.bool_) if ins[0].dtype is dt.bool_ else values), indices


@lowering("sort")
def _sort(b, xs, ins, outs, axis, descending, stable):
    return _top_k(b, xs, ins, axis, descending)[0]


@lowering("argsort")
def _argsort(b, xs, ins, outs, axis, descending, stable):
    return b.cast(_top_k(b, xs, ins, axis, descending)[1], dt.int64, outs[0].dtype)


@lowering("cumulative_prod")
def _cumulative_prod(b, xs, ins, outs, axis, dtype, include_initial):
    """A scan by doubling (Hillis–Steele): log2(n) steps, each a product with the array shifted by 2^k."""
    x, n = b.cast(xs[0], ins[0].dtype, dtype), ins[0].shape[axis]
    shape = list(ins[0].shape)
    step = 1
    while step < n:
        shape[axis] = step
        ones = b.const(np.ones(shape, dt.NUMPY[dtype]))
        shifted = b.node("Concat", [ones, b.node("Slice", [x, b.ints([0]), b.ints([n - step]), b.ints([axis])])], axis=axis)
        x, step = b.node("Mul", [x, shifted]), step * 2
    if not include_initial:
        return x if n > 1 else b.node("Identity", [x])
    shape[axis] = 1
    return b.node("Concat", [b.const(np.ones(shape, dt.NUMPY[dtype])), x], axis=axis)


@lowering("searchsorted")
def _searchsorted(b, xs, ins, outs, side):
    (sorted_, values), _ = cast_common(b, xs, ins)
    # the count of sorted elements before each value: exact, O(len(sorted) · len(values)) work
    expanded = b.node("Unsqueeze", [values, b.ints([-1])])
    before = b.node("Less" if side == "left" else "LessOrEqual", [sorted_, expanded])
    return reduce(b, "ReduceSum", b.cast(before, dt.bool_, outs[0].dtype), (ins[1].ndim,), False)
