"""Layer 2 — the op table: one :class:`Op` row per operation, and the helpers rules share.

A row holds everything ember knows about an operation that is not a backend kernel: its name,
array inputs, attributes with defaults, a *meta rule* (output shapes and dtypes from input
shapes and dtypes, never data), an optional *canon rule* (attributes made explicit: defaults
resolved, axes normalised, so every backend and the wire see the same explicit op), and its
gradient rule. Engines, the wire and capture read rows generically; nothing else computes shapes
or dtypes. The example inputs the generated tests draw for each row live with the tests
(tests/recipes/), not here.

An op instance is an ``OpRecord`` (records.py), the one record every layer uses: ``(op name,
inputs, outputs, attributes, output metas)`` where attributes are None, bool, int, float, complex, str, DType or tuples of those.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import dtypes as dt
from ..errors import ArgumentError, AxisError, DTypeError, EmberError, ShapeError, with_prefix


class Meta(NamedTuple):
    """What is known of an array without its data: shape and dtype.

    A dimension is ``None`` only for a data-dependent output before it is computed.
    """

    shape: tuple
    dtype: dt.DType

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the array's data (its shape must be known)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def size(self) -> int | None:
        return None if None in self.shape else math.prod(self.shape)


class _Required:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED = _Required()  # an attribute without a default: the caller must give it
ELEMENTWISE_FAMILIES = ("elementwise unary", "elementwise binary")  # the rows the two factories of elementwise.py make
# a row's family: the standard's section it belongs to, or its extension (fft, linalg) or ember.nn
FAMILIES = (*ELEMENTWISE_FAMILIES, "creation", "data type", "indexing", "linear algebra", "manipulation", "reduction",
            "searching", "set", "sorting", "utility", "fft", "linalg", "nn")
NO_GRADIENT = "no gradient"  # the grad rule of an op whose outputs carry no gradient

# Meta rule results: each row keeps its own (``Op.cache``), and the rows' caches together hold at
# most META_CACHE_ENTRIES, for the whole process, so the clients of a compute peer cannot grow them
# without limit; keys with very long shapes or attribute tuples (a reshape to 100,000 dimensions)
# are computed each time, never kept. Failures are never cached. A call without attributes is
# keyed by its input metas alone, its value ``(None, output metas)``: eager execution
# (array.apply) reads that directly, without calling Op.infer.
META_CACHE_ENTRIES = 16384
_CACHED_LENGTH = 64
_ROWS: weakref.WeakSet = weakref.WeakSet()  # every row made, whose caches count against the bound
_cached = 0  # entries in the rows' caches together


def cached_entries() -> int:
    """How many meta rule results the rows' caches hold together (at most META_CACHE_ENTRIES)."""
    return sum(len(row.cache) for row in _ROWS)


def _remember(cache: dict, key, value) -> None:
    global _cached
    if _cached >= META_CACHE_ENTRIES:
        for row in _ROWS:
            row.cache.clear()
        _cached = 0
    cache[key] = value
    _cached += 1


def _kind(value):
    """A value's type, or for a tuple its items' kinds (a cache key's second half)."""
    return tuple(map(_kind, value)) if type(value) is tuple else type(value)


