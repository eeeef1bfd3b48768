"""The autodiff engine: records a tape of differentiable ops, then forwards them to its inner
engine (any engine: local, remote, capture).

Handles are :class:`Var` objects wrapping the inner engine's handle and its meta; a Var produced
by an op on tracked inputs points to the tape entry that made it, an ``OpRecord`` (ops/records.py)
whose inputs are Vars or literals and whose outputs are the inner handles the gradient rules read. Rows whose outputs carry no
gradient (``NO_GRADIENT``) stop tracking there and remember why.
"""

from __future__ import annotations

import threading

from .. import dtypes as dt
from ..ops.records import OpRecord
from ..ops.table import NO_GRADIENT, Meta
from .base import Engine

_MODE = threading.local()


def grad_enabled() -> bool:
    """Whether ops on tracked arrays are recorded (see ``em.no_grad``)."""
    return getattr(_MODE, "enabled", True)


def set_grad_enabled(enabled: bool) -> bool:
    previous = grad_enabled()
    _MODE.enabled = enabled
    return previous


class Var:
    """An autodiff handle: the inner handle and its meta, whether it requires a gradient, and the
    tape entry (output ``index`` of ``node``) that produced it."""

    __slots__ = ("handle", "meta", "requires_grad", "node", "index", "grad", "stopped_by", "__weakref__")

    def __init__(self, handle, meta: Meta, node: OpRecord | None = None, index: int = 0, requires_grad: bool = False,
                 grad=None, stopped_by: str | None = None):
        self.handle, self.meta, self.node, self.index = handle, meta, node, index
        self.requires_grad = requires_grad or node is not None
        self.grad, self.stopped_by = grad, stopped_by


def _tape_input(value, meta: Meta):
    """A tape entry's input: a Var, a literal, or an array of the inner device as an untracked Var."""
    if type(value) is Var:
        return value
    return (value, meta.dtype.name) if dt.is_python_scalar(value) else Var(value, meta)


class AutodiffEngine(Engine):
    """Gradient tracking over the engine of ``inner_device``."""

    def __init__(self, inner_device):
        self.inner_device = inner_device

    @property
    def inner(self):
        return self.inner_device.engine

    @property
    def executes(self) -> bool:  # type: ignore[override]
        return self.inner.executes

    def execute(self, op, inputs, in_metas, attrs, metas):
        raw = []
        tracked = False
        for value in inputs:
            if type(value) is Var:
                raw.append(value.handle)
                tracked = tracked or value.requires_grad
            else:
                raw.append(value)
        outs, metas = self.inner.execute(op, tuple(raw), in_metas, attrs, metas)
        if not (tracked and grad_enabled()):
            return tuple(Var(o, m) for o, m in zip(outs, metas)), metas
        if op.grad is NO_GRADIENT:
            return tuple(Var(o, m, stopped_by=op.name) for o, m in zip(outs, metas)), metas
        node = OpRecord(op.name, tuple(map(_tape_input, inputs, in_metas)), outs, attrs, metas)
        return tuple(Var(o, m, node, i) for i, (o, m) in enumerate(zip(outs, metas))), metas

    def upload(self, host) -> Var:
        return Var(self.inner.upload(host), Meta(tuple(host.shape), dt.FROM_NUMPY[host.dtype]))

    def download(self, handle: Var):
        return self.inner.download(handle.handle)

    def native(self, handle: Var):
        return self.inner.native(handle.handle)

    def sync(self) -> None:
        self.inner.sync()

    def stats(self) -> dict:
        return self.inner.stats()

    def rebind(self, old, new):
        """In-place updates keep a leaf a leaf: ``w -= lr * w.grad`` under ``no_grad``."""
        if type(old) is Var and old.requires_grad and old.node is None:
            if type(new) is Var and new.node is not None:
                from ..errors import EmberError
                raise EmberError("an in-place update of an array that requires grad would be recorded; "
                                 "update parameters inside `with em.no_grad():`")
            return Var(new.handle, new.meta, requires_grad=True, grad=old.grad)  # this engine's handles are all Vars
        return new

    def unwrap(self, handle):
        """A tracked value's handle on the inner device: its value, cut from the tape."""
        return handle.handle
