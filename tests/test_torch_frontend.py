"""ember.torch: PyTorch programs on ember devices, judged against torch eager."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ember as em  # noqa: E402
import ember.torch as et  # noqa: E402
from ember.torch.lowering import LOWERINGS  # noqa: E402
from ember.torch.tensor import IN_PLACE_FUNCTIONAL, per_tensor  # noqa: E402

from .conftest import jax_available  # noqa: E402
from .peers import Peer  # noqa: E402

STEPS = 20

OPTIMIZERS = {  # name → (class, arguments): the optimizers torch.optim users train MLPs with
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.05}),
}

LOSSES = {  # name → (loss module, targets for a batch of 16 three-way outputs)
    "mse": (torch.nn.MSELoss, lambda: torch.randn(16, 3)),
    "cross-entropy": (torch.nn.CrossEntropyLoss, lambda: torch.randint(0, 3, (16,))),
}


def _cnn():
    """Conv2d → BatchNorm2d → ReLU → MaxPool2d, twice, then Flatten → Dropout → Linear (convolutions without bias, as
    before any batch norm: a bias it cancels has a zero gradient, which Adam would scale float noise of up)."""
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 6, 3, bias=False), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2, stride=1),
                         nn.Flatten(), nn.Dropout(0.25), nn.Linear(6, 3))


class _Encoder(torch.nn.Module):
    """A small Transformer encoder classifying sequences of tokens: Embedding → two TransformerEncoderLayers (their
    MultiheadAttention, LayerNorms and dropout as PyTorch builds them) → LayerNorm → mean over the sequence → Linear."""

    def __init__(self, vocabulary=50, width=32, heads=4, layers=2, classes=3):
        super().__init__()
        nn = torch.nn
        self.embed = nn.Embedding(vocabulary, width)
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.norm(self.encoder(self.embed(tokens))).mean(dim=1))


MODELS = {  # name → (the model, a batch of 16 inputs)
    "mlp": (lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)),
            lambda: torch.randn(16, 4)),
    "cnn": (_cnn, lambda: torch.randn(16, 3, 8, 8)),
    "transformer": (_Encoder, lambda: torch.randint(0, 50, (16, 12))),
}


def train(device, optimizer: str, foreach: bool, loss: str, per_step=None, model: str = "mlp"):
    """A model's 20 losses, its eval-mode predictions and its final state; ``device`` None is torch eager.
    The loop is PyTorch's own: only the ``to_device`` lines differ."""
    torch.manual_seed(0)
    make_model, inputs = MODELS[model]
    model = make_model()
    make_loss, targets = LOSSES[loss]
    x, y = inputs(), targets()
    if device is not None:
        model, x, y = et.to_device(model, device), et.to_device(x, device), et.to_device(y, device)
    kind, arguments = OPTIMIZERS[optimizer]
    step_with = kind(model.parameters(), foreach=foreach, **arguments)
    loss_of = make_loss()
    model.train()
    losses = []
    for _ in range(STEPS):
        step_with.zero_grad()
        value = loss_of(model(x), y)
        value.backward()
        step_with.step()
        losses.append(value.item())
        if per_step is not None:
            per_step()
    model.eval()
    with torch.no_grad():
        predictions = model(x).cpu()
    return losses, predictions, {name: t.cpu() for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def torch_peer():
    with Peer("--device", "torch:cpu") as running:
        yield running


@pytest.fixture(scope="module")
def numpy_tls_peer(pki):
    with Peer(*pki.local.serve_args()) as running:
        yield running


@pytest.fixture(scope="module", params=["numpy", "torch:cpu", "jax:cpu", "peer", "torch-peer", "tls-peer"])
def device(request):
    """Each ember device the models train on: local backends, a numpy and a torch:cpu peer, a numpy peer over TLS."""
    if request.param == "peer":
        return em.device(request.getfixturevalue("peer").url())
    if request.param == "torch-peer":
        return em.device(request.getfixturevalue("torch_peer").url())
    if request.param == "tls-peer":
        return em.device(request.getfixturevalue("numpy_tls_peer").url("embers"), tls_ca=request.getfixturevalue("pki").ca)
    if request.param.startswith("jax") and not jax_available():
        pytest.skip("jax is not installed")
    return em.device(request.param)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_an_mlp_trains_unchanged_with_torch_eagers_losses(device, optimizer, foreach, loss):
    eager_losses, eager_predictions, eager_state = train(None, optimizer, foreach, loss)
    losses, predictions, state = train(device, optimizer, foreach, loss)
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]  # it learned
    np.testing.assert_allclose(predictions, eager_predictions, rtol=1e-5, atol=1e-6)
    assert state.keys() == eager_state.keys()
    for name in state:
        assert state[name].dtype == eager_state[name].dtype == torch.float32
        np.testing.assert_allclose(state[name], eager_state[name], rtol=1e-5, atol=1e-6)


