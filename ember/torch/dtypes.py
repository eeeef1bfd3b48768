"""PyTorch dtypes ↔ ember dtypes: the same names (``torch.float32`` ↔ ``ember.float32``)."""

from __future__ import annotations

import torch

import ember as em
from ember.errors import DTypeError

_TO_EMBER = {getattr(torch, name): dtype for name, dtype in em.dtypes.BY_NAME.items() if hasattr(torch, name)}
_TO_TORCH = {dtype: torch_dtype for torch_dtype, dtype in _TO_EMBER.items()}


def to_ember(dtype: torch.dtype) -> em.dtypes.DType:
    """The ember dtype of a PyTorch dtype; DTypeError for one ember lacks (float16, bfloat16, …)."""
    found = _TO_EMBER.get(dtype)  # every op asks: a lookup, not a name
    if found is None:
        raise DTypeError(f"ember.torch: ember has no dtype {dtype} (it holds the Array API's 13 dtypes)")
    return found


def to_torch(dtype: em.dtypes.DType) -> torch.dtype:
    """The PyTorch dtype of an ember dtype."""
    return _TO_TORCH[dtype]
