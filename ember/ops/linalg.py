"""The ``linalg`` extension: matrix functions over stacks of matrices in the last two axes
(decompositions, inverses, solve, diagonals, traces, norms) and its vector functions (cross,
vector_norm). The main namespace's matmul, tensordot and vecdot are in linear_algebra.py.

Gradient rules take complex values in PyTorch's convention, as in elementwise.py.
"""

from __future__ import annotations

from .. import dtypes as dt
from ..errors import ArgumentError, AxisError, ShapeError
from .gradients import NotDifferentiable, conj, expand_reduced, scatter_back, unbroadcast
from .table import (
    REQUIRED,
    Meta,
    Op,
    as_int,
    broadcast_shapes,
    define,
    fmt_shape,
    normalize_axes,
    reduced_shape,
    require,
    require_ndim,
)


def _mH(xp, a):
    """The conjugate transpose of a stack of matrices (the transpose for real ones)."""
    return conj(xp, xp.matrix_transpose(a))


def _square(x):
    require_ndim(x, 2)
    require(x.dtype, "floating")
    if x.shape[-1] != x.shape[-2]:
        raise ShapeError(f"input must be a stack of square matrices, got shape {fmt_shape(x.shape)}")


def _matrix_op(name, meta, *, attrs=None, multiple=False, determined=None, unit_free=(), unordered=(), symmetric_input=False,
               grad, doc):
    define(Op(name, ("x",), attrs or {}, meta, family="linalg", multiple=multiple, lift=True, determined=determined,
              unit_free=unit_free, unordered=unordered, symmetric_input=symmetric_input, grad=grad, doc=doc))


def _same_square(x, **_):
    _square(x)
    return Meta(x.shape, x.dtype)


def _cholesky_grad(xp, g, out, x, upper):
    lower = _mH(xp, out) if upper else out
    gl = _mH(xp, g) if upper else g
    n = x.shape[-1]
    eye = xp.eye(n, dtype=x.dtype, device=x.device)
    p = _mH(xp, lower) @ gl
    phi = xp.tril(p) - 0.5 * eye * p
    lt = _mH(xp, lower)
    y = xp.linalg.solve(lt, phi)
    s = _mH(xp, xp.linalg.solve(lt, _mH(xp, y)))
    return (0.5 * (s + _mH(xp, s)),)


_matrix_op("cholesky", lambda x, upper: _same_square(x), attrs={"upper": False}, symmetric_input=True, grad=_cholesky_grad,
           doc="Cholesky factor of a Hermitian positive-definite matrix.")


def _inv_grad(xp, g, out, x):
    t = _mH(xp, out)
    return (-(t @ g @ t),)


_matrix_op("inv", _same_square, grad=_inv_grad, doc="Matrix inverse.")


def _det_grad(xp, g, out, x):
    """g · conj(adj x)ᵀ, with the adjugate from the SVD x = u·diag(s)·vh: adj x = det(u·vh)·vh^H·diag(∏_{j≠i} s_j)·u^H,
    so a singular x (where inv fails) has its gradient too."""
    u, s, vh = xp.linalg.svd(x)
    others = xp.prod(xp.where(xp.eye(x.shape[-1], dtype=xp.bool, device=x.device), 1.0, s[..., None, :]), axis=-1)
    phase = conj(xp, xp.linalg.det(u) * xp.linalg.det(vh))
    return ((g * phase)[..., None, None] * ((u * others[..., None, :]) @ vh),)


_matrix_op("det", lambda x: (_square(x), Meta(x.shape[:-2], x.dtype))[1], grad=_det_grad, doc="Determinant.")


def _slogdet_grad(xp, g, out, x):
    g_sign, scale = g
    if g_sign is not None and x.dtype.kind == dt.COMPLEX:  # a complex sign turns with Im tr(x⁻¹ dx)
        turn = 1j * xp.imag(g_sign * xp.conj(out[0]))
        scale = turn if scale is None else scale + turn
    if scale is None:  # a real sign is piecewise constant
        return (xp.zeros_like(x),)
    return (scale[..., None, None] * _mH(xp, xp.linalg.inv(x)),)


