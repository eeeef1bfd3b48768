"""ONNX export of captured graphs: a lowering table keyed by op row name, like a backend's kernel
table, so each row is defined once (ember/ops/) and a row without a lowering is found generically.
The lowerings live by family in onnx_math.py, onnx_arrays.py and onnx_nn.py; this module holds the
table, the model builder, what they share, the rows without an ONNX form and the export itself.

A lowering is ``lower(b, xs, ins, outs, **attrs)``: ``b`` the model builder, ``xs`` the ONNX
names of the record's inputs, ``ins``/``outs`` the input and output metas, ``attrs`` the
canonical attributes; it returns the ONNX name of the output (or a list, for several). Rows
ONNX cannot express are in ``GAPS`` with the reason. Rows without array inputs (creation rows,
``dropout_mask``, ``fftfreq``) need no lowering: their outputs are fixed by their attributes, so
ember computes them once, on NumPy, and stores them as initializers.

The ``onnx`` package is imported only when a model is written (the extra ``ember[onnx]``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .. import dtypes as dt
from ..errors import OnnxError
from ..ops import OPS
from ..ops.records import LITERAL_METAS
from ..ops.table import Meta

OPSET = 18  # ReduceX take their axes as an input from 18 on; ONNX Runtime runs it everywhere

ONNX_TYPES = {  # ember dtype name -> onnx.TensorProto data type
    "bool": 9, "int8": 3, "int16": 5, "int32": 6, "int64": 7, "uint8": 2, "uint16": 4, "uint32": 12, "uint64": 13,
    "float32": 1, "float64": 11, "complex64": 14, "complex128": 15,
}

LOWERINGS: dict = {}
GAPS: dict[str, str] = {}


class NotExportable(Exception):
    """A lowering's refusal of one op instance (an attribute value ONNX cannot express)."""


def lowering(*names):
    def register(fn):
        for name in names:
            LOWERINGS[name] = fn
        return fn
    return register


# --- the builder -----------------------------------------------------------------------------------

class Builder:
    """Collects nodes and initializers; names are unique within the model."""

    def __init__(self, dynamic_batch: bool = False):
        import onnx
        self.onnx = onnx
        self.dynamic_batch = dynamic_batch
        self.op = ""  # the ember op being lowered: its nodes are named after it
        self.nodes: list = []
        self.initializers: list = []
        self._count = 0

    def fresh(self, hint: str = "t") -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def node(self, op_type: str, inputs, outputs: int = 1, **attrs):
        names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(self.onnx.helper.make_node(op_type, list(inputs), names, name=f"{self.op}/{names[0]}", **attrs))
        return names[0] if outputs == 1 else names

    def const(self, value, name: str | None = None) -> str:
        name = name or self.fresh("const")
        self.initializers.append(self.onnx.numpy_helper.from_array(np.asarray(value), name))
        return name

    def ints(self, values) -> str:
        return self.const(np.asarray(values, dtype=np.int64).reshape(-1))

    def scalar(self, value, dtype: dt.DType) -> str:
        return self.const(np.asarray(value, dtype=dt.NUMPY[dtype]))

    def cast(self, x: str, source: dt.DType, target: dt.DType) -> str:
        return x if source is target else self.node("Cast", [x], to=ONNX_TYPES[target.name])

    def reshape(self, x: str, shape) -> str:
        return self.node("Reshape", [x, self.ints(shape)], allowzero=1)


# --- what the lowering modules share -------------------------------------------------------------

def host_arrays(out):
    from ..interop import asnumpy
    return [asnumpy(a) for a in (out if isinstance(out, tuple) else (out,))]


def cast_common(b, xs, ins, dtype=None):
    """The inputs cast to one dtype (the promoted one unless given): ONNX operators take one type."""
    dtype = dtype or (ins[0].dtype if len(ins) == 1 else dt.promote(ins[0].dtype, ins[1].dtype))
    return [b.cast(x, m.dtype, dtype) for x, m in zip(xs, ins)], dtype


def axes_of(axis, ndim):
    return tuple(range(ndim)) if axis is None else tuple(axis)


def reduce(b, op_type, x, axes, keepdims):
    if not axes:
        return b.node("Identity", [x])
    return b.node(op_type, [x, b.ints(axes)], keepdims=int(keepdims))


