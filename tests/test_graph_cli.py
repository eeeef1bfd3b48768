"""``ember graph``: the summary, conversions and drawings of a saved graph, and ``ember graph verify`` across
NumPy, torch and a real compute peer, as a user runs them (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import torch_available


def ember(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "ember.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def saved(tmp_path):
    from .test_onnx import spirals_forward
    graph, _ = spirals_forward(batch=8)
    return graph.save(tmp_path / "spirals.ember")


def test_summary_and_conversions(saved, tmp_path):
    pytest.importorskip("onnx")
    result = ember("graph", str(saved), "--render", str(tmp_path / "g.dot"), "--onnx", str(tmp_path / "g.onnx"),
                   "--json", str(tmp_path / "g.json"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("CapturedGraph: 5 ops, 1 input, 1 output") and "linear ×3, gelu ×2" in result.stdout
    assert (tmp_path / "g.dot").read_text().startswith("digraph ember")
    assert json.loads((tmp_path / "g.json").read_text())["format"] == "ember.graph"
    back = ember("graph", str(tmp_path / "g.onnx"))  # an ONNX model reads back as a graph
    assert back.returncode == 0 and "input  points: (8, 2) float64" in back.stdout, back.stderr


@pytest.mark.skipif(not torch_available(), reason="torch is not installed")
def test_verify_across_devices_and_a_peer(saved, peer):
    result = ember("graph", "verify", str(saved), "--on", f"numpy,torch:cpu,{peer.url()}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verified 5 ops on numpy, torch:cpu, ember://" in result.stdout and "every intermediate agrees" in result.stdout


def test_bad_uses_exit_2(saved, tmp_path):
    one = ember("graph", "verify", str(saved), "--on", "numpy")
    assert one.returncode == 2 and "at least two devices" in one.stderr
    missing = ember("graph", str(tmp_path / "nothing.ember"))
    assert missing.returncode == 2 and "nothing.ember" in missing.stderr