_matrix_op("slogdet", lambda x: (_square(x), (Meta(x.shape[:-2], x.dtype), Meta(x.shape[:-2], dt.real_of(x.dtype))))[1],
           multiple=True, grad=_slogdet_grad, doc="Sign and log of the absolute determinant.")


def _eigh_grad(xp, g, out, x):
    w, v = out
    gw, gv = g
    vt = _mH(xp, v)
    inner = xp.zeros_like(x)
    if gw is not None:
        inner = inner + gw[..., :, None] * xp.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    if gv is not None:
        gap = w[..., None, :] - w[..., :, None]
        off = ~xp.eye(x.shape[-1], dtype=xp.bool, device=x.device)
        f = xp.where(off, 1.0 / xp.where(off, gap, 1.0), 0.0)
        inner = inner + f * (vt @ gv)
    ga = v @ inner @ vt
    return (0.5 * (ga + _mH(xp, ga)),)


_matrix_op("eigh", lambda x: (_square(x), (Meta(x.shape[:-1], dt.real_of(x.dtype)), Meta(x.shape, x.dtype)))[1],
           multiple=True, determined=(0,), unit_free=(1,), symmetric_input=True, grad=_eigh_grad,
           doc="Eigenvalues and eigenvectors of a Hermitian matrix.")


def _eigvalsh_grad(xp, g, out, x):
    _, v = xp.linalg.eigh(x)
    return (v @ (g[..., :, None] * _mH(xp, v)),)


_matrix_op("eigvalsh", lambda x: (_square(x), Meta(x.shape[:-1], dt.real_of(x.dtype)))[1], symmetric_input=True,
           grad=_eigvalsh_grad, doc="Eigenvalues of a Hermitian matrix.")


def _eig_meta(x):
    _square(x)
    complex_ = dt.complex_of(x.dtype)
    return Meta(x.shape[:-1], complex_), Meta(x.shape, complex_)


def _from_eigenbasis(xp, inner, v, x):
    """``V⁻ᴴ · inner · Vᴴ``: a cotangent in the eigenbasis taken back to x (its real part for a real x)."""
    vh = _mH(xp, v)
    ga = xp.linalg.solve(vh, inner @ vh)
    return (ga if x.dtype.kind == dt.COMPLEX else xp.real(ga),)


def _eig_grad(xp, g, out, x):
    """PyTorch's rule for x = V·diag(w)·V⁻¹ with unit-norm columns: gA = V⁻ᴴ (diag(gw) + (Vᴴ gV −
    Vᴴ V·diag(Re diag(Vᴴ gV))) / conj(w_j − w_i)) Vᴴ, the phase of each eigenvector left free."""
    w, v = out
    gw, gv = g
    on_diagonal = xp.eye(x.shape[-1], dtype=xp.bool, device=x.device)
    inner = xp.zeros(x.shape, dtype=v.dtype, device=x.device)
    if gv is not None:
        projected = _mH(xp, v) @ gv
        gap = xp.conj(w[..., None, :] - w[..., :, None])
        inner = projected - _mH(xp, v) @ (v * xp.real(xp.linalg.diagonal(projected))[..., None, :])
        inner = inner / xp.where(on_diagonal, 1.0, gap)
    if gw is not None:
        inner = xp.where(on_diagonal, gw[..., :, None], inner)
    return _from_eigenbasis(xp, inner, v, x)


def _eigvals_grad(xp, g, out, x):
    _, v = xp.linalg.eig(x)
    on_diagonal = xp.eye(x.shape[-1], dtype=xp.bool, device=x.device)
    return _from_eigenbasis(xp, xp.where(on_diagonal, g[..., :, None], 0.0), v, x)


_matrix_op("eig", _eig_meta, multiple=True, determined=(0,), unit_free=(1,), unordered=(0,), grad=_eig_grad,
           doc="Eigenvalues and unit-norm eigenvectors (columns) of a general matrix, complex.")
