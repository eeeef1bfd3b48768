"""Namespace functions generated from op rows, and the argument handling they share."""

from __future__ import annotations

import inspect

from .. import dtypes as dt
from ..array import Array, bind
from ..devices import device as as_device
from ..errors import DTypeError, EmberError, with_prefix
from ..ops import OPS
from ..ops.table import REQUIRED

_LOWER_KINDS = (dt.BOOL, dt.SIGNED, dt.UNSIGNED)


def astype_raw(x: Array, dtype: dt.DType) -> Array:
    """``x`` cast to ``dtype`` through the astype row (no-op when it already has it)."""
    if x._meta.dtype is dtype:
        return x
    return bind(OPS["astype"], (x,), {"dtype": dtype, "copy": True})


def lift(op, arrays: tuple) -> tuple:
    """Cast bool/integer inputs of a ``lift`` op to the default float (NumPy's sqrt(int))."""
    return tuple(astype_raw(a, dt.default_float) if isinstance(a, Array) and a._meta.dtype.kind in _LOWER_KINDS else a
                 for a in arrays)


def promote_all(op_name: str, arrays: tuple) -> tuple:
    """Cast every array to the common dtype, so kernels see one dtype (explicit casts in the IR)."""
    dtypes = [a._meta.dtype for a in arrays if isinstance(a, Array)]
    if not dtypes or all(d is dtypes[0] for d in dtypes):
        return arrays
    common = dtypes[0]
    try:
        for d in dtypes[1:]:
            common = dt.promote(common, d)
    except EmberError as error:
        raise with_prefix(error, op_name) from None
    return tuple(astype_raw(a, common) if isinstance(a, Array) else a for a in arrays)


def signature(op) -> inspect.Signature:
    """The Python signature of row ``op``'s namespace function: arrays positional-only, then attributes."""
    P = inspect.Parameter
    params = [P(n.lstrip("*"), P.POSITIONAL_ONLY) for n in op.inputs]
    only = "/" in op.positional
    for attr in op.positional:
        if attr == "/":
            only = False
            continue
        default = op.attrs[attr]
        params.append(P(attr, P.POSITIONAL_ONLY if only else P.POSITIONAL_OR_KEYWORD,
                        default=P.empty if default is REQUIRED else default))
    params += [P(a, P.KEYWORD_ONLY, default=P.empty if d is REQUIRED else d)
               for a, d in op.attrs.items() if a not in op.positional]
    if not op.inputs:
        params.append(P("device", P.KEYWORD_ONLY, default=None))
    return inspect.Signature(params)


def from_row(op_name: str, name: str | None = None):
    """The namespace function of op row ``op_name``: arrays positional, attributes by keyword.

    Rows without array inputs (creation) also take ``device=``.
    """
    op = OPS[op_name]
    name = name or op_name
    variadic = op.variadic
    n_arrays = 1 if variadic else len(op.inputs)
    defaults = op.attrs
    positional = tuple(a for a in op.positional if a != "/")
    keywords = defaults.keys() - set(op.positional[:op.positional.index("/")] if "/" in op.positional else ())
    required = any(d is REQUIRED for d in defaults.values())
    creation = not op.inputs
    needs_lift = op.lift
    promote = op.promote_inputs

    def function(*args, **kwargs):
        if len(args) < n_arrays:
            raise TypeError(f"{name}() takes {n_arrays} array argument{'s' if n_arrays > 1 else ''}, got {len(args)}")
        arrays = tuple(args[0]) if variadic else args[:n_arrays]
        attrs = dict(defaults)
        extra = args[n_arrays:]
        if extra:
            if len(extra) > len(positional):
                raise TypeError(f"{name}() takes at most {n_arrays + len(positional)} positional arguments, got {len(args)}")
            attrs.update(zip(positional, extra))
        device = kwargs.pop("device", None) if creation else None
        if kwargs:
            unknown = kwargs.keys() - keywords
            if unknown:
                raise TypeError(f"{name}() got an unexpected keyword argument {sorted(unknown)[0]!r}")
            attrs.update(kwargs)
        if required:
            missing = [a for a, v in attrs.items() if v is REQUIRED]
            if missing:
                raise TypeError(f"{name}() missing required argument {missing[0]!r}")
        if needs_lift:
            arrays = lift(op, arrays)
        if promote:
            arrays = promote_all(name, arrays)
        if creation:
            return bind(op, (), attrs, device=as_device(device) if device is not None else None)
        return bind(op, arrays, attrs)

    function.__name__ = function.__qualname__ = name
    function.__doc__ = op.doc
    function.__signature__ = signature(op)
    return function


def named_result(op_name: str, result: type):
    """The function of a multi-output row, returning the standard's named tuple ``result``."""
    raw = from_row(op_name)

    def function(*args, **kwargs):
        return result(*raw(*args, **kwargs))

    function.__name__ = function.__qualname__ = op_name
    function.__doc__ = raw.__doc__
    function.__signature__ = raw.__signature__
    return function


def require_array(value, name: str, what: str = "x") -> Array:
    if not isinstance(value, Array):
        raise DTypeError(f"{name}: {what} must be an ember array, got {type(value).__name__}")
    return value


def device_dtypes(device) -> tuple:
    """The dtypes a device's engine supports (every dtype where it does not say)."""
    engine = device.engine
    backend = getattr(engine, "backend", None)
    if backend is not None:
        return backend.dtypes
    names = getattr(engine, "dtypes", None)
    if names:
        return tuple(dt.from_name(n) if isinstance(n, str) else n for n in names)
    inner = getattr(engine, "inner", None)
    return device_dtypes(device.inner()) if inner is not None and device.inner() is not device else dt.ALL


def accumulating(function):
    """For sum-like functions: on a device without uint64 (PyTorch), unsigned inputs accumulate
    in int64 by default instead of refusing (the standard's default is the default uint)."""
    def wrapper(x, /, *args, dtype=None, **kwargs):
        if dtype is None and isinstance(x, Array) and x.dtype.kind == dt.UNSIGNED and dt.uint64 not in device_dtypes(x.device):
            dtype = dt.int64
        return function(x, *args, dtype=dtype, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = function.__name__
    wrapper.__doc__ = function.__doc__
    wrapper.__signature__ = function.__signature__
    return wrapper
