"""ONNX export of captured graphs: a lowering table keyed by op row name, like a backend's kernel
table, so each row is defined once (ember/ops/) and a row without a lowering is found generically.
The lowerings live by family in onnx_math.py, onnx_reductions.py, onnx_arrays.py and onnx_nn.py,
over the table, the model builder and the helpers of onnx_lowering.py; this module holds the rows
without an ONNX form and the export itself.

A lowering is ``lower(b, xs, ins, outs, **attrs)``: ``b`` the model builder, ``xs`` the ONNX
names of the record's inputs, ``ins``/``outs`` the input and output metas, ``attrs`` the
canonical attributes; it returns the ONNX name of the output (or a list, for several). Rows
ONNX cannot express are in ``GAPS`` with the reason. Rows without array inputs (creation rows,
``dropout_mask``, ``fftfreq``) need no lowering: their outputs are fixed by their attributes, so
ember computes them once, on NumPy, and stores them as initializers.

The ``onnx`` package is imported only when a model is written (the extra ``ember[onnx]``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import dtypes as dt
from ..errors import OnnxError
from ..ops import OPS
from ..ops.records import LITERAL_METAS
from ..ops.table import Meta
from . import onnx_arrays, onnx_math, onnx_nn, onnx_reductions  # noqa: F401 — the lowering tables fill LOWERINGS
from .onnx_lowering import LOWERINGS, ONNX_TYPES, Builder, NotExportable, host_arrays

OPSET = 18  # ReduceX take their axes as an input from 18 on; ONNX Runtime runs it everywhere

GAPS: dict[str, str] = {}


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

