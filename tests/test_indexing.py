"""x[key] and x[key] = value against NumPy's results, on every local device."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ember as em
from ember.namespace.indexing import encode_key
from ember.ops.indexing import index_shape

from .conftest import LOCAL_DEVICES

shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


@st.composite
def host_and_key(draw, with_arrays=True):
    shape = draw(shapes)
    host = draw(hnp.arrays(np.int32, shape, elements=st.integers(-100, 100)))
    kind = draw(st.sampled_from(["basic", "integer", "mask", "mixed"] if with_arrays and shape else ["basic"]))
    if kind == "basic":
        key = draw(hnp.basic_indices(shape, allow_newaxis=True, allow_ellipsis=True))
    elif kind == "mixed":  # integers, slices and index arrays: where the arrays' dimensions go depends on their adjacency
        assume(all(shape))
        result = draw(hnp.array_shapes(min_dims=0, max_dims=2, max_side=3))
        parts = [draw(st.sampled_from(["int", "slice", "array"])) for _ in shape]
        assume("array" in parts)
        key = tuple(draw(st.integers(-side, side - 1)) if part == "int" else slice(None, None, draw(st.sampled_from([1, -1, 2])))
                    if part == "slice" else draw(hnp.arrays(np.int64, result, elements=st.integers(-side, side - 1)))
                    for part, side in zip(parts, shape))
    elif kind == "integer":
        assume(all(shape))
        key = draw(hnp.integer_array_indices(shape, result_shape=hnp.array_shapes(min_dims=0, max_dims=2, max_side=3)))
    else:
        depth = draw(st.integers(1, len(shape)))
        key = draw(hnp.arrays(np.bool_, shape[:depth]))
    return host, key


def to_ember_key(key, device):
    if isinstance(key, np.ndarray):
        return em.asarray(key, device=device)
    if isinstance(key, tuple):
        return tuple(to_ember_key(k, device) for k in key)
    return key


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
@settings(max_examples=200)  # cheap, and keys have many corners
@given(case=host_and_key())
def test_getitem_matches_numpy(device_name, case):
    host, key = case
    x = em.asarray(host, device=device_name)
    expected = host[key]
    result = x[to_ember_key(key, device_name)]
    assert result.shape == expected.shape, f"shape {result.shape} vs NumPy {expected.shape} for key {key!r}"
    np.testing.assert_array_equal(em.asnumpy(result), expected)
    assert_rule_gives(host, x, to_ember_key(key, device_name), expected.shape)


def assert_rule_gives(host, x, key, expected):
    """The meta rule's own shape for ``x[key]`` (an engine replaces a data-dependent one by the real shape): only a
    mask's length may be unknown."""
    template, arrays = encode_key(x, key)
    rule = index_shape(host.shape, template, tuple(a._meta for a in arrays))
    masked = any(a.dtype == em.bool for a in arrays)
    assert len(rule) == len(expected) and all(r == e or masked and r is None for r, e in zip(rule, expected)), \
        f"meta rule {rule} vs NumPy {expected} for key {key!r}"


def _unique_integer_arrays(key):
    arrays = key if isinstance(key, tuple) else (key,)
    no_integer_arrays = all(not isinstance(k, np.ndarray) or k.dtype == np.bool_ for k in arrays)
    return no_integer_arrays or len(arrays) == 1 and len(np.unique(arrays[0])) == arrays[0].size


_I, _S, _E = np.array([[2, 0], [1, 3]]), slice(None), Ellipsis
_M = np.arange(20).reshape(4, 5) % 3 == 0  # a 2-d mask takes two axes


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
@pytest.mark.parametrize("key", [(_S, 1, _S, _I), (_S, _I, _S, -1), (_S, 1, _I, _S), (_S, _I, 2, _S), (0, _S, _I, _S),
                                 (_I, _S, _S, 1), (_S, _I, _S, _I), (_S, _S, 0, _I),
                                 (1, _I, _E), (_E, 2, _I), (_M, _E), (_M, _E, 1), (_E, _M[:, :4].T)],
                         ids=["s1si", "sisi", "s1is", "si2s", "0sis", "iss1", "sisi2", "ss0i",
                              "1ie", "e2i", "me", "me1", "em"])
