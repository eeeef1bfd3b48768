"""Reductions, scans, searching, sorting and set operations (statistical, searching, sorting,
set and utility sections of the standard)."""

from __future__ import annotations

from .. import dtypes as dt
from ..errors import ArgumentError, ShapeError
from . import samples
from .table import Meta, Op, as_int, define, fmt_shape, normalize_axes, normalize_axis, reduced_shape, require, require_ndim


def _axes_canon(x, axis, **_):
    return {"axis": normalize_axes(axis, x.ndim)}


def _accumulating_canon(x, axis, dtype, **_):
    return {"axis": normalize_axes(axis, x.ndim), "dtype": dtype or dt.accumulation_dtype(x.dtype)}


def reduction(name, category, result, *, lift=None, canon=_axes_canon, extra_attrs=None, nonempty=False, doc=""):
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
              lift=lift, doc=doc,
              examples=samples.reduction(lift or category, extra=_extra_examples(extra_attrs), min_side=int(nonempty)),
              bad_examples=samples.bad_axis(lift or category)))


def _extra_examples(extra_attrs):
    if "correction" in extra_attrs:
        return lambda g: {"correction": g.choice([0.0, 1.0])}
    return None


def _explicit_dtype(x, attrs):
    return attrs["dtype"]


reduction("sum", "numeric", _explicit_dtype, canon=_accumulating_canon, extra_attrs={"dtype": None},
          doc="Sum over axis; small integers accumulate in 64 bits unless dtype is given.")
reduction("prod", "numeric", _explicit_dtype, canon=_accumulating_canon, extra_attrs={"dtype": None},
          doc="Product over axis; small integers accumulate in 64 bits unless dtype is given.")
reduction("max", "real numeric", lambda x, a: x.dtype, nonempty=True, doc="Maximum over axis (NaN propagates).")
reduction("min", "real numeric", lambda x, a: x.dtype, nonempty=True, doc="Minimum over axis (NaN propagates).")
reduction("mean", "floating", lambda x, a: x.dtype, lift="floating", doc="Arithmetic mean over axis.")
reduction("std", "real floating", lambda x, a: x.dtype, lift="real floating", extra_attrs={"correction": 0.0},
          doc="Standard deviation over axis with a degrees-of-freedom correction.")
reduction("var", "real floating", lambda x, a: x.dtype, lift="real floating", extra_attrs={"correction": 0.0},
          doc="Variance over axis with a degrees-of-freedom correction.")
reduction("all", "any", lambda x, a: dt.bool_, doc="Whether every element along axis is true.")
reduction("any", "any", lambda x, a: dt.bool_, doc="Whether some element along axis is true.")
reduction("count_nonzero", "any", lambda x, a: dt.default_index, doc="Number of non-zero elements along axis.")


def _arg_canon(x, axis, **_):
    return {"axis": None if axis is None else normalize_axis(axis, x.ndim)}


def _arg_meta(x, axis, keepdims):
    require(x.dtype, "real numeric")
    if 0 in (x.shape if axis is None else (x.shape[axis],)):
        raise ShapeError(f"cannot take argmax/argmin over a zero-size axis of shape {fmt_shape(x.shape)}")
    return Meta(reduced_shape(x.shape, None if axis is None else (axis,), keepdims), dt.default_index)


def _arg_examples(g):
    shape = g.shape(min_dims=1, min_side=1)
    axis = g.choice([None, g.integer(-len(shape), len(shape) - 1)])
    return (g.array(shape, g.dtype("real numeric")),), {"axis": axis, "keepdims": g.flag()}


