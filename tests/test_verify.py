"""Verified replay: a graph run on NumPy, torch and a compute peer agrees op by op; a device made to diverge
on purpose is caught at the op where the difference starts, and named with its inputs and errors."""

from __future__ import annotations

import numpy as np
import pytest

import ember as em

from .conftest import torch_available

pytestmark = pytest.mark.skipif(not torch_available(), reason="torch is not installed")


def spirals_graph():
    from .test_onnx import spirals_forward
    return spirals_forward(batch=32)


def test_devices_agree_on_every_intermediate(peer):
    graph, points = spirals_graph()
    report = graph.verify(["numpy", "torch:cpu", peer.url()], inputs={"points": points})
    assert report.ok, str(report)
    assert report.ops == len(graph.ops) and "float64" in report.max_errors
    assert "every intermediate agrees" in str(report)


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
