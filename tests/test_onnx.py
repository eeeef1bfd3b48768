"""ONNX export, generated from the op table: every row with a lowering (ember/graphs/onnx.py) is captured
on its recipes' examples, exported, checked by ``onnx.checker`` and run by ONNX Runtime, whose results must
equal ember's replay within the dtype's tolerance. Plus whole models: the spirals forward pass, a small conv
net and attention; and the refusal of rows without an ONNX form."""

from __future__ import annotations

import os

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


def assert_agree(graph, arrays, what, feeds=None, determined=None):
    """Replay on NumPy and ONNX Runtime; returns {dtype name: max abs error}. Outputs outside ``determined``
    (a row's, like ``empty``'s none) are checked in shape and dtype only."""
    model = to_model(graph)
    onnx.checker.check_model(model, full_check=True)
    expected = graph(*[em.asarray(a) for a in arrays], device="numpy")
    expected = [em.asnumpy(e) for e in (expected if isinstance(expected, tuple) else (expected,))]
    actual = run_onnxruntime(model, feeds or {name: a for (name, _, _), a in zip(graph.inputs, arrays)})
    errors = {}
    for k, ((name, node), e, a) in enumerate(zip(graph.outputs, expected, actual)):
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what} {name}: ORT {a.shape} {a.dtype}, ember {e.shape} {e.dtype}"
        if determined is not None and k not in determined:
            continue
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


@settings(max_examples=int(os.environ.get("EMBER_ONNX_EXAMPLES", "10")))  # an ONNX Runtime session per example
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
    graph = capture_row(op, arrays, attrs)
    try:
        to_model(graph)
    except OnnxError as refusal:  # an attribute value without an ONNX form (the nuclear norm): refused, by name
        assert [(k, n) for k, n, _ in refusal.unsupported] == [(0, name)], str(refusal)
        assume(False)
    assert_agree(graph, arrays, name, determined=op.determined)


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


# --- whole models ------------------------------------------------------------------------------------

def spirals_forward(batch: int = 400, dtype=np.float64):
    """The spirals MLP's forward pass (ember/spirals.py), its weights as constants."""
    from ember.spirals import init_params, logits, two_spirals
    with em.capture() as cap:
        x = cap.input((batch, 2), dt.FROM_NUMPY[np.dtype(dtype)], name="points")
        params = [em.asarray(p.astype(dtype), device=cap.device) for p in init_params()]
        cap.output(logits(params, x), name="logits")
    return cap.graph, two_spirals()[0][:batch].astype(dtype)


def conv_net(dtype):
    rng = np.random.default_rng(1)
    with em.capture() as cap:
        x = cap.input((2, 3, 10, 10), dtype, name="image")
        w1 = em.asarray(rng.standard_normal((8, 3, 3, 3)).astype(dt.NUMPY[dtype]), device=cap.device)
        b1 = em.asarray(rng.standard_normal(8).astype(dt.NUMPY[dtype]), device=cap.device)
        w2 = em.asarray(rng.standard_normal((8, 4, 3, 3)).astype(dt.NUMPY[dtype]), device=cap.device)
        head = em.asarray(rng.standard_normal((5, 8 * 2 * 2)).astype(dt.NUMPY[dtype]), device=cap.device)
        h = em.nn.relu(em.nn.conv2d(x, w1, b1, padding=1))
        h = em.nn.max_pool2d(h, 2)
        h = em.nn.silu(em.nn.conv2d(h, w2, stride=2, padding=1, groups=2))
        h = em.nn.avg_pool2d(h, 2, padding=1)
        h = em.nn.layer_norm(em.reshape(h[:, :, :2, :2], (2, -1)), (32,))
        cap.output(em.nn.log_softmax(em.nn.linear(h, head)), name="scores")
    return cap.graph, rng.standard_normal((2, 3, 10, 10)).astype(dt.NUMPY[dtype])


