"""ONNX import: ``load_onnx`` reads an ONNX model into a CapturedGraph by running its nodes through
ember's namespace inside a capture scope, so the graph holds ordinary op rows: it replays on any
device (a compute peer included) and ember's autodiff differentiates it.

``IMPORTS`` maps an ONNX operator to ``fn(ctx, node) -> outputs``. Values whose data the model fixes
(initializers, Constant nodes, and what is computed from them alone, Shape of a captured tensor
included) are kept as host arrays and folded at import, so shape arithmetic (Shape → Gather →
Concat → Reshape, as exporters write it) never reaches the graph.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .. import dtypes as dt
from ..array import Array
from ..errors import GraphFormatError, OnnxError
from ..interop import asnumpy
from ..namespace import creation, elementwise, linear_algebra, manipulation, nn, searching, statistical
from ..namespace.data_types import astype
from .onnx_lowering import ONNX_TYPES
from .scope import capture

FROM_ONNX = {code: dt.BY_NAME[name] for name, code in ONNX_TYPES.items()}
IMPORTS: dict = {}


def importer(*op_types):
    def register(fn):
        for op_type in op_types:
            IMPORTS[op_type] = fn
        return fn
    return register


class Context:
    """One node's view: its inputs as arrays (captured, or folded on NumPy) or as host values."""

    def __init__(self, node, values: dict, device, attrs: dict):
        self.node, self.values, self.device, self.attrs = node, values, device, attrs

    def attr(self, name, default=None):
        return self.attrs.get(name, default)

    def has(self, k: int) -> bool:
        return len(self.node.input) > k and self.node.input[k] != ""

    def array(self, k: int) -> Array:
        value = self.values[self.node.input[k]]
        return value if isinstance(value, Array) else creation.asarray(value, device=self.device)

    def arrays(self) -> list:
        return [self.array(k) for k in range(len(self.node.input)) if self.has(k)]

    def static(self, k: int) -> np.ndarray:
        """An input the model must fix (a shape, axes, starts): a host array."""
        value = self.values[self.node.input[k]]
        if isinstance(value, Array):
            if value.device.engine.executes:
                return asnumpy(value)
            raise OnnxError(f"load_onnx: {self.node.op_type} node {self.node.name!r} needs input {k} "
                            f"({self.node.input[k]!r}) fixed by the model, but it is computed from graph inputs")
        return value

    def shape(self, k: int) -> tuple:
        value = self.values[self.node.input[k]]
        return tuple(value.shape)


def _elementwise(fn):
    return lambda ctx: fn(*ctx.arrays())


for _type, _fn in {"Abs": elementwise.abs, "Neg": elementwise.negative, "Exp": elementwise.exp, "Log": elementwise.log,
                   "Sqrt": elementwise.sqrt, "Sin": elementwise.sin, "Cos": elementwise.cos, "Tan": elementwise.tan,
                   "Asin": elementwise.asin, "Acos": elementwise.acos, "Atan": elementwise.atan, "Sinh": elementwise.sinh,
                   "Cosh": elementwise.cosh, "Asinh": elementwise.asinh, "Acosh": elementwise.acosh,
                   "Atanh": elementwise.atanh, "Tanh": elementwise.tanh, "Reciprocal": elementwise.reciprocal,
                   "Floor": elementwise.floor, "Ceil": elementwise.ceil, "Round": elementwise.round,
                   "Sign": elementwise.sign, "IsNaN": elementwise.isnan, "Not": elementwise.logical_not,
                   "BitwiseNot": elementwise.bitwise_invert, "Sigmoid": nn.sigmoid, "Relu": nn.relu,
                   "Add": elementwise.add, "Sub": elementwise.subtract, "Mul": elementwise.multiply,
                   "Pow": elementwise.pow, "Equal": elementwise.equal, "Less": elementwise.less,
                   "Greater": elementwise.greater, "LessOrEqual": elementwise.less_equal,
                   "GreaterOrEqual": elementwise.greater_equal, "And": elementwise.logical_and,
                   "Or": elementwise.logical_or, "Xor": elementwise.logical_xor, "BitwiseAnd": elementwise.bitwise_and,
                   "BitwiseOr": elementwise.bitwise_or, "BitwiseXor": elementwise.bitwise_xor,
                   "MatMul": linear_algebra.matmul, "Where": searching.where}.items():
    IMPORTS[_type] = _elementwise(_fn)


