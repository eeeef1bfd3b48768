"""ONNX export of captured graphs: a lowering table keyed by op row name, like a backend's kernel
table, so each row is defined once (ember/ops/) and a row without a lowering is found generically.

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
from ..ops.indexing import ELLIPSIS
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


# --- elementwise -------------------------------------------------------------------------------

def _unary(op_type):
    return lambda b, xs, ins, outs: b.node(op_type, xs)


def _common(b, xs, ins, dtype=None):
    """The inputs cast to one dtype (the promoted one unless given): ONNX operators take one type."""
    dtype = dtype or (ins[0].dtype if len(ins) == 1 else dt.promote(ins[0].dtype, ins[1].dtype))
    return [b.cast(x, m.dtype, dtype) for x, m in zip(xs, ins)], dtype


_ORDERED = ("Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Max", "Min")  # ONNX orders no bools


def _binary(op_type, negate=False):
    def lower(b, xs, ins, outs):
        operands, dtype = _common(b, xs, ins)
        if dtype is dt.bool_ and op_type in _ORDERED:
            operands = [b.cast(x, dt.bool_, dt.int32) for x in operands]
        out = b.node(op_type, operands)
        if dtype is dt.bool_ and op_type in ("Max", "Min"):
            out = b.cast(out, dt.int32, dt.bool_)
        return b.node("Not", [out]) if negate else out
    return lower


for _name, _type in {"exp": "Exp", "log": "Log", "sqrt": "Sqrt", "sin": "Sin", "cos": "Cos",
                     "tanh": "Tanh", "reciprocal": "Reciprocal",
                     "sign": "Sign", "negative": "Neg",
                     "positive": "Identity", "relu": "Relu", "sigmoid": "Sigmoid", "abs": "Abs"}.items():
    LOWERINGS[_name] = _unary(_type)

for _name, _type in {"add": "Add", "subtract": "Sub", "multiply": "Mul", "divide": "Div", "pow": "Pow",
                     "equal": "Equal", "greater": "Greater", "greater_equal": "GreaterOrEqual", "less": "Less",
                     "less_equal": "LessOrEqual", "maximum": "Max", "minimum": "Min"}.items():
    LOWERINGS[_name] = _binary(_type)
LOWERINGS["not_equal"] = _binary("Equal", negate=True)


@lowering("trunc")
def _trunc(b, xs, ins, outs):
    if ins[0].dtype.kind != dt.REAL:
        return b.node("Identity", xs)
    floor, ceil = b.node("Floor", xs), b.node("Ceil", xs)
    return b.node("Where", [b.node("Less", [xs[0], b.scalar(0, ins[0].dtype)]), ceil, floor])


for _name, _type in {"ceil": "Ceil", "floor": "Floor", "round": "Round"}.items():
    LOWERINGS[_name] = (lambda op_type: lambda b, xs, ins, outs: (
        b.node(op_type, xs) if ins[0].dtype.kind == dt.REAL else b.node("Identity", xs)))(_type)


# ONNX Runtime computes these in float32 only: float64 is decomposed into operators it has for float64
def _atan64(b, x):
    """Cephes' atan: two range reductions and a rational function, accurate to float64 rounding."""
    f = dt.float64
    c = lambda v: b.scalar(v, f)
    size = b.node("Abs", [x])
    big = b.node("Greater", [size, c(2.414213562373095)])  # tan(3π/8)
    mid = b.node("And", [b.node("Not", [big]), b.node("Greater", [size, c(0.66)])])
    safe = b.node("Where", [big, size, c(1.0)])
    reduced = b.node("Where", [big, b.node("Neg", [b.node("Reciprocal", [safe])]),
                               b.node("Where", [mid, b.node("Div", [b.node("Sub", [size, c(1.0)]),
                                                                    b.node("Add", [size, c(1.0)])]), size])])
    offset = b.node("Where", [big, c(math.pi / 2), b.node("Where", [mid, c(math.pi / 4), c(0.0)])])
    tail = b.node("Where", [big, c(6.123233995736765886130e-17), b.node("Where", [mid, c(0.5 * 6.123233995736765886130e-17),
                                                                                   c(0.0)])])
    z = b.node("Mul", [reduced, reduced])

    def poly(coefficients, monic):
        acc = c(1.0) if monic else c(coefficients[0])
        for k in coefficients[0 if monic else 1:]:
            acc = b.node("Add", [b.node("Mul", [acc, z]), c(k)])
        return acc
    p = poly((-8.750608600031904122785e-1, -1.615753718733365076637e1, -7.500855792314704667340e1,
              -1.228866684490136173410e2, -6.485021904942025371773e1), False)
    q = poly((2.485846490142306297962e1, 1.650270098316988542046e2, 4.328810604912902668951e2,
              4.853903996359136964868e2, 1.945506571482613964425e2), True)
    rational = b.node("Mul", [b.node("Mul", [reduced, z]), b.node("Div", [p, q])])
    value = b.node("Add", [offset, b.node("Add", [b.node("Add", [reduced, rational]), tail])])
    return b.node("Where", [b.node("Less", [x, c(0.0)]), b.node("Neg", [value]), value])


def _erf64(b, x):
    """erf(x) = 2/√π · x · e^(-x²) · Σ (2x²)^n / (1·3·…·(2n+1)): positive terms, no cancellation; ±1 beyond |x| = 6."""
    f = dt.float64
    c = lambda v: b.scalar(v, f)
    clipped = b.node("Clip", [x, c(-6.0), c(6.0)])
    square = b.node("Mul", [clipped, clipped])
    total = c(1.0)
    for n in range(130, 0, -1):
        total = b.node("Add", [c(1.0), b.node("Mul", [b.node("Mul", [square, c(2.0 / (2 * n + 1))]), total])])
    scale = b.node("Mul", [b.node("Mul", [clipped, b.node("Exp", [b.node("Neg", [square])])]), c(2 / math.sqrt(math.pi))])
    return b.node("Mul", [scale, total])


def _atan(b, dtype, xs):
    return _atan64(b, xs[0]) if dtype is dt.float64 else b.node("Atan", xs)


def _sinh64(b, x):
    """sinh from expm1, exact for a tiny x: (e - 1/(e+1)·e)/2 with e = expm1(x), i.e. (e + e/(e+1)) / 2."""
    e = _expm1(b, x, dt.float64)
    return _half(b, b.node("Add", [e, b.node("Div", [e, b.node("Add", [e, _one64(b)])])]))


def _asinh64(b, x):
    """asinh(|x|) = log1p(|x| + x²/(1 + sqrt(1 + x²))), with x's sign."""
    size = b.node("Abs", [x])
    square = b.node("Mul", [x, x])
    inner = b.node("Add", [size, b.node("Div", [square, b.node("Add", [_one64(b), b.node("Sqrt", [
        b.node("Add", [_one64(b), square])])])])])
    return _copysign(b, _log1p(b, inner, dt.float64), x, dt.float64)


def _float64_decomposition(op_type, decompose):
    return lambda b, xs, ins, outs: decompose(b, xs[0]) if ins[0].dtype is dt.float64 else b.node(op_type, xs)


def _half(b, x):
    return b.node("Mul", [x, b.scalar(0.5, dt.float64)])


def _one64(b):
    return b.scalar(1.0, dt.float64)


