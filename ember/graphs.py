"""Layer 7 — captured graphs: the capture scope, CapturedGraph (summary, DOT, save/load, replay)
and ``jit``.

A graph is plain data: inputs, outputs, constants and op records ``(row name, inputs, outputs,
attrs)`` whose inputs are node ids or ``(value, dtype name)`` literals — the same records the
wire carries, so a compute peer runs a registered graph with the code that runs single ops.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import dtypes as dt
from .array import Array, _new_array
from .devices import CaptureDevice, default_device
from .devices import device as as_device
from .engines.capture import Node
from .errors import (
    CaptureError,
    DataDependentError,
    DTypeError,
    EmberError,
    GraphFormatError,
    NotSupportedError,
    NoValueError,
    OutputError,
    ProtocolError,
    ScopeActiveError,
    ScopeClosedError,
    ShapeError,
    TracedBranchError,
    UndeclaredInputError,
)
from .ops import OPS
from .ops.records import LITERAL_METAS, OpRecord, check_records
from .ops.table import Meta, fmt_shape
from .trees import flatten, unflatten

GRAPH_FORMAT_VERSION = 1

__all__ = ["CaptureScope", "CapturedGraph", "capture", "load_graph", "jit", "ScopeActiveError", "OutputError",
           "TracedBranchError", "GraphFormatError", "ScopeClosedError", "NoValueError", "DataDependentError",
           "UndeclaredInputError"]


@dataclass(eq=False)
class CapturedGraph:
    """A recorded computation: call it to replay it on any executing device."""

    inputs: list            # [(name, id, Meta)]
    outputs: list           # [(name, id)]
    ops: list               # [OpRecord]
    constants: dict         # id -> read-only NumPy array
    metas: dict             # id -> Meta, for every node
    _uploads: dict = field(default_factory=dict, repr=False)  # engine -> constant handles

    # --- replay ---------------------------------------------------------------------------------

    def __call__(self, *args, device=None, **kwargs):
        """Run the graph on ``device`` (default: the device of the first array argument, else
        the default device). Inputs by position or by name; returns one array, or a tuple."""
        values = self._bind_inputs(args, kwargs)
        target = as_device(device) if device is not None else next(
            (v.device for v in values if isinstance(v, Array)), None) or default_device()
        from .namespace.creation import asarray
        handles = []
        for (name, _, meta), value in zip(self.inputs, values):
            array = value if isinstance(value, Array) and value.device is target else asarray(value, device=target)
            if array.shape != meta.shape or array.dtype is not meta.dtype:
                error = DTypeError if array.dtype is not meta.dtype else ShapeError
                raise error(f"replay: input {name!r} expects {fmt_shape(meta.shape)} {meta.dtype}, "
                            f"got {fmt_shape(array.shape)} {array.dtype}")
            handles.append(array._handle)
        outs = target.engine.run_graph(self, handles)
        arrays = tuple(_new_array(h, self.metas[i], target) for h, (_, i) in zip(outs, self.outputs))
        return arrays[0] if len(arrays) == 1 else arrays

    def _bind_inputs(self, args, kwargs) -> list:
        names = [name for name, _, _ in self.inputs]
        if len(args) > len(names):
            raise TypeError(f"replay: the graph takes {len(names)} inputs ({', '.join(names)}), got {len(args)}")
        values = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"replay: the graph has no input {key!r}; its inputs are {', '.join(names)}")
            if key in values:
                raise TypeError(f"replay: input {key!r} given twice")
            values[key] = value
        missing = [n for n in names if n not in values]
        if missing:
            raise TypeError(f"replay: missing input {missing[0]!r}")
        return [values[n] for n in names]

    def constant_handles(self, engine) -> dict:
        """Constants uploaded once per engine (a graph replayed many times uploads them once)."""
        handles = self._uploads.get(engine)
        if handles is None:
            handles = {i: engine.upload(v) for i, v in self.constants.items()}
            self._uploads[engine] = handles
        return handles

    # --- inspection -----------------------------------------------------------------------------

    def op_counts(self) -> Counter:
        return Counter(op.name for op in self.ops)

    def flops(self) -> int:
        """A rough count of floating-point work: elementwise ops and reductions count their
        elements, contractions 2·M·N·K (rows with a ``flops`` rule)."""
        total = 0
        for op in self.ops:
            row = OPS[op.name]
            ins = [self.metas[i] if isinstance(i, int) else LITERAL_METAS[i[1]] for i in op.inputs]
            outs = [self.metas[i] for i in op.outputs]
            if row.flops is not None:
                total += row.flops(ins, outs, op.attrs)
            elif row.family.startswith("elementwise"):
                total += sum(math.prod(m.shape) for m in outs)
            elif row.family == "reduction":
                total += sum(math.prod(m.shape) for m in ins)
        return total

    def constant_bytes(self) -> int:
        return sum(v.nbytes for v in self.constants.values())

    def __str__(self) -> str:
        counts = self.op_counts()
        lines = [f"CapturedGraph: {len(self.ops)} ops, {len(self.inputs)} inputs, {len(self.outputs)} outputs, "
                 f"{len(self.constants)} constants ({format_bytes(self.constant_bytes())}), ~{_count(self.flops())} flops"]
        shown = 6  # a summary, not a listing: to_json() has everything
        for name, _, meta in self.inputs[:shown]:
            lines.append(f"  input  {name}: {fmt_shape(meta.shape)} {meta.dtype}")
        if len(self.inputs) > shown:
            lines.append(f"  … and {len(self.inputs) - shown} more inputs")
        for name, node in self.outputs[:shown]:
            meta = self.metas[node]
            lines.append(f"  output {name}: {fmt_shape(meta.shape)} {meta.dtype}")
        if len(self.outputs) > shown:
            lines.append(f"  … and {len(self.outputs) - shown} more outputs")
        lines.append("  ops: " + ", ".join(f"{name} ×{n}" for name, n in counts.most_common()))
        return "\n".join(lines)

    def __repr__(self) -> str:
        inputs, outputs = [n for n, _, _ in self.inputs], [n for n, _ in self.outputs]
        return f"<CapturedGraph {len(self.ops)} ops, inputs {inputs}, outputs {outputs}>"

    def to_dot(self) -> str:
        """The graph in Graphviz's DOT language."""
        def label(meta):
            return f"{fmt_shape(meta.shape)} {meta.dtype}"

        lines = ["digraph ember {", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=10];']
        producer = {}
        for name, node, meta in self.inputs:
            lines.append(f'  n{node} [shape=ellipse, style=filled, fillcolor="#dbeafe", label="{name}\\n{label(meta)}"];')
            producer[node] = f"n{node}"
        for node in self.constants:
            lines.append(f'  n{node} [shape=note, label="constant\\n{label(self.metas[node])}"];')
            producer[node] = f"n{node}"
        for k, op in enumerate(self.ops):
            attrs = ", ".join(f"{a}={v}" for a, v in op.attrs.items() if v is not None and a != "key")
            text = op.name + (f"\\n{attrs}" if attrs and len(attrs) < 40 else "")
            lines.append(f'  op{k} [shape=box, style="rounded,filled", fillcolor="#fef3c7", label="{text}"];')
            for j, ref in enumerate(op.inputs):
                if isinstance(ref, int):
                    lines.append(f'  {producer[ref]} -> op{k} [label="{label(self.metas[ref])}", fontsize=8];')
                else:
                    lines.append(f'  lit{k}_{j} [shape=plaintext, label="{ref[0]!r}"]; lit{k}_{j} -> op{k};')
            for node in op.outputs:
                producer[node] = f"op{k}"
        for name, node in self.outputs:
            lines.append(f'  out_{name} [shape=ellipse, style=filled, fillcolor="#dcfce7", label="{name}"];')
            lines.append(f'  {producer[node]} -> out_{name} [label="{label(self.metas[node])}", fontsize=8];')
        lines.append("}")
        return "\n".join(lines)

    def render(self, path) -> Path:
        """Draw the graph: ``.dot`` writes DOT text; other suffixes (``.svg``, ``.png``, ``.pdf``)
        need Graphviz's ``dot`` program."""
        path = Path(path)
        if path.suffix == ".dot":
            path.write_text(self.to_dot())
            return path
        dot = shutil.which("dot")
        if dot is None:
            raise NotSupportedError(f"render: drawing {path.name} needs Graphviz's `dot` program, which is not installed "
                                    f"(apt install graphviz); render to a .dot file, or use g.to_dot()")
        subprocess.run([dot, f"-T{path.suffix.lstrip('.') or 'svg'}", "-o", str(path)], input=self.to_dot(),
                       text=True, check=True, capture_output=True)
        return path

    # --- files ----------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """A JSON-ready description, for reading (constants are summarised, not stored)."""
        def meta(m):
            return {"shape": list(m.shape), "dtype": m.dtype.name}

        def ref(r):
            return r if isinstance(r, int) else {"literal": _json_scalar(r[0]), "dtype": r[1]}

        return {
            "format": "ember.graph", "version": GRAPH_FORMAT_VERSION,
            "inputs": [{"name": n, "id": i, **meta(m)} for n, i, m in self.inputs],
            "outputs": [{"name": n, "id": i, **meta(self.metas[i])} for n, i in self.outputs],
            "constants": [{"id": i, **meta(self.metas[i]), "bytes": int(v.nbytes)} for i, v in self.constants.items()],
            "ops": [{"op": op.name, "inputs": [ref(r) for r in op.inputs], "outputs": list(op.outputs),
                     "attrs": {k: _json_value(v) for k, v in op.attrs.items()}} for op in self.ops],
        }

    def save(self, path) -> Path:
        """Write the graph: ``.json`` writes the readable export; anything else the binary format
        (msgpack frames, constants as raw segments) that :func:`load_graph` reads."""
        path = Path(path)
        if path.suffix == ".json":
            path.write_text(json.dumps(self.to_json(), indent=1))
            return path
        from .wire import protocol as wire
        constant_ids = list(self.constants)
        header = {
            "t": "graph", "format": "ember.graph", "version": GRAPH_FORMAT_VERSION,
            "inputs": tuple((n, i, m.dtype, m.shape) for n, i, m in self.inputs),
            "outputs": tuple((n, i) for n, i in self.outputs),
            "ops": tuple((op.name, op.inputs, op.outputs, op.attrs) for op in self.ops),
            "metas": tuple((i, m.dtype, m.shape) for i, m in self.metas.items()),
            "constants": tuple(constant_ids),
        }
        buffers = wire.encode_frame(header, [self.constants[i] for i in constant_ids])
        with open(path, "wb") as f:
            for b in buffers:
                f.write(b)
        return path


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _json_scalar(value):
    return {"re": value.real, "im": value.imag} if isinstance(value, complex) else value


