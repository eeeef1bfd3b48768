"""The ``linalg`` extension of the standard (``ember.linalg``)."""

from __future__ import annotations

from typing import NamedTuple

from .. import dtypes as dt
from ..array import Array, prefixed
from ..errors import ShapeError
from ._generate import accumulating, from_row, named_result, require_array
from .linear_algebra import matmul, matrix_transpose, tensordot, vecdot  # noqa: F401  (also in linalg)

cholesky = from_row("cholesky")
cross = from_row("cross")
det = from_row("det")
diagonal = from_row("diagonal")
eigvals = from_row("eigvals")
eigvalsh = from_row("eigvalsh")
inv = from_row("inv")
matrix_norm = from_row("matrix_norm")
matrix_power = from_row("matrix_power")
solve = from_row("solve")
svdvals = from_row("svdvals")
trace = accumulating(from_row("trace"))
vector_norm = from_row("vector_norm")
_pinv = from_row("pinv")

__all__ = ["cholesky", "cross", "det", "diagonal", "eig", "eigh", "eigvals", "eigvalsh", "inv", "matmul", "matrix_norm",
           "matrix_power", "matrix_rank", "matrix_transpose", "outer", "pinv", "qr", "slogdet", "solve", "svd", "svdvals",
           "tensordot", "trace", "vecdot", "vector_norm"]


class EigResult(NamedTuple):
    eigenvalues: Array
    eigenvectors: Array


class EighResult(NamedTuple):
    eigenvalues: Array
    eigenvectors: Array


class QRResult(NamedTuple):
    Q: Array
    R: Array


class SlogdetResult(NamedTuple):
    sign: Array
    logabsdet: Array


class SVDResult(NamedTuple):
    U: Array
    S: Array
    Vh: Array


eig = named_result("eig", EigResult)
eigh = named_result("eigh", EighResult)
qr = named_result("qr", QRResult)
slogdet = named_result("slogdet", SlogdetResult)
svd = named_result("svd", SVDResult)


@prefixed("pinv")
def pinv(x, /, *, rtol=None) -> Array:
    """Moore–Penrose pseudo-inverse; singular values at or below rtol × the largest are dropped.

    ``rtol`` is a float, or an array broadcasting against x's stack of matrices.
    """
    if not isinstance(rtol, Array):
        return _pinv(x, rtol=rtol)
    from .elementwise import conj, divide, greater
    from .searching import where
    from .statistical import max as max_
    u, s, vh = svd(require_array(x, "pinv"), full_matrices=False)
    largest = max_(s, axis=-1, keepdims=True) if s.shape[-1] else s
    keep = greater(s, largest * rtol[..., None])
    inverse = where(keep, divide(1.0, where(keep, s, 1.0)), 0.0)
    return matmul(matrix_transpose(conj(vh)) * inverse[..., None, :], matrix_transpose(conj(u)))


@prefixed("matrix_rank")
def matrix_rank(x, /, *, rtol=None) -> Array:
    """Number of singular values above rtol × the largest (default max(M, N) × eps)."""
    from .searching import count_nonzero
    from .statistical import max as max_
    require_array(x, "matrix_rank")
    if x.ndim < 2:
        raise ShapeError(f"input must be at least 2-d, got shape {x.shape}")
    s = svdvals(x)
    if rtol is None:
        rtol = max(x.shape[-2:]) * dt.finfo(s.dtype).eps
    largest = max_(s, axis=-1, keepdims=True) if s.shape[-1] else s[..., :1]
    if isinstance(rtol, Array):
        rtol = rtol[..., None]
    return count_nonzero(s > largest * rtol, axis=-1)


@prefixed("outer")
def outer(x1, x2, /) -> Array:
    """Outer product of two 1-d arrays."""
    from .elementwise import multiply
    for a in (x1, x2):
        require_array(a, "outer")
        if a.ndim != 1:
            raise ShapeError(f"inputs must be 1-d, got shapes {x1.shape} and {x2.shape}")
    return multiply(x1[:, None], x2[None, :])
