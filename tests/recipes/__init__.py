"""Example-input recipes for the tests generated from the op table, keyed by op name.

A recipe is a function of ``g``, a drawing source the tests provide (tests/generators.py,
backed by hypothesis): ``g.shape(...)``, ``g.dtype(category)``, ``g.array(shape, dtype, low=,
high=, nonzero=)``, ``g.broadcastable(shape)``, ``g.integer(lo, hi)``, ``g.choice(seq)``,
``g.flag()``, ``g.permutation(seq)``,
``g.dtype_of(host_array)``. A good recipe returns ``(arrays, attrs)``; a bad one returns
``(arrays, attrs, expected_exception_type)``. Recipes never touch a backend.

``EXAMPLES[name]`` draws good inputs for row ``name`` (every row has one, or is tested by hand:
tests/test_op_table.py checks both ways); ``BAD_EXAMPLES[name]`` draws inputs the row must refuse
with a typed error (or is a list of such recipes, one per refusal the row's rules make).
``BRANCHES[name]`` lists attribute pins, one per branch of the row's rules an attribute selects.
One module per ops module of ember (``ember/ops/linalg.py`` → ``linalg.py``); ``samples.py``
holds the recipes many rows share. The rows themselves never see the recipes: they are test
data, and ember does not ship them.
"""

from __future__ import annotations

from collections.abc import Callable

from . import creation, elementwise, fft, indexing, linalg, linear_algebra, manipulation, nn, reductions

EXAMPLES: dict[str, Callable] = {}
BAD_EXAMPLES: dict[str, Callable] = {}
# attribute values that pick different branches of a row's rules (each norm's ord): tests that must reach every
# branch run the row once per entry, with the entry's values over the recipe's
BRANCHES: dict[str, list[dict]] = {}

for _module in (creation, elementwise, fft, indexing, linalg, linear_algebra, manipulation, nn, reductions):
    for _mapping, _recipes in ((EXAMPLES, _module.EXAMPLES), (BAD_EXAMPLES, _module.BAD_EXAMPLES)):
        _twice = _mapping.keys() & _recipes.keys()
        if _twice:
            raise ValueError(f"recipes for {sorted(_twice)} defined twice")
        _mapping.update(_recipes)
    BRANCHES.update(getattr(_module, "BRANCHES", {}))



def bad_recipes(name: str) -> list[Callable]:
    """The bad-input recipes of row ``name`` as a list (a row may give one or several)."""
    recipes = BAD_EXAMPLES.get(name, [])
    return list(recipes) if isinstance(recipes, (list, tuple)) else [recipes]


def branches(name: str) -> list[dict]:
    """The attribute pins row ``name`` is tested with, one per branch of its rules (``[{}]``: the recipe's own)."""
    return BRANCHES.get(name, [{}])


__all__ = ["EXAMPLES", "BAD_EXAMPLES", "BRANCHES", "bad_recipes", "branches"]
