"""ONNX lowerings of the linear algebra, manipulation and indexing rows (see onnx.py); rows that only move
elements are one Gather at positions ember computes."""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes as dt
from ..ops import OPS
from ..ops.indexing import ELLIPSIS
from ..ops.table import Meta
from .onnx_lowering import LOWERINGS, NotExportable, axes_of, cast_common, host_arrays, lowering, reduce, transposed

# --- linear algebra ----------------------------------------------------------------------------

@lowering("matmul")
def _matmul(b, xs, ins, outs):
    return b.node("MatMul", cast_common(b, xs, ins)[0])


@lowering("tensordot")
def _tensordot(b, xs, ins, outs, axes):
    """Both operands permuted and flattened to matrices, one MatMul, the free axes restored."""
    (x1, x2), _ = cast_common(b, xs, ins, outs[0].dtype)
    first, second = axes
    free1 = [a for a in range(ins[0].ndim) if a not in first]
    free2 = [a for a in range(ins[1].ndim) if a not in second]
    inner = math.prod(ins[0].shape[a] for a in first)
    left = b.reshape(transposed(b, x1, free1 + list(first)), (math.prod(ins[0].shape[a] for a in free1), inner))
    right = b.reshape(transposed(b, x2, list(second) + free2), (inner, math.prod(ins[1].shape[a] for a in free2)))
    return b.reshape(b.node("MatMul", [left, right]), outs[0].shape)


@lowering("vecdot")
def _vecdot(b, xs, ins, outs, axis):
    product = b.node("Mul", cast_common(b, xs, ins)[0])
    ndim = max(ins[0].ndim, ins[1].ndim)
    return reduce(b, "ReduceSum", product, (axis % ndim,), False)


@lowering("trace")
def _trace(b, xs, ins, outs, offset, dtype):
    diagonal = _rearrangement(b, xs, ins, outs, "diagonal", {"offset": offset})
    return reduce(b, "ReduceSum", b.cast(diagonal, ins[0].dtype, dtype), (ins[0].ndim - 2,), False)


@lowering("cross")
def _cross(b, xs, ins, outs, axis):
    (x1, x2), _ = cast_common(b, xs, ins, outs[0].dtype)
    a1, a2 = (b.node("Gather", [x1, b.ints(order)], axis=axis % ins[0].ndim) for order in ((1, 2, 0), (2, 0, 1)))
    b1, b2 = (b.node("Gather", [x2, b.ints(order)], axis=axis % ins[1].ndim) for order in ((1, 2, 0), (2, 0, 1)))
    return b.node("Sub", [b.node("Mul", [a1, b2]), b.node("Mul", [a2, b1])])


@lowering("matrix_norm")
def _matrix_norm(b, xs, ins, outs, keepdims, ord):
    last = (ins[0].ndim - 2, ins[0].ndim - 1)
    if ord == "fro":
        return reduce(b, "ReduceL2", xs[0], last, keepdims)
    if ord not in (1, -1, math.inf, -math.inf):
        raise NotExportable(f"the {ord!r} matrix norm needs singular values: ONNX has no SVD")
    summed, picked = (last[0], last[1]) if ord in (1, -1) else (last[1], last[0])
    sums = reduce(b, "ReduceSum", b.node("Abs", xs), (summed,), True)
    return reduce(b, "ReduceMax" if ord > 0 else "ReduceMin", sums, (summed, picked) if keepdims else last, keepdims) \
        if keepdims else b.reshape(reduce(b, "ReduceMax" if ord > 0 else "ReduceMin", sums, (picked,), True), outs[0].shape)


@lowering("matrix_power")
def _matrix_power(b, xs, ins, outs, n):
    """Repeated squaring, as NumPy computes it; a negative power needs an inverse, which ONNX has not."""
    if n < 0:
        raise NotExportable(f"matrix_power with n={n} needs a matrix inverse: ONNX has no operator for it")
    size = ins[0].shape[-1]
    if n == 0:
        return b.node("Expand", [b.const(np.eye(size, dtype=dt.NUMPY[outs[0].dtype])), b.ints(outs[0].shape)])
    result, power = None, xs[0]
    while True:
        if n & 1:
            result = power if result is None else b.node("MatMul", [result, power])
        n >>= 1
        if not n:
            return result if result != xs[0] else b.node("Identity", [result])
        power = b.node("MatMul", [power, power])


@lowering("det")
def _det(b, xs, ins, outs):
    if ins[0].dtype is not dt.float32:
        raise NotExportable(f"ONNX Runtime's Det computes float32 only, not {ins[0].dtype}")
    return b.node("Det", xs)


