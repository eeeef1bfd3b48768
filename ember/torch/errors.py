"""The errors of ``ember.torch``, each an ember error and the builtin a PyTorch user would catch::

    NotSupportedError (NotImplementedError)
    ├── UnloweredOpError   an aten op without a lowering or a decomposition ember can run
    └── AliasingError      an in-place op whose effect a live view or base could not see
    DeviceError (ValueError)
    └── MixedDevicesError  an ember tensor and a host tensor (not 0-d) in one op
"""

from __future__ import annotations

import os
import traceback

import torch

import ember
from ember.errors import DeviceError, NotSupportedError

_LIBRARIES = tuple(os.path.dirname(module.__file__) + os.sep for module in (torch, ember))


class UnloweredOpError(NotSupportedError):
    """An aten op reached an ember tensor and has no lowering: nothing ran, nothing fell back to the CPU."""

    op = None  # the aten op without a lowering (the innermost one, where a decomposition led there)


class AliasingError(NotSupportedError):
    """An in-place op on a tensor that shares elements with another live tensor (a view or its base)."""


class MixedDevicesError(DeviceError):
    """An op mixed ember tensors with host tensors of more than one element."""


def user_line() -> str:
    """``file:line: code`` of the innermost frame outside torch and ember: where the user called."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_LIBRARIES) and not frame.filename.startswith("<"):
            return f"{frame.filename}:{frame.lineno}: {frame.line}"
    return "(no caller outside torch and ember)"
