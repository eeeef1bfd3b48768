"""The layers hold: every import in ember points down (pyproject.toml's import-linter contract,
described in docs/architecture.md), and the check fails when one points up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(package_parent: Path) -> subprocess.CompletedProcess:
    # the contract reads `ember` from package_parent first; no cache, so a planted import is seen
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          capture_output=True, text=True, cwd=package_parent, env=env, timeout=120)


def test_every_import_points_down_the_layers():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "ember", tmp_path / "ember", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "ember" / "dtypes.py", "a") as f:
        f.write("\n\ndef _planted():\n    from .graphs import jit  # a lazy import counts too\n    return jit\n")
    result = _lint(tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout
    assert "ember.dtypes -> ember.graphs" in result.stdout
