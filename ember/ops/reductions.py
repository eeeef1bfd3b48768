"""Reductions, scans, searching, sorting and set operations (statistical, searching, sorting,
set and utility sections of the standard)."""

from __future__ import annotations

from .. import dtypes as dt
from ..errors import ArgumentError, ShapeError
from .gradients import conj, expand_reduced, scatter_back
from .table import (
    NO_GRADIENT,
    Meta,
    Op,
    as_int,
    define,
    fmt_shape,
    normalize_axes,
    normalize_axis,
    reduced_shape,
    require,
    require_ndim,
)


def _axes_canon(x, axis, **_):
    return {"axis": normalize_axes(axis, x.ndim)}


def _accumulating_canon(x, axis, dtype, **_):
    return {"axis": normalize_axes(axis, x.ndim), "dtype": dtype or dt.accumulation_dtype(x.dtype)}


def reduction(name, category, result, *, lift=False, canon=_axes_canon, extra_attrs=None, nonempty=False, grad, doc):
    """Define a reduction over ``axis`` (None, int or tuple) with ``keepdims``.

    ``result(x, attrs) -> dtype``; ``nonempty`` refuses reducing over a zero-size axis (max, min).
    """
    def meta(x, axis, keepdims, **attrs):
        require(x.dtype, category)
        if nonempty and 0 in [x.shape[a] for a in (range(x.ndim) if axis is None else axis)]:
            raise ShapeError(f"cannot reduce over a zero-size axis of shape {fmt_shape(x.shape)} (there is no identity)")
        return Meta(reduced_shape(x.shape, axis, keepdims), result(x, attrs))

    extra_attrs = extra_attrs or {}
    define(Op(name, ("x",), {"axis": None, **extra_attrs, "keepdims": False}, meta, canon, family="reduction",
              lift=lift, grad=grad, doc=doc))


def _explicit_dtype(x, attrs):
    return attrs["dtype"]


def _count(x, axis) -> int:
    n = 1
    for a in (range(x.ndim) if axis is None else axis):
        n *= x.shape[a]
    return n


def _sum_grad(xp, g, out, x, axis, dtype, keepdims):
    return (xp.astype(expand_reduced(xp, g, x.shape, axis, keepdims), x.dtype),)


def _prod_grad(xp, g, out, x, axis, dtype, keepdims):
    # d prod / d x_i = prod / x_i (inputs are nonzero where this is used; zeros give nan, as in JAX), conjugated
    return (expand_reduced(xp, g * conj(xp, out), x.shape, axis, keepdims) / conj(xp, x),)


def _extremum_grad(xp, g, out, x, axis, keepdims):
    """Ties share the cotangent evenly (like NumPy's and PyTorch's amax)."""
    full = expand_reduced(xp, out, x.shape, axis, keepdims)
    mask = xp.astype(x == full, x.dtype)
    count = expand_reduced(xp, xp.sum(mask, axis=axis, keepdims=keepdims), x.shape, axis, keepdims)
    return (expand_reduced(xp, g, x.shape, axis, keepdims) * mask / count,)


def _mean_grad(xp, g, out, x, axis, keepdims):
    return (expand_reduced(xp, g, x.shape, axis, keepdims) / _count(x, axis),)


def _var_grad(xp, g, out, x, axis, correction, keepdims):
    centred = x - xp.mean(x, axis=axis, keepdims=True)
    return (expand_reduced(xp, g, x.shape, axis, keepdims) * 2 * centred / (_count(x, axis) - correction),)


def _std_grad(xp, g, out, x, axis, correction, keepdims):
    centred = x - xp.mean(x, axis=axis, keepdims=True)
    safe = xp.where(out > 0, out, 1.0)  # at std = 0 take the zero subgradient, not 0/0
    scale = expand_reduced(xp, xp.where(out > 0, g / safe, 0.0), x.shape, axis, keepdims)
    return (scale * centred / (_count(x, axis) - correction),)


reduction("sum", "numeric", _explicit_dtype, canon=_accumulating_canon, extra_attrs={"dtype": None}, grad=_sum_grad,
          doc="Sum over axis; small integers accumulate in 64 bits unless dtype is given.")
reduction("prod", "numeric", _explicit_dtype, canon=_accumulating_canon, extra_attrs={"dtype": None}, grad=_prod_grad,
          doc="Product over axis; small integers accumulate in 64 bits unless dtype is given.")