_matrix_op("eigvals", lambda x: _eig_meta(x)[0], unordered=(0,), grad=_eigvals_grad,
           doc="Eigenvalues of a general matrix, complex.")


def _matrix_power_meta(x, n):
    require_ndim(x, 2)
    require(x.dtype, "numeric" if n >= 0 else "floating")
    if x.shape[-1] != x.shape[-2]:
        raise ShapeError(f"input must be a stack of square matrices, got shape {fmt_shape(x.shape)}")
    return Meta(x.shape, x.dtype)


def _matrix_power_grad(xp, g, out, x, n):
    if n == 0:
        return (xp.zeros_like(x),)
    base = x if n > 0 else xp.linalg.inv(x)
    m = abs(n)
    powers = [xp.eye(x.shape[-1], dtype=x.dtype, device=x.device)]
    for _ in range(m - 1):
        powers.append(powers[-1] @ base)
    gb = sum((_mH(xp, powers[k]) @ g @ _mH(xp, powers[m - 1 - k]) for k in range(m)), xp.zeros_like(x))
    if n > 0:
        return (gb,)
    return (-(_mH(xp, base) @ gb @ _mH(xp, base)),)


define(Op("matrix_power", ("x",), {"n": REQUIRED}, _matrix_power_meta, lambda x, n: {"n": as_int(n, "n")}, family="linalg",
          positional=("n", "/"), grad=_matrix_power_grad, doc="x raised to the integer power n (negative n inverts)."))


def _general(x):
    require_ndim(x, 2)
    require(x.dtype, "floating")
    m, n = x.shape[-2:]
    return x.shape[:-2], m, n, min(m, n)


def _qr_meta(x, mode):
    batch, m, n, k = _general(x)
    if mode not in ("reduced", "complete"):
        raise ArgumentError(f"mode must be 'reduced' or 'complete', got {mode!r}")
    q = m if mode == "complete" else k
    return Meta(batch + (m, q), x.dtype), Meta(batch + (q, n), x.dtype)


def _svd_meta(x, full_matrices):
    batch, m, n, k = _general(x)
    u, v = (m, n) if full_matrices else (k, k)
    return Meta(batch + (m, u), x.dtype), Meta(batch + (k,), dt.real_of(x.dtype)), Meta(batch + (v, n), x.dtype)


def _svd_grad(xp, g, out, x, full_matrices):
    gu, gs, gvh = g
    if gu is not None or gvh is not None:
        raise NotImplementedError("svd: gradients through U and Vh are not supported; use svdvals for S")
    u, _, vh = xp.linalg.svd(x, full_matrices=False)
    return (u @ (gs[..., :, None] * vh),)


def _svdvals_grad(xp, g, out, x):
    u, _, vh = xp.linalg.svd(x, full_matrices=False)
    return (u @ (g[..., :, None] * vh),)


define(Op("qr", ("x",), {"mode": "reduced"}, _qr_meta, family="linalg", multiple=True, lift=True, determined=(),
          grad=NotDifferentiable("qr: gradients are not implemented yet"), doc="QR decomposition."))
define(Op("svd", ("x",), {"full_matrices": True}, _svd_meta, family="linalg", multiple=True, lift=True, determined=(1,),
          grad=_svd_grad, doc="Singular value decomposition."))
define(Op("svdvals", ("x",), {}, lambda x: (lambda b, m, n, k: Meta(b + (k,), dt.real_of(x.dtype)))(*_general(x)),
          family="linalg", lift=True, grad=_svdvals_grad, doc="Singular values."))
define(Op("pinv", ("x",), {"rtol": None}, lambda x, rtol: (lambda b, m, n, k: Meta(b + (n, m), x.dtype))(*_general(x)),
          family="linalg", lift=True,
          grad=NotDifferentiable("pinv: gradients are not implemented yet; solve or lstsq-style formulas differentiate"),
          doc="Moore–Penrose pseudo-inverse."))