def test_integers_count_as_index_arrays_for_where_the_arrays_dimensions_go(device_name, key):
    """NumPy's rule: with an index array in the key, an integer is advanced too; advanced items that stand apart put the
    broadcast dimensions first, together they put them where the first one stands (random keys rarely draw these)."""
    host = np.arange(4 * 5 * 4 * 4).reshape(4, 5, 4, 4)
    x = em.asarray(host, device=device_name)
    result = x[to_ember_key(key, device_name)]
    assert result.shape == host[key].shape
    assert_rule_gives(host, x, to_ember_key(key, device_name), host[key].shape)
    np.testing.assert_array_equal(em.asnumpy(result), host[key])
    expected = host.copy()
    expected[key] = -1
    x[to_ember_key(key, device_name)] = em.asarray(np.full(host[key].shape, -1), device=device_name)
    np.testing.assert_array_equal(em.asnumpy(x), expected)


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
@settings(max_examples=200)
@given(case=host_and_key(), data=st.data())
def test_setitem_matches_numpy(device_name, case, data):
    host, key = case
    assume(_unique_integer_arrays(key))  # with repeated indices the standard leaves the winner open
    target_shape = host[key].shape
    value_shape = data.draw(st.sampled_from([target_shape, target_shape[1:] if target_shape else (), ()]))
    value = data.draw(hnp.arrays(np.int32, value_shape, elements=st.integers(-100, 100)))
    expected = host.copy()
    expected[key] = value
    x = em.asarray(host.copy(), device=device_name)
    before = x
    x[to_ember_key(key, device_name)] = em.asarray(value, device=device_name)
    assert x is before
    np.testing.assert_array_equal(em.asnumpy(x), expected)


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
def test_setitem_with_scalar_and_negative_steps(device_name):
    x = em.reshape(em.arange(12, device=device_name), (3, 4))
    x[::-1, 1] = 7
    x[0, ::-2] = -1
    expected = np.arange(12).reshape(3, 4)
    expected[::-1, 1] = 7
    expected[0, ::-2] = -1
    np.testing.assert_array_equal(em.asnumpy(x), expected)


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
def test_setitem_never_writes_through_to_other_arrays(device_name):
    host = np.zeros(4)
    x = em.asarray(host, device=device_name)
    y = x[1:3]
    x[1] = 5.0
    assert float(y[0]) == 0.0 and float(x[1]) == 5.0
    assert host[1] == 0.0  # the caller's buffer is never modified by ember


def test_indexing_errors_are_typed():
    x = em.ones((2, 3))
    with pytest.raises(IndexError, match=r"getitem: index 5 is out of bounds for axis 1 with size 3"):
        x[0, 5]
    with pytest.raises(IndexError, match="too many indices"):
        x[0, 0, 0]
    with pytest.raises(IndexError, match="boolean index of shape"):
        x[em.asarray([True, False, True])]
    with pytest.raises(em.EmberError):
        x["a"]
    with pytest.raises(ValueError, match=r"setitem: value of shape \(4,\) cannot be broadcast"):
        x[0] = em.ones(4)
    with pytest.raises(TypeError, match="cannot assign complex"):
        x[0] = 1j
    assert float(em.sum(x)) == 6.0  # the array is unchanged after the failures
    with em.capture() as cap:  # the meta rule refuses, before any kernel: at the bounds exactly
        c = cap.input((2, 3), em.float64)
        for index in (3, -4):
            with pytest.raises(IndexError, match=rf"^getitem: index {index} is out of bounds for axis 1 with size 3$"):
                c[0, index]
        with pytest.raises(IndexError, match=r"^getitem: boolean index of shape \(1,\) does not match the indexed axes "
                                             r"\(2,\) of shape \(2, 3\)$"):
            c[em.asarray([True], device=cap.device)]
        cap.output(c[1, 2] + c[-2, -3])
    # a mask axis 0 long fits any axis (the standard's rule; NumPy refuses it): the result is empty
    assert x[em.asarray(np.zeros(0, bool))].shape == (0, 3)