_FLOAT64 = {  # the float32-only operators of ONNX Runtime, written with float64 ones
    "tan": ("Tan", lambda b, x: b.node("Div", [b.node("Sin", [x]), b.node("Cos", [x])])),
    "atan": ("Atan", _atan64),
    "asin": ("Asin", lambda b, x: _atan64(b, b.node("Div", [x, b.node("Sqrt", [b.node(
        "Mul", [b.node("Sub", [_one64(b), x]), b.node("Add", [_one64(b), x])])])]))),
    "acos": ("Acos", lambda b, x: b.node("Mul", [b.scalar(2.0, dt.float64), _atan64(b, b.node("Sqrt", [b.node(
        "Div", [b.node("Sub", [_one64(b), x]), b.node("Add", [_one64(b), x])])]))])),
    "sinh": ("Sinh", lambda b, x: _sinh64(b, x)),
    "cosh": ("Cosh", lambda b, x: _half(b, b.node("Add", [b.node("Exp", [x]), b.node("Exp", [b.node("Neg", [x])])]))),
    "asinh": ("Asinh", lambda b, x: _asinh64(b, x)),
    "acosh": ("Acosh", lambda b, x: _log1p(b, b.node("Add", [b.node("Sub", [x, _one64(b)]), b.node("Sqrt", [b.node(
        "Mul", [b.node("Sub", [x, _one64(b)]), b.node("Add", [x, _one64(b)])])])]), dt.float64)),
    "atanh": ("Atanh", lambda b, x: _half(b, _log1p(b, b.node("Div", [b.node("Add", [x, x]), b.node("Sub", [_one64(b), x])]),
                                                     dt.float64))),
}
for _name, (_type, _decompose) in _FLOAT64.items():
    LOWERINGS[_name] = _float64_decomposition(_type, _decompose)


@lowering("square")
def _square(b, xs, ins, outs):
    return b.node("Mul", [xs[0], xs[0]])


def _log1p(b, x, dtype):
    """log(1 + x) without losing a tiny x (Kahan's trick: log(u) · x / (u - 1) with u = 1 + x rounded)."""
    one = b.scalar(1, dtype)
    u = b.node("Add", [x, one])
    d = b.node("Sub", [u, one])
    same = b.node("Equal", [d, b.scalar(0, dtype)])
    exact = b.node("Div", [b.node("Mul", [b.node("Log", [u]), x]), b.node("Where", [same, one, d])])
    return b.node("Where", [same, x, b.node("Where", [b.node("IsInf", [u]), u, exact])])


def _expm1(b, x, dtype):
    """exp(x) - 1 without losing a tiny x (Kahan's trick: (u - 1) · x / log(u) with u = exp(x) rounded)."""
    one, zero = b.scalar(1, dtype), b.scalar(0, dtype)
    u = b.node("Exp", [x])
    d = b.node("Sub", [u, one])
    log_u = b.node("Log", [u])
    exact = b.node("Div", [b.node("Mul", [d, x]), b.node("Where", [b.node("Equal", [log_u, zero]), one, log_u])])
    exact = b.node("Where", [b.node("Equal", [d, b.scalar(-1, dtype)]), d, exact])
    return b.node("Where", [b.node("Equal", [d, zero]), x, b.node("Where", [b.node("IsInf", [u]), u, exact])])


LOWERINGS["expm1"] = lambda b, xs, ins, outs: _expm1(b, xs[0], outs[0].dtype)
LOWERINGS["log1p"] = lambda b, xs, ins, outs: _log1p(b, xs[0], outs[0].dtype)


for _name, _base in (("log2", 2.0), ("log10", 10.0)):
    LOWERINGS[_name] = (lambda base: lambda b, xs, ins, outs: b.node(
        "Div", [b.node("Log", xs), b.scalar(math.log(base), outs[0].dtype)]))(_base)


def _signbit(b, x, dtype):
    """x < 0, or x = -0.0: 1/x is -inf there."""
    zero = b.scalar(0, dtype)
    negative_zero = b.node("And", [b.node("Equal", [x, zero]), b.node("Less", [b.node("Reciprocal", [x]), zero])])
    return b.node("Or", [b.node("Less", [x, zero]), negative_zero])


@lowering("signbit")
def _signbit_row(b, xs, ins, outs):
    if ins[0].dtype.kind != dt.REAL:
        return b.node("Less", [xs[0], b.scalar(0, ins[0].dtype)]) if ins[0].dtype.kind == dt.SIGNED else _all(b, xs[0], False)
    return _signbit(b, xs[0], ins[0].dtype)


for _name, _type in (("isnan", "IsNaN"), ("isinf", "IsInf")):
    LOWERINGS[_name] = (lambda op_type: lambda b, xs, ins, outs: (
        b.node(op_type, xs) if ins[0].dtype.kind == dt.REAL else _all(b, xs[0], False)))(_type)


def _all(b, x, value: bool):
    """A bool tensor of ``x``'s shape, all ``value`` (from x's shape, so it follows a dynamic batch)."""
    return b.node("ConstantOfShape", [b.node("Shape", [x])],
                  value=b.onnx.numpy_helper.from_array(np.array([value], dtype=bool)))


@lowering("isfinite")
def _isfinite(b, xs, ins, outs):
    if ins[0].dtype.kind != dt.REAL:
        return _all(b, xs[0], True)
    return b.node("Not", [b.node("Or", [b.node("IsNaN", xs), b.node("IsInf", xs)])])


@lowering("logical_not")
def _logical_not(b, xs, ins, outs):
    return b.node("Not", _common(b, xs, ins, dt.bool_)[0])


for _name, _type in (("logical_and", "And"), ("logical_or", "Or"), ("logical_xor", "Xor")):
    LOWERINGS[_name] = (lambda op_type: lambda b, xs, ins, outs: b.node(op_type, _common(b, xs, ins, dt.bool_)[0]))(_type)

for _name, _bool, _int in (("bitwise_and", "And", "BitwiseAnd"), ("bitwise_or", "Or", "BitwiseOr"),
                           ("bitwise_xor", "Xor", "BitwiseXor")):
    LOWERINGS[_name] = (lambda bool_type, int_type: lambda b, xs, ins, outs: (
        b.node(bool_type if outs[0].dtype is dt.bool_ else int_type, _common(b, xs, ins)[0])))(_bool, _int)


@lowering("bitwise_invert")
def _invert(b, xs, ins, outs):
    return b.node("Not" if ins[0].dtype is dt.bool_ else "BitwiseNot", xs)


@lowering("floor_divide")
def _floor_divide(b, xs, ins, outs):
    (x1, x2), dtype = _common(b, xs, ins)
    if dtype.kind == dt.REAL:
        return _float_floor_divide(b, x1, x2, dtype)
    # integers: ONNX's Div truncates; x1 - (x1 mod x2) is a multiple of x2, so its quotient is exact
    zero, safe = _nonzero_divisor(b, x2, dtype)
    quotient = b.node("Div", [b.node("Sub", [x1, b.node("Mod", [x1, safe], fmod=0)]), safe])
    return b.node("Where", [zero, b.scalar(0, dtype), quotient])


