"""``ember demo`` end to end in a subprocess: exit status, every section, no process left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_demo_runs_end_to_end_and_leaves_nothing_behind(tmp_path):
    demo = subprocess.Popen([sys.executable, "-m", "ember.cli", "demo", "--out", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = demo.communicate(timeout=600)
    assert demo.returncode == 0, out + err
    for section in ("[1] One Array API computation", "[2] An MLP trained on the peer", "[3] One training step captured",
                    "[4] Serving a capture device is refused", "[5] What it cost", "all checks passed", "peer stopped"):
        assert section in out, section
    assert "blocking round trips for the whole computation and its reads: 1" in out
    assert "cannot host a remote server on a capture device" in out and "exit status 2" in out
    assert (tmp_path / "train_step.ember").exists() and (tmp_path / "train_step.json").exists()
    assert (tmp_path / "train_step.svg").exists() or (tmp_path / "train_step.dot").exists()
    try:
        import onnxruntime
    except ImportError:
        assert "pip install 'ember[onnx]'" in out
    else:
        assert (tmp_path / "train_step.onnx").exists()
        if tuple(map(int, onnxruntime.__version__.split(".")[:2])) >= (1, 26):
            assert "✓ ONNX Runtime's step equals ember's" in out
        else:  # a release without the float64 kernel its optimizer reaches for: said, and the demo goes on
            assert f"ONNX Runtime {onnxruntime.__version__} could not run it" in out
    deadline = time.monotonic() + 10
    while _group_alive(demo.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(demo.pid), "a process of the demo survived it"


def test_ctrl_c_stops_the_peer_too():
    # SIGINT as in a terminal: a job started in the background by a shell inherits it ignored
    demo = subprocess.Popen([sys.executable, "-m", "ember.cli", "demo", "--steps", "5000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in demo.stdout:
            if line.startswith("[2]"):
                break
        time.sleep(1)
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=60)
        assert demo.returncode == 130 and "interrupted" in err
        deadline = time.monotonic() + 10
        while _group_alive(demo.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(demo.pid), "the peer survived Ctrl-C"
    finally:
        if _group_alive(demo.pid):
            os.killpg(demo.pid, signal.SIGKILL)
