"""``ember.torch``: PyTorch models, unchanged, on any ember device::

    import ember.torch
    model = ember.torch.to_device(model, "ember://gpu-box:7878/0")   # the one line that differs
    x, y = ember.torch.to_device(x, device), ember.torch.to_device(y, device)
    loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); loss.item()

A moved tensor is an :class:`Tensor`, a ``torch.Tensor`` wrapper subclass (``__torch_dispatch__``,
the way DTensor and FakeTensor are built) whose elements are an ember array. Autograd, ``no_grad``,
``train()/eval()``, ``state_dict()`` and ``torch.optim`` run as they are, above it; every aten op
below autograd is lowered onto ember's namespace by one table (lowering.py), so the same program
runs on numpy, torch, jax, a peer across the network or a capture device. An op without a lowering
raises :class:`UnloweredOpError` naming it and the user's line — there is no CPU fallback.

Why a wrapper subclass and not a PrivateUse1 device. PrivateUse1 would give ``model.to("ember:0")``
and ``torch.device("ember")``, but it needs a C++ extension: an allocator, a registered kernel per
aten op (or a boxed fallback), device guards, and storage that holds real memory, which an array on
a peer or in a capture does not have. The wrapper subclass is pure Python, needs no build, holds an
array of any device, and sees exactly the aten ops below autograd — the same set PrivateUse1
kernels would implement — with PyTorch's meta kernels for shapes and dtypes. Its price: the device
is spelled ``ember.torch.to_device(x, device)`` instead of ``x.to("ember:…")``, and the tensors
report device ``cpu`` to PyTorch (``.to("cpu")`` and ``.cpu()`` read back). A PrivateUse1 shell over
this same table stays possible later: the lowering table, not the tensor type, is the substance.
"""

from __future__ import annotations

import torch

from ..errors import SignatureError
from .capture import jit
from .errors import AliasingError, MixedDevicesError, UnloweredOpError
from .lowering import LOWERINGS
from .tensor import IN_PLACE_FUNCTIONAL, Tensor, from_torch, per_tensor

__all__ = ["Tensor", "to_device", "jit", "supported_ops", "UnloweredOpError", "AliasingError", "MixedDevicesError"]


def to_device(model_or_tensor, device):
    """Put a module's parameters and buffers (in place; the module is returned) or a tensor on an ember device.

    Parameters stay ``nn.Parameter``s (each now wrapping an ember array), so ``model.parameters()``,
    ``state_dict()`` and optimizers made afterwards see them; a parameter shared by two modules stays
    shared. ``device`` is an ember device or its string (``"numpy"``, ``"jax:cpu"``, ``"ember://host:port/0"``).
    """
    if isinstance(model_or_tensor, torch.Tensor):
        return from_torch(model_or_tensor, device)
    if not isinstance(model_or_tensor, torch.nn.Module):
        raise SignatureError(f"ember.torch.to_device: expected a torch.nn.Module or a torch.Tensor, "
                             f"got {type(model_or_tensor).__name__}")
    moved: dict[int, torch.Tensor] = {}
    for module in model_or_tensor.modules():
        for name, parameter in module._parameters.items():
            if parameter is not None and id(parameter) not in moved:
                moved[id(parameter)] = torch.nn.Parameter(from_torch(parameter, device), parameter.requires_grad)
            if parameter is not None:
                module._parameters[name] = moved[id(parameter)]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = moved.setdefault(id(buffer), from_torch(buffer, device))
    return model_or_tensor


def supported_ops() -> list[str]:
    """The aten overloads ember lowers: the table's, their in-place forms and their ``_foreach_`` forms.

    Ops beyond these run where ``torch._decomp`` decomposes them into these."""
    lowered = set(LOWERINGS) | {op for op, functional in IN_PLACE_FUNCTIONAL.items() if functional in LOWERINGS}
    for op in LOWERINGS:
        in_place = getattr(torch.ops.aten, op.overloadpacket.__name__ + "_", None)
        if in_place is not None and op._overloadname in in_place.overloads():
            lowered.add(getattr(in_place, op._overloadname))
    for packet_name in dir(torch.ops.aten):
        if packet_name.startswith("_foreach_"):
            packet = getattr(torch.ops.aten, packet_name)
            for overload in packet.overloads():
                target = per_tensor(getattr(packet, overload))
                if target is not None and target in lowered:
                    lowered.add(getattr(packet, overload))
    return sorted(str(op) for op in lowered)
