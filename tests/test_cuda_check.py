"""tools/cuda_check.py: its steps in a dry run (each CUDA device replaced by its CPU counterpart), its refusal to
check anything without a GPU, and its reporting of a step that fails or outlives its budget."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "cuda_check.py"


def _load(monkeypatch):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the script sets defaults at import: none outlives the test
    spec = importlib.util.spec_from_file_location("cuda_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(output: str) -> dict[str, tuple[str, str]]:
    """The summary table's rows: step → (result, figure)."""
    lines = output.splitlines()
    start = lines.index(next(line for line in lines if line.split() == ["step", "result", "seconds", "figure"]))
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("total "):
            return rows
        name, result, seconds, *figure = line.split(None, 3)
        assert float(seconds) >= 0
        rows[name] = (result, figure[0] if figure else "")
    raise AssertionError(f"no total line after the summary:\n{output}")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=SCRIPT.parents[1])


def test_a_dry_run_checks_every_step_on_the_cpu_counterparts():
    pytest.importorskip("torch")
    started = time.perf_counter()
    done = _run("--dry-run", "--mib", "16", timeout=300)
    print(f"\nFIGURE the dry run took {time.perf_counter() - started:.0f} s")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "dry run: torch:cuda runs as torch:cpu, jax:gpu runs as jax:cpu" in out
    for number, (name, budget) in enumerate([("torch", 60), ("peer", 90), ("jax", 60), ("frontend", 120), ("bench", 120)], 1):
        assert f"[{number}/5] {name}: " in out and f"(budget {budget} s)" in out
    rows = _summary(out)
    assert list(rows) == ["torch", "peer", "jax", "frontend", "bench"]
    jax_installed = importlib.util.find_spec("jax") is not None
    for name, (result, _) in rows.items():
        assert result == ("ok" if name != "jax" or jax_installed else "skipped"), (name, out)
    assert rows["torch"][1].startswith("16 MiB up ") and rows["torch"][1].endswith(" GB/s")
    assert rows["peer"][1].startswith("1 round trip; 16 MiB up ")
    assert "largest loss difference" in rows["frontend"][1]
    assert " rows, " in rows["bench"][1] and "core" in out  # ember bench's table, printed as it came
    assert "FAILED" not in out and "Traceback" not in out


def test_without_a_gpu_it_says_so_and_checks_nothing():
    from ember.backends import available_devices
    if any(name.startswith(("torch:cuda", "jax:gpu")) for name in available_devices()):
        pytest.skip("this machine has a GPU: the script checks it")
    done = _run(timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no CUDA device found" in done.stdout and "skipped, nothing was checked" in done.stdout
    assert "[1/" not in done.stdout and "step" not in done.stdout.split()  # no step started, no summary


def test_a_failing_step_and_one_over_its_budget_are_reported_and_the_next_step_runs(monkeypatch, capsys):
    check = _load(monkeypatch)
    ran = []

    def fails(machine):
        raise ValueError("a planted failure")

    def hangs(machine):
        time.sleep(60)

    monkeypatch.setattr(check, "STEPS", [check.Step("fails", "raises", 10, None, fails),
                                         check.Step("hangs", "outlives its budget", 1, None, hangs),
                                         check.Step("needs", "needs a backend", 10, "nope", lambda m: ran.append("needs")),
                                         check.Step("passes", "passes", 10, None, lambda m: ran.append("passes") or "42 units")])
    started = time.perf_counter()
    assert check.main(["--dry-run"]) == 1
    assert time.perf_counter() - started < 10  # the hanging step was cut off at its budget
    rows = _summary(capsys.readouterr().out)
    assert rows == {"fails": ("FAILED", "ValueError: a planted failure"), "hangs": ("FAILED", "over its 1 s budget"),
                    "needs": ("skipped", "nope is not installed"), "passes": ("ok", "42 units")}
    assert ran == ["passes"]
    assert check.main(["--dry-run", "--steps", "passes"]) == 0