reduction("max", "real numeric", lambda x, a: x.dtype, nonempty=True, grad=_extremum_grad,
          doc="Maximum over axis (NaN propagates).")
reduction("min", "real numeric", lambda x, a: x.dtype, nonempty=True, grad=_extremum_grad,
          doc="Minimum over axis (NaN propagates).")
reduction("mean", "floating", lambda x, a: x.dtype, lift=True, grad=_mean_grad, doc="Arithmetic mean over axis.")
reduction("std", "real floating", lambda x, a: x.dtype, lift=True, extra_attrs={"correction": 0.0}, grad=_std_grad,
          doc="Standard deviation over axis with a degrees-of-freedom correction.")
reduction("var", "real floating", lambda x, a: x.dtype, lift=True, extra_attrs={"correction": 0.0}, grad=_var_grad,
          doc="Variance over axis with a degrees-of-freedom correction.")
reduction("all", "any", lambda x, a: dt.bool_, grad=NO_GRADIENT, doc="Whether every element along axis is true.")
reduction("any", "any", lambda x, a: dt.bool_, grad=NO_GRADIENT, doc="Whether some element along axis is true.")
reduction("count_nonzero", "any", lambda x, a: dt.default_index, grad=NO_GRADIENT,
          doc="Number of non-zero elements along axis.")


def _arg_canon(x, axis, **_):
    return {"axis": None if axis is None else normalize_axis(axis, x.ndim)}


def _arg_meta(x, axis, keepdims):
    require(x.dtype, "real numeric")
    if 0 in (x.shape if axis is None else (x.shape[axis],)):
        raise ShapeError(f"cannot take argmax/argmin over a zero-size axis of shape {fmt_shape(x.shape)}")
    return Meta(reduced_shape(x.shape, None if axis is None else (axis,), keepdims), dt.default_index)


for _name in ("argmax", "argmin"):
    define(Op(_name, ("x",), {"axis": None, "keepdims": False}, _arg_meta, _arg_canon, family="searching", grad=NO_GRADIENT,
              doc=f"Index of the first {_name[3:]}imum along axis (of the flattened array when axis is None)."))


def _scan_canon(x, axis, dtype, include_initial):
    if axis is None:
        if x.ndim != 1:
            raise ArgumentError(f"axis must be given for an input of shape {fmt_shape(x.shape)} (not 1-d)")
        axis = 0
    return {"axis": normalize_axis(axis, x.ndim), "dtype": dtype or dt.accumulation_dtype(x.dtype)}


def _scan_meta(x, axis, dtype, include_initial):
    require(x.dtype, "numeric")
    shape = list(x.shape)
    shape[axis] += bool(include_initial)
    return Meta(tuple(shape), dtype)


def _cumulative_sum_grad(xp, g, out, x, axis, dtype, include_initial):
    if include_initial:
        g = xp.take(g, xp.arange(1, g.shape[axis], device=g.device), axis=axis)
    return (xp.astype(xp.flip(xp.cumulative_sum(xp.flip(g, axis=axis), axis=axis), axis=axis), x.dtype),)


def _cumulative_prod_grad(xp, g, out, x, axis, dtype, include_initial):
    if include_initial:
        g = xp.take(g, xp.arange(1, g.shape[axis], device=g.device), axis=axis)
        out = xp.take(out, xp.arange(1, out.shape[axis], device=out.device), axis=axis)
    # d out_j / d x_i = out_j / x_i for j >= i (nonzero inputs), conjugated
    reverse = xp.flip(xp.cumulative_sum(xp.flip(g * conj(xp, out), axis=axis), axis=axis), axis=axis)
    return (reverse / conj(xp, x),)


for _name, _grad in (("cumulative_sum", _cumulative_sum_grad), ("cumulative_prod", _cumulative_prod_grad)):
    define(Op(_name, ("x",), {"axis": None, "dtype": None, "include_initial": False}, _scan_meta, _scan_canon,
              family="reduction", grad=_grad,
              doc=f"Cumulative {_name[11:]} along axis, optionally starting with the identity."))


def _diff_meta(x, axis, n):
    require_ndim(x, 1)
    if n < 0:
        raise ArgumentError(f"n must be non-negative, got {n}")
    shape = list(x.shape)
    shape[axis] = max(shape[axis] - n, 0)
    return Meta(tuple(shape), x.dtype)