def _json_value(value):
    if isinstance(value, dt.DType):
        return value.name
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, complex):
        return _json_scalar(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def load_graph(path) -> CapturedGraph:
    """Read a graph written by ``CapturedGraph.save``; GraphFormatError if it is malformed,
    truncated or newer than this ember reads."""
    from .wire import protocol as wire
    data = Path(path).read_bytes()
    reader = wire.FrameReader(wire.Limits(max_frame_bytes=max(len(data), 1 << 20), max_tensor_bytes=max(len(data), 1)))
    try:
        frames = reader.feed(data)
    except (ProtocolError, EmberError) as error:
        raise GraphFormatError(f"load_graph: {path} is not a valid ember graph: {error}") from None
    if len(frames) != 1 or reader.buffer().nbytes != wire.PREFIX_SIZE:
        raise GraphFormatError(f"load_graph: {path} is truncated or has trailing data")
    header, segments = frames[0]
    if header.get("format") != "ember.graph":
        raise GraphFormatError(f"load_graph: {path} is not an ember graph")
    version = header.get("version")
    if type(version) is not int or version < 1:
        raise GraphFormatError(f"load_graph: {path} has no valid graph format version: {version!r}")
    if version > GRAPH_FORMAT_VERSION:
        raise GraphFormatError(f"load_graph: {path} has graph format version {version!r}; this ember reads up to "
                               f"version {GRAPH_FORMAT_VERSION} — upgrade ember")
    try:
        if len(header["constants"]) != len(segments):
            raise GraphFormatError(f"load_graph: {path} names {len(header['constants'])} constants for "
                                   f"{len(segments)} stored tensors")
        metas = {i: Meta(tuple(shape), dtype) for i, dtype, shape in header["metas"]}
        graph = CapturedGraph(
            inputs=[(n, i, Meta(tuple(shape), dtype)) for n, i, dtype, shape in header["inputs"]],
            outputs=[(n, i) for n, i in header["outputs"]],
            ops=[OpRecord(name, tuple(inputs), tuple(outputs), dict(attrs)) for name, inputs, outputs, attrs in header["ops"]],
            constants={i: _read_only(segments[k]) for k, i in enumerate(header["constants"])},
            metas=metas,
        )
        validate(graph)
    except GraphFormatError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, EmberError) as error:
        raise GraphFormatError(f"load_graph: {path} is malformed: {error}") from None
    return graph


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _show(meta: Meta | None) -> str:
    return "nothing" if meta is None else f"{fmt_shape(meta.shape)} {meta.dtype}"


