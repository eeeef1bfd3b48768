"""Indexing: ``x[key]``, ``x[key] = v``, ``take`` and ``take_along_axis``.

A key travels as plain data: a tuple whose items are ints, ``None``, ``"..."``,
``("s", start, stop, step)`` for a slice and ``("a", k)`` for the k-th index array (an array
input of the op). The meta rule follows NumPy's rules, which the standard's indexing is a
subset of: integers and integer arrays broadcast together when any array is present, and
their result axes go where the first of them stood if they are adjacent, else in front.
"""

from __future__ import annotations

from .. import dtypes as dt
from ..errors import ArgumentError, DTypeError, IndexingError, ShapeError
from .gradients import scatter_back, unbroadcast
from .table import Meta, Op, broadcast_shapes, broadcasts_to, define, fmt_shape, normalize_axis, require

ELLIPSIS = "..."


def decode_key(key: tuple, arrays: tuple, make_slice=slice) -> tuple:
    """The native key for a backend: placeholders replaced by ``arrays`` and real slices."""
    out = []
    for item in key:
        if type(item) is tuple:
            out.append(make_slice(*item[1:]) if item[0] == "s" else arrays[item[1]])
        elif item == ELLIPSIS:
            out.append(Ellipsis)
        else:
            out.append(item)
    return tuple(out)


def _slice_length(size: int, start, stop, step) -> int:
    return len(range(*slice(start, stop, step).indices(size)))


def index_shape(shape: tuple, key: tuple, arrays: tuple) -> tuple:
    """The shape of ``x[key]`` for ``x`` of ``shape``; ``None`` marks a boolean-mask length."""
    ndim = len(shape)
    if key.count(ELLIPSIS) > 1:
        raise IndexingError(f"an index can only have a single ellipsis ('...'), got {key!r:.200} (indexing shape "
                            f"{fmt_shape(shape)})")
    consumed = 0
    for item in key:
        if type(item) is tuple and item[0] == "a":
            index = arrays[item[1]]
            consumed += index.ndim if index.dtype is dt.bool_ else 1
        elif item is not None and item != ELLIPSIS:
            consumed += 1
    if consumed > ndim:
        raise IndexingError(f"too many indices for an array of shape {fmt_shape(shape)}: {consumed} axes indexed")
    out: list = []
    # the index arrays' shapes and their positions in ``out``; an integer beside them is advanced too (NumPy's rule), but
    # it adds no dimension to their broadcast and none to ``out``, so where the broadcast goes is _adjacent's to decide
    advanced: list = []
    advanced_at: list = []
    dim = 0
    for item in key:
        if item is None:
            out.append(1)
        elif type(item) is tuple and item[0] == "s":
            _, start, stop, step = item
            if step == 0:
                raise IndexingError(f"slice step cannot be zero (indexing shape {fmt_shape(shape)})")
            out.append(_slice_length(shape[dim], start, stop, step))
            dim += 1
        elif type(item) is tuple:
            index = arrays[item[1]]
            if index.dtype is dt.bool_:
                axes = shape[dim:dim + index.ndim]
                # the standard lets a mask axis be 0 long whatever the axis it indexes (the result is empty)
                if len(axes) != index.ndim or any(m not in (a, 0) for m, a in zip(index.shape, axes, strict=True)):
                    raise IndexingError(f"boolean index of shape {fmt_shape(index.shape)} does not match the indexed "
                                        f"axes {fmt_shape(axes)} of shape {fmt_shape(shape)}")
                advanced.append((None,))
                dim += index.ndim
            else:
                if not dt.in_category(index.dtype, "integral"):
                    raise IndexingError(f"index arrays must be integer or boolean, got {index.dtype} (indexing shape "
                                        f"{fmt_shape(shape)})")
                advanced.append(index.shape)
                dim += 1
            advanced_at.append(len(out))
        elif item == ELLIPSIS:
            skip = ndim - consumed
            out.extend(shape[dim:dim + skip])
            dim += skip
        else:
            size = shape[dim]
            if not -size <= item < size:
                raise IndexingError(f"index {item} is out of bounds for axis {dim} with size {size}")
            dim += 1
    out.extend(shape[dim:])
    if not advanced:
        return tuple(out)
    try:
        broadcast = broadcast_shapes(*advanced)
    except ShapeError:
        shapes = ", ".join(fmt_shape(s) for s in advanced)
        raise IndexingError(f"index arrays of shapes {shapes} cannot be broadcast together (indexing shape "
                            f"{fmt_shape(shape)})") from None
    at = advanced_at[0] if _adjacent(key) else 0
    return tuple(out[:at]) + broadcast + tuple(out[at:])


def _adjacent(key: tuple) -> bool:
    """Whether the advanced (integer and array) items of ``key`` stand next to each other."""
    flags = [type(item) is tuple and item[0] == "a" or (type(item) is int) for item in key]
    positions = [i for i, f in enumerate(flags) if f]
    return positions == list(range(positions[0], positions[-1] + 1))


