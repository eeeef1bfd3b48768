"""What the peer sends while a batch runs: each served connection's :class:`Link` (the lock its
two writers share) and the one :class:`Heartbeat` thread that sends ``alive`` frames on the links
whose session asked for keepalives (docs/protocol.md, "Keepalives")."""

from __future__ import annotations

import select
import socket
import threading
import time

from ..errors import EmberError
from ..wire import protocol as wire

_ALIVE = wire.encode_frame({"t": "alive"})


class Link:
    """A served connection and what its two writers share: the session's thread, which sends
    replies, and the heartbeat, which sends ``alive`` frames while a batch runs."""

    def __init__(self, connection):
        self.connection = connection
        self.lock = threading.Lock()
        self.interval: float | None = None     # seconds between alive frames (None: the client asked for none)
        self.busy_since: float | None = None   # when the running batch started (None: between batches)
        self.last_alive = 0.0

    def send(self, replies) -> None:
        """Send reply frames ((header, segments) pairs); the batch is over, so no alive frame follows."""
        with self.lock:
            self.busy_since = None
            for header, segments in replies:
                self.connection.send(wire.encode_frame(header, segments))

    def beat(self, now: float) -> None:
        """Send an alive frame if a batch has run an interval since it began or since the last one."""
        started = self.busy_since
        if started is None or now - max(started, self.last_alive) < self.interval:
            return
        if not self.lock.acquire(blocking=False):  # the session is sending replies: no need
            return
        try:
            # busy_since is cleared under the lock before the session reads again: the socket is ours;
            # a client that does not read (its buffers full) gets no alive frame rather than a stalled heartbeat
            if self.busy_since is not None and _writable(self.connection.sock):
                self.connection.send(_ALIVE)
                self.last_alive = now
        except EmberError:
            pass  # the session's thread finds out for itself
        finally:
            self.lock.release()


class Heartbeat:
    """One thread for all sessions that asked for keepalives: each of their links beats every
    half of the shortest interval."""

    def __init__(self):
        self.links: set[Link] = set()
        self.wake = threading.Condition()
        self.stopped = False

    def add(self, link: Link) -> None:
        """Beat ``link`` from now on (its session asked for keepalives)."""
        with self.wake:
            self.links.add(link)
            self.wake.notify()  # its interval may be shorter than the current wait

    def remove(self, link: Link) -> None:
        """Beat ``link`` no more (its session ended)."""
        with self.wake:
            self.links.discard(link)

    def run(self) -> None:
        """Beat the links until :meth:`stop` (the server's ``ember-heartbeat`` thread)."""
        with self.wake:
            while not self.stopped:
                self.wake.wait(min((link.interval for link in self.links), default=60.0) / 2)
                now = time.monotonic()
                for link in self.links:
                    link.beat(now)

    def stop(self) -> None:
        """End :meth:`run` (the peer is stopping)."""
        with self.wake:
            self.stopped = True
            self.wake.notify()


def _writable(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    return bool(poller.poll(0))
