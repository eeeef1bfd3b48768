"""The NumPy backend: ember's embedded default. Kernels are NumPy 2 functions, which follow
the Array API standard for most operations; array_api_compat fills the rest."""

from __future__ import annotations

import functools
import math
import weakref

import array_api_compat.numpy as compat
import numpy as np

from .. import dtypes as dt
from ..ops.indexing import decode_key
from .base import Backend, cpu_threads, held_alone
from .numpy_nn import KERNELS as NN_KERNELS

NATIVE, EMBER = dt.NUMPY, dt.FROM_NUMPY  # NumPy's dtypes are the host's: the map lives in dtypes


def _setitem(x, value, *indices, key):
    out = x.copy()
    out[decode_key(key, indices)] = value
    return out


def _floor_divide(x1, x2):
    out = np.floor_divide(x1, x2)
    if out.dtype.kind == "f":  # NumPy gives nan for inf // finite; the standard wants floor(x1 / x2) there
        infinite = np.isinf(x1) & np.isfinite(x2) | np.isfinite(x1) & np.isinf(x2)
        if infinite.any():
            out = np.where(infinite, np.floor(np.divide(x1, x2)), out)
    return out


def _expm1(x):
    out = np.expm1(x)
    if out.dtype.kind == "c":  # NumPy's complex expm1 loses the standard's values at infinities …
        out = np.where(np.isfinite(x), out, np.exp(x) - 1)
        zero = (x.real == 0) & (x.imag == 0)
        if zero.any():  # … and gives -0 for expm1(-0 + 0j), where the standard wants +0
            exact = np.zeros_like(out)
            exact.imag = x.imag
            out = np.where(zero, exact, out)
    return out


def _tanh(x):
    out = np.tanh(x)
    if out.dtype.kind == "c":  # tanh(±inf + yj) is ±1 + 0j for finite y
        edge = np.isinf(x.real) & np.isfinite(x.imag)
        if edge.any():
            out = np.where(edge, np.sign(x.real) + 0j, out)
    return out


def _scatter_add(x, indices, values):
    out = x.copy()
    np.add.at(out, indices, values)
    return out


def _mean(x, axis, keepdims):
    """np.mean's arithmetic without its Python wrapper (three times faster on small arrays)."""
    count = x.size if axis is None else math.prod(x.shape[a] for a in axis)
    total = np.add.reduce(x, axis=axis, keepdims=keepdims)
    return np.true_divide(total, count) if count else np.true_divide(total, 0.0)


def _sort(x, axis, descending, stable):
    return compat.sort(x, axis=axis, descending=descending, stable=stable)


def _argsort(x, axis, descending, stable):
    return compat.argsort(x, axis=axis, descending=descending, stable=stable)


def _complex(a):
    """``a`` in the complex dtype of its precision: NumPy's eig gives real results when every eigenvalue is real."""
    return a.astype(np.result_type(a.dtype, np.complex64), copy=False)


def _unique(function):
    return lambda x: tuple(function(x))


def _fft(function):
    return lambda x, n, axis, norm: function(x, n=n, axis=axis, norm=norm)


def _fftn(function):
    return lambda x, s, axes, norm: function(x, s=s, axes=axes, norm=norm)


def _cumulative(function):
    return lambda x, axis, dtype, include_initial: function(x, axis=axis, dtype=NATIVE[dtype], include_initial=include_initial)


