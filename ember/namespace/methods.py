"""The array's operators, indexing and transposes, installed on :class:`Array` from the namespace
above it (as JAX installs its array methods): the array object itself knows no op."""

from __future__ import annotations

from ..array import Array
from . import elementwise as ew
from . import indexing, linear_algebra, manipulation
from .elementwise import is_operand


def _forward(function):
    def method(self, other):
        if is_operand(other):
            return function(self, other)
        return NotImplemented
    return method


def _reflected(function):
    def method(self, other):
        if not is_operand(other):
            return NotImplemented
        return function(other, self)
    return method


def _in_place(function, name):
    def method(self, other):
        if not is_operand(other):
            return NotImplemented
        self._rebind(function(self, other), name)
        return self
    return method


def _getitem(self, key) -> Array:
    return indexing.getitem(self, key)


def _setitem(self, key, value) -> None:
    self._rebind(indexing.setitem(self, key, value), "__setitem__")


def _transpose(self) -> Array:
    """The array with its axes reversed."""
    return manipulation.permute_dims(self, tuple(range(self.ndim - 1, -1, -1)))


def _matrix_transpose(self) -> Array:
    """The transpose of the last two axes (a stack of matrices transposed)."""
    return linear_algebra.matrix_transpose(self)


def install() -> None:
    """Give :class:`Array` its Python operators (``+``, ``@``, ``x[key]`` …), ``T`` and ``mT``."""
    binary = {
        "add": ew.add, "sub": ew.subtract, "mul": ew.multiply, "truediv": ew.divide, "floordiv": ew.floor_divide,
        "mod": ew.remainder, "pow": ew.pow, "and": ew.bitwise_and, "or": ew.bitwise_or, "xor": ew.bitwise_xor,
        "lshift": ew.bitwise_left_shift, "rshift": ew.bitwise_right_shift, "matmul": linear_algebra.matmul,
    }
    for name, function in binary.items():
        # an elementwise row's operator is the row's own binary function (one frame on the hot path)
        setattr(Array, f"__{name}__", ew.OPERATORS.get(function.__name__) or _forward(function))
        setattr(Array, f"__r{name}__", _reflected(function))
        setattr(Array, f"__i{name}__", _in_place(function, f"__i{name}__"))
    for name, function in {"eq": ew.equal, "ne": ew.not_equal, "lt": ew.less, "le": ew.less_equal,
                           "gt": ew.greater, "ge": ew.greater_equal}.items():
        setattr(Array, f"__{name}__", ew.OPERATORS[function.__name__])
    for name, function in {"abs": ew.abs, "neg": ew.negative, "pos": ew.positive, "invert": ew.bitwise_invert}.items():
        setattr(Array, f"__{name}__", function)
    Array.__getitem__, Array.__setitem__ = _getitem, _setitem
    Array.T, Array.mT = property(_transpose), property(_matrix_transpose)