def _diff_grad(xp, g, out, x, axis, n):
    """The adjoint of a first difference, n times: dx_k = g_{k-1} - g_k."""
    if x.shape[axis] <= n:  # the output was empty
        return (xp.zeros_like(x),)
    for _ in range(n):
        shape = list(g.shape)
        shape[axis] = 1
        zero = xp.zeros(tuple(shape), dtype=g.dtype, device=g.device)
        g = xp.concat([zero, g], axis=axis) - xp.concat([g, zero], axis=axis)
    return (g,)


def _diff_canon(x, axis, n):
    axis, n = normalize_axis(axis, max(x.ndim, 1)), as_int(n, "n")
    if x.ndim and n > x.shape[axis]:  # the result is empty from n = length on; NumPy would loop n times
        n = x.shape[axis]
    return {"axis": axis, "n": n}


define(Op("diff", ("x",), {"axis": -1, "n": 1}, _diff_meta, _diff_canon,
          family="utility", grad=_diff_grad, doc="n-th discrete difference along axis."))


# --- sorting and searching -----------------------------------------------------------------

def _sort_meta(result):
    def meta(x, axis, descending, stable):
        require(x.dtype, "real")
        return Meta(x.shape, result or x.dtype)
    return meta


def _sort_grad(xp, g, out, x, axis, descending, stable):
    order = xp.argsort(x, axis=axis, descending=descending, stable=True)
    return (scatter_back(xp, g, x, lambda positions: xp.take_along_axis(positions, order, axis=axis)),)


for _name, _result, _grad in (("sort", None, _sort_grad), ("argsort", dt.default_index, NO_GRADIENT)):
    define(Op(_name, ("x",), {"axis": -1, "descending": False, "stable": True}, _sort_meta(_result),
              lambda x, axis, **_: {"axis": normalize_axis(axis, max(x.ndim, 1))}, family="sorting", grad=_grad,
              doc=f"{'Sorted values' if _name == 'sort' else 'Indices that sort'} along axis."))


def _searchsorted_meta(x1, x2, side):
    if x1.ndim != 1:
        raise ShapeError(f"x1 must be 1-d, got x1 {fmt_shape(x1.shape)} (and x2 {fmt_shape(x2.shape)})")
    if side not in ("left", "right"):
        raise ArgumentError(f"side must be 'left' or 'right', got {side!r}")
    require(dt.promote(x1.dtype, x2.dtype), "real")
    return Meta(x2.shape, dt.default_index)


define(Op("searchsorted", ("x1", "x2"), {"side": "left"}, _searchsorted_meta, promote_inputs=True, family="searching",
          grad=NO_GRADIENT, doc="Insertion indices of x2 into the sorted 1-d x1."))


# --- data-dependent shapes -----------------------------------------------------------------

def _nonzero_meta(x):
    if x.ndim == 0:
        raise ShapeError(f"nonzero is not defined for 0-d arrays, got shape {fmt_shape(x.shape)}")
    return tuple(Meta((None,), dt.default_index) for _ in range(x.ndim))


define(Op("nonzero", ("x",), {}, _nonzero_meta, family="searching", multiple=True, data_dependent=True, grad=NO_GRADIENT,
          doc="Indices of the non-zero elements, one array per axis."))


def _unique_meta(parts):
    def meta(x):
        out = {"values": Meta((None,), x.dtype), "indices": Meta((None,), dt.default_index),
               "inverse_indices": Meta(x.shape, dt.default_index), "counts": Meta((None,), dt.default_index)}
        return tuple(out[p] for p in parts)
    return meta


for _name, _parts in (("unique_values", ("values",)), ("unique_counts", ("values", "counts")),
                      ("unique_inverse", ("values", "inverse_indices")),
                      ("unique_all", ("values", "indices", "inverse_indices", "counts"))):
    define(Op(_name, ("x",), {}, _unique_meta(_parts), family="set", multiple=len(_parts) > 1, data_dependent=True,
              grad=NO_GRADIENT, doc=f"Unique elements of x, flattened, with {', '.join(_parts)}."))


def _isin_meta(x1, x2, invert):
    if not isinstance(invert, bool):
        raise ArgumentError(f"invert must be a bool, got {invert!r}")
    require(dt.promote(x1.dtype, x2.dtype), "real", "inputs")  # their common dtype
    return Meta(x1.shape, dt.bool_)


define(Op("isin", ("x1", "x2"), {"invert": False}, _isin_meta, promote_inputs=True, family="set", grad=NO_GRADIENT,
          doc="Whether each element of x1 is among x2's elements (is not, with invert=True)."))
