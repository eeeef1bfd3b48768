"""What users install is what the source tree holds: the wheel carries every module and imports anywhere.

The editable install the tests run under reads the source tree, so it cannot notice a package left
out of the wheel; this test builds the wheel from a copy of the tree and checks it file by file.
"""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
LEFT_BEHIND = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis")


def _python_files(folder: Path, installed_as: str) -> set[str]:
    return {f"{installed_as}/{path.relative_to(folder).as_posix()}" for path in folder.rglob("*.py")
            if "__pycache__" not in path.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=LEFT_BEHIND)  # no stale build/ can hide a missing file
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(work / "dist")],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = (work / "dist").glob("ember-*.whl")
    return path


def test_wheel_holds_every_module_of_ember_and_the_benchmarks(wheel):
    expected = _python_files(ROOT / "ember", "ember") | _python_files(ROOT / "benchmarks", "ember/benchmarks")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if name.endswith(".py")}
        entry_points = next(archive.read(n).decode() for n in archive.namelist() if n.endswith("entry_points.txt"))
    assert "ember/remote/server.py" in expected and "ember/benchmarks/core.py" in expected  # the walk found them
    assert expected - shipped == set(), "left out of the wheel"
    assert shipped - expected == set(), "in the wheel but not in the source tree"
    assert "ember = ember.cli:main" in entry_points


OPTIONAL = ("torch", "jax", "ray", "onnx", "onnxruntime", "prometheus_client")  # the extras' packages


def test_installed_wheel_imports_every_module_from_another_directory(wheel, tmp_path):
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # a module of an optional extra that is not installed here (jax on Python 3.10) may fail for that reason only
    script = (
        "import importlib, importlib.util, pkgutil, ember\n"
        "names = [m.name for m in pkgutil.walk_packages(ember.__path__, 'ember.')]\n"
        "for name in names:\n"
        "    try: importlib.import_module(name)\n"
        "    except ModuleNotFoundError as error:\n"
        f"        if error.name not in {OPTIONAL!r} or importlib.util.find_spec(error.name): raise\n"
        "print(ember.__file__); print(len(names))\n"
        "import ember.cli; ember.cli.main(['bench', 'no-such-suite'])\n"
    )
    # -I -S: no source tree on sys.path and no .pth files, so the editable install's finder stays out;
    # the dependencies come from this environment's site-packages, ember only from the installed wheel
    path = [str(target), *site.getsitepackages()]
    run = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path[:0] = {path!r}\n" + script],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    location, count = run.stdout.split()[:2]
    assert Path(location).is_relative_to(target)
    assert int(count) >= len(_python_files(ROOT / "ember", "ember")) - 1  # every module but ember/__init__.py itself
    assert "unknown suite 'no-such-suite'; choose from core" in run.stderr  # ember.benchmarks is importable