def attention(dtype, batch=2):
    rng = np.random.default_rng(2)
    with em.capture() as cap:
        tokens = cap.input((batch, 5, 8), dtype, name="tokens")
        mask = cap.input((5, 5), dtype, name="mask")
        wq, wk, wv = (em.asarray(rng.standard_normal((8, 8)).astype(dt.NUMPY[dtype]), device=cap.device) for _ in range(3))
        q, k, v = em.nn.linear(tokens, wq), em.nn.linear(tokens, wk), em.nn.linear(tokens, wv)
        heads = [em.permute_dims(em.reshape(t, (batch, 5, 2, 4)), (0, 2, 1, 3)) for t in (q, k, v)]
        causal = em.nn.scaled_dot_product_attention(*heads, is_causal=True)
        masked = em.nn.scaled_dot_product_attention(*heads, attn_mask=mask, scale=0.3)
        mixed = em.reshape(em.permute_dims(causal + masked, (0, 2, 1, 3)), (batch, 5, 8))
        cap.output(em.nn.gelu(mixed), name="mixed")
    return cap.graph, (rng.standard_normal((batch, 5, 8)), np.triu(np.full((5, 5), -1e9), 1))


@pytest.mark.parametrize("dtype", [em.float32, em.float64])
def test_models_match_replay(dtype):
    graph, points = spirals_forward(dtype=dt.NUMPY[dtype])
    assert_agree(graph, [points], "spirals")
    graph, image = conv_net(dtype)
    assert_agree(graph, [image], "conv net")
    graph, arrays = attention(dtype)
    assert_agree(graph, [a.astype(dt.NUMPY[dtype]) for a in arrays], "attention")


@pytest.mark.parametrize("dtype", [em.float32, em.float64])
def test_a_conv_nets_training_step_matches_replay(dtype):
    """Forward and backward (conv2d, max and average pooling and their gradient rows), captured by em.jit."""
    rng = np.random.default_rng(4)

    def loss(params, image):
        w1, w2 = params
        h = em.nn.max_pool2d(em.nn.relu(em.nn.conv2d(image, w1, padding=1)), 2)
        h = em.nn.avg_pool2d(em.nn.conv2d(h, w2, stride=2, padding=1, groups=2), 2, padding=1)
        return em.sum(h * h)

    native = em.dtypes.NUMPY[dtype]
    params = [rng.standard_normal((4, 3, 3, 3)).astype(native), rng.standard_normal((4, 2, 3, 3)).astype(native)]
    image = rng.standard_normal((2, 3, 8, 8)).astype(native)
    step = em.jit(em.value_and_grad(loss))
    step([em.asarray(p) for p in params], em.asarray(image))
    (graph, _), = step.graphs.values()
    assert {"conv2d_input_grad", "conv2d_weight_grad", "max_pool2d_grad"} <= set(graph.op_counts())
    assert_agree(graph, [*params, image], "conv training step")


def test_named_inputs_outputs_initializers_and_a_dynamic_batch(tmp_path):
    graph, points = spirals_forward(batch=16)
    path = graph.to_onnx(tmp_path / "spirals.onnx", dynamic_batch=True)
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == ["points"] and [o.name for o in model.graph.output] == ["logits"]
    assert len(model.graph.initializer) >= len(graph.constants)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (16, 3, 400):  # other batch sizes than the captured one
        other, x = spirals_forward(batch=batch)
        (out,) = session.run(None, {"points": x})
        np.testing.assert_allclose(out, em.asnumpy(other(em.asarray(x))), rtol=1e-9, atol=1e-11)


def test_the_batch_is_fixed_unless_asked_for(tmp_path):
    graph, _ = spirals_forward(batch=16)
    model = onnx.load(str(graph.to_onnx(tmp_path / "fixed.onnx")))
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [16, 2] and not dims[0].dim_param


