"""Sessions that resume after a lost connection, on the peer's side, without I/O (docs/protocol.md,
"Sessions that resume").

A client that asks for it at the handshake (``"resume": true``) gets a resumable session: a
32-byte secret and the window it is kept for after its connection is lost. Its batches are
numbered; :class:`Resumable` runs each number once and keeps the replies to the last one, so a
batch sent again after a resume is answered from what it already did. When the connection is
lost the shell parks the session (:meth:`Parking.park`): its tensors stay, counted as before,
until a ``resume`` frame proves it is its client — the secret, compared in constant time, and the
token checked again (``Host.resume``) — or its window passes (:meth:`Parking.expire`).
"""

from __future__ import annotations

import hmac
import secrets
import threading
from collections import OrderedDict

from ..errors import ProtocolError
from ..profiling import format_bytes

RESUME_WINDOW = 300.0  # seconds a lost session is kept for its client, by default (--resume-window)
SECRET_BYTES = 32
GONE_KEPT = 1024  # why sessions went, remembered for the resumes that come too late
_DUMMY = secrets.token_bytes(SECRET_BYTES)  # compared against for an unknown session: the same time as a known one
NOTHING_KEPT = (0, ())  # a Resumable's kept replies once its client has had them (no batch is numbered 0)


class Resumable:
    """A resumable session's side of the numbering: the last batch handled and its replies, the
    secret its client proves itself with, and whether (since when) it is parked."""

    __slots__ = ("secret", "done", "kept", "parked_at", "lock", "holder")

    def __init__(self, secret: bytes):
        self.secret = secret
        self.done = 0           # the highest batch number handled
        self.kept: tuple = NOTHING_KEPT  # (n, replies) of the last batch handled: a resent one is answered from it
        self.parked_at = None   # when its connection was lost (it waits for a resume), else None
        self.lock = threading.Lock()  # held by the connection serving it: a resume waits for the old one to let go
        self.holder = None      # the shell's link of that connection, which a resume ends (connections.py)

    def admit(self, n) -> bool:
        """Whether batch ``n`` is new (True) or one already handled and sent again after a resume
        (False: answer it with :meth:`repeat`). ProtocolError for a missing number or a gap."""
        if type(n) is not int or n < 1:
            raise ProtocolError(f"a batch of a resumable session is numbered: its 'n' must be an integer ≥ 1, "
                                f"got {n!r:.20}")
        if n <= self.done:
            return False
        if n != self.done + 1:
            raise ProtocolError(f"batch {n} came after batch {self.done}: the batches between were lost")
        self.kept = NOTHING_KEPT  # the client had the last replies before it sent more: their tensors' buffers may go
        return True

    def repeat(self, n: int) -> list:
        """The replies to batch ``n``, handled already: those kept if it was the last, else none (its
        client had them before it sent more)."""
        number, replies = self.kept
        return replies if number == n else []

    def handled(self, n: int, header: dict, replies: list) -> list:
        """Batch ``n`` (its ``header``) was handled with ``replies``: keep them, acknowledged; an
        ``ack`` frame where it asked for one and has no reply."""
        self.done = n
        if replies:
            replies[0][0]["ack"] = n  # every reply carries the highest batch handled
        elif header.get("ask"):
            replies = [({"t": "ack", "n": n}, [])]
        self.kept = (n, replies)
        return replies


class Parking:
    """The resumable sessions of a peer and the parked ones among them, by session id: who may
    claim one back, which have waited past ``window`` seconds, and why a session is gone."""

    def __init__(self, window: float = RESUME_WINDOW):
        self.window = window
        self.sessions: dict = {}  # id → session, every resumable session, parked or not
        self.gone: OrderedDict = OrderedDict()  # id → why it is gone, the latest GONE_KEPT
        self.lock = threading.Lock()

    def issue(self, session) -> bytes:
        """Make ``session`` resumable: its secret."""
        session.resumable = Resumable(secrets.token_bytes(SECRET_BYTES))
        with self.lock:
            self.sessions[session.id] = session
        return session.resumable.secret

    def find(self, session_id, secret) -> object | None:
        """The session of ``session_id`` if ``secret`` is its own, else None (in constant time either way)."""
        with self.lock:
            session = self.sessions.get(session_id) if type(session_id) is str else None
        known = session.resumable.secret if session is not None else _DUMMY
        good = type(secret) is bytes and hmac.compare_digest(known, secret)
        return session if good and session is not None else None

    def park(self, session, now: float) -> None:
        """``session``'s connection is lost: keep it for its window."""
        session.resumable.parked_at = now

    def expired(self, now: float) -> list:
        """The parked sessions whose window has passed (the caller closes them); they are gone."""
        with self.lock:
            late = [s for s in self.sessions.values()
                    if s.resumable.parked_at is not None and now - s.resumable.parked_at > self.window]
        for session in late:
            table = session.table
            self.forget(session, f"its connection was lost more than {self.window:g} s ago (the peer's "
                                 f"--resume-window), and its {len(table.sizes)} array(s) on the peer "
                                 f"({format_bytes(table.live_bytes())}) were freed")
        return late

    def forget(self, session, why: str) -> None:
        """``session`` is gone (closed, expired): remember why, for a resume that comes too late."""
        with self.lock:
            if self.sessions.pop(session.id, None) is not None:
                self.gone[session.id] = why
                while len(self.gone) > GONE_KEPT:
                    self.gone.popitem(last=False)

    def why_gone(self, session_id) -> str:
        """Why the session of ``session_id`` cannot be resumed."""
        with self.lock:
            why = self.gone.get(session_id) if type(session_id) is str else None
        return why or "the peer does not know it (it may have restarted, or the secret is wrong)"
