"""ONNX import: models ember did not write — built with ``onnx.helper`` here, or exported by PyTorch — read by
``em.load_onnx`` and replayed on NumPy, torch and a compute peer, equal to ONNX Runtime; differentiated by ember's
autodiff; and the refusal that lists every operator ember does not import."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import ember as em
from ember.errors import OnnxError

from .conftest import torch_available

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

RNG = np.random.default_rng(3)


def _model(nodes, inputs, outputs, initializers=(), opset=18):
    graph = helper.make_graph(nodes, "handwritten", inputs, outputs,
                              initializer=[numpy_helper.from_array(v, name) for name, v in initializers])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="a test, not ember")
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def mlp_model(path):
    """An MLP as exporters write it: Gemm, Relu, shape arithmetic (Shape → Gather → Concat → Reshape), Softmax."""
    f = TensorProto.DOUBLE
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axis0"], ["n1"]),
        helper.make_node("Concat", ["n1", "split"], ["shape"], axis=0),
        helper.make_node("Reshape", ["r", "shape"], ["r2"]),
        helper.make_node("ReduceMean", ["r2", "axis2"], ["m"], keepdims=0),
        helper.make_node("MatMul", ["m", "w2"], ["logits"]),
        helper.make_node("Tanh", ["logits"], ["t"]),
        helper.make_node("Mul", ["t", "logits"], ["u"]),
        helper.make_node("Softmax", ["u"], ["probs"], axis=-1),
    ]
    initializers = [("w1", RNG.standard_normal((8, 3))), ("b1", RNG.standard_normal(8)), ("zero", np.array(0, np.int64)),
                    ("axis0", np.array([0], np.int64)), ("split", np.array([2, 4], np.int64)),
                    ("axis2", np.array([1], np.int64)), ("w2", RNG.standard_normal((4, 5)))]
    model = _model(nodes, [helper.make_tensor_value_info("x", f, ["batch", 3])],
                   [helper.make_tensor_value_info("probs", f, ["batch", 5])], initializers)
    onnx.save(model, str(path))
    return path


def conv_model(path):
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Conv", ["image", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["bn"], epsilon=1e-3),
        helper.make_node("LeakyRelu", ["bn"], ["a"], alpha=0.1),
        helper.make_node("MaxPool", ["a"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["p"], ["g"]),
        helper.make_node("Flatten", ["g"], ["flat"], axis=1),
        helper.make_node("Clip", ["flat", "lo", "hi"], ["out"]),
    ]
    c = 4
    initializers = [("w", RNG.standard_normal((c, 3, 3, 3)).astype(np.float32)), ("b", RNG.standard_normal(c).astype(np.float32)),
                    ("scale", RNG.random(c).astype(np.float32) + 0.5), ("bias", RNG.standard_normal(c).astype(np.float32)),
                    ("mean", RNG.standard_normal(c).astype(np.float32)), ("var", RNG.random(c).astype(np.float32) + 0.5),
                    ("lo", np.array(-0.5, np.float32)), ("hi", np.array(0.8, np.float32))]
    model = _model(nodes, [helper.make_tensor_value_info("image", f, [2, 3, 8, 8])],
                   [helper.make_tensor_value_info("out", f, [2, c])], initializers)
    onnx.save(model, str(path))
    return path


def onnxruntime(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_a_handwritten_mlp_runs_on_every_local_device_and_a_peer(tmp_path, peer):
    path = mlp_model(tmp_path / "mlp.onnx")
    graph = em.load_onnx(path, shapes={"x": (6, 3)})
    assert [n for n, _, _ in graph.inputs] == ["x"] and [n for n, _ in graph.outputs] == ["probs"]
    x = RNG.standard_normal((6, 3))
    (expected,) = onnxruntime(path, {"x": x})
    devices = ["numpy", peer.url()] + (["torch:cpu"] if torch_available() else [])
    for device in devices:
        out = graph(em.asarray(x, device=device))
        assert str(out.device) == str(em.device(device))
        np.testing.assert_allclose(em.asnumpy(out), expected, rtol=1e-12, atol=1e-12, err_msg=device)


def test_a_handwritten_conv_net_matches_onnxruntime(tmp_path):
    path = conv_model(tmp_path / "conv.onnx")
    graph = em.load_onnx(path)
    image = RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)
    (expected,) = onnxruntime(path, {"image": image})
    np.testing.assert_allclose(em.asnumpy(graph(em.asarray(image))), expected, rtol=2e-5, atol=2e-6)


def test_an_imported_model_is_differentiable(tmp_path):
    graph = em.load_onnx(mlp_model(tmp_path / "mlp.onnx"), shapes={"x": (4, 3)})
    x = RNG.standard_normal((4, 3))
    weights = RNG.standard_normal((4, 5))
    loss = lambda v: em.sum(graph(v) * em.asarray(weights))
    gradient = em.asnumpy(em.grad(loss)(em.asarray(x)))
    step, numeric = 1e-6, np.zeros_like(x)
    for index in np.ndindex(x.shape):
        bump = np.zeros_like(x)
        bump[index] = step
        numeric[index] = (float(loss(em.asarray(x + bump))) - float(loss(em.asarray(x - bump)))) / (2 * step)
    np.testing.assert_allclose(gradient, numeric, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch_available(), reason="torch is not installed")
def test_a_pytorch_export_imports(tmp_path):
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 5), torch.nn.LayerNorm(5),
                                torch.nn.Sigmoid(), torch.nn.Softmax(-1)).eval()
    x = torch.randn(2, 3, 8, 8)
    path = tmp_path / "torch.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter warns that it is the legacy one; the other needs onnxscript
        torch.onnx.export(model, (x,), str(path), dynamo=False, input_names=["image"], output_names=["probs"])
    graph = em.load_onnx(path)
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(em.asnumpy(graph(em.asarray(x.numpy()))), expected, rtol=1e-5, atol=1e-6)


def test_unsupported_operators_are_listed_at_once(tmp_path):
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Erf", ["x"], ["a"]), helper.make_node("Einsum", ["a", "a"], ["b"], equation="ij,ij->ij"),
             helper.make_node("Relu", ["b"], ["c"]), helper.make_node("HardSwish", ["c"], ["y"])]
    path = tmp_path / "odd.onnx"
    onnx.save(_model(nodes, [helper.make_tensor_value_info("x", f, [2, 2])], [helper.make_tensor_value_info("y", f, [2, 2])]),
              str(path))
    with pytest.raises(OnnxError) as info:
        em.load_onnx(path)
    message = str(info.value)
    assert message.startswith("load_onnx: ") and all(op in message for op in ("Erf", "Einsum", "HardSwish"))
    assert "Relu" not in message and isinstance(info.value, NotImplementedError)
    assert {op for _, op, _ in info.value.unsupported} == {"Erf", "Einsum", "HardSwish"}


def test_a_symbolic_input_needs_its_sizes(tmp_path):
    with pytest.raises(OnnxError, match="'x'.*shapes="):
        em.load_onnx(mlp_model(tmp_path / "mlp.onnx"))


def test_ember_export_round_trips(tmp_path):
    """What ember writes, ember reads back: the same values on replay."""
    from .test_onnx import attention, conv_net, spirals_forward
    for make, arrays in ((spirals_forward, None), (conv_net, em.float32), (attention, em.float64)):
        graph, data = make() if arrays is None else make(arrays)
        data = data if isinstance(data, tuple) else (data,)
        data = [np.asarray(d, dtype=np.float64 if arrays is None else em.dtypes.NUMPY[arrays]) for d in data]
        back = em.load_onnx(graph.to_onnx(tmp_path / "model.onnx"))
        expected = em.asnumpy(graph(*[em.asarray(d) for d in data]))
        np.testing.assert_allclose(em.asnumpy(back(*[em.asarray(d) for d in data])), expected, rtol=1e-5, atol=1e-6)


def test_a_file_that_is_not_a_model_and_external_data_are_refused(tmp_path):
    from ember.graphs import GraphFormatError
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07not a protobuf at all\xff\xff")
    with pytest.raises(GraphFormatError, match="garbage.onnx is not a valid ONNX model"):
        em.load_onnx(garbage)
    model = onnx.load(str(mlp_model(tmp_path / "mlp.onnx")))
    onnx.save_model(model, str(tmp_path / "split.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    with pytest.raises(OnnxError, match="external files"):
        em.load_onnx(tmp_path / "split.onnx", shapes={"x": (2, 3)})
