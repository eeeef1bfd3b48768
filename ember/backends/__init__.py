"""Layer 3 — backends: kernel tables over native arrays, device enumeration, host transfer.

A backend module exposes a ``Backend`` object per hardware device (see base.py). Backends are
imported lazily, so ``import ember`` never imports torch.
"""

from __future__ import annotations

import importlib

BACKEND_MODULES = {"numpy": "ember.backends.numpy", "torch": "ember.backends.torch"}


def backend_module(name: str):
    """The module of backend ``name`` ("numpy", "torch"); ImportError if it is not installed."""
    return importlib.import_module(BACKEND_MODULES[name])


def available_devices() -> list[str]:
    """Device strings of every local device: numpy, and torch's when torch is installed."""
    names = ["numpy"]
    try:
        names += backend_module("torch").devices()
    except ImportError:
        pass
    return names
