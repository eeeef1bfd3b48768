"""The NumPy backend: ember's embedded default. Kernels are the generic table (generic.py) over
NumPy 2, which has the standard's names; array_api_compat fills in where NumPy's functions lack
the standard's arguments, and NumPy's values are fixed where they are not the standard's."""

from __future__ import annotations

import functools
import math
import weakref

import array_api_compat.numpy as compat
import numpy as np

from .. import dtypes as dt
from ..ops.indexing import decode_key
from . import generic
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


# NumPy 2 has the standard's names; array_api_compat's functions serve where NumPy's lack the standard's arguments
XP = generic.Namespace(np, **{name: getattr(compat, name) for name in (
    "sort", "argsort", "unique_values", "unique_counts", "unique_inverse", "unique_all")})

KERNELS = {
    **generic.kernels(XP, NATIVE),
    "expm1": _expm1, "tanh": _tanh, "floor_divide": _floor_divide,  # NumPy's values where the standard's differ
    "mean": _mean,
    "setitem": _setitem, "scatter_add": _scatter_add,  # no function of the standard
    **NN_KERNELS,
}
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
