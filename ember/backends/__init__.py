"""Layer 3 — backends: kernel tables over native arrays, device enumeration, host transfer.

A backend module exposes a ``Backend`` object per hardware device (see base.py). Backends are
imported lazily, so ``import ember`` never imports torch or jax.
"""

from __future__ import annotations

import importlib

BACKEND_MODULES = {"numpy": "ember.backends.numpy", "torch": "ember.backends.torch", "jax": "ember.backends.jax"}


def backend_module(name: str):
    """The module of backend ``name`` ("numpy", "torch", "jax"); ImportError if it is not installed."""
    return importlib.import_module(BACKEND_MODULES[name])


def available_devices() -> list[str]:
    """Device strings of every local device: numpy, and torch's and jax's where they are installed."""
    names = ["numpy"]
    for optional in ("torch", "jax"):
        try:
            names += backend_module(optional).devices()
        except ImportError:
            pass
    return names