def _fold(fn, arrays):
    out = arrays[0]
    for a in arrays[1:]:
        out = fn(out, a)
    return out


IMPORTS["Max"] = lambda ctx: _fold(elementwise.maximum, ctx.arrays())
IMPORTS["Min"] = lambda ctx: _fold(elementwise.minimum, ctx.arrays())
IMPORTS["Sum"] = lambda ctx: _fold(elementwise.add, ctx.arrays())
IMPORTS["Mean"] = lambda ctx: elementwise.divide(_fold(elementwise.add, ctx.arrays()), float(len(ctx.arrays())))
IMPORTS["Identity"] = IMPORTS["Dropout"] = lambda ctx: ctx.array(0)  # inference: dropout is the identity


@importer("Div")
def _div(ctx):
    a, b = ctx.arrays()
    if dt.in_category(a.dtype, "real floating"):
        return elementwise.divide(a, b)
    # ONNX divides integers with truncation; ember's floor_divide rounds down: step back where they differ
    q = elementwise.floor_divide(a, b)
    inexact = elementwise.not_equal(elementwise.multiply(q, b), a)
    return searching.where(elementwise.logical_and(inexact, elementwise.less(q, 0)), q + 1, q)


@importer("Mod")
def _mod(ctx):
    a, b = ctx.arrays()
    if not ctx.attr("fmod", 0):
        return elementwise.remainder(a, b)
    return elementwise.subtract(a, elementwise.multiply(elementwise.trunc(elementwise.divide(a, b)), b))


@importer("IsInf")
def _isinf(ctx):
    x = ctx.array(0)
    positive, negative = ctx.attr("detect_positive", 1), ctx.attr("detect_negative", 1)
    inf = elementwise.isinf(x)
    if positive and negative:
        return inf
    return elementwise.logical_and(inf, elementwise.greater(x, 0) if positive else elementwise.less(x, 0))


@importer("LeakyRelu")
def _leaky_relu(ctx):
    x = ctx.array(0)
    return searching.where(elementwise.greater_equal(x, 0), x, elementwise.multiply(x, ctx.attr("alpha", 0.01)))


@importer("Clip")
def _clip(ctx):
    x = ctx.array(0)
    if ctx.has(1):
        x = elementwise.maximum(x, ctx.array(1))
    if ctx.has(2):
        x = elementwise.minimum(x, ctx.array(2))
    return x


@importer("Gelu")
def _gelu(ctx):
    return nn.gelu(ctx.array(0), approximate=ctx.attr("approximate", b"none").decode())


@importer("Softmax", "LogSoftmax")
def _softmax(ctx):
    fn = nn.softmax if ctx.node.op_type == "Softmax" else nn.log_softmax
    return fn(ctx.array(0), axis=ctx.attr("axis", -1))


@importer("Cast")
def _cast(ctx):
    return astype(ctx.array(0), FROM_ONNX[ctx.attr("to")])


@importer("Reshape")
def _reshape(ctx):
    x, shape = ctx.array(0), [int(s) for s in ctx.static(1)]
    if not ctx.attr("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return manipulation.reshape(x, tuple(shape))


@importer("Flatten")
def _flatten(ctx):
    x = ctx.array(0)
    axis = ctx.attr("axis", 1) % (x.ndim + 1) if x.ndim else 0
    return manipulation.reshape(x, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))


def _axes_of(ctx, k=1):
    if ctx.has(k):
        return [int(a) for a in ctx.static(k)]
    return ctx.attr("axes")


@importer("Unsqueeze")
def _unsqueeze(ctx):
    x, axes = ctx.array(0), _axes_of(ctx)
    ndim = x.ndim + len(axes)
    axes = sorted(a % ndim for a in axes)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return manipulation.reshape(x, tuple(shape))


@importer("Squeeze")
def _squeeze(ctx):
    x, axes = ctx.array(0), _axes_of(ctx)
    axes = tuple(range(x.ndim)) if axes is None else axes
    axes = {a % x.ndim for a in axes if x.shape[a % x.ndim] == 1}
    return manipulation.reshape(x, tuple(s for i, s in enumerate(x.shape) if i not in axes))