for _name in ("argmax", "argmin"):
    define(Op(_name, ("x",), {"axis": None, "keepdims": False}, _arg_meta, _arg_canon, family="searching",
              examples=_arg_examples, bad_examples=samples.bad_axis("real numeric"),
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


def _scan_examples(g):
    shape = g.shape(min_dims=1)
    axis = g.integer(-len(shape), len(shape) - 1)
    return (g.array(shape, g.dtype("numeric"), low=-3, high=3),), {"axis": axis, "include_initial": g.flag()}


for _name in ("cumulative_sum", "cumulative_prod"):
    define(Op(_name, ("x",), {"axis": None, "dtype": None, "include_initial": False}, _scan_meta, _scan_canon,
              family="reduction", examples=_scan_examples, bad_examples=samples.bad_axis("numeric"),
              doc=f"Cumulative {_name[11:]} along axis, optionally starting with the identity."))


def _diff_meta(x, axis, n):
    require_ndim(x, 1)
    if n < 0:
        raise ArgumentError(f"n must be non-negative, got {n}")
    shape = list(x.shape)
    shape[axis] = max(shape[axis] - n, 0)
    return Meta(tuple(shape), x.dtype)


def _diff_examples(g):
    shape = g.shape(min_dims=1)
    axis = g.integer(-len(shape), len(shape) - 1)
    return (g.array(shape, g.dtype("real numeric"), low=-100, high=100),), {"axis": axis, "n": g.integer(0, 2)}


define(Op("diff", ("x",), {"axis": -1, "n": 1}, _diff_meta,
          lambda x, axis, n: {"axis": normalize_axis(axis, max(x.ndim, 1)), "n": as_int(n, "n")},
          family="utility", examples=_diff_examples, bad_examples=samples.bad_axis("numeric"),
          doc="n-th discrete difference along axis."))


# --- sorting and searching -----------------------------------------------------------------

def _sort_meta(result):
    def meta(x, axis, descending, stable):
        require(x.dtype, "real")
        return Meta(x.shape, result or x.dtype)
    return meta


def _sort_examples(g):
    shape = g.shape(min_dims=1)
    axis = g.integer(-len(shape), len(shape) - 1)
    return (g.array(shape, g.dtype("real numeric")),), {"axis": axis, "descending": g.flag(), "stable": True}


for _name, _result in (("sort", None), ("argsort", dt.default_index)):
    define(Op(_name, ("x",), {"axis": -1, "descending": False, "stable": True}, _sort_meta(_result),
              lambda x, axis, **_: {"axis": normalize_axis(axis, max(x.ndim, 1))}, family="sorting",
              examples=_sort_examples, bad_examples=samples.bad_axis("real numeric"),
              doc=f"{'Sorted values' if _name == 'sort' else 'Indices that sort'} along axis."))


def _searchsorted_meta(x1, x2, side):
    if x1.ndim != 1:
        raise ShapeError(f"x1 must be 1-d, got shape {fmt_shape(x1.shape)}")
    if side not in ("left", "right"):
        raise ArgumentError(f"side must be 'left' or 'right', got {side!r}")
    require(dt.promote(x1.dtype, x2.dtype), "real")
    return Meta(x2.shape, dt.default_index)


def _searchsorted_examples(g):
    dtype = g.dtype("real numeric")
    import numpy as np  # the recipe sorts its own input; recipes run only in tests
    return (np.sort(g.array((g.integer(0, 6),), dtype)), g.array(g.shape(), dtype)), {"side": g.choice(["left", "right"])}


define(Op("searchsorted", ("x1", "x2"), {"side": "left"}, _searchsorted_meta, promote_inputs=True, family="searching",
          examples=_searchsorted_examples, doc="Insertion indices of x2 into the sorted 1-d x1."))


# --- data-dependent shapes -----------------------------------------------------------------

def _nonzero_meta(x):
    if x.ndim == 0:
        raise ShapeError("nonzero is not defined for 0-d arrays")
    return tuple(Meta((None,), dt.default_index) for _ in range(x.ndim))


define(Op("nonzero", ("x",), {}, _nonzero_meta, family="searching", multiple=True, data_dependent=True,
          examples=lambda g: ((g.array(g.shape(min_dims=1), g.dtype("any")),), {}),
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
              examples=lambda g: ((g.array(g.shape(), g.dtype("real numeric"), low=0, high=5),), {}),
              doc=f"Unique elements of x, flattened, with {', '.join(_parts)}."))


# --- gradient rules ------------------------------------------------------------------------------------

from .gradients import conj, defgrad, expand_reduced, no_gradient, scatter_back  # noqa: E402


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


def _sort_grad(xp, g, out, x, axis, descending, stable):
    order = xp.argsort(x, axis=axis, descending=descending, stable=True)
    return (scatter_back(xp, g, x, lambda positions: xp.take_along_axis(positions, order, axis=axis)),)


defgrad("sum", _sum_grad)
defgrad("prod", _prod_grad)
defgrad("max", _extremum_grad)
defgrad("min", _extremum_grad)
defgrad("mean", _mean_grad)
defgrad("var", _var_grad)
defgrad("std", _std_grad)
defgrad("cumulative_sum", _cumulative_sum_grad)
defgrad("cumulative_prod", _cumulative_prod_grad)
defgrad("diff", _diff_grad)
defgrad("sort", _sort_grad)
no_gradient("all", "any", "count_nonzero", "argmax", "argmin", "argsort", "searchsorted", "nonzero",
            "unique_values", "unique_counts", "unique_inverse", "unique_all")
