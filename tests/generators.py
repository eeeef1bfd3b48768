"""The drawing source ``g`` that op-row recipes use (see tests/recipes/), on hypothesis."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ember import dtypes as dt
from ember.backends.numpy import EMBER, NATIVE


class Drawer:
    """Draws shapes, dtypes and host arrays for one example, limited to ``dtypes``."""

    def __init__(self, data, dtypes=dt.ALL, distinct: bool = False):
        self.data = data
        self.dtypes = tuple(dtypes)
        self.distinct = distinct  # floating arrays without repeated values (no ties for gradients)

    def draw(self, strategy):
        return self.data.draw(strategy)

    def shape(self, min_dims=0, max_dims=3, min_side=0, max_side=4) -> tuple:
        return self.draw(hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side))

    def dtype(self, category: str) -> dt.DType:
        choices = [d for d in self.dtypes if dt.in_category(d, category)]
        return self.draw(st.sampled_from(choices))

    def dtype_of(self, host: np.ndarray) -> dt.DType:
        return EMBER[host.dtype]

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def choice(self, seq):
        return self.draw(st.sampled_from(list(seq)))

    def flag(self) -> bool:
        return self.draw(st.booleans())

    def permutation(self, seq):
        return self.draw(st.permutations(list(seq)))

    def broadcastable(self, shape: tuple, only_smaller: bool = False) -> tuple:
        """A shape that broadcasts with ``shape``: some leading axes dropped, some sizes set to 1."""
        keep = self.integer(0, len(shape))
        out = [s if self.flag() else 1 for s in shape[len(shape) - keep:]]
        if not only_smaller and self.flag():
            out = [1] * self.integer(0, 1) + out
        return tuple(out)

    def array(self, shape, dtype: dt.DType, low=None, high=None, nonzero=False) -> np.ndarray:
        native = NATIVE[dtype]
        if dtype.kind == dt.BOOL:
            elements = st.booleans() if not nonzero else st.just(True)
        elif dtype.kind in (dt.SIGNED, dt.UNSIGNED):
            info = np.iinfo(native)
            lo = max(info.min, -10 if low is None else low)
            hi = min(info.max, 10 if high is None else high)
            elements = st.integers(lo, hi)
            if nonzero:
                elements = elements.filter(bool) if (lo, hi) != (0, 0) else st.just(1)
        else:
            width = 32 if dtype in (dt.float32, dt.complex64) else 64
            lo = -10.0 if low is None else float(low)
            hi = 10.0 if high is None else float(high)
            real = st.floats(lo, hi, width=width, allow_subnormal=False)
            if nonzero:
                real = real.filter(lambda v: abs(v) > 1e-3)
            if self.distinct:  # for gradients: no ties, and no kinks of abs/sign/copysign within a step
                real = real.filter(lambda v: abs(v) > 1e-2)
            elements = real if dtype.kind == dt.REAL else st.builds(complex, real, real)
            if self.distinct:
                return self.draw(hnp.arrays(native, shape, elements=elements, unique=True))
        return self.draw(hnp.arrays(native, shape, elements=elements))
