"""Verified replay: a graph run on NumPy, torch and a compute peer agrees op by op; a device made to diverge
on purpose is caught at the op where the difference starts, and named with its inputs and errors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import ember as em
from ember.graphs.verify import _errors, sample_inputs

from .conftest import torch_available

needs_torch = pytest.mark.skipif(not torch_available(), reason="torch is not installed")


def spirals_graph():
    from .test_onnx import spirals_forward
    return spirals_forward(batch=32)


@needs_torch
def test_devices_agree_on_every_intermediate(peer):
    graph, points = spirals_graph()
    report = graph.verify(["numpy", "torch:cpu", peer.url()], inputs={"points": points})
    assert report.ok, str(report)
    assert report.ops == len(graph.ops) and "float64" in report.max_errors
    assert "every intermediate agrees" in str(report)


@needs_torch
def test_a_diverging_kernel_is_named(monkeypatch):
    """A real device made wrong in one kernel: torch:cpu's gelu is patched in this process to be off by 0.1 %
    (as a miscompiled or approximate kernel would be; no honest device here is wrong on its own). The op before
    it (linear) agrees; the report names the first gelu op — not the ops after it, which the error spread to."""
    graph, points = spirals_graph()
    backend = em.device("torch:cpu").engine.backend
    exact = backend.kernels["gelu"]
    monkeypatch.setitem(backend.kernels, "gelu", lambda x, **attrs: exact(x, **attrs) * 1.001)
    report = graph.verify(["numpy", "torch:cpu"], inputs=[points])
    assert not report.ok
    first = next(k for k, op in enumerate(graph.ops) if op.name == "gelu")
    assert first > 0 and graph.ops[first + 1].name == "linear"  # an agreeing op before, a spread-to op after
    divergence = report.divergence
    assert (divergence.index, divergence.op, divergence.device, divergence.reference) == (first, "gelu", "torch:cpu", "numpy")
    assert divergence.inputs == [((32, 64), "float64")]
    assert 1e-5 < divergence.max_abs < 1e-1 and 5e-4 < divergence.max_rel < 2e-3
    assert f"op {first} (gelu" in str(report) and "(32, 64) float64" in str(report)


def test_integer_outputs_must_be_equal():
    with em.capture() as cap:
        x = cap.input((5,), em.float64, name="x")
        cap.output(em.argmax(x), name="i")
    report = cap.graph.verify(["numpy", "numpy"], inputs=[np.arange(5.0)])
    assert report.ok and report.max_errors == {"int64": (0.0, 0.0)}


# --- the comparison, the sample inputs and the report, piece by piece -------------------------------------

@pytest.mark.parametrize("actual, expected, errors", [
    (np.zeros(0), np.zeros(0), (0.0, 0.0, True)),
    (np.array([2, 3]), np.array([2, 3]), (0.0, 0.0, True)),
    (np.array([3, 3]), np.array([2, 3]), (1.0, 0.5, False)),  # integers must be equal
    (np.array([1, 0], np.uint8), np.array([0, 0], np.uint8), (1.0, np.inf, False)),  # off a zero: infinitely
    (np.array([True]), np.array([False]), (1.0, np.inf, False)),
    (np.array([1.0, 2.0 + 1e-10]), np.array([1.0, 2.0]), (1e-10, 5e-11, True)),  # float64: rtol 1e-9
    (np.array([0.6, 0.25]), np.array([0.5, 0.25]), (0.1, 0.2, False)),  # relative to a value below one
    (np.array([1.0, 2.0 + 1e-6]), np.array([1.0, 2.0]), (1e-6, 5e-7, False)),
    (np.array([np.nan, 1.0]), np.array([np.nan, 1.0]), (0.0, 0.0, True)),  # NaNs in the same places agree
    (np.array([np.nan, 1.0]), np.array([0.5, 1.0]), (np.inf, np.inf, False)),
    (np.array([0.5, 1.0]), np.array([np.nan, 1.0]), (np.inf, np.inf, False)),
    (np.array([np.inf, -1.0]), np.array([np.inf, -1.0]), (0.0, 0.0, True)),
    (np.array([np.inf]), np.array([np.inf]), (0.0, 0.0, True)),  # nothing finite to scale atol by
    (np.array([1.0, 1.5e-11]), np.array([1.0, 0.0]), (1.5e-11, np.inf, False)),  # atol exactly 1e-11 below one
    (np.array([1e6, 1e-6]), np.array([1e6, 0.0]), (1e-6, np.inf, True)),  # atol grows with the largest value
    (np.array([1.0, 1e-6]), np.array([1.0, 0.0]), (1e-6, np.inf, False)),  # … and not below 1e-11
    (np.array([np.inf, 1.0]), np.array([np.inf, 0.0]), (1.0, np.inf, False)),  # an infinity does not scale it
    (np.array([1.0001], np.float32), np.array([1.0], np.float32), None),  # float32: rtol 2e-4
    (np.array([1.001], np.float32), np.array([1.0], np.float32), None),
    (np.array([1 + 1j]), np.array([1 + 1j + 1e-6]), None),  # complex: by modulus of the difference
])
def test_errors_by_dtype(actual, expected, errors):
    """(max abs error, max rel error, within tolerance) for the tolerances of the op table's own tests."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division by a zero size along the way
        got = _errors(actual, expected)
    if errors is None:  # computed here from the dtype's documented tolerance
        gap = float(np.max(np.abs(actual.astype(np.complex128) - expected.astype(np.complex128))))
        size = float(np.max(np.abs(expected)))
        rtol, atol = {np.dtype(np.float32): (2e-4, 1e-5), np.dtype(np.complex128): (1e-9, 1e-11)}[expected.dtype]
        errors = (gap, gap / size, gap <= atol * max(1.0, size) + rtol * size)
    assert got[2] == errors[2]
    np.testing.assert_allclose(got[:2], errors[:2], rtol=1e-6)


