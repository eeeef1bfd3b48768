"""Elementwise operations: rows made by two family factories, plus where, tril and triu.

Binary rows receive operands of one dtype: the namespace casts mixed dtypes and Python scalars
beforehand (explicit casts in the IR, so every backend sees the same op), and ``lift`` tells it
to cast lower kinds up first (NumPy's ``sqrt(int)`` is float64).

Gradient rules are first order; complex values follow PyTorch's convention: the gradient of a
real loss L is dL/dRe z + i dL/dIm z, so a holomorphic f gets g · conj(f'(z)).
"""

from __future__ import annotations

from .. import dtypes as dt
from .gradients import conj, unbroadcast
from .table import NO_GRADIENT, Meta, Op, broadcast_shapes, define, require, require_ndim

SAME, BOOL, REAL = "same", "bool", "real"
_RESULT = {SAME: lambda d: d, BOOL: lambda d: dt.bool_, REAL: dt.real_of}


def unary(name, category, result=SAME, lift=False, *, grad, doc):
    """Define ``name(x)``: accepts ``category``, returns the same shape and the ``result`` dtype."""
    to_result = _RESULT[result]

    def meta(x):
        require(x.dtype, category)
        return Meta(x.shape, to_result(x.dtype))

    return define(Op(name, ("x",), {}, meta, family="elementwise unary", doc=doc, lift=lift, grad=grad))


def binary(name, category, result=SAME, lift=False, *, grad, doc):
    """Define ``name(x1, x2)``: broadcasting, operands of one dtype from ``category``."""
    to_result = _RESULT[result]

    def meta(x1, x2):
        dtype = dt.promote(x1.dtype, x2.dtype)
        require(dtype, category, "inputs")  # their common dtype
        return Meta(broadcast_shapes(x1.shape, x2.shape), to_result(dtype))

    return define(Op(name, ("x1", "x2"), {}, meta, family="elementwise binary", doc=doc, lift=lift, grad=grad))


# --- unary rows ------------------------------------------------------------------------------

_LN2, _LN10 = 0.6931471805599453, 2.302585092994046


def _holomorphic(derivative):
    """A rule from the derivative f'(x), given as ``derivative(xp, out, x)``."""
    return lambda xp, g, out, x: (g * conj(xp, derivative(xp, out, x)),)


def _one(rule):
    """A unary rule from ``rule(xp, g, out, x)`` returning the one cotangent, not a tuple."""
    return lambda xp, g, out, x: (rule(xp, g, out, x),)


FLOATING = "floating"
_DERIVATIVES = {  # f'(x) of the floating functions, as derivative(xp, out, x)
    "acos": lambda xp, out, x: -1 / xp.sqrt(1 - x * x),
    "acosh": lambda xp, out, x: 1 / (xp.sqrt(x - 1) * xp.sqrt(x + 1)),  # not sqrt(x² - 1): its branch cuts differ
    "asin": lambda xp, out, x: 1 / xp.sqrt(1 - x * x),
    "asinh": lambda xp, out, x: 1 / xp.sqrt(x * x + 1),
    "atan": lambda xp, out, x: 1 / (1 + x * x),
    "atanh": lambda xp, out, x: 1 / (1 - x * x),
    "cos": lambda xp, out, x: -xp.sin(x),
    "cosh": lambda xp, out, x: xp.sinh(x),
    "exp": lambda xp, out, x: out,
    "expm1": lambda xp, out, x: out + 1,
    "log": lambda xp, out, x: 1 / x,
    "log1p": lambda xp, out, x: 1 / (1 + x),
    "log2": lambda xp, out, x: 1 / (x * _LN2),
    "log10": lambda xp, out, x: 1 / (x * _LN10),
    "sin": lambda xp, out, x: xp.cos(x),
    "sinh": lambda xp, out, x: xp.cosh(x),
    "sqrt": lambda xp, out, x: 1 / (2 * out),
    "tan": lambda xp, out, x: 1 + out * out,
    "tanh": lambda xp, out, x: 1 - out * out,
    "reciprocal": lambda xp, out, x: -(out * out),
}
for _name, _derivative in _DERIVATIVES.items():
    unary(_name, FLOATING, lift=True, grad=_holomorphic(_derivative),
          doc=f"Elementwise {_name}; integer and bool inputs lift to float64.")


