"""The ember tensor: a ``torch.Tensor`` wrapper subclass whose elements are an ember array.

PyTorch sees an ordinary tensor (shape, dtype, ``requires_grad``, device ``cpu``, and the strides
its meta kernels give, so ``is_contiguous()``, ``view`` and ``empty_like`` behave as in eager);
autograd runs above it as it does for every tensor, and each aten op that reaches the tensor's
``__torch_dispatch__`` is lowered onto ember (lowering.py) and runs on the array's device —
locally, on a peer (lazily, batched), or into a capture. Nothing here reads values except the reads
themselves (``item()``, ``.cpu()``, ``.numpy()``, ``.tolist()``, ``print``).

Aliasing. A tensor's array lives in a :class:`Storage` that ``detach()``, ``.data``, ``alias``
and ``nn.Parameter`` share, so an in-place op (which rebinds the storage's array) is seen by all
of them, as in PyTorch. A view (``t()``, ``view``, a slice …) gets a storage of its own that
remembers its base: an in-place op on a view whose base is still alive, or on a base with a live
view, would not reach the other, so it raises :class:`AliasingError` instead of diverging quietly.
"""

from __future__ import annotations

import weakref

import torch
from torch._decomp import decomposition_table
from torch.utils._pytree import tree_map

import ember as em

from .dtypes import to_ember, to_torch
from .errors import AliasingError, MixedDevicesError, UnloweredOpError, user_line
from .lowering import LOWERINGS
from .lowering_cnn import EAGER_EMPTY, Writes

aten = torch.ops.aten

# ops whose result shares the input's storage (aliases), and those whose result is a view of it
ALIASES = {aten.detach.default, aten.alias.default}
VIEWS = {aten.view.default, aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default,
         aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor,
         aten.select.int}
HOST_SOURCES = {aten.copy.default}  # ops that take a host tensor of any size (uploaded): ``copy_`` loads state dicts
IN_PLACE_FUNCTIONAL = {  # in-place overloads named unlike their functional (pow.Scalar is (Scalar, Tensor))
    aten.bernoulli_.float: aten.bernoulli.p, aten.pow_.Scalar: aten.pow.Tensor_Scalar, aten.pow_.Tensor: aten.pow.Tensor_Tensor}
READS = {aten._local_scalar_dense.default, aten._fused_sdp_choice.default}  # a value, not a tensor, comes back


_RECORDING = None  # the capture.Recording of an ember.torch.jit capture in progress, else None


def record(recording):
    """Start (a capture.Recording) or end (None) recording what ops read and write; the recording."""
    global _RECORDING
    _RECORDING = recording
    return recording


class Storage:
    """The ember array one tensor and its aliases share; ``base``/``views`` link a view and its base."""

    __slots__ = ("array", "base", "views", "__weakref__")

    def __init__(self, array: em.Array, base: Storage | None = None):
        self.array = array
        if _RECORDING is not None:
            _RECORDING.made.add(self)
        self.base = weakref.ref(base) if base is not None else None
        self.views: weakref.WeakSet = weakref.WeakSet()
        if base is not None:
            base.views.add(self)

    def rebind(self, array: em.Array, op) -> None:
        """Take ``array`` as the new value (an in-place op), unless a live view or base would miss it."""
        base = self.base() if self.base is not None else None
        if base is not None or len(self.views):
            other = "its base" if base is not None else "a view of it"
            raise AliasingError(f"{op}: an in-place op on a tensor while {other} is alive cannot reach it on an ember "
                                f"device (ember arrays are values); clone() first — at {user_line()}")
        if _RECORDING is not None:
            _RECORDING.rebinding(self)
        self.array = array


