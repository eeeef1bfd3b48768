"""ember — array computing on any device.

The same Python Array API code runs on a local backend (NumPy, PyTorch), on a compute peer
across the network (``ember://host:port/0``), on a capture device that records instead of
executing, and under autodiff on top of any of them::

    import ember as em
    x = em.asarray([[1.0, 2.0], [3.0, 4.0]], device="numpy")
    y = em.matmul(x, x.mT) * 2 + 1
    em.asnumpy(y)

``ember`` itself is an Array API (2025.12) namespace with the ``linalg`` and ``fft`` extensions.
"""

from __future__ import annotations

import math as _math
import os as _os
import sys as _sys

from .array import Array
from .devices import Device, default_device, device
from .dtypes import (bool_ as bool, complex64, complex128, float32, float64, int8, int16, int32, int64, uint8,  # noqa: A004
                     uint16, uint32, uint64)
from .errors import (AccessDenied, ArgumentError, AxisError, CaptureError, ConnectionLost, DeviceError, DTypeError, EmberError,
                     ExecutionError, HostDeviceError, IndexingError, NotSupportedError, PeerBusy, ProtocolError,
                     ResourceLimitError, ScalarOverflowError, ShapeError, SignatureError, TLSError)
from .namespace import fft, linalg, nn
from .namespace.creation import *  # noqa: F403
from .namespace.data_types import *  # noqa: F403
from .namespace.elementwise import *  # noqa: F403
from .namespace.indexing import *  # noqa: F403
from .namespace.info import __array_namespace_info__
from .namespace.linear_algebra import *  # noqa: F403
from .namespace.manipulation import *  # noqa: F403
from .namespace.searching import *  # noqa: F403
from .namespace.sets import *  # noqa: F403
from .namespace.sorting import *  # noqa: F403
from .namespace.statistical import *  # noqa: F403
from .namespace.utility import *  # noqa: F403
from .interop import asnumpy, stats, sync
from .profiling import profile
from .remote.server import Server, serve
from .graphs import CapturedGraph, capture, jit, load_graph, load_onnx
from .autodiff import autodiff, enable_grad, grad, is_grad_enabled, no_grad, value_and_grad
from . import optim  # noqa: E402

__version__ = "0.1.0"
__array_api_version__ = "2025.12"

Array._namespace = _sys.modules[__name__]  # what every array's __array_namespace__() returns

e = _math.e
inf = _math.inf
nan = _math.nan
pi = _math.pi
newaxis = None

if _os.environ.get("EMBER_PROFILE", "0") not in ("", "0"):  # profile the whole program, report at exit
    from .profiling import profile_program as _profile_program
    _profile_program(_os.environ["EMBER_PROFILE"])

# ``import ember.linalg`` and ``import ember.fft`` work like the attributes
_sys.modules[__name__ + ".linalg"] = linalg
_sys.modules[__name__ + ".fft"] = fft
_sys.modules[__name__ + ".nn"] = nn