def _sign_grad(xp, g, out, x):
    """Piecewise constant for real x; z/|z| for complex z moves along the circle: (g - s·Re(conj(g)·s)) / |z|, 0 at 0."""
    if x.dtype.kind != dt.COMPLEX:
        return xp.zeros_like(x)
    modulus = xp.abs(x)
    return xp.where(modulus > 0, (g - out * xp.real(conj(xp, g) * out)) / xp.where(modulus > 0, modulus, 1.0), 0.0)


_FLAT = lambda xp, g, out, x: xp.zeros_like(g)  # piecewise constant: zero almost everywhere

unary("abs", "numeric", REAL, grad=_one(lambda xp, g, out, x: g * xp.sign(x)),  # z/|z| for complex z
      doc="Absolute value (the modulus of a complex number).")
unary("bitwise_invert", "integral or bool", grad=NO_GRADIENT, doc="Bitwise NOT (logical NOT for bool).")
for _name in ("ceil", "floor", "trunc"):
    unary(_name, "real numeric", grad=_one(_FLAT), doc=f"Elementwise {_name}; integers are returned unchanged.")
unary("conj", "numeric", grad=_one(lambda xp, g, out, x: conj(xp, g)),
      doc="Complex conjugate; real inputs are returned unchanged.")
unary("real", "numeric", REAL, grad=_one(lambda xp, g, out, x: g), doc="Real component.")
unary("imag", "numeric", REAL, grad=_one(lambda xp, g, out, x: g * 1j if x.dtype.kind == dt.COMPLEX else xp.zeros_like(x)),
      doc="Imaginary component (zero for real inputs).")
for _name in ("isfinite", "isinf", "isnan"):
    unary(_name, "numeric", BOOL, grad=NO_GRADIENT, doc=f"Elementwise {_name} test.")
unary("logical_not", "bool", grad=NO_GRADIENT, doc="Logical NOT.")
unary("negative", "numeric", grad=_one(lambda xp, g, out, x: -g), doc="Numerical negative.")
unary("positive", "numeric", grad=_one(lambda xp, g, out, x: g), doc="Numerical positive (a copy).")
unary("round", "numeric", grad=_one(_FLAT), doc="Round half to even.")
unary("sign", "numeric", grad=_one(_sign_grad), doc="Sign (x/|x| for complex).")
unary("signbit", "real floating", BOOL, grad=NO_GRADIENT, doc="Whether the sign bit is set.")
unary("square", "numeric", grad=_holomorphic(lambda xp, out, x: 2 * x), doc="x * x.")


# --- binary rows -----------------------------------------------------------------------------

def _binary(rule):
    """A rule from both partial derivatives; each cotangent is summed back to its input's shape
    (literal inputs get none)."""
    def grad(xp, g, out, x1, x2):
        g1, g2 = rule(xp, g, out, x1, x2)
        return tuple(None if gi is None or not hasattr(xi, "shape") else unbroadcast(xp, gi, xi.shape)
                     for gi, xi in ((g1, x1), (g2, x2)))
    return grad


def _pow_exponent_grad(xp, g, out, x1):
    """d x1**x2 / d x2 = x1**x2 · log x1, taken as 0 where x1 ≤ 0 (0**x2 is flat in x2); for complex x1, log's
    principal branch, and 0 at x1 = 0."""
    if not hasattr(x1, "shape"):  # a Python scalar base, as in 2.0 ** x
        x1 = xp.asarray(x1, dtype=out.dtype, device=out.device)
    keep = x1 != 0 if x1.dtype in (dt.complex64, dt.complex128) else x1 > 0
    return g * conj(xp, xp.where(keep, out * xp.log(xp.where(keep, x1, 1.0)), 0.0))


for _name, _rule in {
    "add": lambda xp, g, out, x1, x2: (g, g),
    "subtract": lambda xp, g, out, x1, x2: (g, -g),
    "multiply": lambda xp, g, out, x1, x2: (g * conj(xp, x2), g * conj(xp, x1)),
}.items():
    binary(_name, "numeric", grad=_binary(_rule), doc=f"Elementwise {_name}.")
binary("divide", FLOATING, lift=True, grad=_binary(lambda xp, g, out, x1, x2: (g / conj(xp, x2), -g * conj(xp, out / x2))),
       doc="True division; integer inputs lift to float64.")