def _graph_with_inputs(*metas):
    with em.capture() as cap:
        arrays = [cap.input(shape, dtype, name=f"x{i}") for i, (shape, dtype) in enumerate(metas)]
        cap.output(em.sum(em.stack([em.sum(em.astype(a, em.complex128)) for a in arrays])), name="total")
    return cap.graph


def test_sample_inputs_fit_each_input_and_repeat_by_seed():
    """Standard-normal floats (complex: both parts), integers in [0, 3), bools both ways; the same seed the same."""
    graph = _graph_with_inputs(((100, 100), em.float32), ((50, 40), em.int32), ((1000,), em.uint8),
                               ((1000,), em.bool), ((100, 100), em.complex64))
    floats, ints, small, flags, complexes = sample_inputs(graph)
    assert [(a.shape, a.dtype) for a in (floats, ints, small, flags, complexes)] == [
        ((100, 100), np.float32), ((50, 40), np.int32), ((1000,), np.uint8), ((1000,), np.bool_), ((100, 100), np.complex64)]
    assert abs(floats.mean()) < 0.05 and 0.95 < floats.std() < 1.05
    assert set(np.unique(ints)) == set(np.unique(small)) == {0, 1, 2}
    assert 400 < flags.sum() < 600
    assert 0.95 < complexes.real.std() < 1.05 and 0.95 < complexes.imag.std() < 1.05
    again, other = sample_inputs(graph), sample_inputs(graph, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(again, (floats, ints, small, flags, complexes)))
    assert not np.array_equal(other[0], floats)


def _sine_graph():
    with em.capture() as cap:
        x = cap.input((3,), em.float64, name="x")
        cap.output(em.sin(x * 2.0) + em.cos(x), name="y")
    return cap.graph


def test_verify_needs_two_devices():
    with pytest.raises(em.ArgumentError, match=r"^verify: give at least two devices to compare, got \['numpy'\]$"):
        _sine_graph().verify(["numpy"])


def test_inputs_by_name_by_position_as_arrays_or_by_default():
    graph, host = _sine_graph(), np.array([0.1, 0.2, 0.3])
    for inputs in ({"x": host}, [host], [em.asarray(host)], None):
        report = graph.verify(["numpy", "numpy"], inputs=inputs)
        assert report.ok and report.ops == 4 and report.devices == ["numpy", "numpy"]
    assert str(report) == ("verified 4 ops on numpy, numpy (reference numpy): every intermediate agrees within its "
                           "dtype's tolerance (float64: max abs 0, max rel 0)")


def test_a_graph_without_ops_verifies_with_nothing_to_compare():
    with em.capture() as cap:
        x = cap.input((2,), em.float64, name="x")
        cap.output(x, name="y")
    report = cap.graph.verify(["numpy", "numpy"])
    assert report.ok and report.ops == 0 and report.max_errors == {}
    assert str(report) == ("verified 0 ops on numpy, numpy (reference numpy): every intermediate agrees within its "
                           "dtype's tolerance")


@needs_torch
def test_the_first_divergence_is_kept_with_its_output_inputs_and_errors(monkeypatch):
    """Two kernels made wrong (slogdet's second output, then sin); the report names the first, its output
    index and its inputs, and the largest errors seen anywhere by dtype."""
    with em.capture() as cap:
        a = cap.input((3, 3), em.float64, name="a")
        sign, logdet = em.linalg.slogdet(a * 2.0 + em.eye(3, device=cap.device))
        cap.output(em.sin(logdet) + sign, name="y")
    graph = cap.graph
    kernels = em.device("torch:cpu").engine.backend.kernels
    slogdet, sin = kernels["slogdet"], kernels["sin"]
    monkeypatch.setitem(kernels, "slogdet", lambda x: (slogdet(x)[0], slogdet(x)[1] + 0.5))
    monkeypatch.setitem(kernels, "sin", lambda x: sin(x) + 3.0)
    host = np.eye(3) * 0.25
    report = graph.verify(["numpy", "torch:cpu"], inputs=[host])
    index = next(k for k, op in enumerate(graph.ops) if op.name == "slogdet")
    d = report.divergence
    assert (d.index, d.op, d.output, d.device, d.reference) == (index, "slogdet", 1, "torch:cpu", "numpy")
    assert d.max_abs == pytest.approx(0.5)
    expected_logdet = np.log(np.linalg.det(host * 2 + np.eye(3)))
    assert d.max_rel == pytest.approx(0.5 / abs(expected_logdet))
    assert report.max_errors["float64"][0] == pytest.approx(3.5, rel=0.2)  # sin's error, beyond the first
    assert str(report) == (f"verified {len(graph.ops)} ops on numpy, torch:cpu (reference numpy): op {index} (slogdet, "
                           f"output 1) diverges: torch:cpu vs numpy: max abs error 0.5, max rel error {d.max_rel:.3g}; "
                           f"inputs (3, 3) float64")


