"""What every backend provides to the local engine."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import dtypes as dt
from ..errors import ArgumentError


def cpu_threads() -> int:
    """The CPUs this process may run on, or ``EMBER_NUM_THREADS`` where set (1 turns splitting off)."""
    text = os.environ.get("EMBER_NUM_THREADS", "")
    if text.strip():
        try:
            return max(1, int(text))
        except ValueError:
            raise ArgumentError(f"EMBER_NUM_THREADS: expected a whole number of threads, got {text!r}") from None
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows
        return os.cpu_count() or 1


def _references(items) -> list:
    return [sys.getrefcount(item) for item in items]


_ALONE = _references((object(),))[0]  # the count of an object that one container alone holds, taken the same way


def held_alone(items, besides: int = 0) -> list[bool]:
    """For each of ``items`` (a list or tuple), whether the container holds its only reference
    (with ``besides``: its only one but that many others the caller knows of, such as an array's
    on its base): no name, view or buffer of it lives anywhere else (a view holds a reference to
    its array). Counted against an object of known references, taken the same way: Python
    versions count a call's arguments differently, and this holds on each."""
    alone = _ALONE + besides
    return [count == alone for count in _references(items)]


class Backend:
    """One hardware device of a native array library.

    ``kernels`` maps op names to callables ``kernel(*native_inputs, **attrs)`` returning a
    native array or a tuple of them; ``gaps`` maps op names the backend cannot run to the
    reason. ``dtypes`` lists the ember dtypes its ops compute on; its arrays may hold any ember
    dtype, moved in and out and converted with ``astype`` (PyTorch's uint16/32/64).
    """

    name: str = ""          # "numpy", "torch"
    device_name: str = ""   # the ember device string of this device: "numpy", "torch:cuda:0"
    native_type: type = object
    kernels: dict[str, Callable[..., Any]]
    gaps: dict[str, str]
    dtypes: tuple[dt.DType, ...] = dt.ALL
    # the threads a compiled plan may split a run of in-place elementwise steps across, block by block: more than
    # one only where each kernel call runs on one CPU and lets the GIL go (NumPy's ufuncs; PyTorch has threads of its own)
    threads: int = 1

    def coerce(self, value) -> Any:
        """A kernel's output as a native array (NumPy returns scalars for 0-d results)."""
        return value

    def into(self, name: str) -> Callable[..., Any] | None:
        """The kernel of elementwise row ``name`` as ``kernel(*inputs, destination)``, writing its
        result into ``destination`` (an array of the result's shape and dtype, perhaps one of the
        inputs) with the casting rules of ``kernels[name]``; None where the backend has none."""
        return None

    def literal(self, value, dtype: dt.DType) -> Any:
        """Scalar ``value`` as a kernel of :meth:`into` takes it fastest, with the result it gives
        for ``value`` itself: converted once when a plan is compiled, not at every call."""
        return value

    def unshared(self, arrays: tuple) -> bool:
        """Whether each of ``arrays`` is held by that tuple alone — no name, view, buffer or weak
        reference anywhere else sees its memory — so a plan may write a new result over it. False
        where the backend cannot tell (the default: a PyTorch view holds its base in C++)."""
        return False

    def compiled(self, plan) -> Any:
        """A compiled form of ``plan`` (the local engine's Plan of a graph: ``run(inputs)`` and
        ``steps``), for a backend with a compiler of its own (JAX's XLA); None runs the plan as is."""
        return None

    def dtype_of(self, native) -> dt.DType:
        raise NotImplementedError

    def from_host(self, host: np.ndarray) -> Any:
        """A native array holding ``host``'s data on this device (sharing its memory where it can:
        ``asarray`` has already copied when the caller asked for a copy)."""
        raise NotImplementedError

    def to_host(self, native) -> np.ndarray:
        """``native`` as a NumPy array in host memory (zero-copy where the library allows)."""
        raise NotImplementedError

    def adopt(self, native) -> Any:
        """A native array of this backend, perhaps on another of its devices, on this device: a
        compute peer moving a tensor between two of its sessions. A host round trip unless the
        backend does better."""
        return self.from_host(np.array(self.to_host(native)))

    def from_dlpack(self, obj, copy: bool | None = None) -> Any:
        raise NotImplementedError