def mean_of(b, x, meta, axes, keepdims, correction=0):
    """A sum divided by the count: NaN over nothing, as NumPy (ONNX's ReduceMean gives 0 there). With a dynamic
    batch the count is taken from x's shape when the model runs (a mean over the batch divides by its size)."""
    total = reduce(b, "ReduceSum", x, axes, keepdims)
    if b.dynamic_batch and axes:
        dims = b.node("Gather", [b.node("Shape", [x]), b.ints(axes)], axis=0)
        count = b.cast(reduce(b, "ReduceProd", dims, [0], False), dt.int64, meta.dtype)
        return b.node("Div", [total, b.node("Sub", [count, b.scalar(correction, meta.dtype)]) if correction else count])
    count = math.prod(meta.shape[a] for a in axes)
    return b.node("Div", [total, b.scalar(count - correction if count else math.nan, meta.dtype)])


def transposed(b, x, perm):
    return b.node("Transpose", [x], perm=perm) if perm != sorted(perm) else x


# --- rows without an ONNX form ---------------------------------------------------------------------

_COMPLEX = "complex results: ONNX Runtime computes no complex arithmetic"
GAPS.update({name: _COMPLEX for name in ("fft", "fftn", "ifft", "ifftn", "rfft", "rfftn", "irfft", "irfftn", "hfft", "ihfft")})
GAPS.update({name: "a data-dependent output length" for name in
             ("nonzero", "unique_values", "unique_counts", "unique_inverse", "unique_all")})
GAPS.update({name: "a factorisation or solver: ONNX has no operator for it (an unrolled one, with fixed pivots or "
                   "iterations, would be another algorithm)"
             for name in ("cholesky", "inv", "slogdet", "eigh", "eigvalsh", "qr", "svd", "svdvals", "pinv", "solve")})
GAPS["nextafter"] = "needs the bits of a float; ONNX has no bit cast"
GAPS.update({name: "a general eigendecomposition: complex results, and ONNX has no operator for it"
             for name in ("eig", "eigvals")})


def exportable_rows() -> list[str]:
    """The rows a graph may hold and still export: a lowering, or no array inputs (folded)."""
    return sorted(name for name, row in OPS.items() if name in LOWERINGS or (not row.inputs and name not in GAPS))


def missing_rows() -> dict[str, str]:
    """Rows without an ONNX form, each with why."""
    return {name: GAPS.get(name, "no lowering") for name in sorted(OPS) if name not in exportable_rows()}


# --- the export ----------------------------------------------------------------------------------

def _value_info(onnx, name, meta: Meta, batch: str | None):
    shape = [batch if (batch and i == 0) else s for i, s in enumerate(meta.shape)]
    return onnx.helper.make_tensor_value_info(name, ONNX_TYPES[meta.dtype.name], shape)


