"""Recipes for the fft rows (ember/ops/fft.py)."""

from __future__ import annotations

from ember import dtypes as dt
from ember.errors import ArgumentError, ShapeError
from ember.ops.fft import _KINDS, _NORMS

EXAMPLES = {}
BAD_EXAMPLES = {}


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
    EXAMPLES[_kind] = _transform_examples(_kind)
    BAD_EXAMPLES[_kind] = lambda g: ((g.array((), dt.float64),), {"n": None, "axis": -1, "norm": "backward"}, ShapeError)
    if _kind in ("fft", "ifft", "rfft", "irfft"):
        EXAMPLES[_kind + "n"] = _transform_examples(_kind + "n")

for _name in ("fftfreq", "rfftfreq"):
    EXAMPLES[_name] = lambda g: ((), {"n": g.integer(1, 8), "d": g.choice([1.0, 0.5]), "dtype": g.dtype("real floating")})
    BAD_EXAMPLES[_name] = lambda g: ((), {"n": 0, "d": 1.0, "dtype": None}, ArgumentError)

for _name in ("fftshift", "ifftshift"):
    EXAMPLES[_name] = lambda g: ((g.array(g.shape(), g.dtype("floating")),), {"axes": None})
