"""The tensors a session's frames bring, counted as they arrive, without I/O.

The frame reader asks :meth:`Uploads.allocate` where each received tensor goes — a buffer from
the peer's pool, counted through the session's quota with its id's overhead (a frame of empty
tensors costs), or None to read its bytes and drop them when there is no room. A message that
keeps a segment (``put``, a graph's constant) claims its reservation; a declined segment's
message says why it was declined; what no message kept counts no more once the frame is handled.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from .memory import TENSOR_OVERHEAD, BufferPool, Quota


class Uploads:
    """The received segments of one session's frames, their reservations until a message keeps them."""

    def __init__(self, quota: Quota, pool: BufferPool):
        self.quota, self.pool = quota, pool
        self.reserved: dict[int, int] = {}   # id of a buffer allocate() gave -> its bytes, until a message keeps it
        self.declined: deque[str] = deque()  # why allocate() declined segments not yet handled, in order
        self.reasons: dict[int, str] = {}    # … those of the frame being handled, by segment

    def allocate(self, shape: tuple, dtype) -> np.ndarray | None:
        """Where a received tensor goes (the frame reader's hook, once the session is open): a
        buffer counted against the quota and the budget, or None to read its bytes and drop them."""
        reason = self.quota.reserve(math.prod(shape) * dtype.itemsize + TENSOR_OVERHEAD)
        if reason is not None:  # why, for the message that meets this segment (frames come in order)
            self.declined.append(reason)
            return None
        array = self.pool.allocate(shape, dtype)
        self.reserved[id(array)] = array.nbytes + TENSOR_OVERHEAD
        return array

    def begin(self, segments: list) -> int:
        """A frame with ``segments`` is handled: take the reasons of those declined; returns the
        bytes that arrived."""
        declined = self.declined
        self.reasons = {i: declined.popleft() if declined else "declined"
                        for i, segment in enumerate(segments) if segment is None}
        return sum(s.nbytes for s in segments if s is not None)

    def claim(self, segment: np.ndarray) -> int | None:
        """The bytes reserved for ``segment`` as it arrived, which a message keeping it takes over;
        None if none were (it did not come through :meth:`allocate`)."""
        return self.reserved.pop(id(segment), None)

    def reason(self, index: int) -> str:
        """Why segment ``index`` of the frame being handled was declined."""
        return self.reasons.get(index, "declined")

    def end(self, segments: list) -> None:
        """The frame is handled: segments no message kept (a refused frame, an unused segment) count no more."""
        reserved = self.reserved
        for segment in segments:
            nbytes = reserved.pop(id(segment), 0) if segment is not None else 0
            if nbytes:
                self.quota.give(nbytes)
