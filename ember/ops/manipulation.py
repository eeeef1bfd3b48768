"""Manipulation operations (the standard's manipulation section, plus astype)."""

from __future__ import annotations

import math

from .. import dtypes as dt
from ..errors import ArgumentError, AxisError, ShapeError
from .gradients import scatter_back, unbroadcast
from .table import (
    REQUIRED,
    Meta,
    Op,
    as_int,
    as_shape,
    broadcast_shapes,
    define,
    fmt_shape,
    normalize_axes,
    normalize_axis,
    require_same_dtype,
)


def _astype_grad(xp, g, out, x, dtype, copy):
    if not dt.in_category(x.dtype, "floating"):
        return (None,)
    if g.dtype.kind == dt.COMPLEX and x.dtype.kind != dt.COMPLEX:
        g = xp.real(g)  # a real input's gradient is the real part (NumPy warns when astype drops the imaginary part)
    return (xp.astype(g, x.dtype),)


define(Op("astype", ("x",), {"dtype": REQUIRED, "copy": True}, lambda x, dtype, copy: Meta(x.shape, dtype),
          lambda x, dtype, copy: {"dtype": _as_dtype(dtype)}, family="data type", positional=("dtype", "/"),
          grad=_astype_grad, doc="Copy of x cast to dtype."))


def _as_dtype(dtype):
    if not isinstance(dtype, dt.DType):
        raise ArgumentError(f"dtype must be an ember dtype, got {dtype!r}")
    return dtype


def _broadcast_to_meta(x, shape):
    if broadcast_shapes(x.shape, shape) != shape or x.ndim > len(shape):
        raise ShapeError(f"cannot broadcast shape {fmt_shape(x.shape)} to {fmt_shape(shape)}")
    return Meta(shape, x.dtype)


define(Op("broadcast_to", ("x",), {"shape": REQUIRED}, _broadcast_to_meta, lambda x, shape: {"shape": as_shape(shape)},
          family="manipulation", positional=("shape",),
          grad=lambda xp, g, out, x, shape: (unbroadcast(xp, g, x.shape),), doc="x broadcast to shape."))


def _concat_meta(*arrays, axis):
    if not arrays:
        raise ArgumentError("needs at least one array")
    dtype = require_same_dtype(*arrays)
    if axis is None:
        return Meta((sum(math.prod(a.shape) for a in arrays),), dtype)
    first = arrays[0]
    if first.ndim == 0:
        raise ShapeError(f"cannot concatenate 0-d arrays, got shapes {', '.join(fmt_shape(a.shape) for a in arrays)}")
    axis = normalize_axis(axis, first.ndim)
    for a in arrays[1:]:
        if a.ndim != first.ndim or any(s != t for i, (s, t) in enumerate(zip(a.shape, first.shape)) if i != axis):
            raise ShapeError(f"shapes {', '.join(fmt_shape(b.shape) for b in arrays)} do not match beside axis {axis}")
    shape = list(first.shape)
    shape[axis] = sum(a.shape[axis] for a in arrays)
    return Meta(tuple(shape), dtype)


def _split_grad(xp, g, out, *arrays, axis):
    """concat's adjoint: the cotangent cut back into the inputs' extents along axis."""
    if axis is None:
        g = xp.reshape(g, (-1,))
    grads, start = [], 0
    for a in arrays:
        if axis is None:
            size = math.prod(a.shape)
            grads.append(xp.reshape(g[start:start + size], a.shape))
        else:
            size = a.shape[axis]
            index = (slice(None),) * (axis % g.ndim) + (slice(start, start + size),)
            grads.append(g[index])
        start += size
    return tuple(grads)


define(Op("concat", ("*arrays",), {"axis": 0}, _concat_meta, promote_inputs=True, family="manipulation", grad=_split_grad,
          doc="Join arrays along an existing axis (flattened when axis is None)."))


def _stack_meta(*arrays, axis):
    if not arrays:
        raise ArgumentError("needs at least one array")
    dtype = require_same_dtype(*arrays)
    if any(a.shape != arrays[0].shape for a in arrays):
        raise ShapeError(f"arrays must share one shape, got {', '.join(fmt_shape(a.shape) for a in arrays)}")
    axis = normalize_axis(axis, arrays[0].ndim + 1)
    shape = list(arrays[0].shape)
    shape.insert(axis, len(arrays))
    return Meta(tuple(shape), dtype)


define(Op("stack", ("*arrays",), {"axis": 0}, _stack_meta, promote_inputs=True, family="manipulation",
          grad=lambda xp, g, out, *arrays, axis: tuple(xp.unstack(g, axis=axis)),
          doc="Join arrays of one shape along a new axis."))


def _expand_dims_canon(x, axis):
    """An int or a tuple of the new axes' positions in the result, as a sorted tuple of non-negative ones."""
    count = 1 if isinstance(axis, int) else len(tuple(axis))
    return {"axis": normalize_axes(axis, x.ndim + count)}


def _expand_dims_meta(x, axis):
    axes = normalize_axes(axis, x.ndim + (1 if isinstance(axis, int) else len(axis)))
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return Meta(tuple(shape), x.dtype)