@lowering("vector_norm")
def _vector_norm(b, xs, ins, outs, axis, keepdims, ord):
    axes = axes_of(axis, ins[0].ndim)
    size = b.node("Abs", xs)
    if ord == 2:
        return reduce(b, "ReduceL2", size, axes, keepdims)  # |x|: a reduction over no axes is the identity
    if ord == 1:
        return reduce(b, "ReduceSum", size, axes, keepdims)
    if ord == math.inf:
        return reduce(b, "ReduceMax", size, axes, keepdims)
    if ord == -math.inf:
        return reduce(b, "ReduceMin", size, axes, keepdims)
    if ord == 0:
        return reduce(b, "ReduceSum", b.cast(b.cast(xs[0], ins[0].dtype, dt.bool_), dt.bool_, outs[0].dtype), axes, keepdims)
    power = b.scalar(ord, outs[0].dtype)
    total = reduce(b, "ReduceSum", b.node("Pow", [size, power]), axes, keepdims)
    return b.node("Pow", [total, b.node("Reciprocal", [power])])


# --- manipulation ------------------------------------------------------------------------------

@lowering("reshape", "squeeze", "expand_dims")
def _reshape(b, xs, ins, outs, **_):
    shape = outs[0].shape
    if b.dynamic_batch and ins[0].ndim and shape and ins[0].shape[0] == shape[0] and 0 not in shape:
        # the leading axis copied from the input (ONNX's 0 without allowzero), so the batch stays dynamic
        return b.node("Reshape", [xs[0], b.ints((0,) + shape[1:])], allowzero=0)
    return b.reshape(xs[0], shape)


@lowering("broadcast_to")
def _broadcast_to(b, xs, ins, outs, shape):
    return b.node("Expand", [xs[0], b.ints(outs[0].shape)])


@lowering("permute_dims")
def _permute(b, xs, ins, outs, axes):
    return b.node("Transpose", xs, perm=list(axes)) if axes else b.node("Identity", xs)


@lowering("moveaxis")
def _moveaxis(b, xs, ins, outs, source, destination):
    ndim = ins[0].ndim
    src = [s % ndim for s in ((source,) if isinstance(source, int) else source)]
    dst = [d % ndim for d in ((destination,) if isinstance(destination, int) else destination)]
    order = [n for n in range(ndim) if n not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return b.node("Transpose", xs, perm=order)


@lowering("concat")
def _concat(b, xs, ins, outs, axis):
    if axis is None:
        xs, axis = [b.reshape(x, (-1,)) for x in xs], 0
    return b.node("Concat", xs, axis=axis % max(ins[0].ndim, 1))


@lowering("stack")
def _stack(b, xs, ins, outs, axis):
    axis = axis % outs[0].ndim
    return b.node("Concat", [b.node("Unsqueeze", [x, b.ints([axis])]) for x in xs], axis=axis)


def _rearrangement(b, xs, ins, outs, name, attrs):
    """A row that only moves elements (flip, roll, repeat …): ember runs it once on the positions
    0 … n-1 of the input, and the ONNX model gathers the flattened input at the positions it gave."""
    from ..array import bind
    from ..namespace.creation import asarray
    positions = asarray(np.arange(math.prod(ins[0].shape), dtype=np.int64).reshape(ins[0].shape), device="numpy")
    gathered = bind(OPS[name], (positions,), attrs)
    flat = b.reshape(xs[0], (-1,))
    results = [b.node("Gather", [flat, b.const(np.asarray(g))], axis=0) for g in host_arrays(gathered)]
    return results[0] if len(results) == 1 else results


for _name in ("flip", "roll", "repeat", "tile", "unstack", "fftshift", "ifftshift", "diagonal"):
    LOWERINGS[_name] = (lambda name: lambda b, xs, ins, outs, **attrs: _rearrangement(b, xs, ins, outs, name, attrs))(_name)


# --- indexing ----------------------------------------------------------------------------------

def _indexed_axes(key: tuple, ndim: int) -> list:
    """The input axis each array item of ``key`` indexes."""
    consumed = sum(1 for item in key if item is not None and item != ELLIPSIS)
    axes, dim = [], 0
    for item in key:
        if type(item) is tuple and item[0] == "a":
            axes.append(dim)
        if item == ELLIPSIS and type(item) is not tuple:
            dim += ndim - consumed
        elif item is not None:
            dim += 1
    return axes


def _positions(b, x_meta, arrays, array_metas, key):
    """The flat positions ``x[key]`` reads, as an ONNX tensor of the output's shape. They are affine in
    each index array: ember computes them with every index array zero, and the model adds each array's
    (wrapped) indices times its axis' stride, broadcast where NumPy puts the indexed axes."""
    from ..ops.indexing import _adjacent, decode_key
    if any(m.dtype is dt.bool_ for m in array_metas):
        raise NotExportable("a boolean mask index has a data-dependent length")
    shape = x_meta.shape
    zeros = tuple(np.zeros(m.shape, np.int64) for m in array_metas)
    static = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)[decode_key(key, zeros)]
    total = b.const(np.array(static))
    if not arrays:
        return total
    advanced = [i for i, item in enumerate(key) if type(item) is int or (type(item) is tuple and item[0] == "a")]
    broadcast = np.broadcast_shapes(*(m.shape for m in array_metas))
    consumed = sum(1 for item in key if item is not None and item != ELLIPSIS)
    at = 0
    if _adjacent(key):  # after the output axes of the items before the first advanced one
        at = sum(len(shape) - consumed if item == ELLIPSIS else 1 for item in key[:advanced[0]] if type(item) is not int)
    layout = [1] * at + list(broadcast) + [1] * (static.ndim - at - len(broadcast))
    for index, meta, axis in zip(arrays, array_metas, _indexed_axes(key, len(shape))):
        wrapped = b.cast(index, meta.dtype, dt.int64)
        negative = b.node("Less", [wrapped, b.scalar(0, dt.int64)])
        wrapped = b.node("Where", [negative, b.node("Add", [wrapped, b.scalar(shape[axis], dt.int64)]), wrapped])
        spread = b.reshape(b.node("Expand", [wrapped, b.ints(broadcast)]), layout)
        total = b.node("Add", [total, b.node("Mul", [spread, b.scalar(math.prod(shape[axis + 1:]), dt.int64)])])
    return total


