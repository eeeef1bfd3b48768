"""Layer 7 — captured graphs: the capture scope (``scope``), CapturedGraph with replay and
inspection (``graph``), the file format's reader and validation (``files``), and ``jit``."""

from ..errors import (
                      DataDependentError,
                      GraphFormatError,
                      NoValueError,
                      OutputError,
                      ScopeActiveError,
                      ScopeClosedError,
                      TracedBranchError,
                      UndeclaredInputError,
)
from .files import load_graph, validate
from .graph import GRAPH_FORMAT_VERSION, CapturedGraph, format_bytes
from .jit import Jitted, jit
from .onnx_import import load_onnx
from .scope import CaptureScope, capture

__all__ = ["CaptureScope", "CapturedGraph", "capture", "load_graph", "validate", "jit", "Jitted", "format_bytes",
           "GRAPH_FORMAT_VERSION", "load_onnx", "ScopeActiveError", "OutputError", "TracedBranchError", "GraphFormatError",
           "ScopeClosedError", "NoValueError", "DataDependentError", "UndeclaredInputError"]