def _float_floor_divide(b, x1, x2, dtype):
    """NumPy's (and CPython's) float floor division, from fmod: floor(x1 / x2) of the rounded quotient is off by
    one where the quotient rounds to an integer (-1 // 0.01 is -101); x1 / x2 floored where x2 is 0 or a value
    is infinite, as ember's kernels."""
    zero, one = b.scalar(0, dtype), b.scalar(1, dtype)
    mod = b.node("Mod", [x1, x2], fmod=1)
    div = b.node("Div", [b.node("Sub", [x1, mod]), x2])
    differ = b.node("And", [b.node("Not", [b.node("Equal", [mod, zero])]),
                            b.node("Xor", [b.node("Less", [x2, zero]), b.node("Less", [mod, zero])])])
    div = b.node("Where", [differ, b.node("Sub", [div, one]), div])
    floor = b.node("Floor", [div])
    floor = b.node("Where", [b.node("Greater", [b.node("Sub", [div, floor]), b.scalar(0.5, dtype)]),
                             b.node("Add", [floor, one]), floor])
    plain = b.node("Or", [b.node("Equal", [x2, zero]), b.node("Or", [b.node("IsInf", [x1]), b.node("IsInf", [x2])])])
    return b.node("Where", [plain, b.node("Floor", [b.node("Div", [x1, x2])]), floor])


def _nonzero_divisor(b, x2, dtype):
    """(x2 == 0, x2 with 1 there): an integer division by zero kills ONNX Runtime's process (SIGFPE), and
    NumPy gives 0 there."""
    zero = b.node("Equal", [x2, b.scalar(0, dtype)])
    return zero, b.node("Where", [zero, b.scalar(1, dtype), x2])


@lowering("remainder")
def _remainder(b, xs, ins, outs):
    (x1, x2), dtype = _common(b, xs, ins)
    if dtype.kind != dt.REAL:
        zero, safe = _nonzero_divisor(b, x2, dtype)
        return b.node("Where", [zero, b.scalar(0, dtype), b.node("Mod", [x1, safe], fmod=0)])  # the divisor's sign
    # floats: C's fmod, moved into the divisor's sign where the signs differ
    r = b.node("Mod", [x1, x2], fmod=1)
    zero = b.scalar(0, dtype)
    differ = b.node("And", [b.node("Not", [b.node("Equal", [r, zero])]),
                            b.node("Xor", [b.node("Less", [r, zero]), b.node("Less", [x2, zero])])])
    return b.node("Where", [differ, b.node("Add", [r, x2]), r])


@lowering("hypot")
def _hypot(b, xs, ins, outs):
    (x1, x2), dtype = _common(b, xs, ins)
    # m · sqrt(1 + (n/m)²) with m the larger magnitude: x² neither overflows nor underflows
    a1, a2 = b.node("Abs", [x1]), b.node("Abs", [x2])
    large, small = b.node("Max", [a1, a2]), b.node("Min", [a1, a2])
    zero = b.node("Equal", [large, b.scalar(0, dtype)])
    ratio = b.node("Div", [small, b.node("Where", [zero, b.scalar(1, dtype), large])])
    scaled = b.node("Mul", [large, b.node("Sqrt", [b.node("Add", [b.scalar(1, dtype), b.node("Mul", [ratio, ratio])])])])
    return b.node("Where", [b.node("IsInf", [large]), large, scaled])


def _copysign(b, magnitude, sign, dtype):
    size = b.node("Abs", [magnitude])
    return b.node("Where", [_signbit(b, sign, dtype), b.node("Neg", [size]), size])


@lowering("copysign")
def _copysign_row(b, xs, ins, outs):
    (x1, x2), dtype = _common(b, xs, ins)
    return _copysign(b, x1, x2, dtype)


@lowering("atan2")
def _atan2(b, xs, ins, outs):
    (y, x), dtype = _common(b, xs, ins)
    zero, pi = b.scalar(0, dtype), b.scalar(math.pi, dtype)
    quotient = _atan(b, dtype, [b.node("Div", [y, b.node("Where", [b.node("Equal", [x, zero]), b.scalar(1, dtype), x])])])
    left = b.node("Add", [quotient, _copysign(b, pi, y, dtype)])  # x < 0: atan(y/x) ± π
    on_axis = b.node("Where", [b.node("Equal", [y, zero]),
                               b.node("Where", [_signbit(b, x, dtype), _copysign(b, pi, y, dtype), y]),
                               _copysign(b, b.scalar(math.pi / 2, dtype), y, dtype)])  # x = ±0
    return b.node("Where", [b.node("Greater", [x, zero]), quotient,
                            b.node("Where", [b.node("Less", [x, zero]), left, on_axis])])


@lowering("logaddexp")
def _logaddexp(b, xs, ins, outs):
    (x1, x2), dtype = _common(b, xs, ins)
    top = b.node("Max", [x1, x2])
    gap = b.node("Neg", [b.node("Abs", [b.node("Sub", [x1, x2])])])
    return b.node("Add", [top, b.node("Log", [b.node("Add", [b.scalar(1, dtype), b.node("Exp", [gap])])])])


@lowering("conj", "real")
def _real_identity(b, xs, ins, outs):
    return b.node("Identity", xs)  # complex graphs are refused before lowering: here the input is real


@lowering("imag")
def _imag(b, xs, ins, outs):
    return b.node("Sub", [xs[0], xs[0]])


@lowering("where")
def _where(b, xs, ins, outs):
    dtype = outs[0].dtype
    (x1, x2), _ = _common(b, xs[1:], ins[1:], dt.int32 if dtype is dt.bool_ else dtype)  # ONNX Runtime selects no bools
    out = b.node("Where", [b.cast(xs[0], ins[0].dtype, dt.bool_), x1, x2])
    return b.cast(out, dt.int32, dt.bool_) if dtype is dt.bool_ else out


@lowering("astype")
def _astype(b, xs, ins, outs, dtype, copy):
    return b.node("Cast", xs, to=ONNX_TYPES[dtype.name]) if dtype is not ins[0].dtype else b.node("Identity", xs)


for _name in ("tril", "triu"):
    LOWERINGS[_name] = (lambda upper: lambda b, xs, ins, outs, k: b.node(
        "Trilu", [xs[0], b.const(np.asarray(k, np.int64))], upper=upper))(int(_name == "triu"))


# --- reductions --------------------------------------------------------------------------------

def _axes(axis, ndim):
    return tuple(range(ndim)) if axis is None else tuple(axis)


def _reduce(b, op_type, x, axes, keepdims):
    if not axes:
        return b.node("Identity", [x])
    return b.node(op_type, [x, b.ints(axes)], keepdims=int(keepdims))


def _exact_product(b, x, meta, axes, out_shape):
    """A product of integers by halving (ONNX Runtime's ReduceProd goes through floating point and rounds
    int64 products beyond 2^53): the reduced axes moved last and flattened, then halves multiplied."""
    kept = [a for a in range(meta.ndim) if a not in axes]
    size = math.prod(meta.shape[a] for a in axes)
    if size == 0:
        return b.const(np.ones(out_shape, dt.NUMPY[meta.dtype]))
    flat = b.reshape(_transposed(b, x, kept + list(axes)), tuple(meta.shape[a] for a in kept) + (size,))
    last = len(kept)
    while size > 1:
        half = size // 2
        pair = b.node("Mul", [b.node("Slice", [flat, b.ints([0]), b.ints([half]), b.ints([last])]),
                              b.node("Slice", [flat, b.ints([half]), b.ints([2 * half]), b.ints([last])])])
        if size % 2:
            pair = b.node("Concat", [pair, b.node("Slice", [flat, b.ints([2 * half]), b.ints([size]), b.ints([last])])],
                          axis=last)
        flat, size = pair, half + size % 2
    return b.reshape(flat, out_shape)