CNN_OPTIMIZERS = ["sgd-momentum", "adam"]


@pytest.mark.parametrize("optimizer", CNN_OPTIMIZERS)
def test_a_cnn_with_batch_norm_trains_unchanged_with_torch_eagers_losses_and_running_statistics(device, optimizer):
    eager_losses, eager_predictions, eager_state = train(None, optimizer, False, "cross-entropy", model="cnn")
    losses, predictions, state = train(device, optimizer, False, "cross-entropy", model="cnn")
    print(f"\nFIGURE cnn {optimizer} on {device}: largest loss difference "
          f"{np.max(np.abs(np.subtract(losses, eager_losses)) / np.abs(eager_losses)):.1e} (relative)")
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-4, atol=1e-6)
    assert losses[-1] < losses[0]  # it learned
    np.testing.assert_allclose(predictions, eager_predictions, rtol=1e-4, atol=1e-5)  # eval(): the running statistics
    assert state.keys() == eager_state.keys() and "1.running_mean" in state and "5.running_var" in state
    for name in state:
        assert state[name].dtype == eager_state[name].dtype
        np.testing.assert_allclose(state[name], eager_state[name], rtol=1e-4, atol=1e-5, err_msg=name)
    assert state["1.num_batches_tracked"].item() == STEPS


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_a_transformer_encoder_trains_unchanged_with_torch_eagers_losses(device, foreach):
    eager_losses, eager_predictions, eager_state = train(None, "adamw", foreach, "cross-entropy", model="transformer")
    losses, predictions, state = train(device, "adamw", foreach, "cross-entropy", model="transformer")
    print(f"\nFIGURE transformer adamw on {device}: largest loss difference "
          f"{np.max(np.abs(np.subtract(losses, eager_losses)) / np.abs(eager_losses)):.1e} (relative)")
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-4, atol=1e-6)  # dropout's masks are eager's
    assert losses[-1] < losses[0]  # it learned
    np.testing.assert_allclose(predictions, eager_predictions, rtol=1e-4, atol=1e-5)
    assert state.keys() == eager_state.keys() and "encoder.layers.1.self_attn.in_proj_weight" in state
    for name in state:
        ours, eagers = state[name], eager_state[name]
        if name.endswith("in_proj_bias"):  # the keys' bias: softmax ignores it, so its gradient is rounding noise,
            width = len(ours) // 3  # which AdamW scales up to full steps: the queries' and values' parts are compared
            ours = torch.cat([state[name][:width], state[name][2 * width:]])
            eagers = torch.cat([eager_state[name][:width], eager_state[name][2 * width:]])
        np.testing.assert_allclose(ours, eagers, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("model, optimizer", [("mlp", name) for name in OPTIMIZERS] + [("cnn", "sgd-momentum"),
                                                                                       ("transformer", "adamw")])
def test_loss_item_once_a_step_is_the_one_round_trip_on_a_peer(peer, model, optimizer):
    remote = em.device(peer.url())
    trips = []
    train(remote, optimizer, model == "mlp", "cross-entropy", model=model,
          per_step=lambda: trips.append(em.stats(remote)["round_trips"]))
    assert np.diff(trips).tolist() == [1] * (STEPS - 1)


@pytest.mark.parametrize("kernel, stride, padding", [(2, None, 0), (3, 2, 1), (2, 1, 0)])
def test_max_pool_indices_and_gradient_match_eager(kernel, stride, padding):
    torch.manual_seed(kernel * 10 + padding)
    x = torch.randn(2, 3, 7, 6)
    x[0, 0, :2, :2] = 1.0  # a tie: PyTorch keeps the first
    x.requires_grad_()
    moved = et.to_device(x.detach(), "numpy").requires_grad_()
    pooled, indices = torch.nn.functional.max_pool2d(x, kernel, stride, padding, return_indices=True)
    ours, our_indices = torch.nn.functional.max_pool2d(moved, kernel, stride, padding, return_indices=True)
    np.testing.assert_array_equal(ours.numpy(), pooled.detach().numpy())
    assert our_indices.dtype == torch.int64 and our_indices.tolist() == indices.tolist()
    cotangent = torch.randn_like(pooled)
    pooled.backward(cotangent)
    ours.backward(et.to_device(cotangent, "numpy"))
    # overlapping windows: a position's cotangents summed in another order, each ~1, differ by a float32 rounding
    np.testing.assert_allclose(moved.grad.numpy(), x.grad.numpy(), rtol=1e-6, atol=2e-7)


def test_parameters_stay_parameters_and_the_optimizer_updates_them_in_place():
    model = et.to_device(torch.nn.Linear(3, 2), "numpy")
    parameters = list(model.parameters())
    assert all(isinstance(p, torch.nn.Parameter) and isinstance(p, et.Tensor) for p in parameters)
    before = [p.ember_array for p in parameters]
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(et.to_device(torch.ones(5, 3), "numpy")).sum().backward()
    optimizer.step()
    assert list(model.parameters()) == parameters  # the same objects, rebound to new arrays
    assert all(p.ember_array is not old for p, old in zip(parameters, before))
    state = optimizer.state[parameters[0]]
    assert isinstance(state["exp_avg"], et.Tensor) and not isinstance(state["step"], et.Tensor)  # the step count is host


def test_a_shared_parameter_stays_shared():
    first = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(first, torch.nn.ReLU(), first)
    et.to_device(model, "numpy")
    assert model[0].weight is model[2].weight and len(list(model.parameters())) == 2


def test_load_state_dict_uploads_host_values_through_copy():
    eager = torch.nn.Linear(3, 2)
    model = et.to_device(torch.nn.Linear(3, 2), "numpy")
    model.load_state_dict(eager.state_dict())
    assert isinstance(model.weight, et.Tensor)
    np.testing.assert_array_equal(model.weight.numpy(), eager.weight.detach().numpy())


def _on(values, dtype=None, device="numpy"):
    return et.to_device(torch.tensor(values, dtype=dtype), device)


def test_reads_come_back_as_host_values():
    x = _on([[1.5, 2.0], [3.0, 4.0]])
    assert type(x.cpu()) is torch.Tensor and type(x.to("cpu")) is torch.Tensor
    assert x.to("cpu", torch.float64).dtype == torch.float64
    assert x.numpy().tolist() == x.tolist() == [[1.5, 2.0], [3.0, 4.0]]
    assert x.sum().item() == 10.5 and isinstance(x.sum().item(), float)
    assert x.to(torch.int32).ember_array.dtype == em.int32  # a dtype alone casts on the device
    assert "ember.torch.Tensor" in repr(x) and "numpy" in repr(x)


# (operation, operands, the dtype PyTorch gives): PyTorch's rules, not ember's (which would give float64 and int64)
PROMOTIONS = [
    ("int64 tensor + 0.5", lambda a, b: a + 0.5, ([1, 2], torch.int64), None, torch.float32),
    ("int64 / int64", lambda a, b: a / b, ([1, 2], torch.int64), ([2, 4], torch.int64), torch.float32),
    ("int32 * int64 0-d", lambda a, b: a * torch.tensor(3), ([1, 2], torch.int32), None, torch.int32),
    ("float32 * float64 0-d", lambda a, b: a * torch.tensor(3.0, dtype=torch.float64), ([1, 2], torch.float32), None,
     torch.float32),
    ("float32 + float64", lambda a, b: a + b, ([1, 2], torch.float32), ([2, 4], torch.float64), torch.float64),
    ("uint8 + int8", lambda a, b: a + b, ([1, 2], torch.uint8), ([2, 4], torch.int8), torch.int16),
    ("bool + bool", lambda a, b: a + b, ([True, False], torch.bool), ([True, True], torch.bool), torch.bool),
    ("int64 < 1.5", lambda a, b: a < 1.5, ([1, 2], torch.int64), None, torch.bool),
    ("int64 sum", lambda a, b: a.sum(), ([1, 2], torch.int32), None, torch.int64),
    ("float32 mean", lambda a, b: a.mean(), ([1, 2], torch.float32), None, torch.float32),
]


@pytest.mark.parametrize("operation, first, second, dtype", [p[1:] for p in PROMOTIONS], ids=[p[0] for p in PROMOTIONS])
def test_dtypes_follow_pytorchs_promotion(operation, first, second, dtype):
    hosts = [torch.tensor(operand[0], dtype=operand[1]) if operand else None for operand in (first, second)]
    eager = operation(*hosts)
    result = operation(*[et.to_device(h, "numpy") if h is not None else None for h in hosts])
    assert eager.dtype == result.dtype == dtype and result.ember_array.dtype.name == str(dtype)[6:]
    np.testing.assert_array_equal(result.numpy(), eager.numpy())


def test_in_place_ops_rebind_the_storage_every_alias_shares():
    x = _on([1.0, 2.0])
    alias, data = x.detach(), x.data
    alias.add_(1).mul_(2)
    assert x.tolist() == data.tolist() == [4.0, 6.0]
    x.zero_()
    assert alias.tolist() == [0.0, 0.0]
    x.copy_(torch.tensor([7.0, 8.0]))  # host data, uploaded
    assert alias.tolist() == [7.0, 8.0]
    x.fill_(3)
    assert alias.tolist() == [3.0, 3.0]


def test_an_in_place_op_a_live_view_or_base_would_miss_is_refused():
    x = _on([[1.0, 2.0], [3.0, 4.0]])
    view = x.t()
    with pytest.raises(et.AliasingError, match="a view of it is alive"):
        x.add_(1)
    with pytest.raises(et.AliasingError, match="its base is alive"):
        view.mul_(2)
    del view
    x.add_(1)  # no view left: the rebinding is exact
    assert x.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    x.view(4).clone().add_(1)  # a clone is a tensor of its own
    assert x.tolist() == [[2.0, 3.0], [4.0, 5.0]]


# (foreach function, arguments, the per-tensor expression each element matches)
FOREACH = [
    ("_foreach_add_ List alpha", lambda a, b: torch._foreach_add_(a, b, alpha=2), lambda a, b: a + 2 * b),
    ("_foreach_mul_ Scalar", lambda a, b: torch._foreach_mul_(a, 0.5), lambda a, b: a * 0.5),
    ("_foreach_div_ ScalarList", lambda a, b: torch._foreach_div_(a, [2.0, 4.0]), None),
    ("_foreach_addcdiv_ ScalarList", lambda a, b: torch._foreach_addcdiv_(a, b, b, [1.0, 3.0]), None),
    ("_foreach_lerp_ Scalar", lambda a, b: torch._foreach_lerp_(a, b, 0.25), lambda a, b: a + 0.25 * (b - a)),
    ("_foreach_sqrt", lambda a, b: torch._foreach_sqrt(a), lambda a, b: a.sqrt()),
]


@pytest.mark.parametrize("apply, expected", [f[1:] for f in FOREACH], ids=[f[0] for f in FOREACH])
def test_foreach_ops_match_eager_element_by_element(apply, expected):
    hosts = [[torch.tensor([1.0, 4.0]), torch.tensor([9.0])], [torch.tensor([2.0, 3.0]), torch.tensor([5.0])]]
    eager = [[t.clone() for t in ts] for ts in hosts]
    moved = [[et.to_device(t, "numpy") for t in ts] for ts in hosts]
    eager_result, result = apply(*eager), apply(*moved)
    for got, want in zip(result or moved[0], eager_result or eager[0]):
        assert isinstance(got, et.Tensor)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    if expected is not None:
        for got, a, b in zip(result or moved[0], *hosts):
            np.testing.assert_allclose(got.numpy(), expected(a, b).numpy(), rtol=1e-6)


def test_on_capture_a_training_step_records_without_executing_and_a_read_says_so():
    model = et.to_device(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)), "capture")
    loss = torch.nn.functional.cross_entropy(model(et.to_device(torch.randn(16, 4), "capture")),
                                             et.to_device(torch.randint(0, 3, (16,)), "capture"))
    loss.backward()
    assert model[0].weight.grad.shape == (8, 4) and model[0].weight.grad.ember_device == em.device("capture")
    with pytest.raises(em.errors.NoValueError, match="capture records"):
        loss.item()