@needs_torch
def test_a_divergence_names_a_literal_input_and_an_op_without_inputs(monkeypatch):
    kernels = em.device("torch:cpu").engine.backend.kernels
    with em.capture() as cap:
        x = cap.input((3,), em.float64, name="x")
        cap.output(x * 2.0, name="y")
    multiply = kernels["multiply"]
    monkeypatch.setitem(kernels, "multiply", lambda a, b: multiply(a, b) * 1.01)
    d = cap.graph.verify(["numpy", "torch:cpu"], inputs=[np.ones(3)]).divergence
    assert d.inputs == [((3,), "float64"), ((), "float64")] and str(d).endswith("inputs (3,) float64, () float64")
    monkeypatch.setitem(kernels, "multiply", multiply)
    with em.capture() as cap:
        cap.output(em.arange(4.0, device=cap.device), name="r")
    arange = kernels["arange"]
    monkeypatch.setitem(kernels, "arange", lambda *args, **attrs: arange(*args, **attrs) + 1)
    d = cap.graph.verify(["numpy", "torch:cpu"], inputs=[]).divergence
    assert d.op == "arange" and d.inputs == [] and str(d).endswith("; inputs no inputs")


@needs_torch
def test_outputs_fixed_only_up_to_sign_are_not_compared(monkeypatch):
    """eigh's eigenvectors may differ in sign between devices: verify compares the eigenvalues only."""
    kernels = em.device("torch:cpu").engine.backend.kernels
    eigh = kernels["eigh"]
    monkeypatch.setitem(kernels, "eigh", lambda x: (eigh(x)[0], -eigh(x)[1]))
    with em.capture() as cap:
        a = cap.input((3, 3), em.float64, name="a")
        values, vectors = em.linalg.eigh(a)
        cap.output(values, name="w")
        cap.output(vectors, name="v")
    symmetric = np.array([[2.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 1.0]])
    report = cap.graph.verify(["numpy", "torch:cpu"], inputs=[symmetric])
    assert report.ok, str(report)


def test_the_report_lists_each_dtypes_errors():
    """The report lists each dtype's largest errors, in order."""
    with em.capture() as cap:
        x = cap.input((2,), em.float64, name="x")
        cap.output(em.argmax(x * 2.0), name="i")
        cap.output(em.round(x * 2.0 * 0.0), name="zero")
    graph = cap.graph
    report = graph.verify(["numpy", "numpy"], inputs=[np.array([1.0, 2.0])])
    assert str(report).endswith("(float64: max abs 0, max rel 0; int64: max abs 0, max rel 0)")


@needs_torch
def test_errors_accumulate_per_dtype_over_ops(monkeypatch):
    """An early op off by 1 (relative 0.5), later ops exact: the report keeps 1 and 0.5."""
    kernels = em.device("torch:cpu").engine.backend.kernels
    with em.capture() as cap:
        x = cap.input((1,), em.float64, name="x")
        cap.output(em.floor(x * 2.0) * 0.0, name="y")
    multiply = kernels["multiply"]
    monkeypatch.setitem(kernels, "multiply", lambda a, b: multiply(a, b) + (1.0 if float(b) == 2.0 else 0.0))
    report = cap.graph.verify(["numpy", "torch:cpu"], inputs=[np.array([1.0])])
    assert report.max_errors["float64"] == (1.0, 0.5)


@needs_torch
def test_an_undetermined_output_does_not_hide_the_outputs_after_it(monkeypatch):
    """svd's U comes first and is not compared (its columns' signs are free); S after it still is."""
    kernels = em.device("torch:cpu").engine.backend.kernels
    svd = kernels["svd"]
    monkeypatch.setitem(kernels, "svd", lambda x, full_matrices: (lambda u, s, vh: (u, s * 1.01, vh))(
        *svd(x, full_matrices=full_matrices)))
    with em.capture() as cap:
        a = cap.input((3, 3), em.float64, name="a")
        cap.output(em.linalg.svd(a)[1], name="s")
    report = cap.graph.verify(["numpy", "torch:cpu"], inputs=[np.diag([3.0, 2.0, 1.0])])
    assert not report.ok and (report.divergence.op, report.divergence.output) == ("svd", 1)
