"""Bad input raises a typed error naming the operation and the offending shapes, dtypes or
values — and loses nothing: the other arrays keep working."""

from __future__ import annotations

import numpy as np
import pytest

import ember as em
from ember.engines.local import LocalEngine

from .conftest import torch_available


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


def test_a_kernel_failure_names_the_op_and_each_input_literals_by_their_value():
    """A backend's exception becomes a typed error naming the op and its inputs: an array by shape and dtype
    (without torch's module prefix), a literal by its value."""
    x = em.asarray([1.0, 2.0])
    with np.errstate(divide="raise"), pytest.raises(em.ExecutionError,
                                                    match=r"^divide: divide by zero .*\(inputs: \(2,\) float64, 0\.0\)$"):
        em.divide(x, 0.0)
    devices = ["numpy", "torch:cpu"] if torch_available() else ["numpy"]
    for device in devices:
        not_positive = em.asarray([[1.0, 2.0], [2.0, 1.0]], device=device)
        with pytest.raises(em.ExecutionError, match=r"^cholesky: .*\(inputs: \(2, 2\) float64\)$"):
            em.linalg.cholesky(not_positive)
    assert float(em.sum(x)) == 3.0


def test_an_op_without_a_kernel_is_refused_by_name_with_the_backends_reason(monkeypatch):
    """A backend lacking a row's kernel says so, with its reason where it gives one; a kernel failing on the
    general path (an op of several outputs) is named with its inputs, an IndexError as an IndexingError."""
    engine = em.device("numpy").engine
    x = em.asarray([3.0, 1.0, 3.0])
    kernels = dict(engine._kernels)
    del kernels["negative"]
    monkeypatch.setattr(engine, "_kernels", kernels)
    monkeypatch.setattr(engine, "_unchecked", kernels)
    with pytest.raises(em.NotSupportedError, match=r"^negative: not supported on numpy \(no kernel\)$"):
        em.negative(x)
    monkeypatch.setattr(engine.backend, "gaps", {"negative": "not built with it"})
    with pytest.raises(em.NotSupportedError, match=r"^negative: not supported on numpy \(not built with it\)$"):
        em.negative(x)
    with pytest.raises(em.NotSupportedError, match=r"^negative: not supported on numpy$"):  # nor in a plan
        em.jit(lambda x: -x)(x)

    def failing(message, kind):
        def kernel(*args, **kwargs):
            raise kind(message)
        return kernel
    for kind, ember_kind in ((ValueError, em.ExecutionError), (IndexError, em.IndexingError)):
        kernels["unique_counts"] = failing("no counts today", kind)
        with pytest.raises(ember_kind, match=r"^unique_counts: no counts today \(inputs: \(3,\) float64\)$"):
            em.unique_counts(x)
    assert float(em.sum(x)) == 7.0


def test_the_numpy_device_holds_results_as_numpy_arrays_and_counts_from_zero():
    """A reduction's result is a 0-d NumPy array, not a NumPy scalar (what ``asnumpy`` promises), eager or as
    several outputs; a fresh engine has run nothing, moved nothing."""
    x = em.asarray([3.0, 1.0, 3.0])
    logabsdet = em.jit(lambda a: em.linalg.slogdet(a).logabsdet)  # several outputs, in a plan
    for result in (em.sum(x), em.linalg.slogdet(em.eye(2)).logabsdet, logabsdet(em.eye(2)), logabsdet(em.eye(2))):
        host = em.asnumpy(result)
        assert type(host) is np.ndarray and host.shape == () and host.dtype == np.float64
    fresh = LocalEngine(em.device("numpy").engine.backend)
    assert fresh.stats() == {"ops": 0, "round_trips": 0, "bytes_up": 0, "bytes_down": 0}
