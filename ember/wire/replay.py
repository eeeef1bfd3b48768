"""What a resumable session's client keeps for a resume: its batches, numbered, until the peer
acknowledges them (docs/protocol.md, "Sessions that resume").

Each batch frame of a resumable session carries ``"n"``, its sequence number (1, 2, … without a
gap), and every reply the peer sends carries ``"ack"``, the highest number it has handled. The
:class:`Outbox` keeps every frame numbered and not yet acknowledged, in order, so that after a
reconnection the client sends again exactly those the peer has not seen: the peer runs each number
once (a repeat is answered from the reply it kept), so nothing is lost and nothing runs twice. The
outbox is bounded in bytes (EMBER_RESUME_BUFFER): past half the bound a batch asks for an
acknowledgement (``"ask"``), and past the bound the shell waits for one before it sends more.
"""

from __future__ import annotations

from collections import deque

from ..errors import ProtocolError
from .protocol import encode_frame

RESUME_BUFFER = 256 << 20  # bytes of unacknowledged batches a client keeps, by default (EMBER_RESUME_BUFFER)


class Outbox:
    """Numbered frames sent and not yet acknowledged, within ``bound`` bytes (one larger frame fits
    alone)."""

    def __init__(self, bound: int = RESUME_BUFFER):
        self.bound = bound
        self.kept: deque = deque()  # (n, frame buffers, bytes), oldest first
        self.held = 0               # bytes of the frames kept
        self.peak = 0               # the most ever held
        self.last = 0               # the last number given
        self.acked = 0              # the highest the peer acknowledged
        self._asked = 0             # the number whose batch last asked for an acknowledgement

    def frame(self, header: dict, segments: list) -> list:
        """Batch ``header`` and its ``segments`` as a frame (``encode_frame``), numbered, asking for
        an acknowledgement where :meth:`asking` says, and kept until acknowledged."""
        n = header["n"] = self.last = self.last + 1
        if self.held * 2 > self.bound and self.asking():  # asking()'s first test, before its call
            header["ask"] = True
        frame = encode_frame(header, segments)
        # a small frame is one buffer of bytes
        nbytes = len(frame[0]) if len(frame) == 1 else sum(len(b) if type(b) is bytes else b.nbytes for b in frame)
        self.kept.append((n, frame, nbytes))
        self.held += nbytes
        if self.held > self.peak:
            self.peak = self.held
        return frame

    def acknowledge(self, n: int) -> None:
        """The peer has handled every batch up to ``n``: let their frames go. ProtocolError for a
        number not yet given (a peer that acknowledges what it cannot have seen)."""
        if n == self.last and type(n) is int:  # all that was sent (a round trip's reply): no walk along the kept
            self.acked = n
            if self.kept:
                self.kept.clear()
                self.held = 0
            return
        if type(n) is not int or n > self.last:
            raise ProtocolError(f"the peer acknowledged batch {n!r}, but the last one sent is {self.last}")
        if n <= self.acked:
            return
        self.acked = n
        kept = self.kept
        while kept and kept[0][0] <= n:
            self.held -= kept.popleft()[2]

    def asking(self) -> bool:
        """Whether the next batch should ask for an acknowledgement: more than half the bound is
        held, and no batch asked since the last acknowledgement (a stream that only writes gets
        no replies, hence no acknowledgements, unless it asks)."""
        if self.held * 2 <= self.bound or self._asked > self.acked:
            return False
        self._asked = self.last + 1
        return True

    def full(self, nbytes: int = 0) -> bool:
        """Whether ``nbytes`` more would pass the bound (an empty outbox takes any one frame)."""
        return bool(self.kept) and self.held + nbytes > self.bound

    def frames(self) -> list:
        """The frames to send again after a resume, oldest first: those not acknowledged."""
        return [frame for _, frame, _ in self.kept]
