"""A captured graph as data: replay on any device, and inspection (summary, DOT, rendering, a
JSON view); ``save`` writes the file format that ``files.load_graph`` reads.

A graph is plain data: inputs, outputs, constants and op records (``ops.records.OpRecord``)
whose inputs are node ids or ``(value, dtype name)`` literals — the same records the wire
carries, so a compute peer runs a registered graph with the code that runs single ops.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .. import dtypes as dt
from ..array import Array, _new_array
from ..devices import default_device
from ..devices import device as as_device
from ..errors import DTypeError, NotSupportedError, ShapeError, SignatureError
from ..namespace.creation import asarray
from ..ops import OPS
from ..ops.records import LITERAL_METAS
from ..ops.table import fmt_shape
from ..profiling import format_bytes
from ..wire import protocol as wire

GRAPH_FORMAT_VERSION = 1


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
            raise SignatureError(f"replay: the graph takes {len(names)} inputs ({', '.join(names)}), got {len(args)}")
        values = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names:
                raise SignatureError(f"replay: the graph has no input {key!r}; its inputs are {', '.join(names)}")
            if key in values:
                raise SignatureError(f"replay: input {key!r} given twice")
            values[key] = value
        missing = [n for n in names if n not in values]
        if missing:
            raise SignatureError(f"replay: missing input {missing[0]!r}")
        return [values[n] for n in names]

    def verify(self, devices, inputs=None):
        """Replay on each of ``devices`` and compare every intermediate with the first device's; the
        report names the first op whose outputs diverge beyond the dtype's tolerance (graphs/verify.py)."""
        from .verify import verify
        return verify(self, devices, inputs)

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
        lines = [f"CapturedGraph: {_many(len(self.ops), 'op')}, {_many(len(self.inputs), 'input')}, "
                 f"{_many(len(self.outputs), 'output')}, {_many(len(self.constants), 'constant')} "
                 f"({format_bytes(self.constant_bytes())}), ~{_count(self.flops())} flops"]
        shown = 6  # a summary, not a listing: to_json() has everything
        for name, _, meta in self.inputs[:shown]:
            lines.append(f"  input  {name}: {fmt_shape(meta.shape)} {meta.dtype}")
        if len(self.inputs) > shown:
            lines.append(f"  … and {_many(len(self.inputs) - shown, 'more input')}")
        for name, node in self.outputs[:shown]:
            meta = self.metas[node]
            lines.append(f"  output {name}: {fmt_shape(meta.shape)} {meta.dtype}")
        if len(self.outputs) > shown:
            lines.append(f"  … and {_many(len(self.outputs) - shown, 'more output')}")
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
        drawn = subprocess.run([dot, f"-T{path.suffix[1:] or 'svg'}", "-o", str(path)], input=self.to_dot(), text=True,
                               capture_output=True)
        if drawn.returncode:
            raise NotSupportedError(f"render: Graphviz could not draw {path.name}: {drawn.stderr.strip()}")
        return path

    # --- files ----------------------------------------------------------------------------------

    def to_onnx(self, path, dynamic_batch: bool = False) -> Path:
        """Write the graph as an ONNX model (needs ``ember[onnx]``): inputs and outputs keep their
        names, constants become initializers. ``dynamic_batch``: inputs and outputs whose leading size is
        the first input's get a symbolic leading axis "batch" (OnnxError names the ops that would fix it).
        OnnxError lists every op without an ONNX form (docs/onnx.md)."""
        from .onnx import to_onnx
        return to_onnx(self, path, dynamic_batch)

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
        constant_ids = list(self.constants)
        header = {
            "format": "ember.graph", "version": GRAPH_FORMAT_VERSION,
            "inputs": tuple((n, i, m.dtype, m.shape) for n, i, m in self.inputs),
            "outputs": tuple((n, i) for n, i in self.outputs),
            "ops": tuple(op[:4] for op in self.ops),  # the records as the wire carries them (no metas)
            "metas": tuple((i, m.dtype, m.shape) for i, m in self.metas.items()),
            "constants": tuple(constant_ids),
        }
        buffers = wire.encode_frame(header, [self.constants[i] for i in constant_ids])
        with open(path, "wb") as f:
            for b in buffers:
                f.write(b)
        return path



def _many(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


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