@lowering("getitem")
def _getitem(b, xs, ins, outs, key):
    return b.node("Gather", [b.reshape(xs[0], (-1,)), _positions(b, ins[0], xs[1:], ins[1:], key)], axis=0)


@lowering("setitem")
def _setitem(b, xs, ins, outs, key):
    """The positions x[key] reads, written with ScatterND (NumPy keeps the last of repeated positions; ScatterND
    leaves their order undefined: keys with repeated array indices are ambiguous there)."""
    positions = _positions(b, ins[0], xs[2:], ins[2:], key)
    target = Meta(tuple(np.broadcast_shapes(ins[1].shape, _shape_of_key(ins[0], ins[2:], key))), ins[0].dtype)
    values = b.node("Expand", [b.cast(xs[1], ins[1].dtype, ins[0].dtype), b.ints(target.shape)])
    flat = b.reshape(xs[0], (-1,))
    written = b.node("ScatterND", [flat, b.node("Unsqueeze", [b.reshape(positions, (-1,)), b.ints([1])]),
                                   b.reshape(values, (-1,))])
    return b.reshape(written, ins[0].shape)


def _shape_of_key(meta, array_metas, key):
    from ..ops.indexing import index_shape
    return index_shape(meta.shape, key, tuple(array_metas))


@lowering("scatter_add")
def _scatter_add(b, xs, ins, outs):
    x, indices, values = xs
    wrapped = b.cast(indices, ins[1].dtype, dt.int64)
    wrapped = b.node("Where", [b.node("Less", [wrapped, b.scalar(0, dt.int64)]),
                               b.node("Add", [wrapped, b.scalar(ins[0].shape[0], dt.int64)]), wrapped])
    return b.node("ScatterND", [x, b.node("Unsqueeze", [wrapped, b.ints([1])]), values], reduction="add")


@lowering("take")
def _take(b, xs, ins, outs, axis):
    x = xs[0]
    if axis is None:
        x, axis = b.reshape(x, (-1,)), 0
    return b.node("Gather", [x, xs[1]], axis=axis)


@lowering("take_along_axis")
def _take_along_axis(b, xs, ins, outs, axis):
    """GatherElements, after x and the indices are broadcast against each other beside the axis (it does not)."""
    axis = axis % ins[0].ndim
    shape = list(outs[0].shape)
    x_shape = tuple(shape[:axis] + [ins[0].shape[axis]] + shape[axis + 1:])
    x, indices = xs
    if ins[0].shape != x_shape:
        x = b.node("Expand", [x, b.ints(x_shape)])
    if ins[1].shape != outs[0].shape:
        indices = b.node("Expand", [indices, b.ints(outs[0].shape)])
    return b.node("GatherElements", [x, indices], axis=axis)


@lowering("embedding")
def _embedding(b, xs, ins, outs):
    return b.node("Gather", [xs[1], xs[0]], axis=0)
