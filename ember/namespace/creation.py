"""Creation functions (the standard's creation section)."""

from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..array import Array, bind, prefixed
from ..devices import Device, default_device
from ..devices import device as as_device
from ..errors import ArgumentError, DTypeError
from ..ops import OPS
from ..ops.table import Meta
from ._generate import from_row, require_array

arange = from_row("arange")
eye = from_row("eye")
linspace = from_row("linspace")
tril = from_row("tril")
triu = from_row("triu")
_full = from_row("full")
_empty = from_row("empty")

__all__ = ["arange", "asarray", "empty", "empty_like", "eye", "from_dlpack", "full", "full_like", "linspace",
           "meshgrid", "ones", "ones_like", "tril", "triu", "zeros", "zeros_like"]


def _device_or_default(device) -> Device:
    return default_device() if device is None else as_device(device)


def _check_dtype(dtype, name: str):
    if dtype is not None and not isinstance(dtype, dt.DType):
        raise DTypeError(f"{name}: dtype must be an ember dtype, got {dtype!r}")


def full(shape, fill_value, *, dtype=None, device=None) -> Array:
    """An array of ``shape`` filled with ``fill_value`` (dtype inferred from it when not given)."""
    _check_dtype(dtype, "full")
    if isinstance(fill_value, Array):
        fill_value = fill_value.__complex__() if fill_value.dtype.kind == dt.COMPLEX else fill_value._scalar(lambda v: v, "full")
    return _full(shape=shape, fill_value=fill_value, dtype=dtype, device=device)


def zeros(shape, *, dtype=None, device=None) -> Array:
    """An array of zeros (float64 unless dtype is given)."""
    _check_dtype(dtype, "zeros")
    dtype = dtype or dt.default_float
    return _full(shape=shape, fill_value=False if dtype is dt.bool_ else 0, dtype=dtype, device=device)


def ones(shape, *, dtype=None, device=None) -> Array:
    """An array of ones (float64 unless dtype is given)."""
    _check_dtype(dtype, "ones")
    dtype = dtype or dt.default_float
    return _full(shape=shape, fill_value=True if dtype is dt.bool_ else 1, dtype=dtype, device=device)


def empty(shape, *, dtype=None, device=None) -> Array:
    """An uninitialised array (float64 unless dtype is given)."""
    _check_dtype(dtype, "empty")
    return _empty(shape=shape, dtype=dtype, device=device)


def _like(name, fill):
    def function(x, /, *, dtype=None, device=None) -> Array:
        require_array(x, name)
        dtype = dtype or x.dtype
        return fill(x.shape, dtype=dtype, device=device if device is not None else x.device)
    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"Like {name[:-5]}, with x's shape, and x's dtype and device unless given."
    return function


zeros_like = _like("zeros_like", zeros)
ones_like = _like("ones_like", ones)
empty_like = _like("empty_like", empty)


def full_like(x, /, fill_value, *, dtype=None, device=None) -> Array:
    """An array of x's shape filled with fill_value, with x's dtype and device unless given."""
    require_array(x, "full_like")
    return full(x.shape, fill_value, dtype=dtype or x.dtype, device=device if device is not None else x.device)


@prefixed("asarray")
def asarray(obj, /, *, dtype=None, device=None, copy=None) -> Array:
    """An ember array from an ember array, a NumPy/DLPack/buffer object, a Python scalar or a
    nested sequence of them.

    ``copy=None`` reuses memory where possible, ``copy=False`` refuses to copy, ``copy=True``
    always copies.
    """
    _check_dtype(dtype, "asarray")
    if isinstance(obj, Array):
        return _from_array(obj, dtype, device, copy)
    target = _device_or_default(device)
    host = _host_array(obj, dtype, copy)
    engine = target.engine
    meta = Meta(tuple(host.shape), dt.FROM_NUMPY[host.dtype])
    return Array._new(engine.upload(host), meta, target)  # host is already a copy where copy=True asked for one


def _from_array(x: Array, dtype, device, copy) -> Array:
    if device is not None and as_device(device) is not x.device:
        if copy is False:
            raise ValueError(f"copy=False but moving from {x.device} to {device} needs a copy")
        x = x.to_device(device)
        copy = None if copy else copy
    if dtype is not None and dtype is not x.dtype:
        if copy is False:
            raise ValueError(f"copy=False but casting {x.dtype} to {dtype} needs a copy")
        return bind(OPS["astype"], (x,), {"dtype": dtype, "copy": True})
    if copy:
        return bind(OPS["astype"], (x,), {"dtype": x.dtype, "copy": True})
    return x


