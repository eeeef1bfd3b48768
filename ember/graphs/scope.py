"""The capture scope: ``with em.capture() as cap:`` declares inputs and outputs on a capture
device, and ``cap.graph`` extracts the recorded records into a :class:`CapturedGraph`."""

from __future__ import annotations

import threading

from .. import dtypes as dt
from ..array import Array, _new_array
from ..devices import CaptureDevice
from ..engines.capture import Node
from ..errors import CaptureError, DTypeError, OutputError, ScopeActiveError, ScopeClosedError, UndeclaredInputError
from ..ops.records import OpRecord
from ..ops.table import Meta, as_shape
from .graph import CapturedGraph

_ACTIVE = threading.local()


class CaptureScope:
    """``with em.capture() as cap:`` — declare inputs, compute, declare outputs; ``cap.graph``."""

    def __init__(self):
        self.device = CaptureDevice(self)
        self.closed = False
        self._inputs: list[tuple[str, Node]] = []
        self._outputs: list[tuple[str, Node]] = []
        self._graph: CapturedGraph | None = None

    def __enter__(self) -> CaptureScope:
        if getattr(_ACTIVE, "scope", None) is not None:
            raise ScopeActiveError("capture: a capture scope is already active in this thread; close it first "
                                   "(scopes do not nest)")
        _ACTIVE.scope = self
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.scope = None
        self.closed = True

    def input(self, shape, dtype: dt.DType = dt.float64, name: str | None = None) -> Array:
        """A placeholder for a value given at replay: an array on ``cap.device``."""
        if self.closed:
            raise ScopeClosedError("input: this capture scope is closed")
        if not isinstance(dtype, dt.DType):
            raise DTypeError(f"input: dtype must be an ember dtype, got {dtype!r}")
        name = name or f"input{len(self._inputs)}"
        if any(n == name for n, _ in self._inputs):
            raise CaptureError(f"input: an input named {name!r} exists already")
        node = Node(self, Meta(as_shape(shape), dtype), name=name)
        self._inputs.append((name, node))
        return _new_array(node, node.meta, self.device)

    def output(self, value: Array, name: str | None = None) -> None:
        """Declare ``value``, computed in this scope, an output of the graph."""
        if self.closed:
            raise ScopeClosedError("output: this capture scope is closed")
        if not isinstance(value, Array) or type(value._handle) is not Node or value._handle.scope is not self:
            where = value.device if isinstance(value, Array) else type(value).__name__
            raise OutputError(f"output: the value ({where}) was not produced in this capture scope")
        name = name or f"output{len(self._outputs)}"
        if any(n == name for n, _ in self._outputs):
            raise OutputError(f"output: an output named {name!r} exists already")
        self._outputs.append((name, value._handle))
        self._graph = None

    @property
    def graph(self) -> CapturedGraph:
        """The graph from the declared inputs to the declared outputs."""
        if not self._outputs:
            raise OutputError("graph: no outputs were declared (cap.output(y, name='y'))")
        if self._graph is None:
            self._graph = _extract(self._inputs, self._outputs)
        return self._graph


def capture() -> CaptureScope:
    """A capture scope: ``with em.capture() as cap: ...`` then ``cap.graph``."""
    return CaptureScope()


def _extract(inputs, outputs) -> CapturedGraph:
    """Number the nodes reachable from ``outputs`` and order their records topologically."""
    ids: dict = {}
    metas: dict = {}
    constants: dict = {}
    ops: list = []

    def key(node: Node):
        return (id(node.record), node.index) if node.record is not None else id(node)

    def number(k, meta) -> int:
        if k not in ids:
            ids[k] = len(ids)
            metas[ids[k]] = meta
        return ids[k]

    for _, node in inputs:
        number(key(node), node.meta)
    emitted: set = set()
    stack = [(node, False) for _, node in reversed(outputs)]
    while stack:  # iterative post-order: a long chain must not overflow Python's stack
        node, expanded = stack.pop()
        record = node.record
        if record is None:
            if node.value is not None and key(node) not in ids:
                constants[number(key(node), node.meta)] = node.value
            elif node.value is None and key(node) not in ids:
                raise UndeclaredInputError(f"graph: input {node.name!r} belongs to another scope")
            continue
        if id(record) in emitted:
            continue
        if not expanded:
            stack.append((node, True))
            stack.extend((ref, False) for ref in reversed(record.inputs) if type(ref) is Node)
            continue
        emitted.add(id(record))
        refs = tuple(ids[key(ref)] if type(ref) is Node else ref for ref in record.inputs)
        outs = tuple(number((id(record), i), m) for i, m in enumerate(record.metas))
        ops.append(OpRecord(record.name, refs, outs, dict(record.attrs)))
    return CapturedGraph([(n, ids[key(node)], node.meta) for n, node in inputs],
                         [(n, ids[key(node)]) for n, node in outputs], ops, constants, metas)