def _sgd_step(device, jitted: bool):
    """The MLP's SGD-with-momentum step as a function of the batch; ``jitted``: through ember.torch.jit."""
    torch.manual_seed(0)
    model = MODELS["mlp"][0]()
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    if device is not None:
        model, x, y = et.to_device(model, device), et.to_device(x, device), et.to_device(y, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return (et.jit(step) if jitted else step), model, x, y


@pytest.mark.parametrize("where", ["numpy", "jax:cpu", "torch-peer"])
def test_a_jitted_training_step_is_captured_once_and_replays_eagers_losses(where, request):
    if where == "jax:cpu" and not jax_available():
        pytest.skip("jax is not installed")
    device = em.device(request.getfixturevalue("torch_peer").url() if where == "torch-peer" else where)
    eager, model, x, y = _sgd_step(None, False)
    expected = [float(eager(x, y)) for _ in range(STEPS)]
    step, model, x, y = _sgd_step(device, True)
    before = em.stats(device) if device.kind == "remote" else None
    losses = [float(step(x, y).cpu()) for _ in range(STEPS)]
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-6)
    assert len(step.captures) == 1 and model[0].weight.grad.ember_device == device  # .grad rebound after each replay
    graph = step.graph  # inputs: the batch, the parameters and their momentum; outputs: loss, both again, the grads
    assert [name for name, _, _ in graph.inputs].count("arg0") == 1 and len(graph.inputs) == 2 + 4 + 4
    assert len(graph.outputs) == 1 + 4 + 4 + 4
    if before is not None:  # one warm-up step eagerly, then one registration and a reference a call
        after = em.stats(device)
        assert after["graphs_registered"] - before["graphs_registered"] == 1
        assert after["graph_runs"] - before["graph_runs"] == STEPS - 1
        assert after["round_trips"] - before["round_trips"] == STEPS  # each loss read


