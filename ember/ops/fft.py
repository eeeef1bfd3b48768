"""The ``fft`` extension: transforms along axes, and the frequency helpers."""

from __future__ import annotations

from .. import dtypes as dt
from ..errors import ArgumentError, ShapeError
from .table import REQUIRED, Meta, Op, as_int, define, fmt_shape, normalize_axes, normalize_axis, require

_NORMS = ("backward", "ortho", "forward")
# (input category, output dtype from input dtype, output length from (n, input length))
_COMPLEX_OUT = dt.complex_of
_REAL_OUT = dt.real_of
_KINDS = {
    "fft": ("floating", _COMPLEX_OUT, lambda n, m: n),
    "ifft": ("floating", _COMPLEX_OUT, lambda n, m: n),
    "rfft": ("real floating", _COMPLEX_OUT, lambda n, m: n // 2 + 1),
    "irfft": ("floating", _REAL_OUT, lambda n, m: n),
    "hfft": ("floating", _REAL_OUT, lambda n, m: n),
    "ihfft": ("real floating", _COMPLEX_OUT, lambda n, m: n // 2 + 1),
}
# the transform length when n is not given, from the input length along the axis
_DEFAULT_N = {"irfft": lambda m: 2 * (m - 1), "hfft": lambda m: 2 * (m - 1)}


def _one_axis(kind):
    category, out_dtype, out_len = _KINDS[kind]

    def canon(x, n, axis, norm):
        require(x.dtype, category)
        if x.ndim == 0:
            raise ShapeError("input must be at least 1-d")
        axis = normalize_axis(axis, x.ndim)
        n = _DEFAULT_N.get(kind, lambda m: m)(x.shape[axis]) if n is None else as_int(n, "n")
        if n < 1:
            raise ArgumentError(f"transform length n={n} must be at least 1 (input shape {fmt_shape(x.shape)})")
        if norm not in _NORMS:
            raise ArgumentError(f"norm must be one of {_NORMS}, got {norm!r}")
        return {"n": n, "axis": axis}

    def meta(x, n, axis, norm):
        shape = list(x.shape)
        shape[axis] = out_len(n, x.shape[axis])
        return Meta(tuple(shape), out_dtype(x.dtype))
    return canon, meta


def _many_axes(kind):
    category, out_dtype, out_len = _KINDS[kind[:-1]]

    def canon(x, s, axes, norm):
        require(x.dtype, category)
        if axes is None:
            axes = tuple(range(x.ndim)) if s is None else tuple(range(x.ndim - len(s), x.ndim))
        axes = tuple(normalize_axis(a, x.ndim) for a in axes)
        if len(set(axes)) != len(axes):
            raise ArgumentError(f"repeated axis in {axes!r}")
        if s is None:
            last = _DEFAULT_N.get(kind[:-1], lambda m: m)
            s = tuple(x.shape[a] for a in axes[:-1]) + ((last(x.shape[axes[-1]]),) if axes else ())
        s = tuple(as_int(v, "s") for v in s)
        if len(s) != len(axes):
            raise ArgumentError(f"s {s!r} and axes {axes!r} differ in length")
        if any(v < 1 for v in s):
            raise ArgumentError(f"transform lengths s={s!r} must be at least 1")
        if norm not in _NORMS:
            raise ArgumentError(f"norm must be one of {_NORMS}, got {norm!r}")
        return {"s": s, "axes": axes}

    def meta(x, s, axes, norm):
        shape = list(x.shape)
        for i, (a, n) in enumerate(zip(axes, s)):
            shape[a] = out_len(n, x.shape[a]) if i == len(axes) - 1 else n
        return Meta(tuple(shape), out_dtype(x.dtype))
    return canon, meta


def _transform_examples(kind):
    category = _KINDS[kind.rstrip("n") if kind.endswith("fftn") else kind][0]

    def recipe(g):
        shape = g.shape(min_dims=1, min_side=2 if kind in ("irfft", "hfft", "irfftn") else 1)
        x = g.array(shape, g.dtype(category), low=-3, high=3)
        if kind.endswith("n"):
            return (x,), {"s": None, "axes": None, "norm": g.choice(_NORMS)}
        axis = g.integer(-len(shape), len(shape) - 1)
        return (x,), {"n": g.choice([None, g.integer(1, 6)]), "axis": axis, "norm": g.choice(_NORMS)}
    return recipe


for _kind in _KINDS:
    _canon, _meta = _one_axis(_kind)
    define(Op(_kind, ("x",), {"n": None, "axis": -1, "norm": "backward"}, _meta, _canon, family="fft",
              lift="floating" if _KINDS[_kind][0] == "floating" else "real floating",
              examples=_transform_examples(_kind),
              bad_examples=lambda g: ((g.array((), dt.float64),), {"n": None, "axis": -1, "norm": "backward"}, ShapeError),
              doc=f"One-dimensional {_kind} along axis."))
    if _kind in ("fft", "ifft", "rfft", "irfft"):
        _canon, _meta = _many_axes(_kind + "n")
        define(Op(_kind + "n", ("x",), {"s": None, "axes": None, "norm": "backward"}, _meta, _canon, family="fft",
                  lift="floating" if _KINDS[_kind][0] == "floating" else "real floating",
                  examples=_transform_examples(_kind + "n"), doc=f"n-dimensional {_kind} over axes."))


def _freq_canon(n, d, dtype):
    n = as_int(n, "n")
    if n < 1:
        raise ArgumentError(f"n must be at least 1, got {n}")
    return {"n": n, "dtype": dtype or dt.default_float}


for _name, _length in (("fftfreq", lambda n: n), ("rfftfreq", lambda n: n // 2 + 1)):
    define(Op(_name, (), {"n": REQUIRED, "d": 1.0, "dtype": None},
              (lambda length: lambda n, d, dtype: Meta((length(n),), dtype))(_length), _freq_canon, family="fft",
              positional=("n", "/"),
              examples=lambda g: ((), {"n": g.integer(1, 8), "d": g.choice([1.0, 0.5]), "dtype": g.dtype("real floating")}),
              bad_examples=lambda g: ((), {"n": 0, "d": 1.0, "dtype": None}, ArgumentError),
              doc=f"Sample frequencies of {_name[:-4]}."))

for _name in ("fftshift", "ifftshift"):
    define(Op(_name, ("x",), {"axes": None}, lambda x, axes: Meta(x.shape, x.dtype),
              lambda x, axes: {"axes": tuple(range(x.ndim)) if axes is None else normalize_axes(axes, x.ndim)},
              family="fft", examples=lambda g: ((g.array(g.shape(), g.dtype("floating")),), {"axes": None}),
              doc=f"{'Shift' if _name == 'fftshift' else 'Undo the shift of'} the zero frequency to the centre."))

from .gradients import NotDifferentiable, defgrad, no_gradient  # noqa: E402

for _name in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft", "fftn", "ifftn", "rfftn", "irfftn"):
    defgrad(_name, NotDifferentiable(f"{_name}: complex gradients are not supported yet"))
defgrad("fftshift", lambda xp, g, out, x, axes: (xp.fft.ifftshift(g, axes=axes),))
defgrad("ifftshift", lambda xp, g, out, x, axes: (xp.fft.fftshift(g, axes=axes),))
no_gradient("fftfreq", "rfftfreq")
