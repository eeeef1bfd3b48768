"""The WebSocket shell: the same frames, one binary message each, for proxies and browsers.

It drives the ``websockets`` library's sans-I/O protocol objects over a blocking socket, so the
server can take WebSocket clients on the same port as TCP ones (an HTTP request asking for an
upgrade; the server reads its head, ember/remote/http.py). Over TLS (``wss://``) the socket is wrapped before the upgrade.
"""

from __future__ import annotations

import socket
import ssl
from collections import deque

from websockets.client import ClientProtocol
from websockets.exceptions import InvalidState
from websockets.frames import Opcode
from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

from ..errors import ConnectionLost, ProtocolError
from .protocol import PREFIX_SIZE, Frame, FrameReader, Limits
from .tcp import SocketShell, TimedOut, readiness, tune
from .tls import wrap_client

# bytes read at once, into a buffer kept for the connection: a fresh 4 MiB ``recv`` buffer cost 15 µs a receive,
# more than a small frame's whole handling, and its pages fault in on each bulk chunk
_CHUNK = 256 << 10
_FRAGMENT = 4 << 20


def _max_size(limits: Limits) -> int:
    """The largest WebSocket message ``limits`` allow: one frame, its prefix included."""
    return PREFIX_SIZE + limits.max_frame_bytes


class WebSocketConnection(SocketShell):
    """Frames as binary WebSocket messages, for either end. ``timeout`` bounds each send and each
    wait for bytes (:class:`SocketShell`: on plain TCP the kernel's, so a small frame's receive
    is one ``recv``). While ``deadline`` is set (a ``time.monotonic()`` value: a server's
    handshake), no read waits past it."""

    transport = "websocket"

    def __init__(self, sock: socket.socket, protocol, limits: Limits = Limits(), allocate=None,
                 timeout: float | None = None):
        self.sock = sock
        self._waiting = readiness(sock)
        self._scratch = bytearray(_CHUNK)
        self.protocol = protocol
        self.reader = FrameReader(limits, allocate) if allocate else FrameReader(limits)
        self._frames: deque[Frame] = deque()
        self._closed = False
        self._peer_closed = False  # a close frame came
        self._take_timeouts(timeout)

    def set_limits(self, limits: Limits) -> None:
        self.reader.limits = limits
        # read for each message; websockets ≥ 15 calls it max_message_size, older versions max_size
        name = "max_message_size" if hasattr(self.protocol, "max_message_size") else "max_size"
        setattr(self.protocol, name, _max_size(limits))

    def _flush(self) -> None:
        data = self.protocol.data_to_send()
        if data:
            try:
                self.sock.sendall(b"".join(data))
            except OSError as error:
                raise ConnectionLost(f"connection lost while sending: {error}") from None

    def send(self, buffers: list) -> int:
        """One binary message per frame, sent in fragments: buffers are joined until a fragment holds
        4 MiB or more, and a buffer is cut every 4 MiB (so no fragment reaches 8 MiB: no giant joins)."""
        if self.protocol.state is not State.OPEN:  # closing already: the other end failed it or said goodbye
            raise ConnectionLost(f"the WebSocket is {self.protocol.state.name.lower()}")
        try:
            return self._send(buffers)
        except InvalidState as error:
            raise ConnectionLost(f"the WebSocket closed: {error}") from None

    def _send(self, buffers: list) -> int:
        if len(buffers) == 1 and type(buffers[0]) is bytes and len(buffers[0]) <= _FRAGMENT:  # a small frame (encode_frame)
            self.protocol.send_binary(buffers[0])
            self._flush()
            return len(buffers[0])
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(v.nbytes for v in views)
        chunks = []
        for v in views:
            chunks.extend(v[i:i + _FRAGMENT] for i in range(0, v.nbytes, _FRAGMENT))
        pending, size = [], 0
        first = True
        for k, chunk in enumerate(chunks):
            pending.append(chunk)
            size += chunk.nbytes
            last = k == len(chunks) - 1
            if size >= _FRAGMENT or last:
                data = b"".join(pending)
                if first:
                    self.protocol.send_binary(data, fin=last)
                    first = False
                else:
                    self.protocol.send_continuation(data, fin=last)
                self._flush()
                pending, size = [], 0
        if first:  # an empty frame
            self.protocol.send_binary(b"")
            self._flush()
        return total

    def _pump(self, timeout: float | None = None) -> list:
        """The protocol's events from the next bytes that arrive, waiting at most ``timeout``
        seconds (default: the connection's timeout) and never past ``deadline``."""
        protocol = self.protocol
        # this end failed the connection (an oversized message, a bad request): no waiting — a server has closed its
        # end, and a client would wait for the server's close (its timeout) though nothing more is read
        if protocol.eof_sent or protocol.parser_exc is not None:
            raise ConnectionLost(f"the WebSocket closed: {protocol.parser_exc or protocol.handshake_exc}")
        restore = self._limit_wait(timeout)
        try:
            n = self.sock.recv_into(self._scratch)
        except (TimeoutError, BlockingIOError):  # BlockingIOError: the kernel's timeout
            raise TimedOut("timed out waiting for the peer") from None
        except OSError as error:
            raise ConnectionLost(f"connection lost: {error}") from None
        finally:
            if restore:
                self._end_wait()
        if not n:
            self.protocol.receive_eof()
            raise ConnectionLost("the peer closed the connection")
        return self._events(n)

    def _events(self, n: int) -> list:
        """The protocol's events from the ``n`` bytes just read into the scratch buffer."""
        self.protocol.receive_data(self._scratch[:n])  # a copy of what arrived: the protocol keeps it
        events = self.protocol.events_received()
        self._flush()  # pongs and close replies
        if self.protocol.state is State.CLOSED and not events:
            raise ConnectionLost(f"the WebSocket closed: {self.protocol.close_exc}")
        return events

    def _deliver(self, events: list) -> None:
        for event in events:
            opcode = getattr(event, "opcode", None)
            if opcode is Opcode.BINARY or opcode is Opcode.CONT:
                self._frames.extend(self.reader.feed(event.data))  # fragments go straight to the reader
            elif opcode is Opcode.TEXT:
                raise ProtocolError("text WebSocket messages are not part of the ember protocol")
            elif opcode is Opcode.CLOSE:
                self._peer_closed = True  # frames that came before the close are still delivered

    def readable(self) -> bool:
        """Whether a frame, or the connection's end, waits to be received (asked without waiting;
        with the kernel's timeouts, what has come is read at once: :class:`SocketShell`)."""
        if self._frames or self._peer_closed or self._ended or self._failed is not None:
            return True
        if not self._kernel:
            return self._waiting()
        return self._read_now()

    def _take(self, n: int) -> bool:
        self._deliver(self._events(n))
        return bool(self._frames) or self._peer_closed

    def receive(self, timeout: float | None = None) -> Frame:
        """The next frame (blocking). Each wait for bytes lasts at most ``timeout`` seconds (default:
        the connection's timeout) and never past ``deadline``; then TimedOut."""
        while not self._frames:
            if self._failed is not None:
                raise self._failed
            if self._peer_closed:
                raise ConnectionLost("the peer closed the WebSocket")
            if self._ended:
                raise ConnectionLost("the peer closed the connection")
            self._deliver(self._pump(timeout))
        return self._frames.popleft()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.protocol.send_close()
            self._flush()
        except Exception:
            pass
        super().close()


