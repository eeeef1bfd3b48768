"""Recipes for the creation rows (ember/ops/creation.py)."""

from __future__ import annotations

from ember import dtypes as dt
from ember.errors import ArgumentError, DTypeError


def _arange_examples(g):
    start, stop = g.integer(-10, 10), g.integer(-10, 10)
    step = g.choice([1, 2, -1, 0.5, -3])
    return (), {"start": start, "stop": stop, "step": step, "dtype": None}


def _full_examples(g):
    dtype = g.dtype("any")
    fill = g.choice([True, False] if dtype.kind == dt.BOOL else [0, 1, 7])
    return (), {"shape": g.shape(), "fill_value": fill, "dtype": dtype}


EXAMPLES = {
    "arange": _arange_examples,
    "full": _full_examples,
    "empty": lambda g: ((), {"shape": g.shape(), "dtype": g.dtype("any")}),
    "eye": lambda g: ((), {"n_rows": g.integer(0, 4), "n_cols": g.choice([None, g.integer(0, 4)]),
                           "k": g.integer(-3, 3), "dtype": g.dtype("any")}),
    "linspace": lambda g: ((), {"start": g.integer(-5, 5), "stop": g.integer(-5, 5), "num": g.integer(0, 6),
                                "dtype": g.dtype("floating"), "endpoint": g.flag()}),
}

BAD_EXAMPLES = {
    "arange": lambda g: ((), {"start": 0, "stop": 5, "step": 0, "dtype": None}, ArgumentError),
    "full": lambda g: ((), {"shape": (2,), "fill_value": 1.5, "dtype": dt.int32}, DTypeError),
    "empty": lambda g: ((), {"shape": (-1,), "dtype": None}, ValueError),
    "eye": lambda g: ((), {"n_rows": -2, "n_cols": None, "k": 0, "dtype": None}, ArgumentError),
    "linspace": lambda g: ((), {"start": 0, "stop": 1, "num": -1, "dtype": None, "endpoint": True}, ArgumentError),
}
