"""The dtype layer: promotion against array-api-strict's table, scalar rules, finfo/iinfo."""

from __future__ import annotations

import itertools

import pytest

import ember as em
from ember import dtypes as dt

strict = pytest.importorskip("array_api_strict")


def test_promotion_matches_the_standard_where_it_is_defined():
    checked = 0
    for a, b in itertools.product(dt.ALL, repeat=2):
        try:
            expected = strict.result_type(getattr(strict, a.name), getattr(strict, b.name))
        except TypeError:
            continue  # the standard leaves it undefined; ember's own rule is tested below
        assert dt.promote(a, b).name == str(expected).rsplit(".", 1)[-1], (a, b)
        assert em.can_cast(a, b) == strict.can_cast(getattr(strict, a.name), getattr(strict, b.name)), (a, b)
        checked += 1
    assert checked == 73  # every pair the standard defines


def test_across_kinds_the_higher_kind_wins():
    assert dt.promote(em.int32, em.float32) is em.float32
    assert dt.promote(em.bool, em.uint8) is em.uint8
    assert dt.promote(em.int64, em.complex64) is em.complex64
    with pytest.raises(TypeError, match="uint64 and int8 have no common dtype"):
        dt.promote(em.uint64, em.int8)


def test_result_type_takes_arrays_dtypes_and_scalars():
    assert em.result_type(em.ones(2, dtype=em.int8), em.int16, 3) is em.int16
    assert em.result_type(em.float32, 1.5) is em.float32
    assert em.result_type(em.int8, 1.5) is em.float64
    with pytest.raises(TypeError, match="result_type: at least one array or dtype"):
        em.result_type(1, 2.0)


def test_isdtype_finfo_iinfo():
    assert em.isdtype(em.float32, "real floating") and em.isdtype(em.int8, ("bool", "integral"))
    assert not em.isdtype(em.complex64, "real floating") and em.isdtype(em.uint8, "numeric")
    assert em.finfo(em.float32).eps == 2.0**-23 and em.finfo(em.complex128).dtype is em.float64
    assert em.iinfo(em.int8).min == -128 and em.iinfo(em.uint16).max == 65535
    with pytest.raises(TypeError):
        em.iinfo(em.float32)
    with pytest.raises(TypeError, match="unknown kind"):
        em.isdtype(em.float32, "floats")