def connect(host: str, port: int, limits: Limits = Limits(), timeout: float | None = None,
            path: str = "/", tls: ssl.SSLContext | None = None, allocate=None) -> WebSocketConnection:
    """A WebSocket frame connection to ``ws://host:port``, or ``wss://`` when given a TLS client context;
    received tensors go into ``allocate(shape, dtype)``'s arrays when given (a peer's buffer pool)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as error:
        raise ConnectionLost(f"cannot connect to {host}:{port}: {error}") from None
    tune(sock)
    scheme = "ws" if tls is None else "wss"
    if tls is not None:
        sock = wrap_client(sock, tls, host, port, scheme)
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    protocol = ClientProtocol(parse_uri(f"{scheme}://{authority}{path}"), max_size=_max_size(limits))
    connection = WebSocketConnection(sock, protocol, limits, allocate, timeout)
    try:
        protocol.send_request(protocol.connect())
        connection._flush()
        behind = _handshake(connection, Response)[1]
        if protocol.handshake_exc is not None:
            raise ConnectionLost(f"WebSocket handshake with {host}:{port} failed: {protocol.handshake_exc}")
        connection._deliver(behind)
        return connection
    except (ConnectionLost, ProtocolError) as error:  # TimedOut among them: named with the address and the wait
        connection.close()
        if isinstance(error, TimedOut) and timeout is not None:
            raise TimedOut(f"{scheme}://{authority}: no answer to the WebSocket upgrade within {timeout:g} s") from None
        raise


def accept(sock: socket.socket, limits: Limits = Limits(), allocate=None, received: bytes = b"",
           deadline: float | None = None) -> WebSocketConnection:
    """Complete the WebSocket opening handshake of an accepted socket, before ``deadline`` when
    given (a ``time.monotonic()`` value); ``received`` holds the request's bytes (some, or all of
    it) when they were already read from the socket."""
    protocol = ServerProtocol(max_size=_max_size(limits))
    events = []
    if received:
        protocol.receive_data(received)
        events = protocol.events_received()  # the whole request may be there already
    connection = WebSocketConnection(sock, protocol, limits, allocate, sock.gettimeout())  # the server's, until the session's
    connection.deadline = deadline
    request, behind = _handshake(connection, Request, events)
    protocol.send_response(protocol.accept(request))
    connection._flush()
    if protocol.handshake_exc is not None:
        raise ProtocolError(f"WebSocket handshake failed: {protocol.handshake_exc}")
    connection._deliver(behind)
    return connection


def _handshake(connection: WebSocketConnection, kind: type, events: list = ()) -> tuple:
    """The handshake's ``kind`` of event (the client's Request, or the server's Response), read
    from ``events`` and then the connection, and the events that came behind it in the same read:
    frames the other end sent without waiting, which the caller delivers once the handshake is done."""
    while True:
        arrived, events = events or connection._pump(), []
        for at, event in enumerate(arrived):
            if isinstance(event, kind):
                return event, arrived[at + 1:]
