"""The kernel table written once over an array namespace ``xp``; each backend specialises it.

``kernels(xp, native)`` gives each op row whose kernel the Array API standard (or NumPy, where the
standard has no function) spells one way for every library, written over ``xp``; ``native`` maps
ember dtypes to the library's. A backend hands in its library as a :class:`Namespace` under the
standard's names, with its short list of renames (JAX's ``arccos`` for ``acos``, torch's
``bitwise_not`` for ``bitwise_invert``, array_api_compat's ``sort`` where NumPy's has no
``descending``), and lays its overrides over the result: fixes of the standard's special values,
the rows its library spells another way, and the rows the standard has no function for
(``setitem``, ``scatter_add``, most nn rows). So array-api-compat aliases its libraries'
functions, and array-api-strict makes its elementwise functions from one table of names: here
the names are the op table's elementwise rows.

An elementwise row's kernel is the namespace's function itself (``"add": xp.add``), with no
Python frame between: NumPy's ufuncs stay ufuncs, which ``NumpyBackend.into`` relies on.
"""

from __future__ import annotations

import math

from ..ops import OPS
from ..ops.indexing import decode_key

BINARY = tuple(name for name, op in OPS.items() if op.family == "elementwise binary")
ELEMENTWISE = tuple(name for name, op in OPS.items() if op.family == "elementwise unary") + BINARY
FFT = ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
FFTN = ("fftn", "ifftn", "rfftn", "irfftn")


class Namespace:
    """``module`` under the standard's names: each of ``renames`` is the function that serves that
    name here (the library's of another name, or array_api_compat's wrapper); every other name,
    the ``linalg`` and ``fft`` extensions among them, is the module's own."""

    def __init__(self, module, **renames):
        self.__dict__.update(vars(module))
        # the extensions by name: NumPy imports its fft on first use
        self.__dict__.update({name: getattr(module, name) for name in ("linalg", "fft") if hasattr(module, name)})
        self.__dict__.update(renames)

    def __repr__(self) -> str:
        return f"<Namespace of {self.__name__}>"


def _complex(xp, a):
    """``a`` in the complex dtype of its precision: NumPy's eig gives real results when every eigenvalue is real."""
    return a.astype(xp.result_type(a.dtype, xp.complex64), copy=False)


