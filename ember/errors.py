"""The ember exception tree.

Every error ember raises derives from :class:`EmberError` *and* from the builtin exception a
Python user would catch for that situation, so ``except ValueError`` keeps working::

    EmberError
    ├── DTypeError        (TypeError)    an operation does not accept a dtype, or dtypes don't promote
    ├── ShapeError        (ValueError)   shapes don't fit together (broadcasting, matmul, reshape …)
    ├── AxisError         (ValueError, IndexError)   an axis is out of range or repeated
    ├── IndexingError     (IndexError)   a bad index or key in ``x[key]``
    ├── ScalarOverflowError (OverflowError) a Python int does not fit the array's dtype
    ├── ArgumentError     (ValueError)   a bad non-array argument (a count, a mode, a listen address …)
    ├── DeviceError       (ValueError)   a bad device string, or arrays on two devices in one op
    │   └── HostDeviceError              ``serve`` asked to host a device that cannot execute
    ├── NotSupportedError (NotImplementedError) a backend declares a gap for an operation
    │   └── OnnxError                    ops of a graph or an ONNX model without a form on the other side
    ├── ExecutionError    (RuntimeError) a kernel failed on the data (e.g. a singular matrix)
    ├── ProtocolError     (ValueError)   a malformed, oversized or refused frame
    ├── ResourceLimitError (MemoryError) a compute peer's limit on a tensor, a session's bytes or its memory
    ├── AccessDenied      (PermissionError) a compute peer refused the token
    │   └── TLSError                     TLS failed: an untrusted, expired or misnamed certificate, or a TLS mismatch
    ├── ConnectionLost    (ConnectionError) the peer or the connection went away
    ├── PeerBusy          (ConnectionRefusedError) a compute peer serves as many sessions as it may
    └── CaptureError      (RuntimeError) misuse of a capture scope or a value it cannot know
        ├── ScopeActiveError             a scope opened while another is active in this thread
        ├── ScopeClosedError             a tensor of a closed scope used
        ├── NoValueError                 a captured tensor's value asked for
        ├── DataDependentError           an op with a data-dependent output shape captured
        ├── UndeclaredInputError         a value from outside the scope used without declaring it
        ├── OutputError                  ``cap.output`` given something the scope did not produce
        ├── TracedBranchError            a jitted function branched in Python on a traced value
        └── GraphFormatError             a graph file malformed, truncated, inconsistent or newer

Messages name the operation first (``matmul: shapes (3, 4) and (5, 2) are not aligned``).
"""

from __future__ import annotations


class EmberError(Exception):
    """Base class of every exception ember raises."""


class DTypeError(EmberError, TypeError):
    """An operation does not accept a dtype, or two dtypes have no promotion."""


class ShapeError(EmberError, ValueError):
    """Shapes do not fit together."""


class AxisError(EmberError, ValueError, IndexError):
    """An axis is out of range or repeated."""


class IndexingError(EmberError, IndexError):
    """A bad index or key in ``x[key]`` or ``x[key] = v``."""


class ScalarOverflowError(EmberError, OverflowError):
    """A Python integer does not fit the dtype of the array it meets."""


class ArgumentError(EmberError, ValueError):
    """A bad non-array argument (a negative count, an unknown mode …)."""


class SignatureError(EmberError, TypeError):
    """Arguments that do not fit a call: a graph replay's inputs, by position or by name."""


class DeviceError(EmberError, ValueError):
    """A bad device string, or arrays on two devices in one operation."""


class HostDeviceError(DeviceError):
    """``serve`` was asked to host a device that cannot execute operations."""


class NotSupportedError(EmberError, NotImplementedError):
    """A backend declares a gap for an operation or dtype."""


class OnnxError(NotSupportedError):
    """A graph has ops without an ONNX form, or an ONNX model operators ember does not import;
    ``unsupported`` lists every one of them, as ``(where, op, why)``."""

    def __init__(self, message: str, unsupported: tuple = ()):
        super().__init__(message)
        self.unsupported = tuple(unsupported)


class ExecutionError(EmberError, RuntimeError):
    """A kernel failed on the data itself (e.g. a singular matrix)."""


class ProtocolError(EmberError, ValueError):
    """A malformed, oversized or refused frame or handshake."""


class ResourceLimitError(EmberError, MemoryError):
    """A compute peer refused work past one of its limits: a tensor's size, a session's quota of
    live bytes, or the peer's memory budget; the message names the op, the size and the limit."""


class AccessDenied(EmberError, PermissionError):
    """A compute peer refused the session's token."""


class TLSError(AccessDenied):
    """A TLS connection with a compute peer failed: its certificate is not trusted, has expired or
    names another host, or one side speaks TLS and the other does not."""


class ConnectionLost(EmberError, ConnectionError):
    """The compute peer or the connection to it went away."""


class PeerBusy(EmberError, ConnectionRefusedError):
    """A compute peer refused a session because it serves as many as it may (``--max-sessions``)."""


class CaptureError(EmberError, RuntimeError):
    """Misuse of a capture scope, or asking a capture for a value it cannot know."""


class ScopeClosedError(CaptureError):
    """A tensor of a capture scope was used after the scope closed."""


class NoValueError(CaptureError):
    """A captured tensor's value was asked for: capture records, it does not execute."""


class DataDependentError(CaptureError):
    """An op whose output shape depends on data (nonzero, unique, boolean masks) was captured."""


class UndeclaredInputError(CaptureError):
    """A value from outside the capture was used without being declared an input or constant."""


class ScopeActiveError(CaptureError):
    """A capture scope was opened while another is active in this thread."""


class OutputError(CaptureError):
    """``cap.output`` was given something the scope did not produce."""


class TracedBranchError(CaptureError):
    """A jitted function branched in Python on a traced value."""


class GraphFormatError(CaptureError):
    """A graph file is malformed, truncated or of a newer format."""


def with_prefix(error: EmberError, prefix: str) -> EmberError:
    """Return a copy of ``error`` of the same type whose message starts with ``prefix: ``."""
    renamed = type(error)(f"{prefix}: {error}")
    renamed.__cause__ = error.__cause__
    return renamed