def validate(graph: CapturedGraph) -> None:
    """Re-run every op's meta rule from the inputs' metas; GraphFormatError if the graph's
    records disagree (a tampered or inconsistent file)."""
    for where, meta in [*((f"input {n!r}", m) for n, _, m in graph.inputs), *((f"node {i}", m) for i, m in graph.metas.items())]:
        if not isinstance(meta.dtype, dt.DType) or not all(type(s) is int and s >= 0 for s in meta.shape):
            raise GraphFormatError(f"{where} has no valid shape and dtype: {meta.shape!r:.60} {meta.dtype!r:.30}")
    known = {i: m for _, i, m in graph.inputs}
    for name, node, meta in graph.inputs:
        if graph.metas.get(node) != meta:
            raise GraphFormatError(f"input {name!r} is {_show(meta)}, but its node {node} is recorded as "
                                   f"{_show(graph.metas.get(node))}")
    for node, value in graph.constants.items():
        meta = Meta(value.shape, dt.FROM_NUMPY[value.dtype])
        if graph.metas.get(node) != meta:
            raise GraphFormatError(f"constant {node} holds {_show(meta)}, but is recorded as {_show(graph.metas.get(node))}")
        known[node] = meta
    try:
        checked = check_records(graph.ops, known)
    except ProtocolError as error:
        raise GraphFormatError(str(error)) from None
    for row, _, outputs, _, out_metas in checked:
        if any(graph.metas.get(i) != m for i, m in zip(outputs, out_metas)):
            raise GraphFormatError(f"{row.name}: the recorded output metas disagree with the op table")
    for name, node in graph.outputs:
        if node not in known:
            raise GraphFormatError(f"output {name!r} is not produced by the graph")


