"""Capture: recording without executing, graphs, save/load, replay anywhere, jit."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import ember as em
from ember.array import bind
from ember.graphs import (
    DataDependentError,
    GraphFormatError,
    NoValueError,
    OutputError,
    ScopeActiveError,
    ScopeClosedError,
    TracedBranchError,
    UndeclaredInputError,
)
from ember.ops import OPS

from .conftest import LOCAL_DEVICES, REMOTE_SCHEMES, torch_available
from .generators import Drawer
from .peers import Peer
from .recipes import EXAMPLES
from .test_remote import free_port

CAPTURABLE = sorted(name for name, op in OPS.items() if EXAMPLES.get(name) and not op.data_dependent)


def capture_row(op, arrays, attrs):
    """Capture one row applied to placeholders; returns the scope."""
    with em.capture() as cap:
        inputs = [cap.input(a.shape, em.dtypes.from_name(a.dtype.name), name=f"x{i}") for i, a in enumerate(arrays)]
        out = bind(op, tuple(inputs), {**op.attrs, **attrs}, device=cap.device)
        for i, o in enumerate(out if isinstance(out, tuple) else (out,)):
            cap.output(o, name=f"y{i}")
    return cap


@pytest.mark.parametrize("name", CAPTURABLE)
@given(data=st.data())
def test_capture_then_replay_equals_eager(name, data, tmp_path_factory):
    """Generated from the op table: record each row, replay it on numpy, compare with eager
    numpy; then save, load and replay again."""
    op = OPS[name]
    arrays, attrs = EXAMPLES[name](Drawer(data))
    eager = bind(op, tuple(em.asarray(a) for a in arrays), {**op.attrs, **attrs})
    eager = eager if isinstance(eager, tuple) else (eager,)
    assume(eager)  # unstack of an empty axis has no outputs, and a graph needs one
    graph = capture_row(op, arrays, attrs).graph
    assert [graph.metas[i] for _, i in graph.outputs] == [e._meta for e in eager]
    path = tmp_path_factory.mktemp("graphs") / f"{name}.ember"
    for g in (graph, em.load_graph(graph.save(path))):
        replayed = g(*[em.asarray(a) for a in arrays], device="numpy")
        replayed = replayed if isinstance(replayed, tuple) else (replayed,)
        determined = range(len(eager)) if op.determined is None else op.determined
        for i in determined:
            np.testing.assert_array_equal(em.asnumpy(replayed[i]), em.asnumpy(eager[i]), err_msg=f"{name} output {i}")


def mlp(xp_input, weights):
    h = xp_input
    for i, (w, b) in enumerate(weights):
        h = h @ w + b
        if i < len(weights) - 1:
            h = em.maximum(h, 0.0)
    return h


def test_mlp_forward_replays_on_every_device():
    rng = np.random.default_rng(0)
    sizes = [(10, 32), (32, 32), (32, 3)]
    params = [(rng.standard_normal(s), rng.standard_normal(s[1])) for s in sizes]
    with em.capture() as cap:
        x = cap.input((16, 10), em.float64, name="x")
        weights = [(em.asarray(w, device=cap.device), em.asarray(b, device=cap.device)) for w, b in params]
        cap.output(mlp(x, weights), name="logits")
    graph = cap.graph
    assert graph.op_counts() == {"matmul": 3, "add": 3, "maximum": 2}
    assert "matmul ×3" in str(graph) and "input  x: (16, 10) float64" in str(graph)
    host = rng.standard_normal((16, 10))
    expected = em.asnumpy(mlp(em.asarray(host), [(em.asarray(w), em.asarray(b)) for w, b in params]))
    devices = list(LOCAL_DEVICES)
    with Peer() as peer:
        devices += [peer.url(scheme) for scheme in REMOTE_SCHEMES]
        for name in devices:
            out = graph(x=em.asarray(host, device=name))
            assert out.device == em.device(name)
            np.testing.assert_allclose(em.asnumpy(out), expected, rtol=1e-12, atol=1e-12, err_msg=name)


def test_capture_errors_are_typed():
    with em.capture() as cap:
        x = cap.input((3,), em.float32, name="x")
        y = em.exp(x)
        with pytest.raises(ScopeActiveError):
            em.capture().__enter__()
        with pytest.raises(UndeclaredInputError, match="declared inputs"):
            y + em.ones(3, dtype=em.float32)                      # a numpy array, not declared
        with pytest.raises(OutputError, match="not produced in this capture scope"):
            cap.output(em.ones(3), name="z")
        no_value = "has no concrete value: capture records, it does not execute — replay the graph on a device"
        with pytest.raises(NoValueError, match=no_value):
            em.asnumpy(y)
        with pytest.raises(NoValueError):
            float(y[0])
        with pytest.raises(DataDependentError, match="nonzero"):
            em.nonzero(y)
        with pytest.raises(DataDependentError):
            y[y > 1]
        with pytest.raises(CaptureErrorBase, match="to_device"):
            y.to_device("numpy")
        constant = em.asarray([1.0, 2.0], device=cap.device)
        np.testing.assert_array_equal(em.asnumpy(constant.to_device("numpy")), [1.0, 2.0])  # constants move freely
        cap.output(y, name="y")
    with pytest.raises(ScopeClosedError, match="closed"):
        y * 2
    with pytest.raises(ScopeClosedError):
        cap.input((2,))
    with em.capture() as other:
        with pytest.raises(UndeclaredInputError, match="another capture"):
            bind(OPS["negative"], (y,), {}, device=other.device)
    for error in (ScopeActiveError, UndeclaredInputError, OutputError, NoValueError, DataDependentError, ScopeClosedError):
        assert issubclass(error, em.CaptureError) and issubclass(error, em.EmberError)
    np.testing.assert_allclose(em.asnumpy(cap.graph(np.ones(3, np.float32))), np.exp(np.ones(3, np.float32)))


CaptureErrorBase = em.CaptureError


def test_replay_refuses_wrong_inputs_by_name():
    with em.capture() as cap:
        x = cap.input((2, 3), em.float32, name="x")
        cap.output(x * 2, name="y")
    g = cap.graph
    with pytest.raises(ValueError, match=r"replay: input 'x' expects \(2, 3\) float32, got \(2, 4\) float32"):
        g(np.ones((2, 4), np.float32))
    with pytest.raises(TypeError, match=r"replay: input 'x' expects \(2, 3\) float32, got \(2, 3\) float64"):
        g(x=np.ones((2, 3)))
    with pytest.raises(TypeError, match="has no input 'z'"):
        g(z=1)


def test_graph_files_refuse_damage(tmp_path):
    with em.capture() as cap:
        x = cap.input((4,), em.float64, name="x")
        cap.output(em.cumulative_sum(x * em.asarray(np.arange(4.0), device=cap.device)), name="y")
    path = cap.graph.save(tmp_path / "g.ember")
    data = path.read_bytes()
    loaded = em.load_graph(path)
    np.testing.assert_array_equal(em.asnumpy(loaded(np.ones(4))), [0.0, 1.0, 3.0, 6.0])
    (tmp_path / "truncated").write_bytes(data[:-5])
    (tmp_path / "garbage").write_bytes(b"not a graph at all")
    (tmp_path / "trailing").write_bytes(data + b"x")
    newer = data.replace(b"\xa7version\x01", b"\xa7version\x09")
    assert newer != data
    (tmp_path / "newer").write_bytes(newer)
    for name, message in (("truncated", "truncated"), ("garbage", "not a valid ember graph"),
                          ("trailing", "truncated or has trailing data"), ("newer", "version 9")):
        with pytest.raises(GraphFormatError, match=message):
            em.load_graph(tmp_path / name)
    json_path = cap.graph.save(tmp_path / "g.json")
    assert '"op": "cumulative_sum"' in json_path.read_text()


def test_render(tmp_path):
    with em.capture() as cap:
        x = cap.input((3,), em.float32, name="x")
        cap.output(em.sin(x) + 1.0, name="y")
    g = cap.graph
    assert g.render(tmp_path / "g.dot").read_text().startswith("digraph ember")
    assert '"x\\n(3,) float32"' in g.to_dot() and "-> out_y" in g.to_dot()
    g.save(tmp_path / "g.ember")
    assert em.load_graph(tmp_path / "g.ember").to_dot() == g.to_dot()  # deterministic: a file draws as its graph
    if shutil.which("dot") is None:
        assert not os.environ.get("CI"), "CI installs graphviz: rendering to SVG must be tested there"
        with pytest.raises(em.NotSupportedError, match=r"Graphviz's `dot` program.*\.dot file"):
            g.render(tmp_path / "g.svg")
        pytest.skip("graphviz is not installed: only the refusal was checked")
    svg = g.render(tmp_path / "g.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert svg.count('class="node"') == 5  # input, two ops, the literal 1.0, output
    assert all(f">{label}</text>" in svg for label in ("x", "sin", "add", "1.0", "y", "(3,) float32"))


def test_jit_captures_again_for_another_dtype_of_the_same_shape():
    calls = []

    @em.jit
    def double(x):
        calls.append(1)
        return x * 2

    results = [double(em.ones(3, dtype=dtype)) for dtype in (em.float32, em.float64, em.int64, em.float32)]
    assert [r.dtype for r in results] == [em.float32, em.float64, em.int64, em.float32] and len(calls) == 3
    for r in results:
        np.testing.assert_array_equal(em.asnumpy(r), np.full(3, 2, dtype=em.asnumpy(r).dtype))


def test_jit_captures_once_per_signature_and_replays():
    calls = []

    @em.jit
    def step(w, x, scale=1.0):
        calls.append(1)
        return {"y": em.tanh(x @ w) * scale, "norm": em.linalg.vector_norm(w)}

    w, x = em.ones((3, 2)), em.ones((4, 3))
    first = step(w, x)
    second = step(w * 2, x)
    assert len(calls) == 1 and set(first) == {"y", "norm"}
    np.testing.assert_allclose(em.asnumpy(second["y"]), np.tanh(np.ones((4, 3)) @ (2 * np.ones((3, 2)))))
    step(w, em.ones((5, 3)))          # a new shape: captured again
    step(w, x, scale=2.0)             # a new static argument: captured again
    assert len(calls) == 3


def test_jit_refuses_python_branching_on_traced_values():
    @em.jit
    def relu_by_hand(x):
        return x if float(em.sum(x)) > 0 else -x

    with pytest.raises(TracedBranchError, match="em.where"):
        relu_by_hand(em.ones(3))


def test_jit_on_a_peer_registers_once_and_survives_a_restart():
    @em.jit
    def step(x):
        for _ in range(50):
            x = em.sin(x) + 0.5
        return x

    host = np.linspace(0, 1, 8)
    expected = em.asnumpy(step(em.asarray(host)))
    port = free_port()
    with Peer("--listen", f"127.0.0.1:{port}") as peer:
        device = em.device(peer.url())
        x = em.asarray(host, device=device)
        for _ in range(3):
            np.testing.assert_array_equal(em.asnumpy(step(x)), expected)
        stats = em.stats(device)
        assert stats["graphs_registered"] == 1 and stats["graph_runs"] == 3 and stats["ops"] == 0
        before = stats["bytes_up"]
        em.asnumpy(step(x))
        assert em.stats(device)["bytes_up"] - before < 200   # a reference and ids, not 100 ops
        peer.kill()
    with pytest.raises(em.ConnectionLost):
        em.asnumpy(step(x))
    with Peer("--listen", f"127.0.0.1:{port}") as restarted:
        assert em.device(restarted.url()) is device
        lost, x = x, em.asarray(host, device=device)            # a new session on the same device
        np.testing.assert_array_equal(em.asnumpy(step(x)), expected)
        assert em.stats(device)["graphs_registered"] == 1       # registered again, transparently
        with pytest.raises(em.ConnectionLost, match=r"^replay: an input lives in a lost session with "
                                                    rf"{re.escape(str(device))}; its data is gone \(lost the connection"):
            step(lost)
        np.testing.assert_array_equal(em.asnumpy(step(x)), expected)  # the new session goes on


def test_serving_a_capture_device_is_refused():
    with pytest.raises(em.HostDeviceError, match="cannot host a remote server on a capture device"):
        em.serve("capture", listen="127.0.0.1:0")
    with em.capture() as cap:
        with pytest.raises(em.HostDeviceError):
            em.Server(cap.device, "127.0.0.1:0")
    result = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--device", "capture", "--listen", "127.0.0.1:0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "capture records operations without executing them" in result.stderr


def test_unscoped_capture_device_records():
    c = em.device("capture")
    x = em.ones((2, 2), device=c)            # a constant: it has a value
    y = x @ x
    assert y.shape == (2, 2) and y.device == c
    with pytest.raises(NoValueError):
        em.asnumpy(y)
    assert "capture" in repr(y) and "(2, 2)" in repr(y)


@pytest.mark.skipif(not torch_available(), reason="torch is not installed")
def test_graph_replays_on_torch_like_numpy():
    with em.capture() as cap:
        x = cap.input((5,), em.float32, name="x")
        cap.output(em.cumulative_sum(em.exp(x) / 3.0), name="y")
    host = np.linspace(-1, 1, 5, dtype=np.float32)
    np.testing.assert_allclose(em.asnumpy(cap.graph(host, device="torch:cpu")), em.asnumpy(cap.graph(host)), rtol=1e-6)


@pytest.mark.parametrize("target", [name for name in LOCAL_DEVICES if name != "numpy"] or ["numpy"])
def test_a_replay_moves_inputs_to_the_device_it_runs_on(target):
    """graph(x, device=d) runs on d whatever x's device: an array elsewhere (or a host array) is moved there
    first, an array already there is used as it is."""
    with em.capture() as cap:
        x = cap.input((3,), em.float64, name="x")
        cap.output(em.sin(x) * 2.0, name="y")
    host = np.array([0.1, 0.2, 0.3])
    for value in (em.asarray(host), host, em.asarray(host, device=target)):
        out = cap.graph(value, device=target)
        assert out.device is em.device(target)
        np.testing.assert_allclose(em.asnumpy(out), np.sin(host) * 2.0, rtol=1e-15)
    assert cap.graph(em.asarray(host, device=target)).device is em.device(target)  # by default, x's device


def test_replay_arguments_that_do_not_fit_are_refused_naming_the_inputs():
    """By position, by name, twice or missing: a SignatureError (an EmberError and a TypeError) saying which."""
    with em.capture() as cap:
        a, b = cap.input((1,), em.float64, name="a"), cap.input((1,), em.float64, name="b")
        cap.output(a + b, name="y")
    g, one = cap.graph, np.ones(1)
    for call, message in [
        (lambda: g(one, one, one), r"^replay: the graph takes 2 inputs \(a, b\), got 3$"),
        (lambda: g(one, c=one), r"^replay: the graph has no input 'c'; its inputs are a, b$"),
        (lambda: g(one, a=one), r"^replay: input 'a' given twice$"),
        (lambda: g(one), r"^replay: missing input 'b'$"),
        (lambda: g(), r"^replay: missing input 'a'$"),
    ]:
        with pytest.raises(em.SignatureError, match=message) as refused:
            call()
        assert isinstance(refused.value, em.EmberError) and isinstance(refused.value, TypeError)
    assert em.asnumpy(g(one, b=one * 2)).tolist() == [3.0]


def test_a_graphs_constants_are_uploaded_once_per_engine():
    """constant_handles keeps each engine's uploads: a graph replayed many times (on a peer, through autodiff)
    uploads its constants once, and each engine gets its own."""
    weights = np.arange(6.0).reshape(2, 3)
    with em.capture() as cap:
        x = cap.input((3,), em.float64, name="x")
        cap.output(em.asarray(weights, device=cap.device) @ x, name="y")
    graph = cap.graph
    numpy_engine, tracked_engine = em.device("numpy").engine, em.autodiff("numpy").engine
    first = graph.constant_handles(numpy_engine)
    assert graph.constant_handles(numpy_engine) is first and len(first) == 1
    np.testing.assert_array_equal(next(iter(first.values())), weights)
    assert graph.constant_handles(tracked_engine) is graph.constant_handles(tracked_engine) is not first
    x = em.asarray([1.0, 0.0, -1.0], device=em.autodiff("numpy")).requires_grad_()
    for _ in range(2):
        np.testing.assert_array_equal(em.asnumpy(graph(x)), weights @ [1.0, 0.0, -1.0])


def test_every_scope_refusal_word_for_word():
    """The capture scope's refusals name the call, the rule and the offender."""
    with em.capture() as cap:
        x = cap.input((2,), em.float64, name="x")
        with pytest.raises(ScopeActiveError, match=r"^capture: a capture scope is already active in this thread; "
                                                   r"close it first \(scopes do not nest\)$"):
            em.capture().__enter__()
        with pytest.raises(em.DTypeError, match=r"^input: dtype must be an ember dtype, got 'float64'$"):
            cap.input((2,), "float64")
        with pytest.raises(CaptureErrorBase, match=r"^input: an input named 'x' exists already$"):
            cap.input((3,), name="x")
        with pytest.raises(OutputError, match=r"^output: the value \(numpy\) was not produced in this capture scope$"):
            cap.output(em.ones(2))
        with pytest.raises(OutputError, match=r"^output: the value \(list\) was not produced in this capture scope$"):
            cap.output([1.0, 2.0])
        with pytest.raises(NoValueError, match=r"^input 'x' \(\(2,\) float64\) has no concrete value"):
            em.asnumpy(x)
        cap.output(x * 2, name="y")
        with pytest.raises(OutputError, match=r"^output: an output named 'y' exists already$"):
            cap.output(x * 3, name="y")
    with pytest.raises(ScopeClosedError, match=r"^input: this capture scope is closed$"):
        cap.input((2,))
    with pytest.raises(ScopeClosedError, match=r"^output: this capture scope is closed$"):
        cap.output(x)
    assert [name for name, _, _ in cap.graph.inputs] == ["x"]
