"""ONNX export, generated from the op table: every row with a lowering (ember/graphs/onnx.py) is captured
on its recipes' examples, exported, checked by ``onnx.checker`` and run by ONNX Runtime, whose results must
equal ember's replay within the dtype's tolerance. Plus whole models: the spirals forward pass, a small conv
net and attention; and the refusal of rows without an ONNX form."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import ember as em
from ember import dtypes as dt
from ember.array import bind
from ember.errors import OnnxError
from ember.ops import OPS

from .generators import Drawer
from .recipes import EXAMPLES

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from ember.graphs.onnx import exportable_rows, missing_rows, to_model  # noqa: E402

# the dtypes ONNX Runtime has kernels for across the operators ember lowers to; the ONNX model is valid for every
# real dtype, but ONNX Runtime implements e.g. Add for int8 or Neg for uint16 in no version
ORT_DTYPES = (dt.bool_, dt.int32, dt.int64, dt.float32, dt.float64)
EXPORTED = [name for name in exportable_rows() if EXAMPLES.get(name)]
TOLERANCE = {dt.float32: (2e-4, 1e-5), dt.float64: (1e-9, 1e-11)}


def capture_row(op, arrays, attrs):
    with em.capture() as cap:
        inputs = [cap.input(a.shape, dt.FROM_NUMPY[a.dtype], name=f"x{i}") for i, a in enumerate(arrays)]
        out = bind(op, tuple(inputs), {**op.attrs, **attrs}, device=cap.device)
        for j, o in enumerate(out if isinstance(out, tuple) else (out,)):
            cap.output(o, name=f"y{j}")
    return cap.graph


def run_onnxruntime(model, feeds: dict) -> list:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_agree(graph, arrays, what, feeds=None):
    """Replay on NumPy and ONNX Runtime; returns {dtype name: max abs error}."""
    model = to_model(graph)
    onnx.checker.check_model(model, full_check=True)
    expected = graph(*[em.asarray(a) for a in arrays], device="numpy")
    expected = [em.asnumpy(e) for e in (expected if isinstance(expected, tuple) else (expected,))]
    actual = run_onnxruntime(model, feeds or {name: a for (name, _, _), a in zip(graph.inputs, arrays)})
    errors = {}
    for (name, node), e, a in zip(graph.outputs, expected, actual):
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what} {name}: ORT {a.shape} {a.dtype}, ember {e.shape} {e.dtype}"
        rtol, atol = TOLERANCE.get(graph.metas[node].dtype, (0, 0))
        scale = max(1.0, float(np.abs(e[np.isfinite(e)]).max(initial=0))) if e.dtype.kind == "f" else 1
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * scale, equal_nan=True, err_msg=f"{what} {name}")
        if e.size and e.dtype.kind in "fiub":
            gap = np.abs(a.astype(np.float64) - e.astype(np.float64))
            errors[e.dtype.name] = float(np.nanmax(np.where(np.isfinite(gap), gap, 0)))
    return errors


def test_rows_are_lowered_or_named_as_gaps():
    """Every row has an ONNX form or a reason why not; the count is what docs/onnx.md reports."""
    missing = missing_rows()
    assert set(exportable_rows()) | set(missing) == set(OPS)
    assert all(why and why != "no lowering" for why in missing.values()), [n for n, w in missing.items() if w == "no lowering"]
    assert len(exportable_rows()) >= 120, len(exportable_rows())


@settings(max_examples=10)
@pytest.mark.parametrize("name", EXPORTED)
@given(data=st.data())
def test_exported_row_matches_replay(name, data):
    op = OPS[name]
    # rows without inputs are folded into initializers: any dtype ember computes will do
    arrays, attrs = EXAMPLES[name](Drawer(data, ORT_DTYPES if op.inputs else dt.ALL))
    full = {**op.attrs, **attrs}
    _, out_metas = op.infer(tuple(em.asarray(a)._meta for a in arrays), full)
    assume(out_metas and all(m.dtype in ORT_DTYPES for m in out_metas))
    if name == "det":
        assume(arrays[0].dtype == np.float32)  # a float64 det is refused: ONNX Runtime's Det computes float32 only
    assert_agree(capture_row(op, arrays, attrs), arrays, name)


def test_a_graph_with_rows_without_an_onnx_form_names_them_all():
    with em.capture() as cap:
        x = cap.input((4,), em.float64, name="x")
        y = em.fft.fft(x)
        z = em.linalg.inv(em.reshape(x, (2, 2)))
        cap.output(em.sum(em.abs(y)) + em.sum(z), name="y")
    with pytest.raises(OnnxError) as info:
        to_model(cap.graph)
    assert isinstance(info.value, NotImplementedError)
    message = str(info.value)
    assert "fft" in message and "inv" in message and message.startswith("to_onnx: ")
    assert {name for _, name, _ in info.value.unsupported} >= {"fft", "inv"}
