"""What the ONNX lowering modules share (onnx_math.py, onnx_arrays.py, onnx_nn.py): the lowering table
they fill, the model builder a lowering writes nodes into, and helpers. ember/graphs/onnx.py reads the
table and exports; it imports the lowering modules, and they import this one, never onnx.py."""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes as dt

ONNX_TYPES = {  # ember dtype name -> onnx.TensorProto data type
    "bool": 9, "int8": 3, "int16": 5, "int32": 6, "int64": 7, "uint8": 2, "uint16": 4, "uint32": 12, "uint64": 13,
    "float32": 1, "float64": 11, "complex64": 14, "complex128": 15,
}

LOWERINGS: dict = {}


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
