"""Recipes for the fft rows (ember/ops/fft.py)."""

from __future__ import annotations

from ember import dtypes as dt
from ember.errors import ArgumentError, ShapeError
from ember.ops.fft import _KINDS, _NORMS

from . import samples

EXAMPLES = {}
BAD_EXAMPLES = {}


def _transform_examples(kind):
    category = _KINDS[kind.rstrip("n") if kind.endswith("fftn") else kind][0]

    def recipe(g):
        shape = g.shape(min_dims=1, min_side=2 if kind in ("irfft", "hfft", "irfftn") else 1)
        x = g.array(shape, g.dtype(category), low=-3, high=3)
        if kind.endswith("n"):  # all axes, or some in any order; lengths of their own or given
            axes = None if g.flag() else tuple(g.permutation(range(len(shape))))[:g.integer(1, len(shape))]
            # lengths for the axes given, or (axes=None) for the last few axes: s alone picks its axes
            count = len(axes) if axes is not None else g.integer(1, len(shape))
            lengths = None if g.flag() else tuple(g.integer(2, 5) for _ in range(count))
            return (x,), {"s": lengths, "axes": axes, "norm": g.choice(_NORMS)}
        axis = g.integer(-len(shape), len(shape) - 1)
        return (x,), {"n": g.choice([None, g.integer(1, 6)]), "axis": axis, "norm": g.choice(_NORMS)}
    return recipe


def _bad(shape, attrs, error, complex_input=False):
    return samples.refusal([shape], attrs, error, default=dt.complex128 if complex_input else dt.float64)


for _kind in _KINDS:
    EXAMPLES[_kind] = _transform_examples(_kind)
    one = {"n": None, "axis": -1, "norm": "backward"}
    takes_complex = _KINDS[_kind][0] == "complex floating"
    BAD_EXAMPLES[_kind] = [_bad((), one, ShapeError, takes_complex), _bad((4,), {**one, "n": 0}, ArgumentError, takes_complex),
                           _bad((4,), {**one, "n": 2.5}, ArgumentError, takes_complex),
                           _bad((4,), {**one, "norm": "unitary"}, ArgumentError, takes_complex)]
    if _kind in ("fft", "ifft", "rfft", "irfft"):
        EXAMPLES[_kind + "n"] = _transform_examples(_kind + "n")
        many = {"s": None, "axes": None, "norm": "backward"}
        BAD_EXAMPLES[_kind + "n"] = [_bad((2, 3), {**many, "axes": (0, -2)}, ArgumentError, takes_complex),
                                     _bad((2, 3), {**many, "s": (2, 2), "axes": (1,)}, ArgumentError, takes_complex),
                                     _bad((2, 3), {**many, "s": (0, 2)}, ArgumentError, takes_complex),
                                     _bad((2, 3), {**many, "s": (2, 2.5)}, ArgumentError, takes_complex),
                                     _bad((2, 3), {**many, "axes": ()}, ArgumentError, takes_complex),
                                     _bad((2, 3), {**many, "norm": "unitary"}, ArgumentError, takes_complex)]

for _name in ("fftfreq", "rfftfreq"):
    EXAMPLES[_name] = lambda g: ((), {"n": g.integer(1, 8), "d": g.choice([1.0, 0.5]),
                                      "dtype": g.choice([None, g.dtype("real floating")])})
    BAD_EXAMPLES[_name] = [lambda g, n=n: ((), {"n": n, "d": 1.0, "dtype": None}, ArgumentError) for n in (0, 2.5)]

for _name in ("fftshift", "ifftshift"):
    EXAMPLES[_name] = lambda g: ((g.array(g.shape(), g.dtype("floating")),), {"axes": None})
