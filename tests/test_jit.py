"""``em.jit`` at its edges: what the jitted function says of itself, calls without arrays,
arguments on two devices, results on the arguments' device, keyword arguments, what a graph
names its inputs and outputs, and outputs the function did not compute."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import ember as em

from .conftest import torch_available


def scaled(x, y, *, scale):
    """x · scale + y."""
    return x * scale + y


def test_a_jitted_function_keeps_its_name_doc_and_function():
    jitted = em.jit(scaled)
    assert (jitted.__name__, jitted.__doc__, jitted.__wrapped__) == ("scaled", "x · scale + y.", scaled)
    assert repr(jitted) == "<jit scaled: 0 captured>"
    assert em.jit(functools.partial(scaled, scale=2)).__name__ == "function"  # a callable without a name
    assert em.jit(lambda x: x).__name__ == "<lambda>"


def test_keyword_arrays_are_traced_and_the_graph_names_arguments_and_outputs():
    jitted = em.jit(scaled)
    x, y = em.asarray([1.0, 2.0]), em.asarray([10.0, 20.0])
    np.testing.assert_array_equal(em.asnumpy(jitted(x, y, scale=em.asarray(3.0))), [13.0, 26.0])
    np.testing.assert_array_equal(em.asnumpy(jitted(y, x, scale=em.asarray(0.5))), [6.0, 12.0])  # replayed
    assert repr(jitted) == "<jit scaled: 1 captured>"
    ((graph, _),) = jitted.graphs.values()
    assert [name for name, _, _ in graph.inputs] == ["arg0", "arg1", "arg2"] and [n for n, _ in graph.outputs] == ["out0"]


def test_a_call_without_arrays_runs_the_function_itself():
    jitted = em.jit(scaled)
    assert jitted(2, 3, scale=10) == 23 and not jitted.graphs


def test_a_function_returning_no_array_is_captured_once_and_returns_its_value():
    calls = []

    def note(x):
        calls.append(x.shape)
        return {"rows": x.shape[0]}
    jitted = em.jit(note)
    assert jitted(em.ones((3, 2))) == {"rows": 3} and jitted(em.ones((3, 2))) == {"rows": 3}
    assert calls == [(3, 2)]  # captured once; the replay has nothing to run


@pytest.mark.skipif(not torch_available(), reason="torch is not installed")
def test_results_stay_on_the_arguments_device_and_two_devices_are_refused():
    jitted = em.jit(lambda a, b: a * b)
    torch = em.device("torch:cpu")
    a, b = em.asarray([1.0, 2.0], device=torch), em.asarray([3.0, 4.0], device=torch)
    out = jitted(a, b)
    assert out.device is torch and em.asnumpy(out).tolist() == [3.0, 8.0]
    with pytest.raises(em.EmberError) as refused:
        jitted(a, em.asarray([3.0, 4.0]))
    assert str(refused.value) == "jit(<lambda>): array arguments are on different devices: numpy, torch:cpu"


def test_an_output_from_outside_the_function_is_refused_and_an_argument_may_come_back():
    outside = em.ones(2)
    with pytest.raises(em.CaptureError) as refused:
        em.jit(lambda x: (x * 2, outside))(em.zeros(2))
    assert str(refused.value) == ("jit(<lambda>): output 1 is not computed in the function (return it from outside "
                                  "the jitted function)")
    np.testing.assert_array_equal(em.asnumpy(em.jit(lambda x: x)(em.arange(3.0))), [0.0, 1.0, 2.0])