def _getitem_meta(x, *arrays, key):
    shape = index_shape(x.shape, key, arrays)
    return Meta(shape, x.dtype)


def _getitem_grad(xp, g, out, x, *indices, key):
    native = decode_key(key, indices)
    return (scatter_back(xp, g, x, lambda positions: positions[native]),) + (None,) * len(indices)


define(Op("getitem", ("x", "*indices"), {"key": ()}, _getitem_meta, family="indexing",
          data_dependent=True,  # with a boolean index: outputs whose shape holds None
          grad=_getitem_grad,
          doc="x[key]: basic, integer-array and boolean indexing."))


def _setitem_meta(x, value, *arrays, key):
    target = index_shape(x.shape, key, arrays)
    if None not in target and not broadcasts_to(value.shape, target):
        raise ShapeError(f"value of shape {fmt_shape(value.shape)} cannot be broadcast to the shape {fmt_shape(target)} "
                         f"the key selects from {fmt_shape(x.shape)}")
    if value.dtype is not x.dtype:
        raise DTypeError(f"value dtype {value.dtype} differs from the array's {x.dtype}")
    return Meta(x.shape, x.dtype)


def _setitem_grad(xp, g, out, x, value, *indices, key):
    native = decode_key(key, indices)
    gx = xp.asarray(g, copy=True)
    gx[native] = 0.0  # what was overwritten gets no gradient
    gv = unbroadcast(xp, g[native], value.shape) if hasattr(value, "shape") else None
    return (gx, gv) + (None,) * len(indices)


define(Op("setitem", ("x", "value", "*indices"), {"key": ()}, _setitem_meta, family="indexing", grad=_setitem_grad,
          doc="A copy of x with x[key] replaced by value (the namespace rebinds x to it)."))


def _take_meta(x, indices, axis):
    require(indices.dtype, "integral", "indices")
    if indices.ndim != 1:
        raise ShapeError(f"indices must be 1-d, got shape {fmt_shape(indices.shape)} (x {fmt_shape(x.shape)})")
    if axis is None:
        if x.ndim != 1:
            raise ArgumentError(f"axis must be given for an input of shape {fmt_shape(x.shape)} (not 1-d)")
        axis = 0
    axis = normalize_axis(axis, x.ndim)
    return Meta(x.shape[:axis] + indices.shape + x.shape[axis + 1:], x.dtype)


define(Op("take", ("x", "indices"), {"axis": None}, _take_meta, family="indexing",
          grad=lambda xp, g, out, x, indices, axis: (scatter_back(xp, g, x, lambda p: xp.take(p, indices, axis=axis)), None),
          doc="Elements of x at indices along axis."))


def _take_along_meta(x, indices, axis):
    require(indices.dtype, "integral", "indices")
    if indices.ndim != x.ndim:
        raise ShapeError(f"indices of shape {fmt_shape(indices.shape)} must have the rank of x {fmt_shape(x.shape)}")
    axis = normalize_axis(axis, x.ndim)
    try:
        shape = broadcast_shapes(x.shape[:axis] + (1,) + x.shape[axis + 1:],
                                 indices.shape[:axis] + (1,) + indices.shape[axis + 1:])
    except ShapeError:
        raise ShapeError(f"indices of shape {fmt_shape(indices.shape)} do not broadcast with x {fmt_shape(x.shape)} "
                         f"beside axis {axis}") from None
    return Meta(shape[:axis] + (indices.shape[axis],) + shape[axis + 1:], x.dtype)


define(Op("take_along_axis", ("x", "indices"), {"axis": -1}, _take_along_meta, family="indexing",
          grad=lambda xp, g, out, x, indices, axis: (
              scatter_back(xp, g, x, lambda p: xp.take_along_axis(p, indices, axis=axis)), None),
          doc="Elements of x at indices matched along axis."))


def _scatter_add_meta(x, indices, values):
    if x.ndim != 1 or indices.ndim != 1 or values.shape != indices.shape:
        raise ShapeError(f"x and indices must be 1-d and values shaped like indices, got {fmt_shape(x.shape)}, "
                         f"{fmt_shape(indices.shape)} and {fmt_shape(values.shape)}")
    require(indices.dtype, "integral", "indices")
    if values.dtype is not x.dtype:
        raise DTypeError(f"values dtype {values.dtype} differs from x's {x.dtype}")
    return Meta(x.shape, x.dtype)


define(Op("scatter_add", ("x", "indices", "values"), {}, _scatter_add_meta, family="indexing",
          grad=lambda xp, g, out, x, indices, values: (g, None, xp.take(g, indices, axis=0)),
          doc="A copy of the 1-d x with values added at indices (repeated indices accumulate); not in the "
              "standard — the adjoint of gathers."))
