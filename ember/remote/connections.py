"""What a compute peer does with one connection it accepted (``server.py`` accepts and admits them).

On the connection's own thread (:class:`Connections`): TLS first when the peer serves it, then
what the client speaks, told by its first four bytes — ember's TCP frames, a WebSocket upgrade, or
a plain HTTP request for the peer's status, answered at once (``http.py``, ``status.py``) —, then
its first frame. An ``init`` is the handshake of a session, which the sans-I/O
:class:`~ember.remote.host.Host` opens; frames then move between the socket and the
:class:`~ember.remote.session.Session` until the client closes or stays idle too long. A ``fetch``
is another peer's, answered by :class:`~ember.remote.sources.Sources` on a link it may keep. A
``resume`` claims back a session whose connection was lost (parked, not closed: ``resume.py``). A
connection that came when the peer was full is answered ``PeerBusy`` in its own framing
(:meth:`Connections.refuse`). ``heartbeat.py`` keeps clients whose batch runs long informed that
the peer is alive. Nothing here computes: the shell only moves bytes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import select
import socket
import ssl
import threading
import time

from ..errors import EmberError, ProtocolError
from ..wire import protocol as wire
from ..wire.protocol import HANDSHAKE_LIMITS, Limits
from ..wire.tcp import TcpConnection, TimedOut, spin_wait, wait_limit
from ..wire.tls import HANDSHAKE_RECORD
from ..wire.websocket import accept as accept_websocket
from . import http, status
from .heartbeat import Heartbeat, Link
from .memory import BufferPool
from .slots import Slots
from .sources import Sources

log = logging.getLogger("ember.serve")

FIRST_BYTES_SECONDS = 3  # the first four bytes (what the client speaks) within this, and within the handshake's
REFUSAL_SECONDS = 2      # a connection refused as busy: its first bytes, TLS and first frame, all within this
LOG_EVERY = 10           # seconds: a trouble that repeats (busy refusals, lost connections) is logged at most this often
#: what a process runs out of: accept() (or a connection's receive) fails until files or memory come back
SCARCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_TLS_REQUIRED = "this peer requires TLS: connect with embers:// (TCP) or wss:// (WebSocket)"


class Connections:
    """Serves the connections a :class:`~ember.remote.server.Server` accepted, each on a thread of
    its own: :meth:`serve` one that holds a handshake slot, :meth:`refuse` one that found them full.

    What it shares with the server is passed in: ``hosting`` (the peer's
    :class:`~ember.remote.host.Host`), ``sources`` (answering other peers' fetches), ``runner``
    (where a session's fetches run), the TLS context, ``limits`` and timeouts, ``spin`` (how long
    to poll for a client's next frame); the ``slots`` (``slots.py``) and the ``links`` served now
    (which the server closes as it stops), both under ``lock``; and the ``heartbeat``, whose thread
    the server runs."""

    def __init__(self, hosting, sources: Sources, runner, *, tls: ssl.SSLContext | None, limits: Limits, stopping,
                 idle_timeout: float | None, handshake_timeout: float, spin: float, slots: Slots,
                 lock: threading.Lock, links: set[Link], heartbeat: Heartbeat):
        self.hosting, self.sources, self.runner, self.tls = hosting, sources, runner, tls
        self.limits, self.idle_timeout, self.handshake_timeout, self.spin = limits, idle_timeout, handshake_timeout, spin
        self.slots, self.lock, self.links, self.heartbeat = slots, lock, links, heartbeat
        self.stopping = stopping  # whether the peer is stopping: a lost session is then closed, not parked
        self.busy_log = _Throttled(LOG_EVERY)  # connections refused as busy
        self.lost_log = _Throttled(LOG_EVERY)  # connections lost to a lack of files or memory
        self.unchecked_log = _Throttled(LOG_EVERY)  # handshakes refused unchecked: their address must wait

    def serve(self, sock: socket.socket, address: str, key: str) -> None:
        """Serve an accepted connection from ``address`` (whose share of the slots is ``key``'s),
        which holds a handshake slot: open it, and by its first frame answer another peer's fetches
        or open a session and serve it until it ends; every slot it holds is given back, its socket
        closed, whatever happens."""
        link = session = None
        who = address
        lost = False  # the connection was lost (not closed, timed out or refused): a resumable session is parked
        slot = _Slot(self.slots.handshakes, key, self.lock)
        try:
            pool = self.hosting.pool  # one pool for the peer, within its memory budget
            deadline = time.monotonic() + self.handshake_timeout
            connection, plain_on_tls = self._open(sock, pool, deadline, address)
            if connection is None:  # an HTTP request, answered
                return
            link = Link(connection)
            with self.lock:
                self.links.add(link)
            init = connection.receive()
            if init.header.get("t") == "fetch" and not plain_on_tls:  # another peer, fetching a granted tensor
                self._answer_fetches(link, init, address, slot, deadline)
                return
            resuming = init.header.get("t") == "resume" and not plain_on_tls
            if plain_on_tls:  # refused after its init frame is read, so the refusal is not lost to a reset
                replies = [({"t": "refuse", "kind": "TLSError", "reason": _TLS_REQUIRED}, [])]
            elif resuming:  # a session whose connection was lost, claimed back by its client (remote/resume.py)
                session, replies = self.hosting.resume(init, address)
                if session is not None and self._take_over(session.resumable, link, deadline):
                    replies = self.hosting.resumed(session, init, address)
                elif session is not None:
                    session, replies = None, [({"t": "refuse", "kind": "PeerBusy", "reason": "the session's old "
                                                "connection still holds it; try again"}, [])]
            else:
                session, replies = self.hosting.open(init, pool, address)
                if session is not None and session.resumable is not None:
                    session.resumable.lock.acquire()  # this connection serves it until it is parked or closed
            slot.give_back()  # done, before the client hears of it: it may connect again at once
            link.send(replies)
            if session is None:
                refusal = replies[0][0]
                if "wait" in refusal:  # a flood of guesses: a line now and then, not one each
                    self.unchecked_log.note(f"{address}: refused ({refusal['kind']}): {refusal['reason']}")
                else:
                    log.warning("%s: refused (%s): %s", address, refusal["kind"], refusal["reason"])
                return
            info = replies[0][0]
            name = session.client  # its authorizer's name for it, else its address
            who = name if name == address else f"{name} ({address})"
            if resuming:
                log.info("%s: session resumed (batch %d handled)", who, info["ack"])
            else:
                log.info("%s: session opened on device %s (%s)", who, init.header.get("device", 0), info["device"])
            if session.resumable is not None:
                session.resumable.holder = link
            self._converse(link, session, info, who)
        except ProtocolError as error:
            log.warning("%s: closing the connection: %s", who, error)
            self.hosting.failed(who, "ProtocolError", str(error))
            if link is not None:
                try:
                    link.send([({"t": "error", "kind": "ProtocolError", "reason": str(error)}, [])])
                except EmberError:
                    pass
        except ssl.SSLError as error:  # a client that refused the certificate, or spoke something else
            log.warning("%s: closing a TLS connection: %s", who, error.reason or error)
        except (EmberError, OSError) as error:  # the client went away, or missed its handshake deadline …
            lost = True
            scarce = _scarcity(error)
            if scarce is not None:  # … or this process ran out of memory or buffers: that is the peer's to say
                self.lost_log.note(f"{who}: connection lost: {scarce}")
        except Exception:  # never let one session take the server down
            log.exception("%s: unexpected error in a session", who)
        finally:
            if session is not None and session.resumable is not None:
                session.resumable.holder = None
                if lost and not self.stopping():  # kept for its client to resume, for the resume window
                    self.hosting.park(session, time.monotonic())
                    log.info("%s: connection lost; the session is kept %g s for its client to resume", who,
                             self.hosting.parking.window)
                else:
                    self.hosting.close(session)
                    log.info("%s: session closed", who)
                session.resumable.lock.release()
            elif session is not None:
                self.hosting.close(session)
                log.info("%s: session closed", who)
            if link is not None:
                self.heartbeat.remove(link)
                link.connection.close()
                with self.lock:
                    self.links.discard(link)
            else:
                sock.close()
            slot.give_back()

    def _take_over(self, resumable, link: Link, deadline: float) -> bool:
        """Take a resumed session's lock (its ``resumable``'s) from the connection that served it,
        ending that one first if it still does (a half-open connection the client has given up on);
        False if it does not let go before ``deadline``."""
        old = resumable.holder
        if old is not None and old is not link:
            with contextlib.suppress(OSError):
                old.connection.sock.shutdown(socket.SHUT_RDWR)
        return resumable.lock.acquire(timeout=max(0.0, deadline - time.monotonic()))

    def _answer_fetches(self, link: Link, init, address: str, slot: _Slot, deadline: float) -> None:
        """Answer another peer's fetch (``init``) in a slot of the fetches', then, once its capability
        proved good, its next fetches on the same link, which then holds no slot."""
        busy = slot.move(self.slots.fetches)  # it waits for its grant in a slot of the fetches', not in a client's
        if busy is not None:  # refused with retry: the fetching peer asks again after a pause
            self.busy_log.note(f"{address}: refused a fetch: {busy}")
            link.send([({"t": "refuse", "kind": "PeerBusy", "reason": busy, "retry": True}, [])])
            return
        if self.sources.answer(link, init, address, deadline) and self.sources.hold():
            slot.give_back()  # its capability was good: the connection is no handshake now
            try:
                self.sources.answer_more(link, address)
            finally:
                self.sources.let_go()

    def _converse(self, link: Link, session, info: dict, who: str) -> None:
        """Serve an opened session: each frame received is handled and its replies sent, until the
        client closes, or sends nothing for the idle timeout (answered ``ConnectionLost``)."""
        connection = link.connection
        connection.deadline = None  # the handshake is done: the session's own limits and timeout
        connection.set_limits(self.limits)
        connection.reader.allocate = session.allocate  # received tensors count against its quota and the budget
        session.runner = self.runner  # fetches from other peers run beside the session
        connection.set_timeout(self.idle_timeout)
        if info.get("keepalive"):
            link.interval = info["keepalive"]
            self.heartbeat.add(link)
        while True:
            try:
                frame = connection.receive()
            except TimedOut:
                reason = f"closed after {self.idle_timeout:g} s without a frame (the peer's idle timeout)"
                log.info("%s: %s", who, reason)
                link.send([({"t": "error", "kind": "ConnectionLost", "reason": reason}, [])])
                return
            if frame.header.get("t") == "close":
                return
            link.busy_since = time.monotonic()
            # no name holds the replies past the send: their segments would keep tensors' buffers from the pool
            link.send(session.handle(frame))
            # the client's next frame often follows within microseconds (the next batch of a loop, the next
            # request): awake, the peer sees it at once, and the client's send need not wake a sleeping thread,
            # which on a VM costs the sender some 15 µs a frame
            spin_wait(connection, self.spin)

    def refuse(self, refusal: Refusal, address: str, reason: str) -> None:
        """Answer a connection that came when the peer was full with ``PeerBusy`` (``reason``) in its
        framing, within REFUSAL_SECONDS: its first frame read — an init refused as a session, a
        fetch with ``retry`` — or its HTTP request answered with a 503; then close it."""
        connection = None
        try:
            deadline = time.monotonic() + min(REFUSAL_SECONDS, self.handshake_timeout)
            connection, plain_on_tls = self._open(refusal.sock, self.hosting.pool, deadline, address, busy=reason,
                                                  holder=refusal)
            if connection is None:  # an HTTP request, answered
                return
            refusal.sock = connection.sock
            try:
                first = connection.receive()  # read whole, so that closing after the answer sends no reset
            except ProtocolError as error:  # it speaks no ember (a TLS client of a plain peer): as a session would be
                connection.send(wire.encode_frame({"t": "error", "kind": "ProtocolError", "reason": str(error)}))
                return
            if plain_on_tls:
                answer = {"t": "refuse", "kind": "TLSError", "reason": _TLS_REQUIRED}
            else:
                answer = {"t": "refuse", "kind": "PeerBusy", "reason": reason}
                if first.header.get("t") == "fetch":  # another peer's fetch: asked again, later
                    answer["retry"] = True
            connection.send(wire.encode_frame(answer))
        except (EmberError, OSError, ValueError):  # gone, too slow, or displaced by a newer refusal
            pass
        except Exception:  # never let one connection take the server down
            log.exception("%s: unexpected error refusing a connection", address)
        finally:
            if connection is not None:
                connection.close()
            else:
                refusal.sock.close()
            with self.lock:
                self.slots.refusals.give_back(refusal)

    def _open(self, sock: socket.socket, pool: BufferPool, deadline: float, address: str, busy: str | None = None,
              holder: Refusal | None = None):
        """The frame connection of an accepted socket, on its own thread, before ``deadline``: TLS
        first (when served and when the client starts it), then TCP, WebSocket or a plain HTTP
        request (answered here: the connection is then None) by the first bytes, which must come
        within FIRST_BYTES_SECONDS. Also whether the client skipped the TLS this peer requires.
        ``busy``: the peer is full, and an HTTP request is answered 503 with that reason;
        ``holder``'s socket follows the connection's into TLS (so that it can be ended from outside)."""
        try:
            first = _peek(sock, 4, min(deadline, time.monotonic() + FIRST_BYTES_SECONDS))
            received = b""
            tls = self.tls is not None and first[:1] == HANDSHAKE_RECORD
            if tls:
                sock.settimeout(wait_limit(None, deadline))  # the whole TLS handshake, not each read
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                if holder is not None:
                    holder.sock = sock
                sock.do_handshake()
                first = received = _receive_exactly(sock, 4, deadline)  # an SSLSocket cannot peek: handed on
            if first in http.STARTS:
                request = http.read_request(sock, received, deadline)
                if not request.upgrade:
                    self._answer_http(sock, request, address, deadline, plain_on_tls=self.tls is not None and not tls,
                                      busy=busy)
                    sock.close()
                    return None, False
                connection = accept_websocket(sock, HANDSHAKE_LIMITS, pool.allocate, request.raw, deadline)
            else:
                # sends within the handshake's time too; each receive waits until its deadline at most
                connection = TcpConnection(sock, HANDSHAKE_LIMITS, wait_limit(None, deadline), pool.allocate, received)
                connection.deadline = deadline
        except BaseException:
            sock.close()
            raise
        return connection, self.tls is not None and not tls

    def _answer_http(self, sock, request: http.HttpRequest, address: str, deadline: float, plain_on_tls: bool,
                     busy: str | None = None) -> None:
        """Answer a plain HTTP request: the status page, /status.json or /metrics (status.py decides);
        a 503 with the reason when the peer is ``busy``."""
        if plain_on_tls:
            response = status.Response(400, "this peer serves only TLS: use https://\n")
        elif busy is not None:
            response = status.Response(503, busy + "\n", **{"Retry-After": "1"})
        else:
            response = request.refusal or status.answer(self.hosting, request.method, request.path,
                                                        request.header("Authorization"), address, time.time())
        log.debug("%s: HTTP %s %.100s: %d", address, request.method, request.path, response.status)
        http.respond(sock, response, deadline, head_only=request.method == "HEAD")


class _Slot:
    """The slot one connection holds for its address (``key``) in a pool of :class:`Slots`, under
    ``lock``: moved to another pool, or given back once (then it holds none)."""

    __slots__ = ("pool", "key", "lock")

    def __init__(self, pool, key: str, lock: threading.Lock):
        self.pool, self.key, self.lock = pool, key, lock

    def move(self, pool) -> str | None:
        """Hold a slot of ``pool`` instead, if the address has one there (None); else why not (the
        slot held stays held)."""
        with self.lock:
            busy = pool.take(self.key)
            if busy is None:
                self.pool.give_back(self.key)
                self.pool = pool
            return busy

    def give_back(self) -> None:
        """Give the slot held back, if one is (once: a second call does nothing)."""
        with self.lock:
            if self.pool is not None:
                self.pool.give_back(self.key)
                self.pool = None


class Refusal:
    """A connection being refused as busy, in a place of the reserve (``Slots.refusals``): its
    socket (the TLS one once TLS starts), so that a newer refusal can end it from the accept loop."""

    __slots__ = ("sock", "key")

    def __init__(self, sock: socket.socket, key: str):
        self.sock, self.key = sock, key

    def end(self) -> None:
        """Wake its thread, whatever it waits in: a shutdown, not a close, so the thread closes its own file."""
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # the socket's own, not TLS's (which would unwrap it)
        except OSError:  # closed already, or between its plain and TLS socket: its deadline ends it
            pass


class _Throttled:
    """Warnings logged at most once every ``interval`` seconds, each saying how many were left out
    since the one before: a flood of refusals costs the log a line now and then."""

    def __init__(self, interval: float):
        self.interval = interval
        self.last = -math.inf
        self.left_out = 0
        self.lock = threading.Lock()

    def note(self, message: str) -> None:
        """Log ``message`` as a warning, unless one was logged within the interval (then count it)."""
        with self.lock:
            now = time.monotonic()
            if now - self.last < self.interval:
                self.left_out += 1
                return
            left_out, self.left_out, self.last = self.left_out, 0, now
        log.warning("%s%s", message, f" (and {left_out} more like it since the last such line)" if left_out else "")


def _scarcity(error: BaseException) -> OSError | None:
    """The lack of files, memory or buffers (SCARCE) behind ``error`` — itself, or the OSError a
    ConnectionLost was raised in place of — if that is what it is."""
    for cause in (error, error.__cause__, error.__context__):
        if isinstance(cause, OSError) and cause.errno in SCARCE:
            return cause
    return None


_POLLRDHUP = getattr(select, "POLLRDHUP", 0)  # Linux: the other end shut down its side, whatever bytes are unread


def _peek(sock: socket.socket, n: int, deadline: float) -> bytes:
    """The first ``n`` bytes the client sent, left in the socket for whoever reads it next (fewer
    where it closed its end first; TimedOut past ``deadline``). A request's first segment may hold
    fewer than the four bytes that tell TLS, HTTP and ember's frames apart (a slow link, a proxy, a
    hand at a terminal): the rest is awaited until ``deadline`` in waits that lengthen from 1 ms to
    50 ms, since the socket stays readable meanwhile, so a client that stops there costs a few
    milliseconds of CPU in all. A peek cannot tell that the client closed after those bytes: on
    Linux each wait ends when it does (POLLRDHUP), elsewhere the deadline ends it."""
    if not hasattr(select, "poll"):
        return _peek_in_sleeps(sock, n, deadline)
    poller = select.poll()
    poller.register(sock, select.POLLIN | _POLLRDHUP)
    while not poller.poll(max(1, math.ceil(wait_limit(None, deadline) * 1000))):
        pass  # woken early (a signal): wait_limit raises TimedOut once the deadline passes
    first = sock.recv(n, socket.MSG_PEEK)
    if not _POLLRDHUP:
        return first if len(first) in (0, n) else _peek_in_sleeps(sock, n, deadline)
    poller.modify(sock, _POLLRDHUP)  # from now on only a close wakes the wait: the bytes there keep it readable
    pause = 0.001
    while 0 < len(first) < n:
        ended = poller.poll(max(1, math.ceil(min(pause, wait_limit(None, deadline)) * 1000)))
        first = sock.recv(n, socket.MSG_PEEK)
        if ended:  # what came before the close is all there is
            return first
        pause = min(2 * pause, 0.05)
    return first


def _peek_in_sleeps(sock: socket.socket, n: int, deadline: float) -> bytes:
    """:func:`_peek` without poll: a close is noticed at ``deadline``."""
    sock.settimeout(wait_limit(None, deadline))
    first = sock.recv(n, socket.MSG_PEEK)
    pause = 0.001
    while 0 < len(first) < n:
        time.sleep(min(pause, wait_limit(None, deadline)))
        pause = min(2 * pause, 0.05)
        first = sock.recv(n, socket.MSG_PEEK)
    return first


def _receive_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        sock.settimeout(wait_limit(None, deadline))
        chunk = sock.recv(n - len(data))
        if not chunk:
            break  # the client left: the connection's first read reports it
        data += chunk
    return data
