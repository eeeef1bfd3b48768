"""Package discovery for setuptools (the metadata lives in pyproject.toml).

Every package under ``ember/`` is found, never listed by hand, so a new subpackage cannot be left
out of the wheel; ``benchmarks/`` at the root installs as ``ember.benchmarks`` for ``ember bench``.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["ember", "ember.*"])
    + ["ember.benchmarks" + ("." + sub if sub else "") for sub in ["", *find_packages("benchmarks")]],
    package_dir={"ember.benchmarks": "benchmarks"},
)
