"""Reading arrays back to the host, syncing devices and reading their counters."""

from __future__ import annotations

import numpy as np

from .array import Array
from .devices import Device
from .devices import device as as_device
from .errors import DTypeError


def asnumpy(x: Array) -> np.ndarray:
    """x's values as a NumPy array on the host (waits for the device; zero-copy for numpy)."""
    if not isinstance(x, Array):
        raise DTypeError(f"asnumpy: expected an ember array, got {type(x).__name__}")
    return x._host()


def sync(device: Device | str | None = None) -> None:
    """Wait until every operation submitted to ``device`` has run; raise the first deferred error."""
    as_device(device).engine.sync()


def stats(device: Device | str | None = None) -> dict:
    """Counters of a device's session: ``ops``, ``round_trips``, ``bytes_up``, ``bytes_down`` …"""
    return as_device(device).engine.stats()