def to_model(graph, dynamic_batch: bool = False, name: str = "ember"):
    """The ONNX ModelProto of ``graph``; OnnxError listing every op without an ONNX form."""
    try:
        import onnx
    except ImportError:
        raise OnnxError("to_onnx: needs the onnx package (pip install 'ember[onnx]')") from None
    b = Builder(dynamic_batch)
    names = {}
    for input_name, node, _ in graph.inputs:
        names[node] = input_name
    for node, value in graph.constants.items():
        names[node] = b.const(value, f"constant_{node}")
    refused = []
    for k, op in enumerate(graph.ops):
        row = OPS[op.name]
        ins = [graph.metas[i] if type(i) is int else LITERAL_METAS[i[1]] for i in op.inputs]
        outs = [graph.metas[i] for i in op.outputs]
        complex_ = [m.dtype for m in (*ins, *outs) if m.dtype.kind == dt.COMPLEX]
        if complex_:
            refused.append((k, op.name, f"{complex_[0]} values: ONNX Runtime computes no complex arithmetic"))
            continue
        if any(type(i) is int and i not in names for i in op.inputs):
            continue  # reads what a refused op would have made: only the refused op is listed
        if not row.inputs and op.name not in GAPS:
            folded = host_arrays(_fold(row, op.attrs))
            if row.determined == ():  # `empty`: no value is promised, and memory's leftovers never go into a file
                folded = [np.zeros_like(a) for a in folded]
            results = [b.const(a) for a in folded]
        elif op.name not in LOWERINGS:
            refused.append((k, op.name, GAPS.get(op.name, "no lowering")))
            continue
        else:
            xs = [names[i] if type(i) is int else b.scalar(i[0], LITERAL_METAS[i[1]].dtype) for i in op.inputs]
            b.op = f"op{k}:{op.name}"
            try:
                results = LOWERINGS[op.name](b, xs, ins, outs, **op.attrs)
            except NotExportable as why:
                refused.append((k, op.name, str(why)))
                continue
            results = results if isinstance(results, list) else [results]
        names.update(zip(op.outputs, results))
    if refused:
        listing = "; ".join(f"op {k} {name}: {why}" for k, name, why in refused)
        raise OnnxError(f"to_onnx: {len(refused)} op{'s' if len(refused) > 1 else ''} of the graph "
                        f"{'have' if len(refused) > 1 else 'has'} no ONNX form — {listing}", refused)
    sizes = [m.shape[0] for _, _, m in graph.inputs if m.ndim]
    size = sizes[0] if dynamic_batch and sizes else None  # the captured batch: the first input's leading size

    def batch(meta):  # inputs and outputs that lead with the captured batch size lead with "batch"
        return "batch" if size is not None and meta.ndim and meta.shape[0] == size else None
    outputs = []
    for output_name, node in graph.outputs:
        b.nodes.append(onnx.helper.make_node("Identity", [names[node]], [output_name]))
        outputs.append(_value_info(onnx, output_name, graph.metas[node], batch(graph.metas[node])))
    inputs = [_value_info(onnx, n, m, batch(m)) for n, _, m in graph.inputs]
    body = onnx.helper.make_graph(b.nodes, name, inputs, outputs, initializer=b.initializers)
    model = onnx.helper.make_model(body, opset_imports=[onnx.helper.make_opsetid("", OPSET)], producer_name="ember")
    model.ir_version = min(model.ir_version, 9)  # what released ONNX Runtimes read
    if size is not None:
        _check_batch_stays_dynamic(onnx, model, size)
    return model


def _check_batch_stays_dynamic(onnx, model, size: int) -> None:
    """ONNX's shape inference (with data propagation) run over the model: a node computed from the inputs whose
    output leads with the captured batch ``size`` bakes it in; OnnxError names the ember ops of such nodes."""
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
    leading = {}
    for info in [*inferred.input, *inferred.value_info, *inferred.output]:
        dims = info.type.tensor_type.shape.dim
        if dims:
            leading[info.name] = dims[0].dim_param or dims[0].dim_value
    from_inputs = {i.name for i in inferred.input}
    baking = []
    for node in inferred.node:
        if any(i in from_inputs for i in node.input):
            op = node.name.split("/")[0]
            already = any(leading.get(i) == size for i in node.input if i in from_inputs)  # fixed before it
            if any(leading.get(o) == size for o in node.output) and not already and op and op not in baking:
                baking.append(op)
            from_inputs.update(node.output)
    fixed = [o.name for o in inferred.output if leading.get(o.name) == size]  # an output reduced over the batch has none
    if fixed:
        raise OnnxError(f"to_onnx: dynamic_batch: output{'s' if len(fixed) > 1 else ''} {', '.join(fixed)} would keep the "
                        f"captured batch size {size}: {', '.join(baking) or 'an op'} fix{'es' if len(baking) < 2 else ''} "
                        f"it (export without dynamic_batch, or capture at the batch size you run)",
                        tuple((op, "fixes the batch size") for op in baking))


def _fold(row, attrs):
    from ..array import bind
    return bind(row, (), attrs, device=_numpy())


def _numpy():
    from ..devices import device
    return device("numpy")


def to_onnx(graph, path, dynamic_batch: bool = False) -> Path:
    """Write ``graph`` as an ONNX model (opset 18) at ``path``; checked with ``onnx.checker``."""
    import onnx
    model = to_model(graph, dynamic_batch)
    onnx.checker.check_model(model, full_check=True)
    path = Path(path)
    onnx.save(model, str(path))
    return path


from . import onnx_arrays, onnx_math, onnx_nn  # noqa: E402, F401 — the lowering tables fill LOWERINGS
