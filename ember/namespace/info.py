"""The inspection API: ``ember.__array_namespace_info__()``."""

from __future__ import annotations

from .. import dtypes as dt
from ..devices import Device, default_device
from ..devices import device as as_device

_KINDS = ("bool", "signed integer", "unsigned integer", "integral", "real floating", "complex floating", "numeric")


class Info:
    """What this namespace supports, by device (the standard's inspection API)."""

    def capabilities(self) -> dict:
        """Optional features: boolean indexing and data-dependent shapes are supported."""
        return {"boolean indexing": True, "data-dependent shapes": True, "max dimensions": 64}

    def default_device(self) -> Device:
        """The device of arrays made without one (``$EMBER_DEVICE``, else numpy)."""
        return default_device()

    def default_dtypes(self, *, device=None) -> dict:
        """The default dtypes, the same on every device (results agree across devices)."""
        return {"real floating": dt.default_float, "complex floating": dt.default_complex,
                "integral": dt.default_int, "indexing": dt.default_index}

    def devices(self) -> tuple[Device, ...]:
        """The local devices available here, and the default device (a peer named by
        ``EMBER_DEVICE``, say); other remote and capture devices are made by string."""
        from ..backends import available_devices
        found = tuple(as_device(name) for name in available_devices())
        default = default_device()
        return found if default in found else (*found, default)

    def dtypes(self, *, device=None, kind=None) -> dict:
        """The dtypes a device supports, by name, optionally only those of ``kind``."""
        from ._generate import device_dtypes
        target = default_device() if device is None else as_device(device)
        supported = device_dtypes(target)
        if kind is not None:
            supported = [d for d in supported if dt.isdtype(d, kind)]
        return {d.name: d for d in supported}


def __array_namespace_info__() -> Info:
    """The inspection API of the Array API standard."""
    return Info()