def broadcasts_to(shape: tuple, target: tuple) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without growing it."""
    try:
        return broadcast_shapes(shape, target) == target
    except ShapeError:
        return False


def _small(metas: tuple, values: tuple, out: tuple) -> bool:
    return (all(len(m.shape) <= _CACHED_LENGTH for m in (*metas, *out))
            and all(type(v) is not tuple or len(v) <= _CACHED_LENGTH for v in values))


@dataclass(eq=False)
class Op:
    """One row of the op table.

    ``inputs`` names the array inputs; a name starting with ``*`` takes any number of arrays.
    ``attrs`` maps attribute names to defaults. ``meta(*metas, **attrs)`` returns a Meta or a
    tuple of Metas (``multiple=True``). ``canon(*metas, **attrs)`` returns a dict of attribute
    values to replace (explicit defaults). ``grad`` is the gradient rule (see gradients.py), or
    NO_GRADIENT, or a NotDifferentiable saying why not. ``lift`` asks the namespace to cast bool
    and integer inputs to the default float dtype first (``sqrt(int)`` is float64).
    """

    name: str
    inputs: tuple[str, ...]
    attrs: dict[str, Any]
    meta: Callable[..., Any]
    canon: Callable[..., dict] | None = None
    family: str = ""
    multiple: bool = False
    data_dependent: bool = False  # outputs may have data-dependent sizes: a None in their meta's shape
    positional: tuple[str, ...] = ()  # attrs also taken positionally; those before a "/" only so
    lift: bool = False  # the namespace casts bool/integer inputs to the default float dtype
    promote_inputs: bool = False  # the namespace casts all array inputs to their common dtype
    determined: tuple | None = None  # outputs fixed by the inputs (None: all); not e.g. eigenvector signs
    unit_free: tuple = ()  # outputs fixed only up to a unit factor per vector (eigenvectors): their moduli are fixed
    unordered: tuple = ()  # determined outputs whose order along the last axis is not (a general matrix's eigenvalues)
    flops: Callable | None = None  # (input metas, output metas, attrs) -> a rough count, for graph summaries
    # (input metas, output metas, attrs) -> bytes the kernels may hold beyond inputs and outputs (a padded copy,
    # unfolded windows, attention scores); a compute peer counts them against its memory budget before running
    scratch: Callable | None = None
    symmetric_input: bool = False  # reads only a triangle of a symmetric matrix (its gradient is symmetrised)
    grad: Any = None
    doc: str = ""
    cache: dict = field(default_factory=dict, init=False, repr=False)  # this row's meta rule results (see META_CACHE_ENTRIES)
    # no attributes, one output, its size known: a call's result is its cache entry by input metas alone (array.apply)
    plain: bool = field(init=False, repr=False)

    def __post_init__(self):
        self.plain = not self.attrs and not self.multiple and not self.data_dependent
        _ROWS.add(self)

    @property
    def variadic(self) -> bool:
        return bool(self.inputs) and self.inputs[0].startswith("*")

    @property
    def elementwise(self) -> bool:
        """Each output element depends only on the inputs' elements at its (broadcast) position, so
        the result may be written over an input of its shape and dtype that nothing reads later."""
        return self.family in ELEMENTWISE_FAMILIES

    def infer(self, metas: tuple, attrs: dict) -> tuple[dict, tuple]:
        """Canonical attributes and output metas for inputs ``metas``; errors name the op.

        Results are cached by (metas, attrs) in the row's ``cache``: the rules are pure, and a
        chain of the same op on the same shapes pays for the rule once. The cache keeps only the attributes that
        the canon rule replaced, so values it left alone (-0.0 beside 0.0) are never swapped.
        """
        try:
            if attrs:
                values = tuple(attrs.values())
                # types are part of the key, inside tuples too: True, 1 and 1.0 are equal but give different
                # dtypes, and axis=(False, True) is refused where (0, 1) is not
                kinds = tuple(map(type, values))
                key = (metas, values, tuple(map(_kind, values)) if tuple in kinds else kinds)
            else:  # the hot path: an elementwise op
                values, key = (), metas
            replaced, out = self.cache[key]
            return ({**attrs, **replaced} if replaced else attrs), out
        except KeyError:
            pass
        except (TypeError, RecursionError):  # an unhashable attribute, or one nested absurdly deep: compute without caching
            key = None
        try:
            replaced = self.canon(*metas, **attrs) if self.canon is not None else None
            if replaced:
                attrs = {**attrs, **replaced}
            out = self.meta(*metas, **attrs)
        except EmberError as error:
            raise with_prefix(error, self.name) from None
        except RecursionError:  # an attribute nested deeper than Python recurses (a refusal's repr of it)
            raise ArgumentError(f"{self.name}: an attribute is nested too deeply") from None
        out = (out,) if type(out) is Meta else out
        if key is not None and _small(metas, values, out):
            _remember(self.cache, key, (replaced, out))
        return attrs, out

    def __repr__(self) -> str:
        return f"<op {self.name}>"


OPS: dict[str, Op] = {}


def define(op: Op) -> Op:
    """Add ``op`` to the table (each name once, in a known family: graph summaries count flops by family)."""
    if op.name in OPS:
        raise ValueError(f"op {op.name!r} defined twice")
    if op.family not in FAMILIES:
        raise ValueError(f"op {op.name!r}: unknown family {op.family!r}")
    OPS[op.name] = op
    return op


# --- helpers the rules share -----------------------------------------------------------------

def fmt_shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def require(dtype: dt.DType, category: str, what: str = "input") -> None:
    """Raise DTypeError unless ``dtype`` is in ``category``."""
    if not dt.in_category(dtype, category):
        article = "an" if category[0] in "aeiou" else "a"
        raise DTypeError(f"{what} must have {article} {category} dtype, got {dtype}")


def require_same_dtype(*metas: Meta) -> dt.DType:
    first = metas[0].dtype
    for m in metas[1:]:
        if m.dtype is not first:
            raise DTypeError(f"inputs must share one dtype, got {', '.join(str(m.dtype) for m in metas)}")
    return first


def require_ndim(meta: Meta, at_least: int, what: str = "input") -> None:
    if meta.ndim < at_least:
        plural = "s" if at_least > 1 else ""
        raise ShapeError(f"{what} must have at least {at_least} dimension{plural}, got shape {fmt_shape(meta.shape)}")


def broadcast_shapes(*shapes: tuple) -> tuple:
    """The broadcast of ``shapes`` (NumPy rules); ShapeError names them when they don't fit."""
    if len(shapes) == 2 and shapes[0] == shapes[1]:
        return shapes[0]
    ndim = max(len(s) for s in shapes)
    out = []
    for i in range(-ndim, 0):
        size = 1
        for s in shapes:
            if -i <= len(s):
                d = s[i]
                if d == 1 or d == size:
                    continue
                if size == 1:
                    size = d
                elif d is None or size is None:
                    size = None
                else:
                    raise ShapeError(f"shapes {' and '.join(fmt_shape(s) for s in shapes)} cannot be broadcast together")
        out.append(size)
    return tuple(out)


