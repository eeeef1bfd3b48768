"""Recipes for the creation rows (ember/ops/creation.py)."""

from __future__ import annotations

from ember import dtypes as dt
from ember.errors import ArgumentError, DTypeError


def _arange_examples(g):
    start, stop = g.integer(-10, 10), g.choice([None, g.integer(-10, 10), g.integer(-10, 10) + 0.5])
    step = g.choice([1, 2, -1, 0.5, -3])
    whole = all(v == int(v) for v in (start, stop if stop is not None else 0, step))  # an integer dtype takes only these
    # signed: the values may be negative
    dtype = g.choice([None, g.dtype(g.choice(["signed integer", "real floating"] if whole else ["real floating"]))])
    return (), {"start": start, "stop": stop, "step": step, "dtype": dtype}


def _linspace_examples(g):
    start, stop = g.integer(-5, 5), g.choice([g.integer(-5, 5), g.integer(-5, 5) + 0.5, complex(g.integer(-5, 5), 1)])
    start, stop = g.permutation([start, stop])
    dtype = g.choice([None, g.dtype("complex floating" if isinstance(start + stop, complex) else "floating")])
    return (), {"start": start, "stop": stop, "num": g.integer(0, 6), "dtype": dtype, "endpoint": g.flag()}


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
    "linspace": _linspace_examples,
}

BAD_EXAMPLES = {
    "arange": [lambda g: ((), {"start": 0, "stop": 5, "step": 0, "dtype": None}, ArgumentError),
               *(lambda g, bad=bad: ((), {**{"start": 0, "stop": 5, "step": 1, "dtype": None}, **bad}, ArgumentError)
                 for bad in ({"start": "0"}, {"stop": 1j}, {"step": "1"})),
               lambda g: ((), {"start": 0, "stop": 5, "step": 1, "dtype": dt.bool_}, DTypeError),
               lambda g: ((), {"start": 2, "stop": -2, "step": -1, "dtype": dt.uint8}, DTypeError),
               lambda g: ((), {"start": 120, "stop": 130, "step": 1, "dtype": dt.int8}, DTypeError),
               lambda g: ((), {"start": 0, "stop": 2, "step": 0.5, "dtype": dt.int8}, DTypeError)],
    "full": [lambda g: ((), {"shape": (2,), "fill_value": 1.5, "dtype": dt.int32}, DTypeError),
             lambda g: ((), {"shape": (2,), "fill_value": [1.5], "dtype": dt.float64}, ArgumentError)],
    "empty": lambda g: ((), {"shape": (-1,), "dtype": None}, ValueError),
    "eye": [lambda g, bad=bad: ((), {**{"n_rows": 2, "n_cols": None, "k": 0, "dtype": None}, **bad}, ArgumentError)
            for bad in ({"n_rows": -2}, {"n_cols": -1}, {"n_rows": 2.5}, {"n_cols": 2.5}, {"k": 0.5})],
    "linspace": [*(lambda g, bad=bad: ((), {**{"start": 0, "stop": 1, "num": 3, "dtype": None, "endpoint": True}, **bad},
                                        ArgumentError)
                   for bad in ({"num": -1}, {"num": 2.5}, {"start": "0"}, {"stop": [1]})),
                 lambda g: ((), {"start": 0, "stop": 1, "num": 3, "dtype": dt.int32, "endpoint": True}, DTypeError)],
}