# --- the capture scope ------------------------------------------------------------------------------

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
        from .ops.table import as_shape
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
        ops.append(OpRecord(record.op.name, refs, outs, dict(record.attrs)))
    return CapturedGraph([(n, ids[key(node)], node.meta) for n, node in inputs],
                         [(n, ids[key(node)]) for n, node in outputs], ops, constants, metas)


# --- jit ---------------------------------------------------------------------------------------------

class Jitted:
    """A function captured once per (argument structure, shapes, dtypes, device) and replayed."""

    def __init__(self, function):
        self.function = function
        self.graphs: dict = {}
        self.__name__ = getattr(function, "__name__", "function")
        self.__doc__ = getattr(function, "__doc__", None)
        self.__wrapped__ = function

    def __call__(self, *args, **kwargs):
        leaves: list = []
        structure = flatten((args, kwargs), leaves)
        if not leaves:
            return self.function(*args, **kwargs)
        devices = {leaf.device for leaf in leaves}
        if len(devices) > 1:
            raise EmberError(f"jit({self.__name__}): array arguments are on different devices: {', '.join(map(str, devices))}")
        device = leaves[0].device
        key = (structure, tuple((leaf.shape, leaf.dtype) for leaf in leaves), device)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(structure, leaves)
        graph, out_structure = entry
        results = graph(*leaves, device=device) if graph.outputs else ()
        results = results if isinstance(results, tuple) else (results,)
        return unflatten(out_structure, results)

    def _capture(self, structure, leaves):
        with capture() as cap:
            tracers = [cap.input(leaf.shape, leaf.dtype, name=f"arg{i}") for i, leaf in enumerate(leaves)]
            args, kwargs = unflatten(structure, tracers)
            try:
                result = self.function(*args, **kwargs)
            except NoValueError as error:
                raise TracedBranchError(f"jit({self.__name__}): the function read a traced value while being captured "
                                        f"(Python `if`/`while`/`float()` on an array): {error}. Use em.where for "
                                        f"data-dependent choices, or pass the value as a non-array argument") from None
            out_leaves: list = []
            out_structure = flatten(result, out_leaves)
            for i, leaf in enumerate(out_leaves):
                if type(leaf._handle) is Node and leaf._handle.scope is cap:
                    cap.output(leaf, name=f"out{i}")
                else:
                    raise OutputError(f"jit({self.__name__}): output {i} is not computed in the function "
                                      f"(return it from outside the jitted function)")
        graph = cap.graph if out_leaves else CapturedGraph([], [], [], {}, {})
        return graph, out_structure

    def __repr__(self) -> str:
        return f"<jit {self.__name__}: {len(self.graphs)} captured>"


def jit(function):
    """Capture ``function`` on its first call for each argument structure, shapes, dtypes and
    device, and replay the graph afterwards — on a compute peer, the graph is registered once
    and each call sends only a reference and tensor ids."""
    return Jitted(function)