def normalize_axis(axis: int, ndim: int, what: str = "axis") -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ArgumentError(f"{what} must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise AxisError(f"{what} {axis} is out of bounds for an array of dimension {ndim}")
    return axis % ndim if ndim else 0


def normalize_axes(axis, ndim: int) -> tuple | None:
    """``None`` stays None (all axes); an int or a sequence becomes a sorted tuple of distinct axes."""
    if axis is None:
        return None
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    normalized = tuple(normalize_axis(a, ndim) for a in axes)
    if len(set(normalized)) != len(normalized):
        raise AxisError(f"repeated axis in {axis!r}")
    return tuple(sorted(normalized))


def reduced_shape(shape: tuple, axes: tuple | None, keepdims: bool) -> tuple:
    if axes is None:
        axes = tuple(range(len(shape)))
    if keepdims:
        return tuple(1 if i in axes else s for i, s in enumerate(shape))
    return tuple(s for i, s in enumerate(shape) if i not in axes)


def as_int(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        if hasattr(value, "__index__"):
            return value.__index__()
        raise ArgumentError(f"{what} must be an int, got {value!r}")
    return value


def as_shape(shape, what: str = "shape") -> tuple:
    """A shape argument as a tuple of ints (an int means a 1-d shape)."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        shape = tuple(as_int(s, what) for s in shape)
    except TypeError:
        raise ArgumentError(f"{what} must be an int or a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in shape):
        raise ShapeError(f"{what} {fmt_shape(shape)} has a negative dimension")
    return shape