def test_a_jitted_steps_graph_saves_exports_to_onnx_and_verifies_across_backends(tmp_path):
    step, model, x, y = _sgd_step("numpy", True)
    for _ in range(3):
        step(x, y)
    graph = step.graph
    loaded = em.load_graph(graph.save(tmp_path / "step.ember"))
    inputs = {name: np.random.default_rng(0).integers(0, 3, meta.shape) if meta.dtype == em.int64 else
              np.random.default_rng(1).standard_normal(meta.shape).astype(np.float32) for name, _, meta in graph.inputs}
    np.testing.assert_array_equal(em.asnumpy(loaded(**inputs, device="numpy")[0]), em.asnumpy(graph(**inputs)[0]))
    backends = ["numpy", "torch:cpu"] + (["jax:cpu"] if jax_available() else [])
    report = graph.verify(backends, inputs)
    assert report.ok, str(report)
    pytest.importorskip("onnx")
    assert graph.to_onnx(tmp_path / "step.onnx").stat().st_size > 0


def test_a_jitted_step_recaptures_for_new_shapes_and_refuses_reads_and_host_noise():
    step, model, x, y = _sgd_step("numpy", True)
    step(x, y)
    step(x, y)
    step(x[:8], y[:8])
    assert len(step.captures) == 2
    held = x.cpu()
    read = et.jit(lambda x: x.sum().item(), warmup=0)
    with pytest.raises(em.errors.CaptureError, match=r"read a value while captured .*return tensors instead"):
        read(x)
    noisy = et.jit(lambda x: torch.nn.functional.dropout(x, 0.5), warmup=0)
    with pytest.raises(em.errors.CaptureError, match="noise drawn on the host"):
        noisy(x)
    assert torch.equal(x.cpu(), held)  # a refused capture leaves its tensors as they were, on their device


