"""The ``fft`` extension of the standard (``ember.fft``)."""

from ._generate import from_row

_NAMES = ("fft", "ifft", "fftn", "ifftn", "rfft", "irfft", "rfftn", "irfftn", "hfft", "ihfft",
          "fftfreq", "rfftfreq", "fftshift", "ifftshift")
for _name in _NAMES:
    globals()[_name] = from_row(_name)

__all__ = list(_NAMES)
