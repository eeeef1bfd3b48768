"""What a captured graph shows of itself, exactly: its summary, its JSON view, its DOT drawing,
and the files ``render`` writes (Graphviz draws SVG and PNG where ``dot`` is installed; CI has it)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

import ember as em

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")


@pytest.fixture(scope="module")
def graph():
    with em.capture() as cap:
        a = cap.input((2, 3), em.float32, "a")
        w = em.asarray(np.ones((3, 4), np.float32), device=cap.device)
        y = em.matmul(a, w) * 2.5
        cap.output(em.sum(y, axis=1, dtype=em.float64), "s")
        cap.output(em.astype(y, em.complex64) + (1 + 2j), "z")
    return cap.graph


def test_the_summary_counts_everything_and_lists_inputs_and_outputs(graph):
    assert repr(graph) == "<CapturedGraph 5 ops, inputs ['a'], outputs ['s', 'z']>"
    assert str(graph) == (  # matmul 2·2·4·3 + multiply 8 + sum over 8 + add 8 flops; astype counts none
        "CapturedGraph: 5 ops, 1 input, 2 outputs, 1 constant (48 B), ~72 flops\n"
        "  input  a: (2, 3) float32\n"
        "  output s: (2,) float64\n"
        "  output z: (2, 4) complex64\n"
        "  ops: matmul ×1, multiply ×1, sum ×1, astype ×1, add ×1")
    assert graph.flops() == 72 and graph.constant_bytes() == 48


def test_a_long_summary_shows_six_inputs_and_outputs_and_counts_the_rest():
    with em.capture() as cap:
        xs = [cap.input((1000, 1000), em.float64, f"x{k}") for k in range(8)]
        big = em.asarray(np.zeros(196_608), device=cap.device)  # 1.5 MiB
        for k in range(7):
            cap.output(em.matmul(xs[k], xs[k + 1]) + em.sum(big), f"y{k}")
    text = str(cap.graph).splitlines()
    assert text[0] == "CapturedGraph: 21 ops, 8 inputs, 7 outputs, 1 constant (1.5 MiB), ~14.0G flops"
    assert text[1:8] == [f"  input  x{k}: (1000, 1000) float64" for k in range(6)] + ["  … and 2 more inputs"]
    assert text[8:15] == [f"  output y{k}: (1000, 1000) float64" for k in range(6)] + ["  … and 1 more output"]
    assert text[15] == "  ops: matmul ×7, sum ×7, add ×7"


def test_the_json_view_describes_every_node_op_literal_and_attribute(graph):
    assert graph.to_json() == {
        "format": "ember.graph", "version": 1,
        "inputs": [{"name": "a", "id": 0, "shape": [2, 3], "dtype": "float32"}],
        "outputs": [{"name": "s", "id": 4, "shape": [2], "dtype": "float64"},
                    {"name": "z", "id": 6, "shape": [2, 4], "dtype": "complex64"}],
        "constants": [{"id": 1, "shape": [3, 4], "dtype": "float32", "bytes": 48}],
        "ops": [
            {"op": "matmul", "inputs": [0, 1], "outputs": [2], "attrs": {}},
            {"op": "multiply", "inputs": [2, {"literal": 2.5, "dtype": "float32"}], "outputs": [3], "attrs": {}},
            {"op": "sum", "inputs": [3], "outputs": [4], "attrs": {"axis": [1], "dtype": "float64", "keepdims": False}},
            {"op": "astype", "inputs": [3], "outputs": [5], "attrs": {"dtype": "complex64", "copy": True}},
            {"op": "add", "inputs": [5, {"literal": {"re": 1.0, "im": 2.0}, "dtype": "complex64"}], "outputs": [6],
             "attrs": {}},
        ]}


def test_non_finite_complex_and_text_attributes_are_json_text(tmp_path):
    with em.capture() as cap:
        cap.output(em.full((2,), math.inf, device=cap.device), "inf")
        cap.output(em.full((1,), math.nan, device=cap.device), "nan")
        cap.output(em.full((1,), 1 - 1j, device=cap.device), "c")
        logits = cap.input((2, 3), em.float64, "logits")
        cap.output(em.nn.cross_entropy(logits, em.asarray([0, 2], device=cap.device), reduction="sum"), "loss")
    view = cap.graph.to_json()
    assert [op["attrs"]["fill_value"] for op in view["ops"][:3]] == ["inf", "nan", {"re": 1.0, "im": -1.0}]
    assert view["ops"][3]["attrs"] == {"reduction": "sum"}
    text = cap.graph.save(tmp_path / "g.json").read_text()
    assert json.loads(text) == view and text.count("\n") > 40  # indented: one value a line, for reading


DOT = r'''digraph ember {
  rankdir=TB;
  node [fontname="Helvetica", fontsize=10];
  n0 [shape=ellipse, style=filled, fillcolor="#dbeafe", label="a\n(2, 3) float32"];
  n1 [shape=note, label="constant\n(3, 4) float32"];
  op0 [shape=box, style="rounded,filled", fillcolor="#fef3c7", label="matmul"];
  n0 -> op0 [label="(2, 3) float32", fontsize=8];
  n1 -> op0 [label="(3, 4) float32", fontsize=8];
  op1 [shape=box, style="rounded,filled", fillcolor="#fef3c7", label="multiply"];
  op0 -> op1 [label="(2, 4) float32", fontsize=8];
  lit1_1 [shape=plaintext, label="2.5"]; lit1_1 -> op1;
  op2 [shape=box, style="rounded,filled", fillcolor="#fef3c7", label="sum"];
  op1 -> op2 [label="(2, 4) float32", fontsize=8];
  op3 [shape=box, style="rounded,filled", fillcolor="#fef3c7", label="astype\ndtype=complex64, copy=True"];
  op1 -> op3 [label="(2, 4) float32", fontsize=8];
  op4 [shape=box, style="rounded,filled", fillcolor="#fef3c7", label="add"];
  op3 -> op4 [label="(2, 4) complex64", fontsize=8];
  lit4_1 [shape=plaintext, label="(1+2j)"]; lit4_1 -> op4;
  out_s [shape=ellipse, style=filled, fillcolor="#dcfce7", label="s"];
  op2 -> out_s [label="(2,) float64", fontsize=8];
  out_z [shape=ellipse, style=filled, fillcolor="#dcfce7", label="z"];
  op4 -> out_z [label="(2, 4) complex64", fontsize=8];
}'''


def test_the_dot_drawing_is_exactly_the_graph(graph):
    assert graph.to_dot() == DOT  # sum's attributes (41 characters) are too long for its box: left out


def test_the_drawing_leaves_out_indexing_keys_and_unset_attributes():
    with em.capture() as cap:
        x = cap.input((4, 3), em.float32, "x")
        cap.output(em.sum(x[1:, 0]), "s")
    dot = cap.graph.to_dot()
    assert 'label="getitem"' in dot and "key=" not in dot
    assert 'label="sum\\ndtype=float32, keepdims=False"' in dot  # axis is None: not drawn


def test_render_writes_dot_text_without_graphviz(graph, tmp_path):
    assert graph.render(tmp_path / "g.dot").read_text() == DOT


def test_render_without_graphviz_says_what_to_install(graph, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(em.NotSupportedError) as refused:
        graph.render(tmp_path / "g.svg")
    assert str(refused.value) == ("render: drawing g.svg needs Graphviz's `dot` program, which is not installed "
                                  "(apt install graphviz); render to a .dot file, or use g.to_dot()")


@needs_dot
def test_a_format_graphviz_lacks_is_refused_with_its_reason(graph, tmp_path):
    with pytest.raises(em.NotSupportedError) as refused:
        graph.render(tmp_path / "g.nosuchformat")
    assert str(refused.value).startswith("render: Graphviz could not draw g.nosuchformat: ")
    assert "nosuchformat" in str(refused.value).split(": ", 2)[2]  # dot's own words


@needs_dot
@pytest.mark.parametrize("name, magic", [("g.svg", b"<?xml"), ("g.png", b"\x89PNG"), ("g.pdf", b"%PDF"), ("g", b"<?xml")])
def test_render_draws_with_graphviz_in_the_format_of_the_suffix(graph, tmp_path, name, magic):
    path = graph.render(tmp_path / name)
    assert path == tmp_path / name and path.read_bytes().startswith(magic)
    if magic == b"<?xml":
        assert all(word in path.read_text() for word in ("matmul", "astype", "(2, 4) complex64"))


def test_byte_sizes_and_counts_are_shown_in_their_units_at_each_boundary():
    from ember.graphs.graph import _count
    assert [em.graphs.format_bytes(n) for n in (0, 1023, 1024, 1536, 1024 ** 2 - 1, 1024 ** 2, 1024 ** 3 - 1,
                                                 1024 ** 3, 5 * 1024 ** 4)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "1024.0 KiB", "1.0 MiB", "1024.0 MiB", "1.0 GiB", "5.0 TiB"]
    assert [_count(n) for n in (999, 1000, 1500, 999_999, 10 ** 6, 10 ** 9 - 1, 10 ** 9, 2 * 10 ** 12)] == [
        "999", "1.0k", "1.5k", "1000.0k", "1.0M", "1000.0M", "1.0G", "2000.0G"]


@pytest.mark.parametrize("count", [6, 7])
def test_the_summary_lists_six_inputs_and_outputs_then_says_how_many_more(count):
    with em.capture() as cap:
        xs = [cap.input((1,), em.float64, name=f"x{i}") for i in range(count)]
        for i, x in enumerate(xs):
            cap.output(x + 1.0, name=f"y{i}")
    text = str(cap.graph)
    assert text.count("  input  x") == text.count("  output y") == 6
    more = [line.strip() for line in text.splitlines() if line.strip().startswith("…")]
    assert more == ([] if count == 6 else ["… and 1 more input", "… and 1 more output"])


def test_flops_count_each_family_by_its_rule():
    """Contractions 2·M·N·K by their rows' rules (tensordot and vecdot read their axes), reductions their
    inputs' elements, elementwise ops their outputs' elements, everything else nothing."""
    with em.capture() as cap:
        a = cap.input((4, 5), em.float64, name="a")
        b = cap.input((5, 3), em.float64, name="b")
        t = em.tensordot(a, b, axes=([1], [0]))  # 2 · 12 · 5 = 120
        v = em.vecdot(a, a)  # 2 · 4 · 5 = 40
        s = em.sum(t)  # 12
        e = em.exp(v)  # 4
        cap.output(em.reshape(e, (2, 2)) + s, name="y")  # reshape 0, add 4
    assert cap.graph.flops() == 120 + 40 + 12 + 4 + 4
