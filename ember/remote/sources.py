"""This peer as the *source* of transfers between peers: it answers other peers' ``fetch``
frames with the tensors its sessions granted (:mod:`ember.remote.transfers` is the logic,
:mod:`ember.remote.fetching` the other end). ``connections.py`` hands it the connections whose
first frame is a fetch.

A fetch connection counts as a handshake until its capability is known good: it waits for its
grant within the handshake's deadline and limits. A grant is used once the destination says the
tensor arrived (``got``); a connection cut before that grants it again, for the destination's next
try. Once good, the connection is kept for the next fetches of that peer
(:mod:`ember.remote.links`), a bounded number of them.
"""

from __future__ import annotations

import logging
import threading
import time

from ..errors import EmberError
from ..wire.tcp import TimedOut
from . import links
from .host import Host

log = logging.getLogger("ember.serve")
CONFIRM_SECONDS = 10  # how long a source waits for the destination's "got" before it grants the tensor again


class Sources:
    """This peer as the source of transfers: it answers the ``fetch`` frames of other peers, on the
    connection that brought the first one and, once a capability was good, on the same connection
    for the next ones (at most ``max_links`` such connections are kept)."""

    def __init__(self, hosting: Host, stopping: threading.Event, max_links: int, handshake_timeout: float):
        self.hosting, self.stopping = hosting, stopping
        self.max_links, self.handshake_timeout = max_links, handshake_timeout
        self.links = 0  # connections of other peers kept open for their next fetch (a thread each)
        self._lock = threading.Lock()

    def answer(self, link, init, address: str, deadline: float) -> bool:
        """Answer another peer's fetch: to its hello (a fetch frame without a capability) this peer's
        identity, then, waiting (within the handshake deadline: the connection has not authenticated
        until its capability is known) for the grant, the tensor or a refusal. The connection counts
        as a handshake all along. True when the tensor was sent."""
        replies, grant = self._answer(init, deadline)
        if replies[0][0]["t"] == "peer":  # the hello: the destination presents its capability once it knows who we are
            link.send(replies)
            frame = link.connection.receive()  # still within the handshake's deadline and limits
            if frame.header.get("t") != "fetch":
                return False
            replies, grant = self._answer(frame, deadline)
            if replies[0][0]["t"] == "peer":  # a second hello: no capability is coming
                return False
        if grant is None:
            link.send(replies)
            log.info("%s: transfer refused: %s", address, replies[0][0].get("reason"))
            return False
        transfers = self.hosting.transfers
        try:
            link.send(replies)
            arrived = link.connection.receive(CONFIRM_SECONDS).header.get("t") == "got"
        except (EmberError, OSError):
            arrived = False
        if not arrived:  # cut while it was sent, or silent: granted again, for the destination's next try
            transfers.unclaim(grant)
            log.info("%s: a granted tensor of %d bytes was sent, but its arrival was not confirmed", address,
                     replies[0][1][0].nbytes)
            return False
        transfers.confirm(grant)
        log.info("%s: sent a granted tensor of %d bytes", address, replies[0][1][0].nbytes)
        return True

    def _answer(self, frame, deadline: float):
        transfers = self.hosting.transfers
        while True:
            generation = transfers.generation
            answer = self.hosting.answer_fetch(frame, final=time.monotonic() >= deadline or self.stopping.is_set())
            if answer is not None:
                return answer
            transfers.wait(generation, deadline - time.monotonic())

    def hold(self) -> bool:
        """Whether a fetch connection that was answered with its tensor may stay open for the next
        fetch (:meth:`let_go` when it ends): up to ``max_links``, and none while the peer stops."""
        with self._lock:
            if self.links >= self.max_links or self.stopping.is_set():
                return False
            self.links += 1
            return True

    def let_go(self) -> None:
        with self._lock:
            self.links -= 1

    def answer_more(self, link, address: str) -> None:
        """Answer the further fetches of a peer whose first one presented a good capability, each
        checked as the first was, until one is refused, anything else comes, or none for
        FETCH_LINK_SECONDS: a peer fetching again (an ``all_reduce``'s rounds, a training loop's
        moves) pays no new connection, thread or TLS handshake."""
        connection = link.connection
        connection.deadline = None
        connection.set_timeout(links.FETCH_LINK_SECONDS)  # how long both ends keep a link (links.py)
        while True:
            try:
                frame = connection.receive()
            except TimedOut:
                return
            if frame.header.get("t") != "fetch":
                return
            if not self.answer(link, frame, address, time.monotonic() + self.handshake_timeout):
                return