@lowering("prod")
def _prod(b, xs, ins, outs, axis, dtype, keepdims):
    x, axes = b.cast(xs[0], ins[0].dtype, dtype), _axes(axis, ins[0].ndim)
    if dtype.kind in (dt.SIGNED, dt.UNSIGNED) and axes:
        return _exact_product(b, x, Meta(ins[0].shape, dtype), axes, outs[0].shape)
    return _reduce(b, "ReduceProd", x, axes, keepdims)


for _name, _type in (("sum", "ReduceSum"),):
    LOWERINGS[_name] = (lambda op_type: lambda b, xs, ins, outs, axis, dtype, keepdims: _reduce(
        b, op_type, b.cast(xs[0], ins[0].dtype, dtype), _axes(axis, ins[0].ndim), keepdims))(_type)


for _name, _type in (("max", "ReduceMax"), ("min", "ReduceMin")):
    LOWERINGS[_name] = (lambda op_type: lambda b, xs, ins, outs, axis, keepdims: _reduce(
        b, op_type, xs[0], _axes(axis, ins[0].ndim), keepdims))(_type)


def _all_any(any_: bool):
    """Counts of true (any) or false (all) elements, so an empty axis gives the identity."""
    def lower(b, xs, ins, outs, axis, keepdims):
        truth = b.cast(xs[0], ins[0].dtype, dt.bool_)
        axes = _axes(axis, ins[0].ndim)
        if not axes:
            return b.node("Identity", [truth])
        counted = truth if any_ else b.node("Not", [truth])
        total = _reduce(b, "ReduceSum", b.cast(counted, dt.bool_, dt.int64), axes, keepdims)
        return b.node("Greater" if any_ else "Equal", [total, b.scalar(0, dt.int64)])
    return lower


LOWERINGS["all"], LOWERINGS["any"] = _all_any(False), _all_any(True)


@lowering("count_nonzero")
def _count_nonzero(b, xs, ins, outs, axis, keepdims):
    nonzero = b.cast(b.cast(xs[0], ins[0].dtype, dt.bool_), dt.bool_, outs[0].dtype)
    return _reduce(b, "ReduceSum", nonzero, _axes(axis, ins[0].ndim), keepdims)


def _mean(b, x, meta, axes, keepdims, correction=0):
    """A sum divided by the count: NaN over nothing, as NumPy (ONNX's ReduceMean gives 0 there)."""
    count = math.prod(meta.shape[a] for a in axes)
    total = _reduce(b, "ReduceSum", x, axes, keepdims)
    return b.node("Div", [total, b.scalar(count - correction if count else math.nan, meta.dtype)])


@lowering("mean")
def _mean_row(b, xs, ins, outs, axis, keepdims):
    return _mean(b, xs[0], ins[0], _axes(axis, ins[0].ndim), keepdims)


def _variance(b, x, meta, axes, correction, keepdims):
    centred = b.node("Sub", [x, _mean(b, x, meta, axes, True)])
    return _mean(b, b.node("Mul", [centred, centred]), meta, axes, keepdims, correction)


@lowering("var")
def _var(b, xs, ins, outs, axis, correction, keepdims):
    return _variance(b, xs[0], ins[0], _axes(axis, ins[0].ndim), correction, keepdims)


@lowering("std")
def _std(b, xs, ins, outs, axis, correction, keepdims):
    return b.node("Sqrt", [_variance(b, xs[0], ins[0], _axes(axis, ins[0].ndim), correction, keepdims)])


for _name, _type in (("argmax", "ArgMax"), ("argmin", "ArgMin")):
    def _arg(b, xs, ins, outs, axis, keepdims, op_type=_type):
        x = xs[0]
        if axis is None:  # of the flattened array
            x, axis = b.reshape(x, (-1,)), 0
        out = b.node(op_type, [x], axis=axis, keepdims=int(keepdims), select_last_index=0)
        return b.reshape(out, outs[0].shape) if keepdims and ins[0].ndim != 1 and xs[0] != x else out
    LOWERINGS[_name] = _arg


@lowering("cumulative_sum")
def _cumulative_sum(b, xs, ins, outs, axis, dtype, include_initial):
    out = b.node("CumSum", [b.cast(xs[0], ins[0].dtype, dtype), b.const(np.asarray(axis, np.int64))])
    if not include_initial:
        return out
    shape = list(ins[0].shape)
    shape[axis] = 1
    return b.node("Concat", [b.const(np.zeros(shape, dt.NUMPY[dtype])), out], axis=axis)


@lowering("diff")
def _diff(b, xs, ins, outs, axis, n):
    x, size = xs[0], ins[0].shape[axis]
    for _ in range(n):
        if size <= 1:
            return b.node("Slice", [x, b.ints([0]), b.ints([0]), b.ints([axis])])
        head = b.node("Slice", [x, b.ints([1]), b.ints([size]), b.ints([axis])])
        tail = b.node("Slice", [x, b.ints([0]), b.ints([size - 1]), b.ints([axis])])
        x, size = b.node("Sub", [head, tail]), size - 1
    return x if n else b.node("Identity", [x])


def _top_k(b, xs, ins, axis, descending):
    """TopK over the whole axis; ONNX's TopK breaks ties by the lower index, which is a stable sort's order."""
    if ins[0].dtype is dt.bool_:
        xs = [b.cast(xs[0], dt.bool_, dt.int32)]
    values, indices = b.node("TopK", [xs[0], b.ints([ins[0].shape[axis]])], outputs=2, axis=axis, largest=int(descending),
                             sorted=1)
    return (b.cast(values, dt.int32, dt.bool_) if ins[0].dtype is dt.bool_ else values), indices


@lowering("sort")
def _sort(b, xs, ins, outs, axis, descending, stable):
    return _top_k(b, xs, ins, axis, descending)[0]


@lowering("argsort")
def _argsort(b, xs, ins, outs, axis, descending, stable):
    return b.cast(_top_k(b, xs, ins, axis, descending)[1], dt.int64, outs[0].dtype)


@lowering("cumulative_prod")
def _cumulative_prod(b, xs, ins, outs, axis, dtype, include_initial):
    """A scan by doubling (Hillis–Steele): log2(n) steps, each a product with the array shifted by 2^k."""
    x, n = b.cast(xs[0], ins[0].dtype, dtype), ins[0].shape[axis]
    shape = list(ins[0].shape)
    step = 1
    while step < n:
        shape[axis] = step
        ones = b.const(np.ones(shape, dt.NUMPY[dtype]))
        shifted = b.node("Concat", [ones, b.node("Slice", [x, b.ints([0]), b.ints([n - step]), b.ints([axis])])], axis=axis)
        x, step = b.node("Mul", [x, shifted]), step * 2
    if not include_initial:
        return x if n > 1 else b.node("Identity", [x])
    shape[axis] = 1
    return b.node("Concat", [b.const(np.ones(shape, dt.NUMPY[dtype])), x], axis=axis)