def test_import_ember_does_not_import_onnx():
    import subprocess
    import sys
    probe = "import sys, ember; print(sorted(m for m in ('onnx', 'onnxruntime') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


SETITEM_KEYS = [  # setitem has no recipe (tests/test_indexing.py tests it by hand): keys of every kind
    ((slice(1, None),), (4, 3)), ((0, slice(None, None, 2)), ()), ((Ellipsis, 1), (1,)), ((None, slice(0, 2), -1), (3,)),
    ((np.array([2, 0, -1]),), (3,)), ((slice(None), np.array([[1], [3]]), np.array([0, 2])), ()),
]


@pytest.mark.parametrize(("key", "value_shape"), SETITEM_KEYS)
def test_setitem_matches_numpy(key, value_shape):
    x = RNG_SETITEM.standard_normal((4, 4, 3))
    value = RNG_SETITEM.standard_normal(value_shape)
    with em.capture() as cap:
        xi, vi = cap.input(x.shape, em.float64, name="x"), cap.input(value.shape, em.float64, name="v")
        live = tuple(em.asarray(k, device=cap.device) if isinstance(k, np.ndarray) else k for k in key)
        xi[live] = vi
        cap.output(xi, name="y")
    expected = x.copy()
    expected[key] = value
    (actual,) = run_onnxruntime(to_model(cap.graph), {"x": x, "v": value})
    np.testing.assert_array_equal(actual, expected)


RNG_SETITEM = np.random.default_rng(5)


def test_means_over_a_dynamic_batch_divide_by_its_size(tmp_path):
    """mean, var and std over the batch axis count the batch when the model runs, not the captured size."""
    with em.capture() as cap:
        x = cap.input((8, 3), em.float64, name="x")
        cap.output(em.mean(x, axis=0) + em.var(x, axis=0, correction=1) + em.std(x), name="y")
    path = cap.graph.to_onnx(tmp_path / "means.onnx", dynamic_batch=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (8, 5, 2):
        host = np.random.default_rng(batch).standard_normal((batch, 3))
        (out,) = session.run(None, {"x": host})
        np.testing.assert_allclose(out, host.mean(axis=0) + host.var(axis=0, ddof=1) + host.std(), rtol=1e-12)


def test_a_dynamic_batch_that_an_op_fixes_is_refused():
    with em.capture() as cap:
        x = cap.input((8, 3), em.float64, name="x")
        cap.output(em.exp(em.flip(x, axis=1)), name="y")
    with pytest.raises(OnnxError, match=r"dynamic_batch: output y would keep the captured batch size 8: op0:flip fixes it"):
        to_model(cap.graph, dynamic_batch=True)
    to_model(cap.graph)  # without a dynamic batch it exports


def test_a_dynamic_batch_through_reshapes():
    """Attention reshapes its heads: reshapes that keep the leading axis keep it dynamic."""
    graph, _ = attention(em.float64)
    model = to_model(graph, dynamic_batch=True)
    dims = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input]
    assert dims == [["batch", 5, 8], [5, 5]]  # the mask does not lead with the batch size: it stays fixed
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch in (2, 5, 1):
        other, (tokens, mask) = attention(em.float64, batch)
        (out,) = session.run(None, {"tokens": tokens, "mask": mask})
        np.testing.assert_allclose(out, em.asnumpy(other(em.asarray(tokens), em.asarray(mask))), rtol=1e-9, atol=1e-11)


def test_integer_division_by_zero_gives_numpys_zero_not_a_crash():
    """ONNX Runtime's integer Div and Mod by zero raise SIGFPE, killing the process: the lowering divides by 1 there."""
    x1, x2 = np.array([7, -7, 5, 0], np.int64), np.array([2, 0, 0, 3], np.int64)
    for name in ("floor_divide", "remainder"):
        graph = capture_row(OPS[name], (x1, x2), {})
        with np.errstate(divide="ignore"):
            assert_agree(graph, [x1, x2], name)