def _host_array(obj, dtype, copy) -> np.ndarray:
    """``obj`` as a host NumPy array with an ember dtype, following the standard's inference."""
    native = dt.NUMPY[dtype] if dtype is not None else None
    if isinstance(obj, (bool, int, float, complex)) or isinstance(obj, (list, tuple)):
        try:  # NumPy's inference matches the standard's defaults (bool, int64, float64, complex128)
            host = np.array(_plain(obj), dtype=native)
        except OverflowError as error:
            raise ArgumentError(f"{error} (for dtype {dtype or 'int64'})") from None
        except ValueError as error:
            raise ArgumentError(f"cannot make an array from {_short(obj)}: {error}") from None
        if copy is False:
            raise ValueError("copy=False but a Python object must be copied into an array")
    else:
        if hasattr(obj, "__dlpack__") and not isinstance(obj, np.ndarray) and not hasattr(obj, "__array_interface__"):
            try:
                obj = np.from_dlpack(obj)
            except (RuntimeError, BufferError, TypeError):  # not on the host: let the library convert
                obj = np.asarray(obj.cpu() if hasattr(obj, "cpu") else obj)
        try:
            host = np.array(obj, dtype=native, copy=copy)
        except ValueError as error:
            raise ValueError(f"{error}") from None
        except TypeError as error:
            raise DTypeError(f"cannot make an array from {type(obj).__name__}: {error}") from None
    if host.dtype not in dt.FROM_NUMPY:
        if host.dtype.isnative is False and host.dtype.newbyteorder("=") in dt.FROM_NUMPY:
            return host.astype(host.dtype.newbyteorder("="))
        raise DTypeError(f"dtype {host.dtype} of {type(obj).__name__} is not an Array API dtype")
    return host


def _plain(obj):
    """Nested sequences with ember arrays replaced by host values."""
    if isinstance(obj, Array):
        return obj._host()
    if isinstance(obj, (list, tuple)):
        return [_plain(item) for item in obj]
    return obj


def _short(obj) -> str:
    text = repr(obj)
    return text if len(text) < 60 else text[:57] + "..."


@prefixed("from_dlpack")
def from_dlpack(x, /, *, device=None, copy=None) -> Array:
    """An ember array from any object with ``__dlpack__`` (zero-copy where the devices allow)."""
    if not hasattr(x, "__dlpack__"):
        raise DTypeError(f"expected an object with __dlpack__, got {type(x).__name__}")
    if isinstance(x, Array):
        return asarray(x, device=device, copy=copy)
    target = _device_or_default(device)
    engine = target.engine
    backend = getattr(engine, "backend", None)
    if backend is not None:
        native = backend.from_dlpack(x, copy=copy)
        return Array._new(native, Meta(tuple(native.shape), backend.dtype_of(native)), target)
    return asarray(np.from_dlpack(x), device=target, copy=copy)


def meshgrid(*arrays, indexing="xy") -> tuple:
    """Coordinate matrices from 1-d coordinate vectors ("xy" or "ij" indexing)."""
    from .manipulation import broadcast_to, reshape
    if indexing not in ("xy", "ij"):
        raise ArgumentError(f"meshgrid: indexing must be 'xy' or 'ij', got {indexing!r}")
    for a in arrays:
        require_array(a, "meshgrid", "each input")
        if a.ndim != 1:
            raise ArgumentError(f"meshgrid: inputs must be 1-d, got shape {a.shape}")
    if len({a.dtype for a in arrays}) > 1:
        raise DTypeError(f"meshgrid: inputs must share one dtype, got {', '.join(str(a.dtype) for a in arrays)}")
    n = len(arrays)
    sizes = [a.shape[0] for a in arrays]
    if indexing == "xy" and n > 1:
        sizes[0], sizes[1] = sizes[1], sizes[0]
    out = []
    for i, a in enumerate(arrays):
        axis = (1 if i == 0 else 0 if i == 1 else i) if indexing == "xy" and n > 1 else i
        shape = [1] * n
        shape[axis] = a.shape[0]
        out.append(broadcast_to(reshape(a, tuple(shape)), tuple(sizes)))
    return tuple(out)