@lowering("searchsorted")
def _searchsorted(b, xs, ins, outs, side):
    (sorted_, values), _ = _common(b, xs, ins)
    # the count of sorted elements before each value: exact, O(len(sorted) · len(values)) work
    expanded = b.node("Unsqueeze", [values, b.ints([-1])])
    before = b.node("Less" if side == "left" else "LessOrEqual", [sorted_, expanded])
    return _reduce(b, "ReduceSum", b.cast(before, dt.bool_, outs[0].dtype), (ins[1].ndim,), False)


# --- linear algebra ----------------------------------------------------------------------------

@lowering("matmul")
def _matmul(b, xs, ins, outs):
    return b.node("MatMul", _common(b, xs, ins)[0])


@lowering("tensordot")
def _tensordot(b, xs, ins, outs, axes):
    """Both operands permuted and flattened to matrices, one MatMul, the free axes restored."""
    (x1, x2), _ = _common(b, xs, ins, outs[0].dtype)
    first, second = axes
    free1 = [a for a in range(ins[0].ndim) if a not in first]
    free2 = [a for a in range(ins[1].ndim) if a not in second]
    inner = math.prod(ins[0].shape[a] for a in first)
    left = b.reshape(_transposed(b, x1, free1 + list(first)), (math.prod(ins[0].shape[a] for a in free1), inner))
    right = b.reshape(_transposed(b, x2, list(second) + free2), (inner, math.prod(ins[1].shape[a] for a in free2)))
    return b.reshape(b.node("MatMul", [left, right]), outs[0].shape)


def _transposed(b, x, perm):
    return b.node("Transpose", [x], perm=perm) if perm != sorted(perm) else x


@lowering("vecdot")
def _vecdot(b, xs, ins, outs, axis):
    product = b.node("Mul", _common(b, xs, ins)[0])
    ndim = max(ins[0].ndim, ins[1].ndim)
    return _reduce(b, "ReduceSum", product, (axis % ndim,), False)


@lowering("trace")
def _trace(b, xs, ins, outs, offset, dtype):
    diagonal = _rearrangement(b, xs, ins, outs, "diagonal", {"offset": offset})
    return _reduce(b, "ReduceSum", b.cast(diagonal, ins[0].dtype, dtype), (ins[0].ndim - 2,), False)


@lowering("cross")
def _cross(b, xs, ins, outs, axis):
    (x1, x2), _ = _common(b, xs, ins, outs[0].dtype)
    a1, a2 = (b.node("Gather", [x1, b.ints(order)], axis=axis % ins[0].ndim) for order in ((1, 2, 0), (2, 0, 1)))
    b1, b2 = (b.node("Gather", [x2, b.ints(order)], axis=axis % ins[1].ndim) for order in ((1, 2, 0), (2, 0, 1)))
    return b.node("Sub", [b.node("Mul", [a1, b2]), b.node("Mul", [a2, b1])])


@lowering("matrix_norm")
def _matrix_norm(b, xs, ins, outs, keepdims, ord):
    last = (ins[0].ndim - 2, ins[0].ndim - 1)
    if ord == "fro":
        return _reduce(b, "ReduceL2", xs[0], last, keepdims)
    if ord not in (1, -1, math.inf, -math.inf):
        raise NotExportable(f"the {ord!r} matrix norm needs singular values: ONNX has no SVD")
    summed, picked = (last[0], last[1]) if ord in (1, -1) else (last[1], last[0])
    sums = _reduce(b, "ReduceSum", b.node("Abs", xs), (summed,), True)
    return _reduce(b, "ReduceMax" if ord > 0 else "ReduceMin", sums, (summed, picked) if keepdims else last, keepdims) \
        if keepdims else b.reshape(_reduce(b, "ReduceMax" if ord > 0 else "ReduceMin", sums, (picked,), True), outs[0].shape)


def _shifter(left: bool):
    """Shifts as products and floor quotients by powers of two (ONNX's BitShift takes unsigned integers only):
    exact, with NumPy's results for shifts of the whole width or more (0, or -1 for a negative right shift)."""
    def lower(b, xs, ins, outs):
        (x, y), dtype = _common(b, xs, ins, outs[0].dtype)
        bits = dtype.itemsize * 8
        zero = b.scalar(0, dtype)
        too_far = b.node("GreaterOrEqual", [y, b.scalar(bits, dtype)])
        clipped = b.node("Max", [b.node("Min", [y, b.scalar(bits - 2, dtype)]), b.scalar(0, dtype)])  # never 2^-1 = 0
        power = b.node("Pow", [b.scalar(2, dtype), clipped])
        if left:
            return b.node("Where", [too_far, zero, b.node("Mul", [x, power])])
        quotient = b.node("Div", [b.node("Sub", [x, b.node("Mod", [x, power], fmod=0)]), power])
        beyond = b.node("Where", [b.node("Less", [x, zero]), b.scalar(-1, dtype), zero]) if dtype.kind == dt.SIGNED else zero
        wide = b.node("GreaterOrEqual", [y, b.scalar(bits - 1, dtype)])  # a shift by bits-1 keeps only the sign
        return b.node("Where", [wide, beyond, quotient])
    return lower


LOWERINGS["bitwise_left_shift"], LOWERINGS["bitwise_right_shift"] = _shifter(True), _shifter(False)


@lowering("matrix_power")
def _matrix_power(b, xs, ins, outs, n):
    """Repeated squaring, as NumPy computes it; a negative power needs an inverse, which ONNX has not."""
    if n < 0:
        raise NotExportable(f"matrix_power with n={n} needs a matrix inverse: ONNX has no operator for it")
    size = ins[0].shape[-1]
    if n == 0:
        return b.node("Expand", [b.const(np.eye(size, dtype=dt.NUMPY[outs[0].dtype])), b.ints(outs[0].shape)])
    result, power = None, xs[0]
    while True:
        if n & 1:
            result = power if result is None else b.node("MatMul", [result, power])
        n >>= 1
        if not n:
            return result if result != xs[0] else b.node("Identity", [result])
        power = b.node("MatMul", [power, power])


@lowering("det")
def _det(b, xs, ins, outs):
    if ins[0].dtype is not dt.float32:
        raise NotExportable(f"ONNX Runtime's Det computes float32 only, not {ins[0].dtype}")
    return b.node("Det", xs)


@lowering("vector_norm")
def _vector_norm(b, xs, ins, outs, axis, keepdims, ord):
    axes = _axes(axis, ins[0].ndim)
    size = b.node("Abs", xs)
    if ord == 2:
        return _reduce(b, "ReduceL2", size, axes, keepdims)  # |x|: a reduction over no axes is the identity
    if ord == 1:
        return _reduce(b, "ReduceSum", size, axes, keepdims)
    if ord == math.inf:
        return _reduce(b, "ReduceMax", size, axes, keepdims)
    if ord == -math.inf:
        return _reduce(b, "ReduceMin", size, axes, keepdims)
    if ord == 0:
        return _reduce(b, "ReduceSum", b.cast(b.cast(xs[0], ins[0].dtype, dt.bool_), dt.bool_, outs[0].dtype), axes, keepdims)
    power = b.scalar(ord, outs[0].dtype)
    total = _reduce(b, "ReduceSum", b.node("Pow", [size, power]), axes, keepdims)
    return b.node("Pow", [total, b.node("Reciprocal", [power])])