KERNELS = {
    # elementwise
    "abs": np.abs, "acos": np.arccos, "acosh": np.arccosh, "asin": np.arcsin, "asinh": np.arcsinh,
    "atan": np.arctan, "atanh": np.arctanh, "bitwise_invert": np.invert, "ceil": np.ceil, "conj": np.conj,
    "cos": np.cos, "cosh": np.cosh, "exp": np.exp, "expm1": _expm1, "floor": np.floor, "imag": np.imag,
    "isfinite": np.isfinite, "isinf": np.isinf, "isnan": np.isnan, "log": np.log, "log1p": np.log1p,
    "log2": np.log2, "log10": np.log10, "logical_not": np.logical_not, "negative": np.negative,
    "positive": np.positive, "real": np.real, "reciprocal": np.reciprocal, "round": np.round, "sign": np.sign,
    "signbit": np.signbit, "sin": np.sin, "sinh": np.sinh, "sqrt": np.sqrt, "square": np.square, "tan": np.tan,
    "tanh": _tanh, "trunc": np.trunc,
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide, "pow": np.power,
    "equal": np.equal, "not_equal": np.not_equal, "greater": np.greater, "greater_equal": np.greater_equal,
    "less": np.less, "less_equal": np.less_equal, "floor_divide": _floor_divide, "remainder": np.remainder,
    "maximum": np.maximum, "minimum": np.minimum, "atan2": np.arctan2, "copysign": np.copysign, "hypot": np.hypot,
    "nextafter": np.nextafter, "logaddexp": np.logaddexp, "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or,
    "bitwise_xor": np.bitwise_xor, "bitwise_left_shift": np.left_shift, "bitwise_right_shift": np.right_shift,
    "logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor,
    "where": np.where, "tril": lambda x, k: np.tril(x, k), "triu": lambda x, k: np.triu(x, k),
    # reductions, scans, searching, sorting, sets
    "sum": lambda x, axis, dtype, keepdims: np.sum(x, axis=axis, dtype=NATIVE[dtype], keepdims=keepdims),
    "prod": lambda x, axis, dtype, keepdims: np.prod(x, axis=axis, dtype=NATIVE[dtype], keepdims=keepdims),
    "max": lambda x, axis, keepdims: np.max(x, axis=axis, keepdims=keepdims),
    "min": lambda x, axis, keepdims: np.min(x, axis=axis, keepdims=keepdims),
    "mean": _mean,
    "std": lambda x, axis, correction, keepdims: np.std(x, axis=axis, ddof=correction, keepdims=keepdims),
    "var": lambda x, axis, correction, keepdims: np.var(x, axis=axis, ddof=correction, keepdims=keepdims),
    "all": lambda x, axis, keepdims: np.all(x, axis=axis, keepdims=keepdims),
    "any": lambda x, axis, keepdims: np.any(x, axis=axis, keepdims=keepdims),
    "count_nonzero": lambda x, axis, keepdims: np.asarray(np.count_nonzero(x, axis=axis, keepdims=keepdims), dtype=np.int64),
    "argmax": lambda x, axis, keepdims: np.argmax(x, axis=axis, keepdims=keepdims),
    "argmin": lambda x, axis, keepdims: np.argmin(x, axis=axis, keepdims=keepdims),
    "cumulative_sum": _cumulative(np.cumulative_sum), "cumulative_prod": _cumulative(np.cumulative_prod),
    "diff": lambda x, axis, n: np.diff(x, n=n, axis=axis),
    "sort": _sort, "argsort": _argsort,
    "searchsorted": lambda x1, x2, side: np.searchsorted(x1, x2, side=side),
    "isin": lambda x1, x2, invert: np.isin(x1, x2, invert=invert),
    "nonzero": np.nonzero,
    "unique_values": compat.unique_values, "unique_counts": _unique(compat.unique_counts),
    "unique_inverse": _unique(compat.unique_inverse), "unique_all": _unique(compat.unique_all),
    # manipulation
    "astype": lambda x, dtype, copy: x.astype(NATIVE[dtype], copy=copy),
    "broadcast_to": np.broadcast_to,
    "concat": lambda *arrays, axis: np.concatenate(arrays, axis=axis),
    "stack": lambda *arrays, axis: np.stack(arrays, axis=axis),
    "expand_dims": lambda x, axis: np.expand_dims(x, axis),
    "flip": lambda x, axis: np.flip(x, axis),
    "moveaxis": lambda x, source, destination: np.moveaxis(x, source, destination),
    "permute_dims": lambda x, axes: np.transpose(x, axes),
    "repeat": lambda x, repeats, axis: np.repeat(x, repeats, axis),
    "reshape": lambda x, shape, copy: np.reshape(x, shape, copy=copy),
    "roll": lambda x, shift, axis: np.roll(x, shift, axis),
    "squeeze": lambda x, axis: np.squeeze(x, axis),
    "tile": lambda x, repetitions: np.tile(x, repetitions),
    "unstack": lambda x, axis: np.unstack(x, axis=axis),
    # creation
    "arange": lambda start, stop, step, dtype: np.arange(start, stop, step, dtype=NATIVE[dtype]),
    "full": lambda shape, fill_value, dtype: np.full(shape, fill_value, dtype=NATIVE[dtype]),
    "empty": lambda shape, dtype: np.empty(shape, dtype=NATIVE[dtype]),
    "eye": lambda n_rows, n_cols, k, dtype: np.eye(n_rows, n_cols, k, dtype=NATIVE[dtype]),
    "linspace": lambda start, stop, num, dtype, endpoint: np.linspace(start, stop, num, endpoint=endpoint, dtype=NATIVE[dtype]),
    # indexing
    "getitem": lambda x, *indices, key: x[decode_key(key, indices)],
    "setitem": _setitem,
    "take": lambda x, indices, axis: np.take(x, indices, axis=axis),
    "take_along_axis": lambda x, indices, axis: np.take_along_axis(x, indices, axis),
    "scatter_add": _scatter_add,
    # linear algebra
    "matmul": np.matmul, "tensordot": lambda x1, x2, axes: np.tensordot(x1, x2, axes),
    "vecdot": lambda x1, x2, axis: np.vecdot(x1, x2, axis=axis),
    "cholesky": lambda x, upper: np.linalg.cholesky(x, upper=upper), "inv": np.linalg.inv, "det": np.linalg.det,
    "slogdet": lambda x: tuple(np.linalg.slogdet(x)), "eigh": lambda x: tuple(np.linalg.eigh(x)),
    "eig": lambda x: tuple(_complex(a) for a in np.linalg.eig(x)), "eigvals": lambda x: _complex(np.linalg.eigvals(x)),
    "eigvalsh": np.linalg.eigvalsh, "matrix_power": lambda x, n: np.linalg.matrix_power(x, n),
    "qr": lambda x, mode: tuple(np.linalg.qr(x, mode=mode)),
    "svd": lambda x, full_matrices: tuple(np.linalg.svd(x, full_matrices=full_matrices)),
    "svdvals": np.linalg.svdvals, "pinv": lambda x, rtol: np.linalg.pinv(x, rtol=rtol), "solve": np.linalg.solve,
    "cross": lambda x1, x2, axis: np.cross(x1, x2, axis=axis),
    "diagonal": lambda x, offset: np.diagonal(x, offset, axis1=-2, axis2=-1),
    "trace": lambda x, offset, dtype: np.trace(x, offset, axis1=-2, axis2=-1, dtype=NATIVE[dtype]),
    "matrix_norm": lambda x, keepdims, ord: np.linalg.matrix_norm(x, keepdims=keepdims, ord=ord),
    "vector_norm": lambda x, axis, keepdims, ord: np.linalg.vector_norm(x, axis=axis, keepdims=keepdims, ord=ord),
    # fft
    "fft": _fft(np.fft.fft), "ifft": _fft(np.fft.ifft), "rfft": _fft(np.fft.rfft), "irfft": _fft(np.fft.irfft),
    "hfft": _fft(np.fft.hfft), "ihfft": _fft(np.fft.ihfft),
    "fftn": _fftn(np.fft.fftn), "ifftn": _fftn(np.fft.ifftn), "rfftn": _fftn(np.fft.rfftn), "irfftn": _fftn(np.fft.irfftn),
    "fftfreq": lambda n, d, dtype: np.fft.fftfreq(n, d).astype(NATIVE[dtype], copy=False),
    "rfftfreq": lambda n, d, dtype: np.fft.rfftfreq(n, d).astype(NATIVE[dtype], copy=False),
    "fftshift": lambda x, axes: np.fft.fftshift(x, axes) if axes else x.copy(),
    "ifftshift": lambda x, axes: np.fft.ifftshift(x, axes) if axes else x.copy(),
}


