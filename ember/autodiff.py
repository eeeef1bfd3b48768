"""Autodiff on any device: ``em.autodiff(d)``, ``backward``, ``em.grad`` and friends.

The forward pass runs on the inner device through the autodiff engine, which keeps a tape; the
backward pass applies each row's gradient rule with the ember namespace on the inner device's
arrays, so it streams to a compute peer or records into a capture like any other ops. First
order; differentiated inputs are real, and complex intermediates (an fft, say) follow PyTorch's
convention (the gradient of a real loss is dL/dRe z + i·dL/dIm z).
"""

from __future__ import annotations

import contextlib
import threading

from . import dtypes as dt
from .array import Array, _new_array
from .devices import AutodiffDevice
from .devices import device as as_device
from .engines.autodiff import Var, grad_enabled, set_grad_enabled
from .errors import DeviceError, DTypeError, EmberError, NotSupportedError
from .namespace.creation import ones, zeros_like
from .ops.gradients import NotDifferentiable
from .trees import flatten, unflatten

__all__ = ["autodiff", "no_grad", "enable_grad", "grad", "value_and_grad", "is_grad_enabled"]


def autodiff(device) -> AutodiffDevice:
    """``device`` with gradient tracking (the same object for the same device)."""
    return as_device(device).autodiff()


@contextlib.contextmanager
def no_grad():
    """Within this block, ops on tracked arrays are not recorded (parameter updates, evaluation)."""
    previous = set_grad_enabled(False)
    try:
        yield
    finally:
        set_grad_enabled(previous)


@contextlib.contextmanager
def enable_grad():
    """Record ops on tracked arrays again inside a ``no_grad`` block."""
    previous = set_grad_enabled(True)
    try:
        yield
    finally:
        set_grad_enabled(previous)


def is_grad_enabled() -> bool:
    """Whether ops on tracked arrays are being recorded."""
    return grad_enabled()


# --- the array methods ---------------------------------------------------------------------------------

def _var(x: Array, what: str) -> Var:
    handle = x._handle
    if type(handle) is not Var:
        raise DeviceError(f"{what}: arrays on {x.device} do not track gradients; create them on em.autodiff({x.device})")
    return handle


def requires_grad_(x: Array, requires_grad: bool = True) -> Array:
    """Track gradients with respect to this array (it must be on an autodiff device)."""
    var = _var(x, "requires_grad_")
    if requires_grad and not dt.in_category(x.dtype, "real floating"):
        raise DTypeError(f"requires_grad_: only real floating arrays can require gradients, got {x.dtype}")
    if var.node is not None and not requires_grad:
        raise EmberError("requires_grad_: an array computed from tracked arrays cannot stop requiring grad; use x.detach()")
    var.requires_grad = requires_grad
    return x


def detach(x: Array) -> Array:
    """x's value on the same device, cut from the tape."""
    handle = x._handle
    if type(handle) is not Var:
        return x
    return _new_array(Var(handle.handle, x._meta), x._meta, x.device)


def get_grad(x: Array) -> Array | None:
    var = _var(x, "grad")
    return None if var.grad is None else _new_array(Var(var.grad._handle, var.grad._meta), var.grad._meta, x.device)


def set_grad(x: Array, value) -> None:
    var = _var(x, "grad")
    if value is None:
        var.grad = None
        return
    if not isinstance(value, Array) or value.shape != x.shape:
        raise EmberError(f"grad: expected an array of shape {x.shape} or None")
    var.grad = _plain(value)


def _plain(x: Array) -> Array:
    """x as an array of the inner device (no tracking)."""
    device = x.device
    handle = x._handle
    if type(handle) is Var:
        return _new_array(handle.handle, x._meta, device.inner())
    return x


def backward(x: Array, gradient: Array | None = None) -> None:
    """Accumulate d x / d leaf into the ``.grad`` of every leaf that requires grad (``x.backward()``)."""
    var = _var(x, "backward")
    if not var.requires_grad:
        reason = f": it comes from {var.stopped_by}, which has no gradient" if var.stopped_by else \
            " (nothing it depends on requires grad: call requires_grad_() on the inputs)"
        raise EmberError(f"backward: this array does not require grad{reason}")
    seed = _seed(x, gradient, "backward")
    cotangents = _run_backward([(var, x._meta, x.device.inner())], [seed])
    for leaf, g in cotangents.items():
        leaf.grad = g if leaf.grad is None else leaf.grad + g


def _seed(x: Array, gradient, what: str) -> Array:
    if gradient is None:
        if x.size != 1:
            raise EmberError(f"{what}: the output has shape {x.shape}; pass a gradient for a non-scalar output")
        return ones(x.shape, dtype=x.dtype, device=x.device.inner())
    if not isinstance(gradient, Array) or gradient.shape != x.shape:
        raise EmberError(f"{what}: the gradient must be an array of shape {x.shape}")
    return _plain(gradient)