@importer("Transpose")
def _transpose(ctx):
    x = ctx.array(0)
    perm = ctx.attr("perm") or list(range(x.ndim))[::-1]
    return manipulation.permute_dims(x, tuple(perm))


@importer("Concat")
def _concat(ctx):
    return manipulation.concat(ctx.arrays(), axis=ctx.attr("axis"))


@importer("Expand")
def _expand(ctx):
    x, shape = ctx.array(0), tuple(int(s) for s in ctx.static(1))
    ndim = max(x.ndim, len(shape))
    padded = (1,) * (ndim - len(shape)) + shape
    current = (1,) * (ndim - x.ndim) + tuple(x.shape)
    return manipulation.broadcast_to(x, tuple(max(a, b) if 1 in (a, b) else a for a, b in zip(current, padded)))


@importer("Gather")
def _gather(ctx):
    return manipulation_take(ctx.array(0), ctx.array(1), ctx.attr("axis", 0))


def manipulation_take(x, indices, axis):
    """ONNX's Gather: any index shape (ember's take takes 1-d indices), negative indices wrap."""
    from ..namespace.indexing import take
    axis %= x.ndim
    flat = manipulation.reshape(indices, (math.prod(indices.shape),))
    flat = searching.where(elementwise.less(flat, 0), flat + x.shape[axis], flat)
    out = take(x, flat, axis=axis)
    return manipulation.reshape(out, x.shape[:axis] + tuple(indices.shape) + x.shape[axis + 1:])


@importer("GatherElements")
def _gather_elements(ctx):
    from ..namespace.indexing import take_along_axis
    x, indices = ctx.array(0), ctx.array(1)
    axis = ctx.attr("axis", 0) % x.ndim
    return take_along_axis(x, searching.where(elementwise.less(indices, 0), indices + x.shape[axis], indices), axis=axis)


@importer("Slice")
def _slice(ctx):
    x = ctx.array(0)
    starts, ends = ctx.static(1), ctx.static(2)
    axes = ctx.static(3) if ctx.has(3) else range(len(starts))
    steps = ctx.static(4) if ctx.has(4) else [1] * len(starts)
    key = [slice(None)] * x.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps):
        size = x.shape[int(axis)]
        clamp = lambda v: max(-size - 1, min(int(v), size))  # ONNX's ends run to ±2**63
        key[int(axis)] = slice(clamp(start), None if step < 0 and end < -size else clamp(end), int(step))
    return x[tuple(key)]


@importer("Shape")
def _shape(ctx):
    shape = np.asarray(ctx.shape(0), dtype=np.int64)
    return shape[ctx.attr("start", 0):ctx.attr("end", None)]


@importer("Size")
def _size(ctx):
    return np.asarray(math.prod(ctx.shape(0)), dtype=np.int64)


@importer("ConstantOfShape")
def _constant_of_shape(ctx):
    from onnx import numpy_helper
    value = ctx.attr("value")
    fill = numpy_helper.to_array(value) if value is not None else np.zeros(1, np.float32)
    return np.full(tuple(int(s) for s in ctx.static(0)), fill.reshape(()), dtype=fill.dtype)


@importer("Range")
def _range(ctx):
    start, limit, delta = (ctx.static(k) for k in range(3))
    return np.arange(start, limit, delta, dtype=np.asarray(start).dtype)


@importer("Gemm")
def _gemm(ctx):
    a, b = ctx.array(0), ctx.array(1)
    if ctx.attr("transA", 0):
        a = manipulation.permute_dims(a, (1, 0))
    if ctx.attr("transB", 0):
        b = manipulation.permute_dims(b, (1, 0))
    out = linear_algebra.matmul(a, b)
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    if alpha != 1.0:
        out = out * alpha
    if ctx.has(2):
        c = ctx.array(2)
        out = out + (c if beta == 1.0 else c * beta)
    return out


def _reduce_axes(ctx):
    axes = _axes_of(ctx)
    if axes is None or len(axes) == 0:
        return None if not ctx.attr("noop_with_empty_axes", 0) else ()
    return tuple(a % max(ctx.array(0).ndim, 1) for a in axes)