binary("pow", "numeric", grad=_binary(lambda xp, g, out, x1, x2: (
    g * conj(xp, x2 * xp.pow(x1, x2 - 1)), _pow_exponent_grad(xp, g, out, x1) if hasattr(x2, "shape") else None)),
       doc="x1 raised to x2.")
binary("equal", "any", BOOL, grad=NO_GRADIENT, doc="x1 == x2.")
binary("not_equal", "any", BOOL, grad=NO_GRADIENT, doc="x1 != x2.")
for _name in ("greater", "greater_equal", "less", "less_equal"):
    binary(_name, "real", BOOL, grad=NO_GRADIENT, doc=f"Elementwise {_name} comparison.")
binary("floor_divide", "real numeric", grad=_binary(lambda xp, g, out, x1, x2: (xp.zeros_like(g), xp.zeros_like(g))),
       doc="Floor of x1 / x2.")
binary("remainder", "real numeric", grad=_binary(lambda xp, g, out, x1, x2: (g, -g * xp.floor_divide(x1, x2))),
       doc="x1 - floor_divide(x1, x2) * x2, with the sign of x2.")
binary("maximum", "real numeric",
       grad=_binary(lambda xp, g, out, x1, x2: (xp.where(x1 >= x2, g, 0.0), xp.where(x1 >= x2, 0.0, g))),
       doc="Larger of the two (NaN propagates).")
binary("minimum", "real numeric",
       grad=_binary(lambda xp, g, out, x1, x2: (xp.where(x1 <= x2, g, 0.0), xp.where(x1 <= x2, 0.0, g))),
       doc="Smaller of the two (NaN propagates).")
for _name, _rule in {
    "atan2": lambda xp, g, out, x1, x2: (g * x2 / (x1 * x1 + x2 * x2), -g * x1 / (x1 * x1 + x2 * x2)),
    "copysign": lambda xp, g, out, x1, x2: (g * xp.sign(x1) * xp.sign(out) if hasattr(x1, "shape") else None, None),
    "hypot": lambda xp, g, out, x1, x2: (g * x1 / out, g * x2 / out),
    "nextafter": lambda xp, g, out, x1, x2: (g, None),
    "logaddexp": lambda xp, g, out, x1, x2: (g * xp.exp(x1 - out), g * xp.exp(x2 - out)),
}.items():
    binary(_name, "real floating", lift=True, grad=_binary(_rule), doc=f"Elementwise {_name}.")
for _name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
    binary(_name, "integral or bool", grad=NO_GRADIENT, doc=f"Elementwise {_name}.")
for _name in ("bitwise_left_shift", "bitwise_right_shift"):
    binary(_name, "integral", grad=NO_GRADIENT, doc=f"Elementwise {_name}; shifts must be non-negative.")
for _name in ("logical_and", "logical_or", "logical_xor"):
    binary(_name, "bool", grad=NO_GRADIENT, doc=f"Elementwise {_name}.")


# --- where, tril, triu -----------------------------------------------------------------------

def _where_meta(condition, x1, x2):
    require(condition.dtype, "bool", "condition")
    return Meta(broadcast_shapes(condition.shape, x1.shape, x2.shape), dt.promote(x1.dtype, x2.dtype))


def _where_grad(xp, g, out, condition, x1, x2):
    return (None,
            None if not hasattr(x1, "shape") else unbroadcast(xp, xp.where(condition, g, 0.0), x1.shape),
            None if not hasattr(x2, "shape") else unbroadcast(xp, xp.where(condition, 0.0, g), x2.shape))


define(Op("where", ("condition", "x1", "x2"), {}, _where_meta, family="searching", grad=_where_grad,
          doc="Elements of x1 where condition holds, else of x2."))


def _triangle_meta(x, k):
    require_ndim(x, 2)
    return Meta(x.shape, x.dtype)


for _name, _grad in (("tril", lambda xp, g, out, x, k: (xp.tril(g, k=k),)),
                     ("triu", lambda xp, g, out, x, k: (xp.triu(g, k=k),))):
    define(Op(_name, ("x",), {"k": 0}, _triangle_meta, family="creation", grad=_grad,
              doc=f"{'Lower' if _name == 'tril' else 'Upper'} triangle of the last two axes, from diagonal k."))
