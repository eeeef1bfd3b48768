"""Helpers that gradient rules share; each row carries its own rule (``Op.grad``), beside its meta rule.

A rule is ``rule(xp, g, out, *inputs, **attrs) -> tuple``: ``xp`` is the ember namespace (the
rules are written with its functions, so a backward pass runs on any device — streamed to a
peer, recorded by capture), ``g`` the cotangent of the output (a tuple for multi-output rows,
``None`` where an output got none), ``out`` the output(s), ``inputs`` the row's inputs (Python
scalars for literals). It returns one cotangent per input, ``None`` where there is none.
"""

from __future__ import annotations


class NotDifferentiable:
    """The grad rule of a row whose gradient ember does not implement (yet), with the reason."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"NotDifferentiable({self.reason!r})"


def conj(xp, value):
    """The complex conjugate, free for real arrays and scalars (most of a backward pass)."""
    if isinstance(value, complex):
        return value.conjugate()
    if hasattr(value, "dtype") and value.dtype.kind == "complex floating":
        return xp.conj(value)
    return value


def unbroadcast(xp, g, shape: tuple):
    """``g`` summed down to ``shape`` (the adjoint of broadcasting to g's shape)."""
    if g.shape == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    if lead:
        g = xp.sum(g, axis=tuple(range(lead)))
    axes = tuple(i for i, (s, t) in enumerate(zip(shape, g.shape)) if s == 1 and t != 1)
    if axes:
        g = xp.sum(g, axis=axes, keepdims=True)
    return g


def expand_reduced(xp, g, shape: tuple, axis, keepdims: bool):
    """A reduction's cotangent broadcast back to the input's ``shape``."""
    if not keepdims:
        axes = range(len(shape)) if axis is None else axis
        for a in sorted(axes):
            g = xp.expand_dims(g, axis=a)
    return xp.broadcast_to(g, shape)


def scatter_back(xp, g, x, gather):
    """The adjoint of a gather (getitem, take, take_along_axis …): ``gather(positions)`` picks
    flat positions of x the way the op picked values; the cotangent is added back at them."""
    size = 1
    for s in x.shape:
        size *= s
    positions = gather(xp.reshape(xp.arange(size, device=x.device), x.shape))
    flat = xp.zeros(size, dtype=g.dtype, device=x.device)
    return xp.reshape(xp.scatter_add(flat, xp.reshape(positions, (-1,)), xp.reshape(g, (-1,))), x.shape)
