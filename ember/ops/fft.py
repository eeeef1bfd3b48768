"""The ``fft`` extension: transforms along axes, and the frequency helpers."""

from __future__ import annotations

from .. import dtypes as dt
from ..errors import ArgumentError, ShapeError
from .gradients import conj
from .table import NO_GRADIENT, REQUIRED, Meta, Op, as_int, define, fmt_shape, normalize_axes, normalize_axis, require

_NORMS = ("backward", "ortho", "forward")
# (input category, output dtype from input dtype, output length from the transform length n)
_COMPLEX_OUT = dt.complex_of
_REAL_OUT = dt.real_of
_KINDS = {
    "fft": ("floating", _COMPLEX_OUT, lambda n: n),
    "ifft": ("floating", _COMPLEX_OUT, lambda n: n),
    "rfft": ("real floating", _COMPLEX_OUT, lambda n: n // 2 + 1),
    "irfft": ("floating", _REAL_OUT, lambda n: n),
    "hfft": ("floating", _REAL_OUT, lambda n: n),
    "ihfft": ("real floating", _COMPLEX_OUT, lambda n: n // 2 + 1),
}
# the transform length when n is not given, from the input length along the axis
_DEFAULT_N = {"irfft": lambda m: 2 * (m - 1), "hfft": lambda m: 2 * (m - 1)}


def _one_axis(kind):
    category, out_dtype, out_len = _KINDS[kind]

    def canon(x, n, axis, norm):
        require(x.dtype, category)
        if x.ndim == 0:
            raise ShapeError(f"input must be at least 1-d, got shape {fmt_shape(x.shape)}")
        axis = normalize_axis(axis, x.ndim)
        n = _DEFAULT_N.get(kind, lambda m: m)(x.shape[axis]) if n is None else as_int(n, "n")
        if n < 1:
            raise ArgumentError(f"transform length n={n} must be at least 1 (input shape {fmt_shape(x.shape)})")
        if norm not in _NORMS:
            raise ArgumentError(f"norm must be one of {_NORMS}, got {norm!r}")
        return {"n": n, "axis": axis}

    def meta(x, n, axis, norm):
        shape = list(x.shape)
        shape[axis] = out_len(n)
        return Meta(tuple(shape), out_dtype(x.dtype))
    return canon, meta


def _many_axes(kind):
    category, out_dtype, out_len = _KINDS[kind[:-1]]

    def canon(x, s, axes, norm):
        require(x.dtype, category)
        if axes is None:
            axes = tuple(range(x.ndim)) if s is None else tuple(range(x.ndim - len(s), x.ndim))
        given, axes = axes, tuple(normalize_axis(a, x.ndim) for a in axes)
        if not axes:  # NumPy would return the input unchanged, not transformed (nor complex)
            raise ArgumentError(f"axes must name at least one axis of shape {fmt_shape(x.shape)}, got {given!r}")
        if len(set(axes)) != len(axes):
            raise ArgumentError(f"axes {given!r} name an axis of shape {fmt_shape(x.shape)} twice")
        if s is None:
            last = _DEFAULT_N.get(kind[:-1], lambda m: m)
            s = tuple(x.shape[a] for a in axes[:-1]) + (last(x.shape[axes[-1]]),)
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
            shape[a] = out_len(n) if i == len(axes) - 1 else n
        return Meta(tuple(shape), out_dtype(x.dtype))
    return canon, meta


# --- gradient rules -------------------------------------------------------------------------------
# A transform with norm N is a linear map whose adjoint is the opposite transform with the
# swapped norm (backward <-> forward); zero-padding to n and truncation are each other's adjoints.
# A cotangent already has the transform's lengths along its axes, so no adjoint passes n or s.
# A real input takes the real part of its cotangent (see autodiff.py).

_SWAP = {"backward": "forward", "forward": "backward", "ortho": "ortho"}


def _resize(xp, a, length: int, axis: int):
    """a cut or zero-padded to ``length`` along ``axis``."""
    current = a.shape[axis]
    if current == length:
        return a
    if current > length:
        return xp.take(a, xp.arange(length, device=a.device), axis=axis)
    shape = list(a.shape)
    shape[axis] = length - current
    return xp.concat([a, xp.zeros(tuple(shape), dtype=a.dtype, device=a.device)], axis=axis)


def _hermitian_weights(xp, n: int, bins: int, axis: int, ndim: int, dtype, device):
    """irfft counts each interior bin twice (it and its mirror); DC and Nyquist once."""
    weights = [1.0 if k == 0 or (n % 2 == 0 and k == n // 2) else 2.0 for k in range(bins)]
    shape = [1] * ndim
    shape[axis] = bins
    return xp.reshape(xp.asarray(weights, dtype=dtype, device=device), tuple(shape))


def _rfft_adjoint(xp, g, n: int, axis: int, norm: str):
    """Adjoint of rfft along axis (output: length n, complex; its real part is the gradient)."""
    full = _resize(xp, g, n, axis)  # the missing mirrored bins get no cotangent
    return xp.fft.ifft(full, axis=axis, norm=_SWAP[norm])


def _irfft_adjoint(xp, g, n: int, axis: int, norm: str):
    """Adjoint of irfft(·, n) along axis: n//2 + 1 complex bins."""
    spectrum = xp.fft.rfft(g, axis=axis, norm=_SWAP[norm])
    return spectrum * _hermitian_weights(xp, n, n // 2 + 1, axis % g.ndim, g.ndim, g.dtype, g.device)


def _fft_grad(inverse):
    def rule(xp, g, out, x, n, axis, norm):
        back = (xp.fft.fft if inverse else xp.fft.ifft)(g, axis=axis, norm=_SWAP[norm])
        return (_resize(xp, back, x.shape[axis], axis),)
    return rule


def _rfft_grad(xp, g, out, x, n, axis, norm):
    return (_resize(xp, _rfft_adjoint(xp, g, n, axis, norm), x.shape[axis], axis),)


def _irfft_grad(xp, g, out, x, n, axis, norm):
    return (_resize(xp, _irfft_adjoint(xp, g, n, axis, norm), x.shape[axis], axis),)


def _hfft_grad(xp, g, out, x, n, axis, norm):
    # hfft(x) = irfft(conj(x)) with the swapped norm
    return (_resize(xp, conj(xp, _irfft_adjoint(xp, g, n, axis, _SWAP[norm])), x.shape[axis], axis),)


def _ihfft_grad(xp, g, out, x, n, axis, norm):
    # ihfft(x) = conj(rfft(x)) with the swapped norm
    return (_resize(xp, _rfft_adjoint(xp, conj(xp, g), n, axis, _SWAP[norm]), x.shape[axis], axis),)


def _fftn_grad(inverse):
    def rule(xp, g, out, x, s, axes, norm):
        back = (xp.fft.fftn if inverse else xp.fft.ifftn)(g, axes=axes, norm=_SWAP[norm])
        for a in axes:
            back = _resize(xp, back, x.shape[a], a)
        return (back,)
    return rule


def _rfftn_grad(xp, g, out, x, s, axes, norm):
    # rfftn = rfft on the last axis, then fft on the others: undo in reverse order
    if len(axes) > 1:
        g = xp.fft.ifftn(g, axes=axes[:-1], norm=_SWAP[norm])
    back = _rfft_adjoint(xp, g, s[-1], axes[-1], norm)
    for a in axes:
        back = _resize(xp, back, x.shape[a], a)
    return (back,)


def _irfftn_grad(xp, g, out, x, s, axes, norm):
    # irfftn = ifft on the leading axes, then irfft on the last: undo in reverse order
    back = _irfft_adjoint(xp, g, s[-1], axes[-1], norm)
    if len(axes) > 1:
        back = xp.fft.fftn(back, axes=axes[:-1], norm=_SWAP[norm])
    for a in axes:
        back = _resize(xp, back, x.shape[a], a)
    return (back,)


_GRADS = {
    "fft": _fft_grad(inverse=False),
    "ifft": _fft_grad(inverse=True),
    "rfft": _rfft_grad,
    "irfft": _irfft_grad,
    "hfft": _hfft_grad,
    "ihfft": _ihfft_grad,
    "fftn": _fftn_grad(inverse=False),
    "ifftn": _fftn_grad(inverse=True),
    "rfftn": _rfftn_grad,
    "irfftn": _irfftn_grad,
}


# --- rows ------------------------------------------------------------------------------------------

for _kind in _KINDS:
    _canon, _meta = _one_axis(_kind)
    define(Op(_kind, ("x",), {"n": None, "axis": -1, "norm": "backward"}, _meta, _canon, family="fft",
              lift=True, grad=_GRADS[_kind],
              doc=f"One-dimensional {_kind} along axis."))
    if _kind in ("fft", "ifft", "rfft", "irfft"):
        _canon, _meta = _many_axes(_kind + "n")
        define(Op(_kind + "n", ("x",), {"s": None, "axes": None, "norm": "backward"}, _meta, _canon, family="fft",
                  lift=True, grad=_GRADS[_kind + "n"],
                  doc=f"n-dimensional {_kind} over axes."))


def _freq_canon(n, d, dtype):
    n = as_int(n, "n")
    if n < 1:
        raise ArgumentError(f"n must be at least 1, got {n}")
    return {"n": n, "dtype": dtype or dt.default_float}


for _name, _length in (("fftfreq", lambda n: n), ("rfftfreq", lambda n: n // 2 + 1)):
    define(Op(_name, (), {"n": REQUIRED, "d": 1.0, "dtype": None},
              (lambda length: lambda n, d, dtype: Meta((length(n),), dtype))(_length), _freq_canon, family="fft",
              positional=("n", "/"), grad=NO_GRADIENT,
              doc=f"Sample frequencies of {_name[:-4]}."))

for _name, _grad in (("fftshift", lambda xp, g, out, x, axes: (xp.fft.ifftshift(g, axes=axes),)),
                     ("ifftshift", lambda xp, g, out, x, axes: (xp.fft.fftshift(g, axes=axes),))):
    define(Op(_name, ("x",), {"axes": None}, lambda x, axes: Meta(x.shape, x.dtype),
              lambda x, axes: {"axes": tuple(range(x.ndim)) if axes is None else normalize_axes(axes, x.ndim)},
              family="fft", grad=_grad,
              doc=f"{'Shift' if _name == 'fftshift' else 'Undo the shift of'} the zero frequency to the centre."))