def kernels(xp, native) -> dict:
    """Each row's kernel over namespace ``xp``, whose dtypes ``native`` maps ember's to; a row whose function
    ``xp`` lacks (torch's unique_values) is left to the backend."""
    def layer_norm(x, *affine, normalized_shape, eps):
        axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
        # statistics in float64, as torch accumulates in a wider type: a constant float32 row normalises to 0, not 1e-4
        wide = x.astype(xp.promote_types(x.dtype, xp.float64), copy=False)
        mean = wide.mean(axis=axes, keepdims=True)
        var = ((wide - mean) ** 2).mean(axis=axes, keepdims=True)
        out = ((wide - mean) / xp.sqrt(var + eps)).astype(x.dtype, copy=False)
        return out * affine[0] + affine[1] if affine else out

    def linear(x, weight, *bias):
        out = x @ weight.T
        return out + bias[0] if bias else out

    table = {
        **{name: getattr(xp, name, None) for name in ELEMENTWISE},
        "where": xp.where, "tril": lambda x, k: xp.tril(x, k), "triu": lambda x, k: xp.triu(x, k),
        # reductions, scans, searching, sorting, sets
        "sum": lambda x, axis, dtype, keepdims: xp.sum(x, axis=axis, dtype=native[dtype], keepdims=keepdims),
        "prod": lambda x, axis, dtype, keepdims: xp.prod(x, axis=axis, dtype=native[dtype], keepdims=keepdims),
        "max": lambda x, axis, keepdims: xp.max(x, axis=axis, keepdims=keepdims),
        "min": lambda x, axis, keepdims: xp.min(x, axis=axis, keepdims=keepdims),
        "mean": lambda x, axis, keepdims: xp.mean(x, axis=axis, keepdims=keepdims),
        "std": lambda x, axis, correction, keepdims: xp.std(x, axis=axis, correction=correction, keepdims=keepdims),
        "var": lambda x, axis, correction, keepdims: xp.var(x, axis=axis, correction=correction, keepdims=keepdims),
        "all": lambda x, axis, keepdims: xp.all(x, axis=axis, keepdims=keepdims),
        "any": lambda x, axis, keepdims: xp.any(x, axis=axis, keepdims=keepdims),
        "count_nonzero": lambda x, axis, keepdims: xp.asarray(xp.count_nonzero(x, axis=axis, keepdims=keepdims),
                                                              dtype=xp.int64),
        "argmax": lambda x, axis, keepdims: xp.argmax(x, axis=axis, keepdims=keepdims),
        "argmin": lambda x, axis, keepdims: xp.argmin(x, axis=axis, keepdims=keepdims),
        "cumulative_sum": lambda x, axis, dtype, include_initial: xp.cumulative_sum(
            x, axis=axis, dtype=native[dtype], include_initial=include_initial),
        "cumulative_prod": lambda x, axis, dtype, include_initial: xp.cumulative_prod(
            x, axis=axis, dtype=native[dtype], include_initial=include_initial),
        "diff": lambda x, axis, n: xp.diff(x, n=n, axis=axis),
        "sort": lambda x, axis, descending, stable: xp.sort(x, axis=axis, descending=descending, stable=stable),
        "argsort": lambda x, axis, descending, stable: xp.argsort(x, axis=axis, descending=descending, stable=stable),
        "searchsorted": lambda x1, x2, side: xp.searchsorted(x1, x2, side=side),
        "isin": lambda x1, x2, invert: xp.isin(x1, x2, invert=invert),
        "nonzero": xp.nonzero,
        "unique_values": getattr(xp, "unique_values", None), "unique_counts": lambda x: tuple(xp.unique_counts(x)),
        "unique_inverse": lambda x: tuple(xp.unique_inverse(x)), "unique_all": lambda x: tuple(xp.unique_all(x)),
        # manipulation
        "astype": lambda x, dtype, copy: x.astype(native[dtype], copy=copy),
        "broadcast_to": xp.broadcast_to,
        "concat": lambda *arrays, axis: xp.concat(arrays, axis=axis),
        "stack": lambda *arrays, axis: xp.stack(arrays, axis=axis),
        "expand_dims": lambda x, axis: xp.expand_dims(x, axis),
        "flip": lambda x, axis: xp.flip(x, axis),
        "moveaxis": lambda x, source, destination: xp.moveaxis(x, source, destination),
        "permute_dims": lambda x, axes: xp.permute_dims(x, axes),
        "repeat": lambda x, repeats, axis: xp.repeat(x, repeats, axis),
        "reshape": lambda x, shape, copy: xp.reshape(x, shape, copy=copy),
        "roll": lambda x, shift, axis: xp.roll(x, shift, axis),
        "squeeze": lambda x, axis: xp.squeeze(x, axis),
        "tile": lambda x, repetitions: xp.tile(x, repetitions),
        "unstack": lambda x, axis: tuple(xp.unstack(x, axis=axis)),
        # creation
        "arange": lambda start, stop, step, dtype: xp.arange(start, stop, step, dtype=native[dtype]),
        "full": lambda shape, fill_value, dtype: xp.full(shape, fill_value, dtype=native[dtype]),
        "empty": lambda shape, dtype: xp.empty(shape, dtype=native[dtype]),
        "eye": lambda n_rows, n_cols, k, dtype: xp.eye(n_rows, n_cols, k, dtype=native[dtype]),
        "linspace": lambda start, stop, num, dtype, endpoint: xp.linspace(start, stop, num, endpoint=endpoint,
                                                                          dtype=native[dtype]),
        # indexing
        "getitem": lambda x, *indices, key: x[decode_key(key, indices)],
        "take": lambda x, indices, axis: xp.take(x, indices, axis=axis),
        "take_along_axis": lambda x, indices, axis: xp.take_along_axis(x, indices, axis),
        # linear algebra
        "matmul": xp.matmul, "tensordot": lambda x1, x2, axes: xp.tensordot(x1, x2, axes),
        "vecdot": lambda x1, x2, axis: xp.vecdot(x1, x2, axis=axis),
        "cholesky": lambda x, upper: xp.linalg.cholesky(x, upper=upper), "inv": xp.linalg.inv, "det": xp.linalg.det,
        "slogdet": lambda x: tuple(xp.linalg.slogdet(x)), "eigh": lambda x: tuple(xp.linalg.eigh(x)),
        "eig": lambda x: tuple(_complex(xp, a) for a in xp.linalg.eig(x)),
        "eigvals": lambda x: _complex(xp, xp.linalg.eigvals(x)),
        "eigvalsh": xp.linalg.eigvalsh, "matrix_power": lambda x, n: xp.linalg.matrix_power(x, n),
        "qr": lambda x, mode: tuple(xp.linalg.qr(x, mode=mode)),
        "svd": lambda x, full_matrices: tuple(xp.linalg.svd(x, full_matrices=full_matrices)),
        "svdvals": xp.linalg.svdvals, "pinv": lambda x, rtol: xp.linalg.pinv(x, rtol=rtol), "solve": xp.linalg.solve,
        "cross": lambda x1, x2, axis: xp.linalg.cross(x1, x2, axis=axis),
        "diagonal": lambda x, offset: xp.diagonal(x, offset, axis1=-2, axis2=-1),
        "trace": lambda x, offset, dtype: xp.trace(x, offset, axis1=-2, axis2=-1, dtype=native[dtype]),
        "matrix_norm": lambda x, keepdims, ord: xp.linalg.matrix_norm(x, keepdims=keepdims, ord=ord),
        "vector_norm": lambda x, axis, keepdims, ord: xp.linalg.vector_norm(x, axis=axis, keepdims=keepdims, ord=ord),
        # fft
        **{name: _fft(getattr(xp.fft, name)) for name in FFT},
        **{name: _fftn(getattr(xp.fft, name)) for name in FFTN},
        "fftfreq": lambda n, d, dtype: xp.fft.fftfreq(n, d).astype(native[dtype], copy=False),
        "rfftfreq": lambda n, d, dtype: xp.fft.rfftfreq(n, d).astype(native[dtype], copy=False),
        "fftshift": lambda x, axes: xp.fft.fftshift(x, axes=axes) if axes else x.copy(),
        "ifftshift": lambda x, axes: xp.fft.ifftshift(x, axes=axes) if axes else x.copy(),
        # nn
        "linear": linear, "layer_norm": layer_norm, "embedding": lambda indices, weight: weight[indices],
    }
    return {name: kernel for name, kernel in table.items() if kernel is not None}  # the rest: the backend's own


def _fft(function):
    return lambda x, n, axis, norm: function(x, n=n, axis=axis, norm=norm)


def _fftn(function):
    return lambda x, s, axes, norm: function(x, s=s, axes=axes, norm=norm)


def attention(xp, softmax):
    """The scaled_dot_product_attention kernel over ``xp``, with the backend's ``softmax(x, axis=...)``."""
    def kernel(q, k, v, *mask, is_causal, scale):
        s = (1 / math.sqrt(q.shape[-1])) if scale is None else scale
        scores = (q @ xp.swapaxes(k, -1, -2)) * s
        if mask:
            scores = scores + mask[0]
        if is_causal:
            scores = xp.where(xp.tril(xp.ones(scores.shape[-2:], dtype=bool)), scores, -xp.inf)
        return softmax(scores, axis=-1) @ v
    return kernel