def _solve_meta(x1, x2):
    _square(x1)
    dtype = dt.promote(x1.dtype, x2.dtype)
    require(dtype, "floating")
    n = x1.shape[-1]
    if x2.ndim == 1:
        if x2.shape[0] != n:
            raise ShapeError(f"shapes {fmt_shape(x1.shape)} and {fmt_shape(x2.shape)} are not aligned")
        return Meta(x1.shape[:-1], dtype)
    if x2.shape[-2] != n:
        raise ShapeError(f"shapes {fmt_shape(x1.shape)} and {fmt_shape(x2.shape)} are not aligned")
    return Meta(broadcast_shapes(x1.shape[:-2], x2.shape[:-2]) + x2.shape[-2:], dtype)


def _solve_grad(xp, g, out, x1, x2):
    t = _mH(xp, x1)
    if x2.ndim == 1:
        gb = xp.linalg.solve(t, g[..., None])[..., 0]
        ga = -(gb[..., :, None] * conj(xp, out)[..., None, :])
    else:
        gb = xp.linalg.solve(t, g)
        ga = -(gb @ _mH(xp, out))
    return unbroadcast(xp, ga, x1.shape), unbroadcast(xp, gb, x2.shape)


define(Op("solve", ("x1", "x2"), {}, _solve_meta, promote_inputs=True, family="linalg", lift=True, grad=_solve_grad,
          doc="Solution of x1 @ out = x2."))


def _cross_canon(x1, x2, axis):
    """The axis counted from the end (a non-negative one counts in the broadcast shape), where both inputs have it."""
    axis, ndim = as_int(axis, "axis"), len(broadcast_shapes(x1.shape, x2.shape))
    if not -min(x1.ndim, x2.ndim) <= (axis - ndim if axis >= 0 else axis) < 0:
        raise AxisError(f"axis {axis} is not an axis of both shapes {fmt_shape(x1.shape)} and {fmt_shape(x2.shape)}")
    return {"axis": axis - ndim if axis >= 0 else axis}


def _cross_meta(x1, x2, axis):
    dtype = dt.promote(x1.dtype, x2.dtype)
    require(dtype, "numeric")
    shape = broadcast_shapes(x1.shape, x2.shape)
    if x1.shape[axis] != 3 or x2.shape[axis] != 3:
        raise ShapeError(f"shapes {fmt_shape(x1.shape)} and {fmt_shape(x2.shape)} must have size 3 along axis {axis}")
    return Meta(shape, dtype)


def _cross_grad(xp, g, out, x1, x2, axis):
    return (unbroadcast(xp, xp.linalg.cross(conj(xp, x2), g, axis=axis), x1.shape),
            unbroadcast(xp, xp.linalg.cross(g, conj(xp, x1), axis=axis), x2.shape))


define(Op("cross", ("x1", "x2"), {"axis": -1}, _cross_meta, _cross_canon, promote_inputs=True, family="linalg", grad=_cross_grad,
          doc="Cross product of 3-vectors along axis."))


def _diagonal_meta(x, offset):
    require_ndim(x, 2)
    rows, cols = x.shape[-2:]
    length = max(0, min(rows, cols - offset) if offset >= 0 else min(rows + offset, cols))
    return Meta(x.shape[:-2] + (length,), x.dtype)


define(Op("diagonal", ("x",), {"offset": 0}, _diagonal_meta, lambda x, offset: {"offset": as_int(offset, "offset")},
          family="linalg",
          grad=lambda xp, g, out, x, offset: (scatter_back(xp, g, x, lambda p: xp.linalg.diagonal(p, offset=offset)),),
          doc="Diagonals of matrices."))


def _trace_meta(x, offset, dtype):
    require_ndim(x, 2)
    require(x.dtype, "numeric")
    return Meta(x.shape[:-2], dtype)


def _trace_grad(xp, g, out, x, offset, dtype):
    eye = xp.eye(x.shape[-2], x.shape[-1], k=offset, dtype=x.dtype, device=x.device)
    return (xp.astype(g, x.dtype)[..., None, None] * eye,)


define(Op("trace", ("x",), {"offset": 0, "dtype": None}, _trace_meta,
          lambda x, offset, dtype: {"offset": as_int(offset, "offset"), "dtype": dtype or dt.accumulation_dtype(x.dtype)},
          family="linalg", grad=_trace_grad, doc="Sums along diagonals."))