# --- manipulation ------------------------------------------------------------------------------

@lowering("reshape", "squeeze", "expand_dims")
def _reshape(b, xs, ins, outs, **_):
    shape = outs[0].shape
    if b.dynamic_batch and ins[0].ndim and shape and ins[0].shape[0] == shape[0] and 0 not in shape:
        # the leading axis copied from the input (ONNX's 0 without allowzero), so the batch stays dynamic
        return b.node("Reshape", [xs[0], b.ints((0,) + shape[1:])], allowzero=0)
    return b.reshape(xs[0], shape)


@lowering("broadcast_to")
def _broadcast_to(b, xs, ins, outs, shape):
    return b.node("Expand", [xs[0], b.ints(outs[0].shape)])


@lowering("permute_dims")
def _permute(b, xs, ins, outs, axes):
    return b.node("Transpose", xs, perm=list(axes)) if axes else b.node("Identity", xs)


@lowering("moveaxis")
def _moveaxis(b, xs, ins, outs, source, destination):
    ndim = ins[0].ndim
    src = [s % ndim for s in ((source,) if isinstance(source, int) else source)]
    dst = [d % ndim for d in ((destination,) if isinstance(destination, int) else destination)]
    order = [n for n in range(ndim) if n not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return b.node("Transpose", xs, perm=order)


@lowering("concat")
def _concat(b, xs, ins, outs, axis):
    if axis is None:
        xs, axis = [b.reshape(x, (-1,)) for x in xs], 0
    return b.node("Concat", xs, axis=axis % max(ins[0].ndim, 1))


@lowering("stack")
def _stack(b, xs, ins, outs, axis):
    axis = axis % outs[0].ndim
    return b.node("Concat", [b.node("Unsqueeze", [x, b.ints([axis])]) for x in xs], axis=axis)


def _rearrangement(b, xs, ins, outs, name, attrs):
    """A row that only moves elements (flip, roll, repeat …): ember runs it once on the positions
    0 … n-1 of the input, and the ONNX model gathers the flattened input at the positions it gave."""
    from ..array import bind
    from ..namespace.creation import asarray
    positions = asarray(np.arange(math.prod(ins[0].shape), dtype=np.int64).reshape(ins[0].shape), device="numpy")
    gathered = bind(OPS[name], (positions,), attrs)
    flat = b.reshape(xs[0], (-1,))
    results = [b.node("Gather", [flat, b.const(np.asarray(g))], axis=0) for g in _as_arrays(gathered)]
    return results[0] if len(results) == 1 else results


def _as_arrays(out):
    from ..interop import asnumpy
    return [asnumpy(a) for a in (out if isinstance(out, tuple) else (out,))]


for _name in ("flip", "roll", "repeat", "tile", "unstack", "fftshift", "ifftshift", "diagonal"):
    LOWERINGS[_name] = (lambda name: lambda b, xs, ins, outs, **attrs: _rearrangement(b, xs, ins, outs, name, attrs))(_name)


# --- indexing ----------------------------------------------------------------------------------

def _indexed_axes(key: tuple, ndim: int) -> list:
    """The input axis each array item of ``key`` indexes."""
    consumed = sum(1 for item in key if item is not None and item != ELLIPSIS)
    axes, dim = [], 0
    for item in key:
        if type(item) is tuple and item[0] == "a":
            axes.append(dim)
        if item == ELLIPSIS and type(item) is not tuple:
            dim += ndim - consumed
        elif item is not None:
            dim += 1
    return axes


def _positions(b, x_meta, arrays, array_metas, key):
    """The flat positions ``x[key]`` reads, as an ONNX tensor of the output's shape. They are affine in
    each index array: ember computes them with every index array zero, and the model adds each array's
    (wrapped) indices times its axis' stride, broadcast where NumPy puts the indexed axes."""
    from ..ops.indexing import _adjacent, decode_key
    if any(m.dtype is dt.bool_ for m in array_metas):
        raise NotExportable("a boolean mask index has a data-dependent length")
    shape = x_meta.shape
    zeros = tuple(np.zeros(m.shape, np.int64) for m in array_metas)
    static = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)[decode_key(key, zeros)]
    total = b.const(np.array(static))
    if not arrays:
        return total
    advanced = [i for i, item in enumerate(key) if type(item) is int or (type(item) is tuple and item[0] == "a")]
    broadcast = np.broadcast_shapes(*(m.shape for m in array_metas))
    consumed = sum(1 for item in key if item is not None and item != ELLIPSIS)
    at = 0
    if _adjacent(key):  # after the output axes of the items before the first advanced one
        at = sum(len(shape) - consumed if item == ELLIPSIS else 1 for item in key[:advanced[0]] if type(item) is not int)
    layout = [1] * at + list(broadcast) + [1] * (static.ndim - at - len(broadcast))
    for index, meta, axis in zip(arrays, array_metas, _indexed_axes(key, len(shape))):
        wrapped = b.cast(index, meta.dtype, dt.int64)
        negative = b.node("Less", [wrapped, b.scalar(0, dt.int64)])
        wrapped = b.node("Where", [negative, b.node("Add", [wrapped, b.scalar(shape[axis], dt.int64)]), wrapped])
        spread = b.reshape(b.node("Expand", [wrapped, b.ints(broadcast)]), layout)
        total = b.node("Add", [total, b.node("Mul", [spread, b.scalar(math.prod(shape[axis + 1:]), dt.int64)])])
    return total


@lowering("getitem")
def _getitem(b, xs, ins, outs, key):
    return b.node("Gather", [b.reshape(xs[0], (-1,)), _positions(b, ins[0], xs[1:], ins[1:], key)], axis=0)


@lowering("setitem")
def _setitem(b, xs, ins, outs, key):
    """The positions x[key] reads, written with ScatterND (NumPy keeps the last of repeated positions; ScatterND
    leaves their order undefined: keys with repeated array indices are ambiguous there)."""
    positions = _positions(b, ins[0], xs[2:], ins[2:], key)
    target = Meta(tuple(np.broadcast_shapes(ins[1].shape, _shape_of_key(ins[0], ins[2:], key))), ins[0].dtype)
    values = b.node("Expand", [b.cast(xs[1], ins[1].dtype, ins[0].dtype), b.ints(target.shape)])
    flat = b.reshape(xs[0], (-1,))
    written = b.node("ScatterND", [flat, b.node("Unsqueeze", [b.reshape(positions, (-1,)), b.ints([1])]),
                                   b.reshape(values, (-1,))])
    return b.reshape(written, ins[0].shape)


def _shape_of_key(meta, array_metas, key):
    from ..ops.indexing import index_shape
    return index_shape(meta.shape, key, tuple(array_metas))


@lowering("scatter_add")
def _scatter_add(b, xs, ins, outs):
    x, indices, values = xs
    wrapped = b.cast(indices, ins[1].dtype, dt.int64)
    wrapped = b.node("Where", [b.node("Less", [wrapped, b.scalar(0, dt.int64)]),
                               b.node("Add", [wrapped, b.scalar(ins[0].shape[0], dt.int64)]), wrapped])
    return b.node("ScatterND", [x, b.node("Unsqueeze", [wrapped, b.ints([1])]), values], reduction="add")


