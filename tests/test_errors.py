"""Bad input raises a typed error naming the operation and the offending shapes, dtypes or
values — and loses nothing: the other arrays keep working."""

from __future__ import annotations

import pytest

import ember as em


def test_error_tree():
    assert issubclass(em.ShapeError, em.EmberError) and issubclass(em.ShapeError, ValueError)
    assert issubclass(em.DTypeError, TypeError) and issubclass(em.AxisError, IndexError)
    assert issubclass(em.DeviceError, ValueError) and issubclass(em.ConnectionLost, ConnectionError)
    assert issubclass(em.HostDeviceError, em.DeviceError) and issubclass(em.NotSupportedError, NotImplementedError)


@pytest.mark.parametrize("call, kind, message", [
    (lambda: em.matmul(em.ones((3, 4)), em.ones((5, 2))), ValueError, r"^matmul: shapes \(3, 4\) and \(5, 2\) are not aligned"),
    (lambda: em.add(em.ones(3), em.ones(4)), ValueError, r"^add: shapes \(3,\) and \(4,\) cannot be broadcast together"),
    (lambda: em.sum(em.ones((2, 2)), axis=2), IndexError, r"^sum: axis 2 is out of bounds for an array of dimension 2"),
    (lambda: em.bitwise_and(em.ones(2), em.ones(2)), TypeError,
     r"^bitwise_and: inputs must have an integral or bool dtype, got float64"),
    (lambda: em.reshape(em.ones(6), (4, 2)), ValueError,
     r"^reshape: cannot reshape an array of shape \(6,\) \(size 6\) into shape \(4, 2\)"),
    (lambda: em.linalg.inv(em.ones((2, 3))), ValueError, r"^inv: input must be a stack of square matrices, got shape \(2, 3\)"),
    (lambda: em.concat([em.ones((2, 3)), em.ones((2, 4))]), ValueError, r"^concat: shapes \(2, 3\), \(2, 4\) do not match"),
    (lambda: em.full((2,), 1.5, dtype=em.int32), TypeError, r"^full: fill_value 1.5 does not fit dtype int32"),
    (lambda: em.ones(2) + "a", TypeError, r"unsupported operand"),
    (lambda: em.sum([1, 2]), TypeError, r"^sum: expected an ember array, got list \(convert it with ember.asarray\)"),
    (lambda: em.max(em.ones((0, 3)), axis=0), ValueError, r"^max: cannot reduce over a zero-size axis"),
    (lambda: em.linalg.inv(em.zeros((2, 2))), RuntimeError, r"^inv: Singular matrix \(inputs: \(2, 2\) float64\)"),
    # refusals whose message is a plain sentence, word for word
    (lambda: em.concat([]), ValueError, r"^concat: needs at least one array$"),
    (lambda: em.stack([]), ValueError, r"^stack: needs at least one array$"),
    (lambda: em.arange(0, "5"), ValueError, r"^arange: stop must be a real Python number, got '5'$"),
    (lambda: em.linspace(0, [1], 3), ValueError, r"^linspace: stop must be a Python number, got \[1\]$"),
    (lambda: em.linspace(0, 1, 2.5), ValueError, r"^linspace: num must be an int, got 2.5$"),
])
def test_bad_input_is_typed_and_named(call, kind, message):
    survivor = em.asarray([1.0, 2.0])
    with pytest.raises(kind, match=message) as info:
        call()
    if "unsupported operand" not in message:
        assert isinstance(info.value, em.EmberError)
    assert float(em.sum(survivor * 2)) == 6.0


def test_meta_errors_come_before_execution():
    x = em.ones((3, 4))
    executed = em.stats(x.device)["ops"]
    with pytest.raises(em.ShapeError):
        em.matmul(x, x)
    assert em.stats(x.device)["ops"] == executed  # nothing reached the backend
