"""The tensors a session's frames bring, without a session: ``Uploads`` as the frame reader and
the messages of a frame use it — each segment counted as it arrives, declined with its reason
when there is no room, and counted no more once its frame is handled unless a message kept it.
"""

from __future__ import annotations

import numpy as np

from ember.remote.memory import TENSOR_OVERHEAD, Budget, BufferPool, Quota
from ember.remote.uploads import Uploads
from ember.wire.protocol import Limits

O = TENSOR_OVERHEAD  # noqa: E741  (what each tensor id costs besides its data)


def _uploads(quota: int = 1 << 20) -> Uploads:
    budget = Budget(1 << 30)
    return Uploads(Quota(Limits(max_session_bytes=quota), budget, {}), BufferPool(budget=budget))


def test_a_received_segment_is_counted_until_a_message_keeps_it_or_its_frame_ends():
    uploads = _uploads()
    kept, unused = uploads.allocate((4,), np.dtype(np.float64)), uploads.allocate((2,), np.dtype(np.float64))
    assert uploads.quota.used == 32 + O + 16 + O
    assert uploads.begin([kept, unused]) == 48 and uploads.claim(kept) == 32 + O  # a put takes its reservation over
    uploads.end([kept, unused])
    assert uploads.quota.used == 32 + O and not uploads.reserved  # the unused one's bytes went back
    assert uploads.claim(np.zeros(2)) is None  # not received here: nothing reserved


def test_a_segment_with_no_room_is_declined_and_its_message_is_told_why():
    uploads = _uploads(quota=100)
    assert uploads.allocate((100,), np.dtype(np.float64)) is None and uploads.quota.used == 0
    assert uploads.begin([None, np.zeros(0)]) == 0
    assert uploads.reason(0) == f"{800 + O} more bytes would exceed this session's quota of 100 bytes (0 in use)"
    assert uploads.reason(1) == "declined" and not uploads.declined  # taken by the frame it belongs to
