"""The main namespace's linear algebra functions (the standard's "Linear Algebra Functions" section): matmul,
tensordot and vecdot. The ``linalg`` extension's rows are in linalg.py.

Gradient rules take complex values in PyTorch's convention, as in elementwise.py.
"""

from __future__ import annotations

import math

from .. import dtypes as dt
from ..errors import ArgumentError, AxisError, ShapeError
from .gradients import conj, unbroadcast
from .table import Meta, Op, broadcast_shapes, define, fmt_shape, normalize_axis, require


def _argsort(values):
    return sorted(range(len(values)), key=lambda i: values[i])


def _matmul_meta(x1, x2):
    if x1.ndim == 0 or x2.ndim == 0:
        raise ShapeError(f"inputs must be at least 1-d, got shapes {fmt_shape(x1.shape)} and {fmt_shape(x2.shape)}")
    dtype = dt.promote(x1.dtype, x2.dtype)
    require(dtype, "numeric")
    a = (1,) + x1.shape if x1.ndim == 1 else x1.shape
    b = x2.shape + (1,) if x2.ndim == 1 else x2.shape
    if a[-1] != b[-2]:
        raise ShapeError(f"shapes {fmt_shape(x1.shape)} and {fmt_shape(x2.shape)} are not aligned "
                         f"({a[-1]} (dim {x1.ndim - 1}) != {b[-2]} (dim {max(x2.ndim - 2, 0)}))")
    try:
        batch = broadcast_shapes(a[:-2], b[:-2])
    except ShapeError:
        raise ShapeError(f"batch shapes of {fmt_shape(x1.shape)} and {fmt_shape(x2.shape)} cannot be broadcast "
                         f"together") from None
    shape = batch + ((a[-2],) if x1.ndim > 1 else ()) + ((b[-1],) if x2.ndim > 1 else ())
    return Meta(shape, dtype)


def _matmul_grad(xp, g, out, x1, x2):
    if x1.ndim == 1 and x2.ndim == 1:  # a dot product
        return g * conj(xp, x2), g * conj(xp, x1)
    a = conj(xp, x1 if x1.ndim > 1 else xp.expand_dims(x1, axis=0))
    b = conj(xp, x2 if x2.ndim > 1 else xp.expand_dims(x2, axis=1))
    if x1.ndim == 1:
        g = xp.expand_dims(g, axis=-2)
    if x2.ndim == 1:
        g = xp.expand_dims(g, axis=-1)
    ga = unbroadcast(xp, g @ xp.matrix_transpose(b), a.shape)
    gb = unbroadcast(xp, xp.matrix_transpose(a) @ g, b.shape)
    return xp.reshape(ga, x1.shape), xp.reshape(gb, x2.shape)


define(Op("matmul", ("x1", "x2"), {}, _matmul_meta, promote_inputs=True, family="linear algebra", grad=_matmul_grad,
          flops=lambda ins, outs, attrs: 2 * math.prod(outs[0].shape) * ins[0].shape[-1],
          doc="Matrix product with NumPy's rules for 1-d operands and batches."))


def _tensordot_canon(x1, x2, axes):
    if isinstance(axes, int) and not isinstance(axes, bool):
        if axes < 0 or axes > min(x1.ndim, x2.ndim):
            raise AxisError(f"axes={axes} is out of range for shapes {fmt_shape(x1.shape)} and {fmt_shape(x2.shape)}")
        return {"axes": (tuple(range(x1.ndim - axes, x1.ndim)), tuple(range(axes)))}
    try:
        first, second = axes
    except (TypeError, ValueError):
        raise ArgumentError(f"axes must be an int or a pair of sequences, got {axes!r}") from None
    first = (first,) if isinstance(first, int) else tuple(first)
    second = (second,) if isinstance(second, int) else tuple(second)
    if len(first) != len(second):
        raise ArgumentError(f"axes {axes!r} name different numbers of axes")
    return {"axes": (tuple(normalize_axis(a, x1.ndim) for a in first), tuple(normalize_axis(a, x2.ndim) for a in second))}


def _tensordot_meta(x1, x2, axes):
    dtype = dt.promote(x1.dtype, x2.dtype)
    require(dtype, "numeric")
    first, second = axes
    for a, b in zip(first, second):
        if x1.shape[a] != x2.shape[b]:
            raise ShapeError(f"shapes {fmt_shape(x1.shape)} and {fmt_shape(x2.shape)} differ on contracted axes {a} and {b}")
    shape = tuple(s for i, s in enumerate(x1.shape) if i not in first) + \
        tuple(s for i, s in enumerate(x2.shape) if i not in second)
    return Meta(shape, dtype)


def _tensordot_grad(xp, g, out, x1, x2, axes):
    first, second = axes
    free1 = [i for i in range(x1.ndim) if i not in first]
    free2 = [i for i in range(x2.ndim) if i not in second]
    n1 = len(free1)
    g1 = xp.tensordot(g, conj(xp, x2), axes=(tuple(range(n1, g.ndim)), tuple(free2)))
    source1 = free1 + [first[k] for k in _argsort(second)]
    g2 = xp.tensordot(conj(xp, x1), g, axes=(tuple(free1), tuple(range(n1))))
    source2 = [second[k] for k in _argsort(first)] + free2
    return xp.permute_dims(g1, tuple(_argsort(source1))), xp.permute_dims(g2, tuple(_argsort(source2)))


define(Op("tensordot", ("x1", "x2"), {"axes": 2}, _tensordot_meta, _tensordot_canon, promote_inputs=True,
          flops=lambda ins, outs, attrs: 2 * math.prod(outs[0].shape) * math.prod(ins[0].shape[a] for a in attrs["axes"][0]),
          family="linear algebra", grad=_tensordot_grad, doc="Sum of products over the given axes."))


def _vecdot_meta(x1, x2, axis):
    dtype = dt.promote(x1.dtype, x2.dtype)
    require(dtype, "numeric")
    shape = broadcast_shapes(x1.shape, x2.shape)
    if not shape:
        raise ShapeError(f"inputs must be at least 1-d, got shapes {fmt_shape(x1.shape)} and {fmt_shape(x2.shape)}")
    if not -len(shape) <= axis < 0:
        raise AxisError(f"axis {axis} must be negative and within the broadcast rank {len(shape)}")
    if x1.shape[axis] != x2.shape[axis]:
        raise ShapeError(f"shapes {fmt_shape(x1.shape)} and {fmt_shape(x2.shape)} differ along axis {axis}")
    return Meta(tuple(s for i, s in enumerate(shape) if i != len(shape) + axis), dtype)


def _vecdot_grad(xp, g, out, x1, x2, axis):
    g = xp.expand_dims(g, axis=axis)  # out = sum(conj(x1) · x2)
    return unbroadcast(xp, conj(xp, g) * x2, x1.shape), unbroadcast(xp, g * x1, x2.shape)


define(Op("vecdot", ("x1", "x2"), {"axis": -1}, _vecdot_meta, promote_inputs=True,
          flops=lambda ins, outs, attrs: 2 * math.prod(outs[0].shape) * ins[0].shape[attrs["axis"]],
          family="linear algebra", grad=_vecdot_grad, doc="Dot product of vectors along axis (conjugating x1)."))