class Tensor(torch.Tensor):
    """A PyTorch tensor whose elements are an ember array on any ember device."""

    _storage: Storage
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, storage: Storage, requires_grad: bool = False, strides=None):
        array = storage.array
        tensor = torch.Tensor._make_wrapper_subclass(cls, array.shape, strides=strides, dtype=to_torch(array.dtype),
                                                     device="cpu", requires_grad=requires_grad)
        tensor._storage = storage
        return tensor

    @property
    def ember_array(self) -> em.Array:
        """The ember array holding this tensor's elements."""
        return self._storage.array

    @property
    def ember_device(self) -> em.Device:
        """The ember device the elements live on."""
        return self._storage.array.device

    # --- reads: the points that wait for the device ----------------------------------------------

    def cpu(self, memory_format=torch.preserve_format) -> torch.Tensor:
        """The elements as a plain CPU tensor (a read: on a peer, one round trip)."""
        return torch.from_numpy(em.asnumpy(self._storage.array).copy())

    def numpy(self, *, force: bool = False):
        """The elements as a NumPy array (a read)."""
        return em.asnumpy(self._storage.array).copy()

    def tolist(self):
        """The elements as nested Python lists (a read)."""
        return self.numpy().tolist()

    def to(self, *args, **kwargs):
        """``to("cpu")`` reads back to a plain tensor; a dtype alone casts on the ember device."""
        # an ember array is a value: copy or not, the result is the same (_parse_to takes no copy: the bool after
        # non_blocking, or the keyword, is left out)
        kwargs.pop("copy", None)
        if args and isinstance(args[0], Tensor):  # another ember tensor's dtype (its "cpu" is no host)
            return super().to(args[0].dtype)
        flags = [i for i, a in enumerate(args) if type(a) is bool]
        parsed = [a for i, a in enumerate(args) if i not in flags[1:]]
        device, dtype, _, _ = torch._C._nn._parse_to(*parsed, **kwargs)
        if device is not None and device.type == "cpu":
            host = self.cpu()
            return host if dtype is None else host.to(dtype)
        if device is not None:
            raise MixedDevicesError(f"ember.torch: move to {device} through the CPU (tensor.cpu().to(...)), or to "
                                    f"another ember device with ember.torch.to_device")
        return super().to(*args, **kwargs)

    def __repr__(self, *, tensor_contents=None) -> str:
        grad = f", grad_fn={type(self.grad_fn).__name__}" if self.grad_fn is not None else ""
        return f"ember.torch.Tensor({self.cpu().tolist()}, dtype={self.dtype}, device={self.ember_device}{grad})"

    # --- every aten op --------------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name.startswith("_foreach_"):
            return _foreach(func, args, kwargs)
        if func in ALIASES:
            return Tensor(args[0]._storage, strides=args[0].stride())
        if func in LOWERINGS:
            return _lowered(func, args, kwargs)
        if name.endswith("_") and not name.endswith("__"):
            return _in_place(func, args, kwargs)
        return _decomposed(func, args, kwargs)


def _lowered(func, args, kwargs, strides=None):
    """``func`` through its lowering: PyTorch's meta kernel for the result's metas, ember for its values
    (``strides``: the result's, where it is written into a tensor of its own layout)."""
    read = func in READS  # asked once: an overload's hash is a Python call, on every op
    out = None if read else metas(func, args, kwargs)
    if strides is not None and out.stride() != strides:  # what draws noise fills in memory order (lowering_cnn.py)
        out = torch.empty_strided(out.shape, strides, dtype=out.dtype, device="meta")
    lower = LOWERINGS[func]
    if kwargs:
        result = lower(out, *_unwrap(func, args), **{name: _unwrapped(func, value) for name, value in kwargs.items()})
    else:
        result = lower(out, *_unwrap(func, args))
    if read:
        return result
    if isinstance(result, Writes):  # an op that also writes into arguments (batch norm's running statistics)
        _write(func, args, kwargs, result.written)
        result = result.result
    return _wrap(result, out, func, args[0]._storage if func in VIEWS else None)


def _write(func, args, kwargs, written: dict) -> None:
    """Rebind each argument a lowering wrote (by the schema's argument names) to its new array, in its dtype."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.name in written:
            tensor = args[position] if position < len(args) else kwargs[argument.name]
            array = written[argument.name]
            target = to_ember(tensor.dtype)
            tensor._storage.rebind(em.astype(array, target) if array.dtype != target else array, func)


def _decomposed(func, args, kwargs):
    """``func`` through torch._decomp's decomposition (or its composite kernel), whose ops dispatch here again."""
    decomposition = decomposition_table.get(func) or _composite(func)
    if decomposition is None:
        raise unlowered(func, "no lowering to ember and no decomposition in torch._decomp")
    try:
        return decomposition(*args, **kwargs)
    except UnloweredOpError as inner:
        raise unlowered(func, f"no lowering to ember, and its decomposition in torch._decomp reaches {inner.op}, "
                              f"which has none") from None


def _composite(func):
    """PyTorch's own composite kernel of ``func`` (CompositeImplicitAutograd), which a decomposition may call."""
    if not func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        return None
    return func.decompose


def unlowered(func, why: str) -> UnloweredOpError:
    """The error for an aten op ember cannot run, naming it and the user's line."""
    error = UnloweredOpError(f"{func}: {why} (ember.torch.supported_ops() lists the ops it lowers) — called at "
                             f"{user_line()}")
    error.op = func
    return error


_METAS: dict = {}  # (op, the arguments' metas and values) → PyTorch's meta result
METAS_KEPT = 4096


def metas(func, args, kwargs):
    """``func``'s result on meta tensors — PyTorch's shapes, dtypes and checks — remembered per signature: a
    meta kernel is a pure function of its arguments' metas and values, and costs more than most lowerings."""
    try:
        key = (func, _signature(args), _signature(kwargs))
        return _METAS[key]
    except TypeError:  # an argument without a hashable form: computed each time
        return func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
    except KeyError:
        if len(_METAS) >= METAS_KEPT:
            _METAS.clear()
        out = _METAS[key] = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
        return out


def _signature(value):
    """A hashable form of an argument: a tensor's shape and dtype, a scalar's type and value (1, 1.0 and True
    promote differently), containers element by element."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.stride(), value.dtype)
    kind = type(value)
    if kind is list or kind is tuple:
        return tuple([_signature(v) for v in value])
    if kind is dict:
        return tuple([(k, _signature(v)) for k, v in value.items()])
    return (kind, value)


def _meta(x):
    """What PyTorch's meta kernel is given for an argument: a meta tensor of the same shape, strides and dtype (and
    the meta device where a device is named)."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return torch.device("meta") if isinstance(x, torch.device) else x


