"""ONNX lowerings of the elementwise rows (see onnx.py): where ONNX Runtime computes an operator in
float32 only, float64 is decomposed into operators it has for float64. The reductions, scans, sorts
and searches are in onnx_reductions.py."""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes as dt
from .onnx_lowering import LOWERINGS, ONNX_TYPES, cast_common, lowering


def _unary(op_type):
    return lambda b, xs, ins, outs: b.node(op_type, xs)


_ORDERED = ("Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Max", "Min")  # ONNX orders no bools


def _binary(op_type, negate=False):
    def lower(b, xs, ins, outs):
        operands, dtype = cast_common(b, xs, ins)
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


def erf64(b, x):
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
    return b.node("Not", cast_common(b, xs, ins, dt.bool_)[0])


for _name, _type in (("logical_and", "And"), ("logical_or", "Or"), ("logical_xor", "Xor")):
    LOWERINGS[_name] = (lambda op_type: lambda b, xs, ins, outs: b.node(op_type, cast_common(b, xs, ins, dt.bool_)[0]))(_type)

for _name, _bool, _int in (("bitwise_and", "And", "BitwiseAnd"), ("bitwise_or", "Or", "BitwiseOr"),
                           ("bitwise_xor", "Xor", "BitwiseXor")):
    LOWERINGS[_name] = (lambda bool_type, int_type: lambda b, xs, ins, outs: (
        b.node(bool_type if outs[0].dtype is dt.bool_ else int_type, cast_common(b, xs, ins)[0])))(_bool, _int)


@lowering("bitwise_invert")
def _invert(b, xs, ins, outs):
    return b.node("Not" if ins[0].dtype is dt.bool_ else "BitwiseNot", xs)


@lowering("floor_divide")
def _floor_divide(b, xs, ins, outs):
    (x1, x2), dtype = cast_common(b, xs, ins)
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
    (x1, x2), dtype = cast_common(b, xs, ins)
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
    (x1, x2), dtype = cast_common(b, xs, ins)
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
    (x1, x2), dtype = cast_common(b, xs, ins)
    return _copysign(b, x1, x2, dtype)


@lowering("atan2")
def _atan2(b, xs, ins, outs):
    (y, x), dtype = cast_common(b, xs, ins)
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
    (x1, x2), dtype = cast_common(b, xs, ins)
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
    (x1, x2), _ = cast_common(b, xs[1:], ins[1:], dt.int32 if dtype is dt.bool_ else dtype)  # ONNX Runtime selects no bools
    out = b.node("Where", [b.cast(xs[0], ins[0].dtype, dt.bool_), x1, x2])
    return b.cast(out, dt.int32, dt.bool_) if dtype is dt.bool_ else out


@lowering("astype")
def _astype(b, xs, ins, outs, dtype, copy):
    return b.node("Cast", xs, to=ONNX_TYPES[dtype.name]) if dtype is not ins[0].dtype else b.node("Identity", xs)


for _name in ("tril", "triu"):
    LOWERINGS[_name] = (lambda upper: lambda b, xs, ins, outs, k: b.node(
        "Trilu", [xs[0], b.const(np.asarray(k, np.int64))], upper=upper))(int(_name == "triu"))


def _shifter(left: bool):
    """Shifts as products and floor quotients by powers of two (ONNX's BitShift takes unsigned integers only):
    exact, with NumPy's results for shifts of the whole width or more (0, or -1 for a negative right shift)."""
    def lower(b, xs, ins, outs):
        (x, y), dtype = cast_common(b, xs, ins, outs[0].dtype)
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
