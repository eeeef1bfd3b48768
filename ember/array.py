"""Layer 5 — the array object and ``bind``, the one entry point from the namespace to engines.

An :class:`Array` is (device, handle, meta): the handle is whatever the device's engine uses
(a native array locally, a tensor id on a compute peer, a graph node in capture), the meta its
shape and dtype, known without asking the engine. Nothing here knows a particular op or a
layer above: the namespace installs the operators, indexing and transposes (namespace/methods.py),
autodiff its methods, and the ember module itself is what ``__array_namespace__`` returns.
"""

from __future__ import annotations

import builtins

import numpy as np

from . import dtypes as dt
from .devices import Device, default_device
from .devices import device as as_device
from .errors import DeviceError, DTypeError, EmberError, ShapeError, with_prefix
from .ops.table import Meta, fmt_shape


class Array:
    """An n-dimensional array on an ember device (the Array API standard's array object)."""

    __slots__ = ("_handle", "_meta", "_device", "__weakref__")
    __array_priority__ = 100  # NumPy defers mixed operators to ours
    _namespace = None  # the ember module, set by it: the array knows no layer above it

    def __init__(self, *args, **kwargs):
        raise TypeError("ember arrays are made by ember functions, e.g. ember.asarray(...)")

    def __init_subclass__(cls, **kwargs):
        raise TypeError("ember.Array cannot be subclassed (bind recognises arrays by exact type)")

    @staticmethod
    def _new(handle, meta: Meta, device: Device) -> Array:
        """An array over an engine handle whose meta is known (no checks: internal)."""
        return _new_array(handle, meta, device)

    # --- attributes ---------------------------------------------------------------------------

    @property
    def shape(self) -> tuple:
        """The shape, a tuple of ints."""
        return self._meta.shape

    @property
    def dtype(self) -> dt.DType:
        """The ember dtype."""
        return self._meta.dtype

    @property
    def device(self) -> Device:
        """The device the array lives on."""
        return self._device

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return len(self._meta.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return self._meta.size

    def __array_namespace__(self, *, api_version: str | None = None):
        """The ember module, which implements the Array API standard 2025.12 (and the revisions before it)."""
        if api_version not in (None, "2021.12", "2022.12", "2023.12", "2024.12", "2025.12"):
            raise ValueError(f"ember implements the Array API standard up to 2025.12, not {api_version!r}")
        return Array._namespace

    # --- reads: the points that wait for the device --------------------------------------------

    def _host(self) -> np.ndarray:
        return self._device.engine.download(self._handle)

    def _scalar(self, kind, what: str):
        if self._meta.size != 1:
            raise TypeError(f"{what}: only arrays of one element convert to Python scalars, got shape {fmt_shape(self.shape)}")
        return kind(self._host().reshape(()).item())

    def __bool__(self) -> bool:
        return self._scalar(builtins.bool, "bool")

    def __int__(self) -> int:
        if self.dtype.kind == dt.COMPLEX:
            raise TypeError("int: cannot convert a complex array to int")
        value = self._scalar(lambda v: v, "int")
        if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
            raise ValueError(f"int: cannot convert {value} to int")
        return int(value)

    def __float__(self) -> float:
        if self.dtype.kind == dt.COMPLEX:
            raise TypeError("float: cannot convert a complex array to float; use ember.real")
        return self._scalar(float, "float")

    def __complex__(self) -> complex:
        return self._scalar(complex, "complex")

    def __index__(self) -> int:
        if self.dtype.kind not in (dt.SIGNED, dt.UNSIGNED):
            raise TypeError(f"__index__: only integer arrays are indices, got {self.dtype}")
        return self._scalar(int, "__index__")

    def __array__(self, dtype=None, copy=None):
        host = self._host()
        if copy:
            host = host.copy()
        return host if dtype is None else host.astype(dtype, copy=False)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export through DLPack (the native array's protocol; a host copy for remote arrays)."""
        native = self._device.engine.native(self._handle)
        kwargs = {"stream": stream}
        if max_version is not None:
            kwargs["max_version"] = max_version
        if dl_device is not None:
            kwargs["dl_device"] = dl_device
        if copy is not None:
            kwargs["copy"] = copy
        try:
            return native.__dlpack__(**kwargs)
        except BufferError:
            legacy = max_version is None or tuple(max_version) < (1, 0)
            if legacy and max_version is not None:
                # JAX refuses versions below 0.5 by number, yet gives a consumer that names no version the one
                # format every version below 1.0 reads (the legacy capsule), zero-copy
                del kwargs["max_version"]
                try:
                    return native.__dlpack__(**kwargs)
                except BufferError:
                    pass
            # else through NumPy: a zero-copy view where the version can mark it read-only (1.0 on), else a copy,
            # which the standard allows unless copy=False
            if legacy and copy is False:
                raise
            return (np.array(native) if legacy else np.asarray(native)).__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._device.engine.native(self._handle).__dlpack_device__()

    def to_device(self, device, /, *, stream=None) -> Array:
        """This array on ``device`` (itself if it is already there). Between two compute peers the
        bytes go from one to the other and nothing waits: a failed move raises at the first read."""
        target = as_device(device)
        if target is self._device:
            return self
        moved = self._device.engine.move(self._handle, self._meta, target.engine)  # peer to peer: no read
        if moved is not None:
            return Array._new(moved, self._meta, target)
        try:
            host = self._host()
        except EmberError as error:
            raise with_prefix(error, "to_device") from None
        handle = target.engine.upload(host)
        return Array._new(handle, self._meta, target)

    def __repr__(self) -> str:
        if not self._device.engine.executes:
            return f"ember.Array(shape={fmt_shape(self.shape)}, dtype={self.dtype}, device={self._device})"
        try:
            body = np.array2string(self._host(), separator=", ", prefix="ember.Array(")
        except EmberError as error:
            body = f"<unreadable: {error}>"
        return f"ember.Array({body}, dtype={self.dtype}, device={self._device})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __iter__(self):
        if not self.shape:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    __hash__ = None  # type: ignore[assignment]

    def _rebind(self, result: Array, what: str) -> None:
        """Make this array hold ``result`` (in-place operators and item assignment)."""
        if result._meta.dtype is not self._meta.dtype:
            raise DTypeError(f"{what}: the result dtype {result.dtype} differs from the array's {self.dtype}; "
                             f"in-place operations keep the dtype")
        if result._meta.shape != self._meta.shape:
            raise ShapeError(f"{what}: the result shape {fmt_shape(result.shape)} differs from the array's "
                             f"{fmt_shape(self.shape)}; in-place operations keep the shape")
        handle = result._handle
        if result._device is not self._device:
            if result._device.inner() is not self._device:
                raise DeviceError(f"{what}: the result is on {result.device}, not on the array's {self.device}")
            handle = result._device.engine.unwrap(handle)  # a tracked result written into an untracked array: its value
        try:
            self._handle = self._device.engine.rebind(self._handle, handle)
        except EmberError as error:
            raise with_prefix(error, what) from None


# --- bind: namespace → engine --------------------------------------------------------------------

def bind(op, inputs: tuple, attrs: dict, device: Device | None = None, literal_dtype: dt.DType | None = None):
    """Apply ``op`` to ``inputs`` (arrays, and Python scalars when ``literal_dtype`` says their
    dtype) on their common device, or on ``device`` for ops without array inputs.

    The meta rule runs first, so a bad call fails before any engine sees it; the engine returns
    handles for outputs whose shapes and dtypes are already known. This is the hot path of
    every operation: keep it lean.
    """
    metas = []
    handles = []
    for value in inputs:
        if type(value) is Array:
            if device is not value._device:
                device = value._device if device is None else _common_device(op, device, value._device)
            metas.append(value._meta)
            handles.append(value._handle)
        elif literal_dtype is not None and dt.is_python_scalar(value):
            metas.append(SCALAR_METAS[literal_dtype])
            handles.append(value)
        else:
            convertible = hasattr(value, "__array__") or isinstance(value, (list, tuple))
            raise DTypeError(f"{op.name}: expected an ember array, got {type(value).__name__}"
                             + (" (convert it with ember.asarray)" if convertible else ""))
    return apply(op, device if device is not None else default_device(), tuple(handles), tuple(metas), attrs)


def apply(op, device: Device, handles: tuple, metas: tuple, attrs: dict):
    """The rest of :func:`bind` once its inputs are gathered: ``handles`` on ``device`` (and
    literals) with their ``metas``. Callers that know their inputs share one device (an
    elementwise op on one array) come here directly."""
    # a plain row (the elementwise ones) has nothing to canonicalise: Op.infer's cache, read without the call
    known = op.cache.get(metas) if op.plain and not attrs else None
    if known is not None:
        meta = known[1][0]
    else:
        attrs, out_metas = op.infer(metas, attrs)
        if op.multiple or op.data_dependent:
            outs, out_metas = device.engine.execute(op, handles, metas, attrs, out_metas)
            if op.multiple:
                return tuple(_new_array(h, m, device) for h, m in zip(outs, out_metas))
            return _new_array(outs[0], out_metas[0], device)
        meta = out_metas[0]
    array = _object_new(Array)  # _new_array, inlined on the hot path
    array._handle, array._meta, array._device = device.engine.apply(op, handles, metas, attrs, meta), meta, device
    return array


SCALAR_METAS = {d: Meta((), d) for d in dt.ALL}  # the metas of Python scalar literals


def _new_array(handle, meta: Meta, device: Device) -> Array:
    array = _object_new(Array)
    array._handle, array._meta, array._device = handle, meta, device
    return array


_object_new = object.__new__


def _common_device(op, first: Device, second: Device) -> Device:
    if first == second:
        # one hardware: a wrapper (autodiff) takes precedence over its inner device
        return first if first.inner() is not first else second
    for mine, other in ((first, second), (second, first)):  # an engine may know better (a capture's inputs)
        engine = mine.inner()._engine  # the engine its arrays came from: asking never starts a session
        error = engine.mixing_error(op.name, mine, other) if engine is not None else None
        if error is not None:
            raise error
    raise DeviceError(f"{op.name}: arrays are on different devices, {first} and {second}; "
                      f"move one with x.to_device(...)")


def prefixed(name: str):
    """Decorator: EmberErrors raised inside get ``name: `` in front of their message."""
    def decorate(function):
        def wrapper(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except EmberError as error:
                if str(error).startswith(name + ":"):
                    raise
                raise with_prefix(error, name) from None
        wrapper.__name__ = wrapper.__qualname__ = function.__name__
        wrapper.__doc__ = function.__doc__
        wrapper.__wrapped__ = function
        return wrapper
    return decorate