def test_an_op_without_a_lowering_raises_a_typed_error_naming_it_and_the_users_line():
    x = _on([0.5, 1.0])
    with pytest.raises(et.UnloweredOpError) as raised:
        torch.special.bessel_j0(x)
    assert isinstance(raised.value, em.EmberError) and isinstance(raised.value, NotImplementedError)
    message = str(raised.value)
    assert "aten.special_bessel_j0.default" in message
    assert "test_torch_frontend.py" in message and "torch.special.bessel_j0(x)" in message


def test_a_host_tensor_with_an_ember_tensor_is_refused_not_computed_on_the_cpu():
    with pytest.raises(et.MixedDevicesError, match="host tensor of shape"):
        _on([1.0, 2.0]) + torch.tensor([1.0, 2.0])


def test_to_device_of_neither_a_module_nor_a_tensor_is_a_typed_error_naming_the_type():
    with pytest.raises(em.SignatureError, match=r"to_device: expected a torch.nn.Module or a torch.Tensor, got list"):
        et.to_device([1.0], "numpy")


def test_supported_ops_lists_the_table_and_each_listed_op_lowers():
    supported = et.supported_ops()
    assert len(supported) >= len(LOWERINGS) >= 100
    by_name = {str(op): op for op in LOWERINGS}
    for name in supported:
        packet_name, overload = name.removeprefix("aten.").rsplit(".", 1)
        op = getattr(getattr(torch.ops.aten, packet_name), overload)
        if packet_name.startswith("_foreach_"):
            assert str(per_tensor(op)) in supported, name
        elif op in IN_PLACE_FUNCTIONAL:
            assert str(IN_PLACE_FUNCTIONAL[op]) in by_name, name
        elif packet_name.endswith("_") and not packet_name.endswith("__"):
            assert str(getattr(getattr(torch.ops.aten, packet_name[:-1]), overload)) in by_name, name
        else:
            assert name in by_name


def test_import_ember_does_not_import_torch():
    code = "import sys, ember; assert 'torch' not in sys.modules and 'ember.torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dropout_draws_eagers_mask_from_torchs_generator_and_leaves_it_where_eager_does():
    x = torch.randn(4, 50)
    torch.manual_seed(3)
    eager, after = torch.nn.functional.dropout(x, 0.3), torch.rand(3)
    torch.manual_seed(3)
    ours, our_after = torch.nn.functional.dropout(et.to_device(x, "numpy"), 0.3), torch.rand(3)
    np.testing.assert_allclose(ours.numpy(), eager.numpy(), rtol=1e-6)
    assert torch.equal(our_after, after)
    assert torch.equal(torch.nn.functional.dropout(et.to_device(x, "numpy"), 0.3, training=False).cpu(), x)