def _unwrap(func, values: tuple) -> list:
    """The arguments a lowering takes: ember arrays for ember tensors, scalars for 0-d host tensors."""
    return [_unwrapped(func, value) for value in values]


def _unwrapped(func, x):
    """One argument of :func:`_unwrap`; lists and tuples (aten's only containers) element by element."""
    if isinstance(x, Tensor):
        return x._storage.array if _RECORDING is None else _RECORDING.array_of(x._storage)
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            return x.item()
        if func not in HOST_SOURCES:
            raise MixedDevicesError(f"{func}: a host tensor of shape {tuple(x.shape)} met an ember tensor; move it "
                                    f"with ember.torch.to_device — at {user_line()}")
        return x
    kind = type(x)
    if kind is list or kind is tuple:
        return kind([_unwrapped(func, v) for v in x])
    return x


def _wrap(result, out, func, base: Storage | None):
    """Ember results as tensors, in the dtype and shape PyTorch's meta kernel gave (``out``)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_wrap(r, o, func, base) for r, o in zip(result, out))
    if not isinstance(out, torch.Tensor):
        return result
    return Tensor(Storage(_as(result, out, func), base), strides=out.stride())


def _as(array: em.Array, out: torch.Tensor, func) -> em.Array:
    """A lowering's array in ``out``'s dtype, checked against ``out``'s shape (a mismatch is a lowering's bug)."""
    if array.shape != out.shape and not (array.shape == (0,) and func in EAGER_EMPTY):
        raise AssertionError(f"{func}: the lowering made shape {array.shape}, PyTorch's meta kernel {tuple(out.shape)}")
    target = to_ember(out.dtype)
    return em.astype(array, target) if array.dtype != target else array


def _in_place(func, args, kwargs):
    """``op_(self, …)``: the functional overload's lowering, its result rebound into ``self``'s storage."""
    functional = IN_PLACE_FUNCTIONAL.get(func) or getattr(getattr(aten, func.overloadpacket.__name__[:-1], None),
                                                         func._overloadname, None)
    if functional is None or functional not in LOWERINGS:
        raise unlowered(func, f"no lowering to ember (an in-place op runs its functional form, "
                              f"{func.overloadpacket.__name__[:-1]}, which has none)")
    self = args[0]
    out = metas(func, args, kwargs)  # PyTorch's checks too: the shape kept, the dtype castable
    args = _with_defaults(func, args, kwargs)  # the functional form may have no default where this one has
    result = _lowered(functional, args, kwargs, strides=self.stride())
    self._storage.rebind(_as(result._storage.array, out, func), func)
    return self


def _with_defaults(func, args: tuple, kwargs: dict) -> tuple:
    """``args`` with the positional arguments PyTorch leaves out of a dispatch at their schema's defaults."""
    full = list(args)
    for argument in func._schema.arguments[len(args):]:
        if argument.kwarg_only or argument.name in kwargs or not argument.has_default_value():
            break
        full.append(argument.default_value)
    return tuple(full)


_FOREACH_OVERLOADS = {"List": ("Tensor", "default"), "Scalar": ("Scalar", "Tensor", "default"),
                      "ScalarList": ("Scalar", "Tensor", "default"), "Tensor": ("Tensor", "default"),
                      "default": ("default",)}


def per_tensor(func):
    """The per-tensor overload a ``_foreach_*`` overload applies to each element, or None."""
    packet = getattr(aten, func.overloadpacket.__name__.removeprefix("_foreach_"), None)
    for overload in _FOREACH_OVERLOADS.get(func._overloadname, ()):
        if packet is not None and overload in packet.overloads():
            return getattr(packet, overload)
    return None


def _foreach(func, args, kwargs):
    """``_foreach_op(lists…)``: the per-tensor op on each element (lists indexed, the rest shared)."""
    target = per_tensor(func)
    if target is None:
        raise unlowered(func, "no per-tensor op with a lowering to apply to each element")
    given = {}  # the target's argument name → the value, matched by position in the two schemas
    for position, (argument, name) in enumerate(zip(func._schema.arguments, target._schema.arguments)):
        if position < len(args) or argument.name in kwargs:
            given[name.name] = args[position] if position < len(args) else kwargs[argument.name]
    results = [target(**{name: value[i] if isinstance(value, (list, tuple)) else value for name, value in given.items()})
               for i in range(len(args[0]))]
    return None if func.overloadpacket.__name__.endswith("_") else results


def from_torch(tensor: torch.Tensor, device) -> Tensor:
    """``tensor``'s elements on an ember device, as an ember tensor (a leaf, ``requires_grad`` kept)."""
    device = em.device(device) if isinstance(device, str) else device
    if isinstance(tensor, Tensor):
        array = tensor.ember_array.to_device(device)
    else:
        array = em.asarray(tensor.detach().contiguous().numpy(), device=device)
    return Tensor(Storage(array), requires_grad=tensor.requires_grad)