for _type, _fn in {"ReduceSum": statistical.sum, "ReduceMean": statistical.mean, "ReduceMax": statistical.max,
                   "ReduceMin": statistical.min, "ReduceProd": statistical.prod}.items():
    def _reducer(ctx, fn=_fn):
        x, axes = ctx.array(0), _reduce_axes(ctx)
        keep = bool(ctx.attr("keepdims", 1))
        if axes == ():
            return x
        out = fn(x, axis=axes, keepdims=keep)
        return astype(out, x.dtype) if out.dtype is not x.dtype else out
    IMPORTS[_type] = _reducer


@importer("ReduceL2")
def _reduce_l2(ctx):
    from ..namespace.linalg import vector_norm
    return vector_norm(ctx.array(0), axis=_reduce_axes(ctx), keepdims=bool(ctx.attr("keepdims", 1)))


@importer("ArgMax", "ArgMin")
def _arg(ctx):
    fn = searching.argmax if ctx.node.op_type == "ArgMax" else searching.argmin
    if ctx.attr("select_last_index", 0):
        raise OnnxError(f"load_onnx: {ctx.node.op_type} with select_last_index=1 is not imported")
    return fn(ctx.array(0), axis=ctx.attr("axis", 0), keepdims=bool(ctx.attr("keepdims", 1)))


@importer("CumSum")
def _cumsum(ctx):
    if ctx.attr("exclusive", 0) or ctx.attr("reverse", 0):
        raise OnnxError("load_onnx: CumSum with exclusive or reverse set is not imported")
    x = ctx.array(0)
    return statistical.cumulative_sum(x, axis=int(ctx.static(1)), dtype=x.dtype)


@importer("Trilu")
def _trilu(ctx):
    k = int(ctx.static(1)) if ctx.has(1) else 0
    return (creation.triu if ctx.attr("upper", 1) else creation.tril)(ctx.array(0), k=k)


@importer("Tile")
def _tile(ctx):
    return manipulation.tile(ctx.array(0), tuple(int(r) for r in ctx.static(1)))