_MATRIX_ORDS = ("fro", "nuc", 1, -1, 2, -2, float("inf"), float("-inf"))


def _matrix_norm_meta(x, keepdims, ord):
    require_ndim(x, 2)
    require(x.dtype, "floating")
    if ord not in _MATRIX_ORDS:
        raise ArgumentError(f"ord must be one of {_MATRIX_ORDS}, got {ord!r}")
    return Meta(x.shape[:-2] + ((1, 1) if keepdims else ()), dt.real_of(x.dtype))


def _matrix_norm_grad(xp, g, out, x, keepdims, ord):
    gg = g if keepdims else g[..., None, None]
    norm = out if keepdims else out[..., None, None]
    if ord == "fro":
        return (gg * x / norm,)
    if ord in ("nuc", 2, -2):
        u, s, vh = xp.linalg.svd(x, full_matrices=False)
        if ord == "nuc":
            return (gg * (u @ vh),)
        k = 0 if ord == 2 else s.shape[-1] - 1
        return (gg * (u[..., :, k:k + 1] @ vh[..., k:k + 1, :]),)
    # 1, -1: largest/smallest column sum of |x|; inf, -inf: of row sums
    axis = -2 if ord in (1, -1) else -1
    sums = xp.sum(xp.abs(x), axis=axis, keepdims=True)
    pick = xp.max(sums, axis=-1 if axis == -2 else -2, keepdims=True) if ord in (1, float("inf")) else \
        xp.min(sums, axis=-1 if axis == -2 else -2, keepdims=True)
    mask = xp.astype(sums == pick, x.dtype)
    mask = mask / xp.sum(mask, axis=-1 if axis == -2 else -2, keepdims=True)
    return (gg * xp.sign(x) * mask,)


define(Op("matrix_norm", ("x",), {"keepdims": False, "ord": "fro"}, _matrix_norm_meta, family="linalg", lift=True,
          grad=_matrix_norm_grad, doc="Matrix norm of the last two axes."))


def _vector_norm_meta(x, axis, keepdims, ord):
    require(x.dtype, "floating")
    if isinstance(ord, bool) or not isinstance(ord, (int, float)):
        raise ArgumentError(f"ord must be a number, got {ord!r}")
    if ord in (float("inf"), float("-inf")) and 0 in [x.shape[a] for a in (range(x.ndim) if axis is None else axis)]:
        raise ShapeError(f"the {ord} norm of a zero-size axis of shape {fmt_shape(x.shape)} is undefined (no identity)")
    return Meta(reduced_shape(x.shape, axis, keepdims), dt.real_of(x.dtype))


def _vector_norm_grad(xp, g, out, x, axis, keepdims, ord):
    gg = expand_reduced(xp, g, x.shape, axis, keepdims)
    norm = expand_reduced(xp, out, x.shape, axis, keepdims)
    if ord == 0:
        return (xp.zeros_like(x),)
    if ord == 1:
        return (gg * xp.sign(x),)
    if ord in (float("inf"), float("-inf")):
        mask = xp.astype(xp.abs(x) == norm, x.dtype)
        count = expand_reduced(xp, xp.sum(mask, axis=axis, keepdims=keepdims), x.shape, axis, keepdims)
        return (gg * xp.sign(x) * mask / count,)
    safe = xp.where(norm > 0, norm, 1.0)  # the zero vector: take the zero subgradient, not 0/0
    if ord == 2:
        return (xp.where(norm > 0, gg * x / safe, 0.0),)
    return (xp.where(norm > 0, gg * xp.sign(x) * xp.abs(x) ** (ord - 1) / safe ** (ord - 1), 0.0),)


define(Op("vector_norm", ("x",), {"axis": None, "keepdims": False, "ord": 2}, _vector_norm_meta,
          lambda x, axis, **_: {"axis": normalize_axes(axis, x.ndim)}, family="linalg", lift=True,
          grad=_vector_norm_grad, doc="Vector norm over axis."))