def _topological(roots: list[Var]) -> list:
    """Tape nodes reachable from ``roots``, each after everything it depends on."""
    order, seen = [], set()
    stack = [(r.node, False) for r in roots if r.node is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((v.node, False) for v in node.inputs if type(v) is Var and v.node is not None and id(v.node) not in seen)
    return order


def _run_backward(roots: list, seeds: list) -> dict:
    """Cotangents of every leaf Var that requires grad, as arrays of the inner device."""
    xp = Array._namespace  # the rules are written with the ember namespace (set by the module above us)
    cot: dict = {}
    leaves: dict = {}

    def add(var: Var, g: Array) -> None:
        key = (id(var.node), var.index) if var.node is not None else id(var)
        if var.node is None:
            leaves[key] = var
        cot[key] = g if key not in cot else cot[key] + g

    for (var, _, _), seed in zip(roots, seeds):
        add(var, seed)
    for node in reversed(_topological([r[0] for r in roots])):
        gs = [cot.pop((id(node), i), None) for i in range(len(node.metas))]
        if all(g is None for g in gs):
            continue
        row = node.row
        rule = row.grad
        if isinstance(rule, NotDifferentiable):
            raise NotSupportedError(f"backward: {rule.reason}")
        inner = next(g.device for g in gs if g is not None)
        ins = tuple(_new_array(v.handle, v.meta, inner) if type(v) is Var else v[0] for v in node.inputs)  # or a literal
        outs = tuple(_new_array(h, m, inner) for h, m in zip(node.outputs, node.metas))
        if row.multiple:
            g_arg, out_arg = tuple(gs), outs
        else:
            g_arg, out_arg = gs[0], outs[0]
        try:
            grads = rule(xp, g_arg, out_arg, *ins, **node.attrs)
        except NotImplementedError as error:
            raise NotSupportedError(f"backward: {error}") from None
        for source, g in zip(node.inputs, grads):
            if g is not None and type(source) is Var and source.requires_grad:
                if source.meta.dtype.kind != dt.COMPLEX and g.dtype.kind == dt.COMPLEX:
                    g = xp.real(g)  # a real input's gradient is the real part of its cotangent
                add(source, g)
    return {leaves[k]: g for k, g in cot.items() if k in leaves}


# --- the functional API ----------------------------------------------------------------------------------

_tracing = threading.local()  # .depth: how many grad functions are running their function now, in this thread


def _track(x) -> Array:
    """A fresh leaf requiring grad over x's value, on autodiff(x's device)."""
    if getattr(_tracing, "depth", 0) and getattr(x._handle, "requires_grad", False):
        # the inner grad would differentiate a detached copy: the outer gradient would be a silent zero
        raise NotSupportedError("grad: higher-order gradients are not supported: this grad runs inside another and "
                                "differentiates a value the outer one tracks")
    inner = x.device.inner()
    handle = x._handle.handle if type(x._handle) is Var else x._handle
    if not dt.in_category(x.dtype, "real floating"):
        raise DTypeError(f"grad: only real floating arrays can be differentiated, got {x.dtype}")
    return _new_array(Var(handle, x._meta, requires_grad=True), x._meta, autodiff(inner))


def value_and_grad(function, argnums=0, has_aux: bool = False):
    """``function``'s value and its gradient with respect to the arguments ``argnums`` (an int
    or a tuple), on whatever device the arguments live — capture included, so a training step
    with its backward pass records into one graph. Arguments may be containers of arrays."""
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)

    def wrapped(*args, **kwargs):
        args = list(args)
        tracked = {}
        for i in nums:
            leaves: list = []
            structure = flatten(args[i], leaves)
            if structure[0] == "static":  # a number, a string: flatten keeps it as it is, and it has no gradient
                raise DTypeError(f"grad: differentiated arguments must be ember arrays (or containers of them), "
                                 f"got {type(args[i]).__name__}")
            ad = [_track(leaf) for leaf in leaves]
            tracked[i] = (structure, ad)
            args[i] = unflatten(structure, ad)
        _tracing.depth = getattr(_tracing, "depth", 0) + 1
        try:
            with enable_grad():
                out = function(*args, **kwargs)
        finally:
            _tracing.depth -= 1
        value, aux = out if has_aux else (out, None)
        if not isinstance(value, Array) or value.size != 1:
            raise EmberError(f"grad: the function must return a scalar array, got "
                             f"{value.shape if isinstance(value, Array) else type(value).__name__}")
        var = value._handle
        cot = {}
        if type(var) is Var and var.requires_grad:
            cot = _run_backward([(var, value._meta, value.device.inner())], [_seed(value, None, "grad")])
        grads = []
        for i in nums:
            structure, ad = tracked[i]
            leaves = [cot.get(a._handle) if a._handle in cot else _zeros_like(a) for a in ad]
            grads.append(unflatten(structure, leaves))
        result = grads[0] if single else tuple(grads)
        value = _plain(value)
        if has_aux:
            return (value, _detach_tree(aux)), result
        return value, result

    wrapped.__name__ = f"value_and_grad({getattr(function, '__name__', 'function')})"
    return wrapped


def grad(function, argnums=0, has_aux: bool = False):
    """The gradient of a scalar ``function`` with respect to its arguments ``argnums``."""
    both = value_and_grad(function, argnums, has_aux)

    def wrapped(*args, **kwargs):
        value, g = both(*args, **kwargs)
        return (g, value[1]) if has_aux else g

    wrapped.__name__ = f"grad({getattr(function, '__name__', 'function')})"
    return wrapped


def _zeros_like(a: Array) -> Array:
    return zeros_like(a, device=a.device.inner())


def _detach_tree(tree):
    leaves: list = []
    structure = flatten(tree, leaves)
    return unflatten(structure, [_plain(leaf) for leaf in leaves])


# --- installed on the array object, which knows nothing of autodiff ---------------------------------

def _requires_grad(x: Array) -> bool:
    """Whether gradients flow to this array."""
    return bool(getattr(x._handle, "requires_grad", False))


def _install() -> None:
    Array.requires_grad_ = requires_grad_
    Array.requires_grad = property(_requires_grad)
    Array.backward = backward
    Array.grad = property(get_grad, set_grad, doc="The gradient accumulated by ``backward`` (None before).")
    Array.detach = detach


_install()