def _symmetric_pads(ctx, spatial=2):
    pads = ctx.attr("pads") or [0] * (2 * spatial)
    if ctx.attr("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or pads[:spatial] != pads[spatial:]:
        raise OnnxError(f"load_onnx: {ctx.node.op_type} node {ctx.node.name!r}: only explicit, symmetric pads are imported")
    return tuple(pads[:spatial])


@importer("Conv")
def _conv(ctx):
    x, w = ctx.array(0), ctx.array(1)
    if x.ndim != 4:
        raise OnnxError(f"load_onnx: Conv node {ctx.node.name!r} is {x.ndim - 2}-d; ember has conv2d")
    return nn.conv2d(x, w, ctx.array(2) if ctx.has(2) else None, stride=tuple(ctx.attr("strides", [1, 1])),
                     padding=_symmetric_pads(ctx), dilation=tuple(ctx.attr("dilations", [1, 1])), groups=ctx.attr("group", 1))


@importer("MaxPool", "AveragePool")
def _pool(ctx):
    x = ctx.array(0)
    padding = _symmetric_pads(ctx)
    if ctx.attr("ceil_mode", 0) or tuple(ctx.attr("dilations", [1, 1])) != (1, 1) or len(ctx.node.output) > 1:
        raise OnnxError(f"load_onnx: {ctx.node.op_type} node {ctx.node.name!r}: ceil_mode, dilations and indices "
                        "are not imported")
    if ctx.node.op_type == "AveragePool" and any(padding) and not ctx.attr("count_include_pad", 0):
        raise OnnxError(f"load_onnx: AveragePool node {ctx.node.name!r}: padding that does not count is not imported")
    fn = nn.max_pool2d if ctx.node.op_type == "MaxPool" else nn.avg_pool2d
    kernel = tuple(ctx.attr("kernel_shape"))
    return fn(x, kernel, stride=tuple(ctx.attr("strides", kernel)), padding=padding)


@importer("GlobalAveragePool")
def _global_average_pool(ctx):
    return statistical.mean(ctx.array(0), axis=(2, 3), keepdims=True)


@importer("LayerNormalization")
def _layer_norm(ctx):
    x = ctx.array(0)
    axis = ctx.attr("axis", -1) % x.ndim
    if len(ctx.node.output) > 1:
        raise OnnxError("load_onnx: LayerNormalization's mean and inverse deviation outputs are not imported")
    shape = x.shape[axis:]
    scale = ctx.array(1)
    bias = ctx.array(2) if ctx.has(2) else creation.zeros(shape, dtype=x.dtype, device=x.device)
    return nn.layer_norm(x, shape, manipulation.broadcast_to(scale, shape), manipulation.broadcast_to(bias, shape),
                         eps=ctx.attr("epsilon", 1e-5))


@importer("BatchNormalization")
def _batch_norm(ctx):
    x, scale, bias, mean, var = ctx.arrays()[:5]
    lead = (1, -1) + (1,) * (x.ndim - 2)
    inv = manipulation.reshape(scale / elementwise.sqrt(var + ctx.attr("epsilon", 1e-5)), lead)
    return (x - manipulation.reshape(mean, lead)) * inv + manipulation.reshape(bias, lead)


def load_onnx(path, shapes: dict | None = None):
    """Read the ONNX model at ``path`` as a CapturedGraph (default domain, the operators in ``IMPORTS``).

    ``shapes`` gives sizes for inputs whose ONNX shape is symbolic (a dynamic batch): ``{"x": (8, 3)}``.
    OnnxError lists every operator of the model ember does not import, at once; GraphFormatError if the file
    is not an ONNX model. Tensors in external files are refused, never read."""
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        raise OnnxError("load_onnx: needs the onnx package (pip install 'ember[onnx]')") from None
    try:  # external data would be read from paths the file names: refused, never followed
        model = onnx.load(str(Path(path)), load_external_data=False)
    except OSError:
        raise
    except Exception as error:
        raise GraphFormatError(f"load_onnx: {path} is not a valid ONNX model: {error}") from None
    graph = model.graph
    external = [t.name for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise OnnxError(f"load_onnx: {path} keeps {len(external)} tensors in external files ({external[0]!r} …); "
                        f"ember reads self-contained models only")
    missing = sorted({(n.domain or "", n.op_type) for n in graph.node
                      if n.op_type not in IMPORTS and n.op_type != "Constant" or n.domain not in ("", "ai.onnx")})
    if missing:
        names = ", ".join(f"{domain + '.' if domain else ''}{op}" for domain, op in missing)
        raise OnnxError(f"load_onnx: {path} uses {len(missing)} operator{'s' if len(missing) > 1 else ''} ember does not "
                        f"import: {names}", tuple((domain, op, "not imported") for domain, op in missing))
    values: dict = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    shapes = shapes or {}
    with capture() as cap:
        for value_info in graph.input:
            if value_info.name in values:
                continue
            tensor = value_info.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
            shape = tuple(shapes.get(value_info.name, dims))
            if None in shape:
                raise OnnxError(f"load_onnx: input {value_info.name!r} has a symbolic shape {dims}; give its sizes: "
                                f"load_onnx(path, shapes={{{value_info.name!r}: (…)}})")
            if tensor.elem_type not in FROM_ONNX:
                raise OnnxError(f"load_onnx: input {value_info.name!r} has ONNX type {tensor.elem_type}, which ember has not")
            values[value_info.name] = cap.input(shape, FROM_ONNX[tensor.elem_type], name=value_info.name)
        for node in graph.node:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "Constant":
                values[node.output[0]] = numpy_helper.to_array(attrs["value"])
                continue
            ctx = Context(node, values, cap.device, attrs)
            inputs = [values[name] for name in node.input if name]
            if all(not isinstance(v, Array) for v in inputs) and inputs:
                ctx = Context(node, {n: creation.asarray(v, device="numpy") for n, v in zip(node.input, inputs) if n},
                              "numpy", attrs)  # fixed by the model: folded now, on NumPy
            try:
                outs = IMPORTS[node.op_type](ctx)
            except OnnxError:
                raise
            except Exception as error:
                raise OnnxError(f"load_onnx: {node.op_type} node {node.name!r}: {error}") from error
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            for name, out in zip(node.output, outs):
                values[name] = asnumpy(out) if isinstance(out, Array) and out.device.engine.executes else out
        for value_info in graph.output:
            out = values[value_info.name]
            cap.output(out if isinstance(out, Array) else creation.asarray(out, device=cap.device), name=value_info.name)
    return cap.graph


__all__ = ["load_onnx", "IMPORTS"]