@lowering("take")
def _take(b, xs, ins, outs, axis):
    x = xs[0]
    if axis is None:
        x, axis = b.reshape(x, (-1,)), 0
    return b.node("Gather", [x, xs[1]], axis=axis)


@lowering("take_along_axis")
def _take_along_axis(b, xs, ins, outs, axis):
    return b.node("GatherElements", xs, axis=axis % ins[0].ndim)


@lowering("embedding")
def _embedding(b, xs, ins, outs):
    return b.node("Gather", [xs[1], xs[0]], axis=0)


# --- ember.nn ----------------------------------------------------------------------------------

@lowering("silu")
def _silu(b, xs, ins, outs):
    return b.node("Mul", [xs[0], b.node("Sigmoid", xs)])


@lowering("gelu")
def _gelu(b, xs, ins, outs, approximate):
    x, dtype = xs[0], ins[0].dtype
    half = b.node("Mul", [x, b.scalar(0.5, dtype)])
    if approximate == "tanh":
        cube = b.node("Mul", [b.node("Mul", [x, x]), x])
        inner = b.node("Mul", [b.node("Add", [x, b.node("Mul", [cube, b.scalar(0.044715, dtype)])]),
                               b.scalar(math.sqrt(2 / math.pi), dtype)])
        return b.node("Mul", [half, b.node("Add", [b.scalar(1, dtype), b.node("Tanh", [inner])])])
    scaled = b.node("Mul", [x, b.scalar(1 / math.sqrt(2), dtype)])
    erf = _erf64(b, scaled) if dtype is dt.float64 else b.node("Erf", [scaled])
    return b.node("Mul", [half, b.node("Add", [b.scalar(1, dtype), erf])])


for _name, _type in (("softmax", "Softmax"), ("log_softmax", "LogSoftmax")):
    LOWERINGS[_name] = (lambda op_type: lambda b, xs, ins, outs, axis: (
        b.node(op_type, xs, axis=axis) if ins[0].ndim else _scalar_softmax(b, xs[0], op_type)))(_type)


def _scalar_softmax(b, x, op_type):
    out = b.node(op_type, [b.reshape(x, (1,))], axis=0)
    return b.reshape(out, ())


def _loss_reduce(b, x, meta, reduction):
    if reduction == "none":
        return x
    return _reduce(b, "ReduceMean" if reduction == "mean" else "ReduceSum", x, tuple(range(meta.ndim)), False)


@lowering("cross_entropy")
def _cross_entropy(b, xs, ins, outs, reduction):
    logits, target = xs
    log_p = b.node("LogSoftmax", [logits], axis=1)
    picked = b.node("GatherElements", [log_p, b.node("Unsqueeze", [b.cast(target, ins[1].dtype, dt.int64), b.ints([1])])],
                    axis=1)
    losses = b.node("Neg", [b.reshape(picked, ins[1].shape)])
    return _loss_reduce(b, losses, Meta(ins[1].shape, ins[0].dtype), reduction)


@lowering("mse_loss")
def _mse_loss(b, xs, ins, outs, reduction):
    d = b.node("Sub", xs)
    return _loss_reduce(b, b.node("Mul", [d, d]), ins[0], reduction)


@lowering("linear")
def _linear(b, xs, ins, outs):
    out = b.node("MatMul", [xs[0], b.node("Transpose", [xs[1]], perm=[1, 0])])
    return b.node("Add", [out, xs[2]]) if len(xs) > 2 else out


@lowering("layer_norm")
def _layer_norm(b, xs, ins, outs, normalized_shape, eps):
    # statistics in float64, as ember's kernels (and torch) accumulate wider: a constant float32 row normalises to 0
    dtype, wide = ins[0].dtype, b.cast(xs[0], ins[0].dtype, dt.float64)
    meta = Meta(ins[0].shape, dt.float64)
    axes = tuple(range(ins[0].ndim - len(normalized_shape), ins[0].ndim))
    centred = b.node("Sub", [wide, _mean(b, wide, meta, axes, True)])
    variance = _mean(b, b.node("Mul", [centred, centred]), meta, axes, True)
    out = b.node("Div", [centred, b.node("Sqrt", [b.node("Add", [variance, b.scalar(eps, dt.float64)])])])
    out = b.cast(out, dt.float64, dtype)
    return b.node("Add", [b.node("Mul", [out, xs[1]]), xs[2]]) if len(xs) == 3 else out


def _pads(padding):
    return [padding[0], padding[1], padding[0], padding[1]]


