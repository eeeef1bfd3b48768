"""The local engine: executes each op immediately through a backend's kernel table."""

from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..errors import EmberError, ExecutionError, IndexingError, NotSupportedError
from ..ops.table import Meta, fmt_shape
from .base import Engine


class LocalEngine(Engine):
    """Runs ops now, on one backend device; handles are native arrays."""

    def __init__(self, backend):
        self.backend = backend
        self._kernels = backend.kernels
        self._native_type = backend.native_type
        self._dtypes = frozenset(backend.dtypes)
        self._all_dtypes = len(self._dtypes) == len(dt.ALL)  # then results need no dtype check
        self.ops_executed = 0

    def execute(self, op, inputs, in_metas, attrs, metas):
        try:
            kernel = self._kernels[op.name]
        except KeyError:
            reason = self.backend.gaps.get(op.name, "no kernel")
            raise NotSupportedError(f"{op.name}: not supported on {self.backend.device_name} ({reason})") from None
        if not self._all_dtypes:
            self._check_dtypes(op, metas)
        try:
            out = kernel(*inputs, **attrs)
        except EmberError:
            raise
        except Exception as error:
            raise _translate(error, op.name, inputs) from error
        self.ops_executed += 1
        native_type = self._native_type
        if op.multiple:
            outs = tuple(o if type(o) is native_type else self.backend.coerce(o) for o in out)
        else:
            outs = (out if type(out) is native_type else self.backend.coerce(out),)
        if op.data_dependent:
            metas = tuple(Meta(tuple(o.shape), m.dtype) for o, m in zip(outs, metas))
        return outs, metas

    def _check_dtypes(self, op, metas) -> None:
        for meta in metas:
            if meta.dtype not in self._dtypes:
                raise NotSupportedError(f"{op.name}: {self.backend.device_name} does not support {meta.dtype} results; "
                                        f"ask for another dtype (e.g. dtype=int64)")

    def upload(self, host: np.ndarray, copy: bool | None = None):
        return self.backend.from_host(host, copy)

    def download(self, handle) -> np.ndarray:
        return self.backend.to_host(handle)

    def native(self, handle):
        return handle

    def stats(self) -> dict:
        return {"ops": self.ops_executed, "round_trips": 0, "bytes_up": 0, "bytes_down": 0}


def _describe(inputs) -> str:
    parts = []
    for value in inputs:
        shape = getattr(value, "shape", None)
        parts.append(f"{fmt_shape(tuple(shape))} {str(value.dtype).replace('torch.', '')}" if shape is not None else repr(value))
    return ", ".join(parts)


def _translate(error: Exception, name: str, inputs) -> EmberError:
    """A backend's exception as a typed ember error naming the op and its inputs."""
    message = f"{name}: {error} (inputs: {_describe(inputs)})"
    if isinstance(error, IndexError):
        return IndexingError(message)
    return ExecutionError(message)