define(Op("expand_dims", ("x",), {"axis": REQUIRED}, _expand_dims_meta, _expand_dims_canon, family="manipulation",
          positional=("axis",), grad=lambda xp, g, out, x, axis: (xp.reshape(g, x.shape),),
          doc="Insert size-1 axes at position axis (an int or a tuple of positions in the result)."))


define(Op("flip", ("x",), {"axis": None}, lambda x, axis: Meta(x.shape, x.dtype),
          lambda x, axis: {"axis": normalize_axes(axis, x.ndim)}, family="manipulation",
          grad=lambda xp, g, out, x, axis: (xp.flip(g, axis=axis),),
          doc="Reverse the order of elements along axis (all axes when None)."))


def _moveaxis_meta(x, source, destination):
    src = (source,) if isinstance(source, int) else tuple(source)
    dst = (destination,) if isinstance(destination, int) else tuple(destination)
    if len(src) != len(dst):
        raise ArgumentError(f"source {source!r} and destination {destination!r} differ in length")
    src = [normalize_axis(a, x.ndim, "source") for a in src]
    dst = [normalize_axis(a, x.ndim, "destination") for a in dst]
    if len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise AxisError(f"repeated axis in source {source!r} or destination {destination!r}")
    order = [a for a in range(x.ndim) if a not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return Meta(tuple(x.shape[a] for a in order), x.dtype)


define(Op("moveaxis", ("x",), {"source": REQUIRED, "destination": REQUIRED}, _moveaxis_meta, family="manipulation",
          positional=("source", "destination", "/"),
          grad=lambda xp, g, out, x, source, destination: (xp.moveaxis(g, destination, source),),
          doc="Move axes from source positions to destination positions."))


def _permute_canon(x, axes):
    """The axes as non-negative ints (negative ones count from the end, 2025.12)."""
    axes = tuple(as_int(a, "axes") for a in axes)
    if len(axes) != x.ndim or any(not -x.ndim <= a < x.ndim for a in axes):
        raise AxisError(f"axes {axes!r} are not a permutation of the {x.ndim} axes of shape {fmt_shape(x.shape)}")
    return {"axes": tuple(a % x.ndim for a in axes)}


def _permute_meta(x, axes):
    axes = tuple(axes)
    if sorted(normalize_axis(a, x.ndim) for a in axes) != list(range(x.ndim)):
        raise AxisError(f"axes {axes!r} are not a permutation of the {x.ndim} axes of shape {fmt_shape(x.shape)}")
    return Meta(tuple(x.shape[a] for a in axes), x.dtype)


def _inverse(axes):
    inverse = [0] * len(axes)
    for i, a in enumerate(axes):
        inverse[a] = i
    return tuple(inverse)


define(Op("permute_dims", ("x",), {"axes": REQUIRED}, _permute_meta, _permute_canon, family="manipulation",
          positional=("axes",), grad=lambda xp, g, out, x, axes: (xp.permute_dims(g, _inverse(axes)),),
          doc="Permute the axes of x (negative axes count from the end)."))


def _repeat_meta(x, repeats, axis):
    size = math.prod(x.shape) if axis is None else x.shape[axis]
    if isinstance(repeats, tuple):
        if len(repeats) not in (1, size):
            raise ShapeError(f"{len(repeats)} repeats do not match the {size} elements of shape {fmt_shape(x.shape)} "
                             f"along axis {axis}")
        if any(r < 0 for r in repeats):
            raise ArgumentError(f"repeats must be non-negative, got {repeats!r}")
        total = sum(repeats) if len(repeats) == size else repeats[0] * size
    else:
        if repeats < 0:
            raise ArgumentError(f"repeats must be non-negative, got {repeats}")
        total = repeats * size
    if axis is None:
        return Meta((total,), x.dtype)
    shape = list(x.shape)
    shape[axis] = total
    return Meta(tuple(shape), x.dtype)


def _repeat_canon(x, repeats, axis):
    repeats = tuple(as_int(r, "repeats") for r in repeats) if isinstance(repeats, (tuple, list)) else as_int(repeats, "repeats")
    return {"repeats": repeats, "axis": None if axis is None else normalize_axis(axis, x.ndim)}


def _repeat_grad(xp, g, out, x, repeats, axis):
    flat = axis is None
    axis_ = 0 if flat else axis
    size = math.prod(x.shape) if flat else x.shape[axis]
    if isinstance(repeats, tuple) and len(repeats) == size:
        counts = repeats
    else:
        counts = (repeats if isinstance(repeats, int) else repeats[0],) * size
    index = xp.asarray([i for i, c in enumerate(counts) for _ in range(c)], dtype=dt.int64, device=g.device)

    def gather(positions):
        return xp.take(xp.reshape(positions, (-1,)) if flat else positions, index, axis=axis_)
    return (scatter_back(xp, g, x, gather),)


define(Op("repeat", ("x",), {"repeats": REQUIRED, "axis": None}, _repeat_meta, _repeat_canon, family="manipulation",
          positional=("repeats", "/"), grad=_repeat_grad, doc="Repeat each element of x (along axis, or of the flattened x)."))


def _reshape_canon(x, shape, copy):
    shape = tuple(as_int(s, "shape") for s in ((shape,) if isinstance(shape, int) else shape))
    size = math.prod(x.shape)
    if shape.count(-1) > 1 or any(s < -1 for s in shape):
        raise ShapeError(f"cannot reshape {fmt_shape(x.shape)} to {fmt_shape(shape)}: at most one -1 and no other negative size")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or size % known:
            raise ShapeError(f"cannot reshape an array of shape {fmt_shape(x.shape)} (size {size}) into shape {fmt_shape(shape)}")
        shape = tuple(size // known if s == -1 else s for s in shape)
    if math.prod(shape) != size:
        raise ShapeError(f"cannot reshape an array of shape {fmt_shape(x.shape)} (size {size}) into shape {fmt_shape(shape)}")
    return {"shape": shape}


define(Op("reshape", ("x",), {"shape": REQUIRED, "copy": None}, lambda x, shape, copy: Meta(shape, x.dtype), _reshape_canon,
          family="manipulation", positional=("shape",), grad=lambda xp, g, out, x, shape, copy: (xp.reshape(g, x.shape),),
          doc="x with a new shape of the same size (one dimension may be -1)."))


def _roll_canon(x, shift, axis):
    shift = tuple(as_int(s, "shift") for s in shift) if isinstance(shift, (tuple, list)) else as_int(shift, "shift")
    if axis is None:
        return {"shift": shift, "axis": None}
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(normalize_axis(a, x.ndim) for a in axes)
    shifts = shift if isinstance(shift, tuple) else (shift,) * len(axes)
    if len(shifts) != len(axes):
        raise ArgumentError(f"shift {shift!r} and axis {axis!r} differ in length")
    return {"shift": shifts, "axis": axes}


define(Op("roll", ("x",), {"shift": REQUIRED, "axis": None}, lambda x, shift, axis: Meta(x.shape, x.dtype), _roll_canon,
          family="manipulation", positional=("shift",),
          grad=lambda xp, g, out, x, shift, axis: (
              xp.roll(g, tuple(-s for s in shift) if isinstance(shift, tuple) else -shift, axis=axis),),
          doc="Roll elements along axis (of the flattened x when axis is None)."))


def _squeeze_meta(x, axis):
    for a in axis:
        if x.shape[a] != 1:
            raise ShapeError(f"cannot squeeze axis {a} of size {x.shape[a]} in shape {fmt_shape(x.shape)}")
    return Meta(tuple(s for i, s in enumerate(x.shape) if i not in axis), x.dtype)


define(Op("squeeze", ("x",), {"axis": REQUIRED}, _squeeze_meta, lambda x, axis: {"axis": normalize_axes(axis, x.ndim)},
          family="manipulation", positional=("axis",), grad=lambda xp, g, out, x, axis: (xp.reshape(g, x.shape),),
          doc="Remove size-1 axes."))


def _tile_meta(x, repetitions):
    reps = tuple(repetitions)
    if any(r < 0 for r in reps):
        raise ArgumentError(f"repetitions must be non-negative, got {reps!r}")
    n = max(len(reps), x.ndim)
    shape = (1,) * (n - x.ndim) + x.shape
    reps = (1,) * (n - len(reps)) + reps
    return Meta(tuple(s * r for s, r in zip(shape, reps)), x.dtype)


def _tile_grad(xp, g, out, x, repetitions):
    n = max(len(repetitions), x.ndim)
    shape = (1,) * (n - x.ndim) + x.shape
    reps = (1,) * (n - len(repetitions)) + tuple(repetitions)
    split = tuple(d for pair in zip(reps, shape) for d in pair)
    summed = xp.sum(xp.reshape(g, split), axis=tuple(range(0, 2 * n, 2)))
    return (xp.reshape(summed, x.shape),)


define(Op("tile", ("x",), {"repetitions": REQUIRED}, _tile_meta,
          lambda x, repetitions: {"repetitions": tuple(as_int(r, "repetitions") for r in repetitions)},
          family="manipulation", positional=("repetitions", "/"), grad=_tile_grad,
          doc="Tile x by repetitions along each axis."))


def _unstack_meta(x, axis):
    if x.ndim == 0:
        raise ShapeError(f"cannot unstack a 0-d array, got shape {fmt_shape(x.shape)}")
    rest = x.shape[:axis] + x.shape[axis + 1:]
    return tuple(Meta(rest, x.dtype) for _ in range(x.shape[axis]))


def _unstack_grad(xp, g, out, x, axis):
    parts = [gi if gi is not None else xp.zeros_like(o) for gi, o in zip(g, out)]
    if not parts:
        return (xp.zeros_like(x),)
    return (xp.stack(parts, axis=axis),)


define(Op("unstack", ("x",), {"axis": 0}, _unstack_meta, lambda x, axis: {"axis": normalize_axis(axis, max(x.ndim, 1))},
          family="manipulation", multiple=True, grad=_unstack_grad, doc="Split x along axis into a tuple of arrays."))