def _window_positions(shape, kernel, stride, padding, dilation, groups, out_hw) -> np.ndarray:
    """For an NCHW input of ``shape`` padded by ``padding``: the flat (C·Hp·Wp) position each window element
    reads, as (groups, C/groups · kh · kw, OH · OW)."""
    _, c, h, w = shape
    hp, wp = h + 2 * padding[0], w + 2 * padding[1]
    channel = np.arange(c).reshape(groups, c // groups, 1, 1, 1, 1)
    i = np.arange(kernel[0]).reshape(1, 1, -1, 1, 1, 1)
    j = np.arange(kernel[1]).reshape(1, 1, 1, -1, 1, 1)
    oh = np.arange(out_hw[0]).reshape(1, 1, 1, 1, -1, 1)
    ow = np.arange(out_hw[1]).reshape(1, 1, 1, 1, 1, -1)
    positions = channel * hp * wp + (oh * stride[0] + i * dilation[0]) * wp + ow * stride[1] + j * dilation[1]
    return positions.reshape(groups, (c // groups) * kernel[0] * kernel[1], out_hw[0] * out_hw[1]).astype(np.int64)


def _windows(b, x, meta, kernel, stride, padding, dilation, groups, out_hw, fill=None):
    """The input's sliding windows as (N, groups, C/groups · kh · kw, OH · OW), by one Gather at positions
    ember computes: how convolution and pooling run where ONNX Runtime has no float64 kernel."""
    n, c, h, w = meta.shape
    hp, wp = h + 2 * padding[0], w + 2 * padding[1]
    pads = b.ints([0, 0, padding[0], padding[1], 0, 0, padding[0], padding[1]])
    padded = b.node("Pad", [x, pads] + ([] if fill is None else [b.scalar(fill, meta.dtype)]))
    flat = b.reshape(padded, (n, c * hp * wp))
    positions = _window_positions(meta.shape, kernel, stride, padding, dilation, groups, out_hw)
    return b.node("Gather", [flat, b.const(positions)], axis=1)


def _scatter_back(b, updates, positions, count, shape, padding, dtype):
    """Add ``updates`` (N, count) at ``positions`` (N, count) of each sample's padded C·Hp·Wp; cut the padding off."""
    n, c, h, w = shape
    hp, wp = h + 2 * padding[0], w + 2 * padding[1]
    rows = b.const(np.broadcast_to(np.arange(n, dtype=np.int64).reshape(n, 1, 1), (n, count, 1)).copy())
    indices = b.node("Concat", [rows, b.node("Unsqueeze", [positions, b.ints([2])])], axis=2)
    zeros = b.node("ConstantOfShape", [b.ints([n, c * hp * wp])],
                   value=b.onnx.numpy_helper.from_array(np.zeros(1, dt.NUMPY[dtype])))
    summed = b.reshape(b.node("ScatterND", [zeros, indices, updates], reduction="add"), (n, c, hp, wp))
    return b.node("Slice", [summed, b.ints([padding[0], padding[1]]), b.ints([padding[0] + h, padding[1] + w]), b.ints([2, 3])])


@lowering("conv2d_input_grad")
def _conv2d_input_grad(b, xs, ins, outs, shape, stride, padding, dilation, groups):
    """The adjoint of the window gather: each window element's share (weightᵀ @ g) added back where it was
    read (ScatterND with reduction="add"), then the padding cut off."""
    g, weight = xs
    n, c, h, w = shape
    o, _, kh, kw = ins[1].shape
    oh, ow = ins[0].shape[2:]
    positions = _window_positions(shape, (kh, kw), stride, padding, dilation, groups, (oh, ow)).reshape(-1)
    if n == 0 or positions.size == 0:
        return b.const(np.zeros(shape, dt.NUMPY[outs[0].dtype]))
    weights = b.node("Transpose", [b.reshape(weight, (groups, o // groups, -1))], perm=[0, 2, 1])
    shares = b.reshape(b.node("MatMul", [weights, b.reshape(g, (n, groups, o // groups, oh * ow))]), (n, positions.size))
    every = b.const(np.broadcast_to(positions, (n, positions.size)).copy())
    return _scatter_back(b, shares, every, positions.size, shape, padding, outs[0].dtype)


@lowering("max_pool2d_grad")
def _max_pool2d_grad(b, xs, ins, outs, kernel_size, stride, padding):
    """g routed to each window's first maximum (as ember's kernels), added back where it was read."""
    x, g = xs
    n, c, oh, ow = ins[1].shape
    if n * c * oh * ow == 0:
        return b.const(np.zeros(ins[0].shape, dt.NUMPY[outs[0].dtype]))
    windows = _windows(b, x, ins[0], kernel_size, stride, padding, (1, 1), c, (oh, ow), fill=-np.inf)  # (N, C, K, L)
    first = b.node("ArgMax", [windows], axis=2, keepdims=1, select_last_index=0)  # (N, C, 1, L)
    positions = _window_positions(ins[0].shape, kernel_size, stride, padding, (1, 1), c, (oh, ow))  # (C, K, L)
    everywhere = b.node("Expand", [b.const(positions), b.ints((n,) + positions.shape)])
    chosen = b.reshape(b.node("GatherElements", [everywhere, first], axis=2), (n, c * oh * ow))
    return _scatter_back(b, b.reshape(g, (n, c * oh * ow)), chosen, c * oh * ow, ins[0].shape, padding, outs[0].dtype)


@lowering("conv2d_weight_grad")
def _conv2d_weight_grad(b, xs, ins, outs, shape, stride, padding, dilation, groups):
    """Σ over the batch of g @ windowsᵀ, per group."""
    x, g = xs
    n, o, oh, ow = ins[1].shape
    if n == 0 or oh * ow == 0:
        return b.const(np.zeros(shape, dt.NUMPY[outs[0].dtype]))
    columns = _windows(b, x, ins[0], shape[2:], stride, padding, dilation, groups, (oh, ow))
    per_sample = b.node("MatMul", [b.reshape(g, (n, groups, o // groups, oh * ow)),
                                   b.node("Transpose", [columns], perm=[0, 1, 3, 2])])
    return b.reshape(_reduce(b, "ReduceSum", per_sample, (0,), False), shape)


@lowering("conv2d")
def _conv2d(b, xs, ins, outs, stride, padding, dilation, groups):
    if ins[0].dtype is dt.float64:
        n, o, oh, ow = outs[0].shape
        columns = _windows(b, xs[0], ins[0], ins[1].shape[2:], stride, padding, dilation, groups, (oh, ow))
        weights = b.reshape(xs[1], (groups, o // groups, -1 if ins[1].shape[1] else 0))
        out = b.reshape(b.node("MatMul", [weights, columns]), (n, o, oh, ow))
        return b.node("Add", [out, b.reshape(xs[2], (1, o, 1, 1))]) if len(xs) > 2 else out
    return b.node("Conv", xs, strides=list(stride), pads=_pads(padding), dilations=list(dilation), group=groups,
                  kernel_shape=list(ins[1].shape[2:]))


@lowering("max_pool2d")
def _max_pool(b, xs, ins, outs, kernel_size, stride, padding):
    return b.node("MaxPool", xs, kernel_shape=list(kernel_size), strides=list(stride), pads=_pads(padding))


@lowering("avg_pool2d")
def _avg_pool(b, xs, ins, outs, kernel_size, stride, padding):
    if ins[0].dtype is dt.float64:
        n, c, oh, ow = outs[0].shape
        columns = _windows(b, xs[0], ins[0], kernel_size, stride, padding, (1, 1), c, (oh, ow))
        total = _reduce(b, "ReduceSum", columns, (2,), False)
        window = b.scalar(kernel_size[0] * kernel_size[1], dt.float64)
        return b.reshape(b.node("Div", [total, window]), (n, c, oh, ow))
    return b.node("AveragePool", xs, kernel_shape=list(kernel_size), strides=list(stride), pads=_pads(padding),
                  count_include_pad=1)


@lowering("scaled_dot_product_attention")
def _attention(b, xs, ins, outs, is_causal, scale):
    q, k, v = xs[:3]
    dtype, length, keys = ins[0].dtype, ins[0].shape[-2], ins[1].shape[-2]
    scale = 1 / math.sqrt(ins[0].shape[-1]) if scale is None else scale
    perm = list(range(ins[1].ndim - 2)) + [ins[1].ndim - 1, ins[1].ndim - 2]
    scores = b.node("Mul", [b.node("MatMul", [q, b.node("Transpose", [k], perm=perm)]), b.scalar(scale, dtype)])
    if len(xs) > 3:
        scores = b.node("Add", [scores, xs[3]])
    if is_causal:
        keep = b.const(np.tril(np.ones((length, keys), dtype=bool)))
        scores = b.node("Where", [keep, scores, b.scalar(-np.inf, dtype)])
    return b.node("MatMul", [b.node("Softmax", [scores], axis=-1), v])


# --- rows without an ONNX form ---------------------------------------------------------------------

_COMPLEX = "complex results: ONNX Runtime computes no complex arithmetic"
GAPS.update({name: _COMPLEX for name in ("fft", "fftn", "ifft", "ifftn", "rfft", "rfftn", "irfft", "irfftn", "hfft", "ihfft")})
GAPS.update({name: "a data-dependent output length" for name in
             ("nonzero", "unique_values", "unique_counts", "unique_inverse", "unique_all")})
GAPS.update({name: "a factorisation or solver: ONNX has no operator for it (an unrolled one, with fixed pivots or "
                   "iterations, would be another algorithm)"
             for name in ("cholesky", "inv", "slogdet", "eigh", "eigvalsh", "qr", "svd", "svdvals", "pinv", "solve")})
GAPS["nextafter"] = "needs the bits of a float; ONNX has no bit cast"


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
            folded = _as_arrays(_fold(row, op.attrs))
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
    fixed = [o.name for o in inferred.output if type(leading.get(o.name)) is int]
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
