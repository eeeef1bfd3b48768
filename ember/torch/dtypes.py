"""PyTorch dtypes ↔ ember dtypes: the same names (``torch.float32`` ↔ ``ember.float32``)."""

from __future__ import annotations

import torch

import ember as em
from ember.errors import DTypeError


def to_ember(dtype: torch.dtype) -> em.dtypes.DType:
    """The ember dtype of a PyTorch dtype; DTypeError for one ember lacks (float16, bfloat16, …)."""
    found = em.dtypes.BY_NAME.get(str(dtype).removeprefix("torch."))
    if found is None:
        raise DTypeError(f"ember.torch: ember has no dtype {dtype} (it holds the Array API's 13 dtypes)")
    return found


def to_torch(dtype: em.dtypes.DType) -> torch.dtype:
    """The PyTorch dtype of an ember dtype."""
    return getattr(torch, dtype.name)
