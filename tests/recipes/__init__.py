"""Example-input recipes for the tests generated from the op table, keyed by op name.

A recipe is a function of ``g``, a drawing source the tests provide (tests/generators.py,
backed by hypothesis): ``g.shape(...)``, ``g.dtype(category)``, ``g.array(shape, dtype, low=,
high=, nonzero=)``, ``g.broadcastable(shape)``, ``g.integer(lo, hi)``, ``g.choice(seq)``,
``g.flag()``, ``g.permutation(seq)``,
``g.dtype_of(host_array)``. A good recipe returns ``(arrays, attrs)``; a bad one returns
``(arrays, attrs, expected_exception_type)``. Recipes never touch a backend.

``EXAMPLES[name]`` draws good inputs for row ``name`` (every row has one, or is tested by hand:
tests/test_op_table.py checks both ways); ``BAD_EXAMPLES[name]`` draws inputs the row must refuse
with a typed error. One module per ops module of ember (``ember/ops/linalg.py`` → ``linalg.py``);
``samples.py`` holds the recipes many rows share. The rows themselves never see the recipes:
they are test data, and ember does not ship them.
"""

from __future__ import annotations

from collections.abc import Callable

from . import creation, elementwise, fft, indexing, linalg, manipulation, nn, reductions

EXAMPLES: dict[str, Callable] = {}
BAD_EXAMPLES: dict[str, Callable] = {}

for _module in (creation, elementwise, fft, indexing, linalg, manipulation, nn, reductions):
    for _mapping, _recipes in ((EXAMPLES, _module.EXAMPLES), (BAD_EXAMPLES, _module.BAD_EXAMPLES)):
        _twice = _mapping.keys() & _recipes.keys()
        if _twice:
            raise ValueError(f"recipes for {sorted(_twice)} defined twice")
        _mapping.update(_recipes)

__all__ = ["EXAMPLES", "BAD_EXAMPLES"]
