"""The capture engine: records operations into a graph and never executes them.

Handles are :class:`Node` objects linked to the ``OpRecord`` of the op that produced them
(ops/records.py: its inputs are nodes or literals, and it keeps its outputs' metas), so a graph
is whatever is reachable from its outputs (nodes nobody holds are freed like any Python object).
Inputs are placeholders declared in a scope; constants are nodes holding a host value, the only
nodes that can be read.
"""

from __future__ import annotations

import itertools

import numpy as np

from .. import dtypes as dt
from ..errors import DataDependentError, NoValueError, ScopeClosedError, UndeclaredInputError
from ..ops.records import OpRecord
from ..ops.table import Meta, fmt_shape
from .base import Engine


class Node:
    """A captured tensor: an input, a constant, or output ``index`` of a record."""

    __slots__ = ("scope", "meta", "record", "index", "value", "name", "__weakref__")
    _counter = itertools.count()

    def __init__(self, scope, meta: Meta, record: OpRecord | None = None, index: int = 0, value=None, name=None):
        self.scope, self.meta, self.record, self.index, self.value, self.name = scope, meta, record, index, value, name

    @property
    def kind(self) -> str:
        return "constant" if self.value is not None else "input" if self.record is None else "computed"


class CaptureEngine(Engine):
    """Records ops for one capture device (a scope, or the unscoped ``capture`` device)."""

    executes = False

    def __init__(self, device, scope=None):
        self.device = device
        self.scope = scope
        self.ops_recorded = 0

    def _check(self, node, what: str) -> None:
        if type(node) is not Node or node.scope is not self.scope:
            raise UndeclaredInputError(f"{what}: a tensor from another capture was used here; declare it with "
                                       f"cap.input(...) or pass its value as a constant")
        if self.scope is not None and self.scope.closed:
            raise ScopeClosedError(f"{what}: this capture scope is closed; its tensors can no longer be used "
                                   f"(replay its graph, cap.graph, on a device instead)")

    def execute(self, op, inputs, in_metas, attrs, metas):
        refs = []
        for value, meta in zip(inputs, in_metas):
            if type(value) is Node:
                self._check(value, op.name)
                refs.append(value)
            else:
                refs.append((value, meta.dtype.name))  # a literal (ops/records.py)
        if op.data_dependent and any(None in m.shape for m in metas):
            raise DataDependentError(f"{op.name}: the output shape depends on the data (nonzero, unique, boolean "
                                     f"masks), which a capture cannot know; capture the computation around it instead")
        if self.scope is not None and self.scope.closed:
            raise ScopeClosedError(f"{op.name}: this capture scope is closed")
        record = OpRecord(op.name, tuple(refs), (), attrs, metas)  # outputs point back at it by index
        self.ops_recorded += 1
        return tuple(Node(self.scope, m, record, i) for i, m in enumerate(metas)), metas

    def mixing_error(self, what: str, mine, other) -> UndeclaredInputError:
        if other.inner().kind == "capture":
            return UndeclaredInputError(f"{what}: a tensor from another capture was used here; declare it with "
                                        f"cap.input(...) or pass its value as a constant")
        return UndeclaredInputError(f"{what}: an array on {other} met a captured one; a capture only sees its declared "
                                    f"inputs (cap.input) and constants (em.asarray(value, device=cap.device))")

    def upload(self, host: np.ndarray) -> Node:
        if self.scope is not None and self.scope.closed:
            raise ScopeClosedError("asarray: this capture scope is closed")
        value = np.array(host, copy=True)  # a constant keeps the value it had when captured
        value.flags.writeable = False
        return Node(self.scope, Meta(tuple(value.shape), dt.FROM_NUMPY[value.dtype]), value=value)

    def download(self, handle: Node) -> np.ndarray:
        if handle.value is not None:
            return handle.value
        what = f"input {handle.name!r}" if handle.record is None else f"the output of {handle.record.name}"
        raise NoValueError(f"{what} ({fmt_shape(handle.meta.shape)} {handle.meta.dtype}) has no concrete value: "
                           f"capture records, it does not execute — replay the graph on a device")

    def stats(self) -> dict:
        return {"ops": self.ops_recorded, "round_trips": 0, "bytes_up": 0, "bytes_down": 0}