KERNELS.update(NN_KERNELS)
# ufuncs whose positional ``out`` NumPy 2.4 deprecates (a third argument read as a third operand by mistake)
_OUT_BY_KEYWORD = (np.maximum, np.minimum)


class NumpyBackend(Backend):
    """NumPy on the host CPU: one device, ``numpy``."""

    name = device_name = "numpy"
    native_type = np.ndarray
    kernels = KERNELS
    gaps: dict = {}

    @functools.cached_property
    def threads(self) -> int:
        return cpu_threads()

    def coerce(self, value):
        return np.asarray(value)

    def into(self, name):
        """A ufunc kernel, whose last positional argument is its ``out``; the wrappers that fix
        NumPy's results (expm1, tanh, floor_divide) and plain functions (round, real) have none."""
        kernel = KERNELS.get(name)
        if not isinstance(kernel, np.ufunc):
            return None
        if kernel in _OUT_BY_KEYWORD:
            return lambda *args: kernel(*args[:-1], out=args[-1])
        return kernel

    def unshared(self, arrays):
        """Reference counts tell: a view or buffer of an array holds a reference to the array that
        owns the memory, so an owner counted by ``arrays`` alone (and with no weak reference) is
        seen by nothing else."""
        for array, alone in zip(arrays, held_alone(arrays)):
            if not alone or type(array) is not np.ndarray or array.base is not None or weakref.getweakrefcount(array):
                return False
        return True

    def literal(self, value, dtype):
        """A 0-d array of the literal's dtype: the dtype NumPy casts a Python scalar to beside an
        array of that dtype (the namespace gives literals the array's dtype), without the cast at
        every call; a value that dtype cannot hold stays a Python scalar, for the kernel to judge."""
        try:
            with np.errstate(all="raise"):
                converted = np.array(value, dtype=NATIVE[dtype])
        except (OverflowError, ValueError, FloatingPointError, TypeError):
            return value
        converted.flags.writeable = False  # shared by every call and plan that uses the value
        return converted

    def dtype_of(self, native) -> dt.DType:
        return EMBER[native.dtype]

    def from_host(self, host):
        return host

    def to_host(self, native):
        return native

    def adopt(self, native):
        """The same array: ember never writes into an array in place, so sessions may share it."""
        return native

    def from_dlpack(self, obj, copy=None):
        return np.from_dlpack(obj, copy=copy)


def devices() -> list[str]:
    """The ember device strings of this backend's devices."""
    return ["numpy"]


def backend(device_name: str = "numpy") -> NumpyBackend:
    """The backend object for ``device_name`` (numpy has one device)."""
    return BACKEND


BACKEND = NumpyBackend()
