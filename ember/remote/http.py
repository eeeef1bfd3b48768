"""The HTTP shell of a compute peer: one GET request a connection, on the peer's own port.

The server reads a request's head here when a connection starts like HTTP: a WebSocket upgrade
goes on to ``ember.wire.websocket``; any other request is answered from ``status.py`` and the
connection closed. Before anyone is authenticated a request may cost little: its head must
arrive whole within the handshake deadline and fit :data:`MAX_HEAD_BYTES` and
:data:`MAX_HEADERS`; a body is refused unread. websockets' HTTP/1.1 parser reads the head.
"""

from __future__ import annotations

import socket
from http import HTTPStatus

from websockets.exceptions import SecurityError
from websockets.http11 import MAX_LINE_LENGTH, Request
from websockets.streams import StreamReader

from ..errors import ConnectionLost
from ..wire.tcp import wait_limit
from .status import Response

MAX_HEAD_BYTES = 16 << 10  # a request line and its headers; browsers send well under 2 KiB
MAX_HEADERS = 64
#: the first four bytes of the requests this port reads as HTTP (the ember protocol's start otherwise)
STARTS = (b"GET ", b"HEAD", b"POST", b"PUT ", b"DELE", b"PATC", b"OPTI", b"TRAC", b"CONN")
#: what every answer says: never cached, never framed or sniffed, and the page's inline script and style only
HEADERS = {"Cache-Control": "no-store", "Connection": "close", "X-Content-Type-Options": "nosniff",
           "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
           "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                      "connect-src 'self'; form-action 'none'; frame-ancestors 'none'"}


class HttpRequest:
    """A request's head: ``method``, ``path``, ``headers`` (None if it would not parse), and
    ``raw``, every byte read (a WebSocket handshake re-reads them); ``refusal`` is the Response
    for a head that broke a limit or would not parse."""

    def __init__(self, method: str, path: str, headers, raw: bytes, refusal: Response | None = None):
        self.method, self.path, self.headers, self.raw, self.refusal = method, path, headers, raw, refusal

    def header(self, name: str) -> str | None:
        """The value of header ``name``; None when it is absent or given more than once."""
        values = self.headers.get_all(name) if self.headers is not None else []
        return values[0] if len(values) == 1 else None

    @property
    def upgrade(self) -> bool:
        """Whether it asks for a WebSocket (the ember protocol over WebSocket)."""
        return self.refusal is None and (self.header("Upgrade") or "").lower() == "websocket"


def _request_line_too_long(error: SecurityError, data: bytearray) -> bool:
    """Whether websockets refused the request line (414) rather than a header (431): websockets 17
    says so by the error's type; 16 (the last for Python 3.10) says "line too long" for either,
    and then it is the request line when that line has not ended within the limit."""
    if type(error).__name__ in ("RequestLineTooLong", "HeaderLineTooLong"):
        return type(error).__name__ == "RequestLineTooLong"
    end = data.find(b"\n")
    return str(error) == "line too long" and not 0 <= end < MAX_LINE_LENGTH


def read_request(sock: socket.socket, received: bytes, deadline: float) -> HttpRequest:
    """Read a request's head from ``sock`` (``received``: its first bytes, already read) before
    ``deadline`` (a ``time.monotonic()`` value; TimedOut past it, ConnectionLost if the client
    leaves), parsing as it arrives so that a head past a limit is refused at once. A HEAD request
    is parsed as the GET it mirrors: websockets before 17 (the last for Python 3.10) parses GET only."""
    data = bytearray(received)
    reader = StreamReader()
    parser = Request.parse(reader.read_line)
    fed = 0  # bytes of data the parser has been given, once the method is known (five bytes)

    def refused(status: int, text: str, **headers) -> HttpRequest:
        method, _, rest = bytes(data).split(b"\r\n", 1)[0].partition(b" ")
        return HttpRequest(method.decode("latin-1"), rest.rpartition(b" ")[0].decode("latin-1"), None, bytes(data),
                           Response(status, text + "\n", **headers))

    while True:
        if not fed and len(data) >= 5:
            head = data.startswith(b"HEAD ")
            reader.feed_data(b"GET " + data[5:] if head else bytes(data))
        elif fed and fed < len(data):
            reader.feed_data(bytes(data[fed:]))
        fed = len(data) if len(data) >= 5 else 0
        try:
            if fed:
                next(parser)  # parses what has arrived; returns when it needs more
        except StopIteration as done:
            request = done.value
            if sum(1 for _ in request.headers.raw_items()) > MAX_HEADERS:
                return refused(431, f"a request has at most {MAX_HEADERS} headers")
            method = "HEAD" if head else getattr(request, "method", "GET")  # websockets before 17: GET only
            return HttpRequest(method, request.path, request.headers, bytes(data))
        except SecurityError as error:  # a line too long, too many headers (websockets' own limits)
            return refused(414 if _request_line_too_long(error, data) else 431, str(error))
        except Exception as error:  # a malformed line, a body, another method …
            method = bytes(data).split(b" ", 1)[0]
            if method.isalpha() and method not in (b"GET", b"HEAD"):
                return refused(405, "only GET and HEAD are served here", Allow="GET, HEAD")
            return refused(400, f"not a request this peer reads: {error}")
        if len(data) >= MAX_HEAD_BYTES:
            return refused(431, f"a request's head is at most {MAX_HEAD_BYTES} bytes")
        sock.settimeout(wait_limit(None, deadline))
        chunk = sock.recv(MAX_HEAD_BYTES - len(data))
        if not chunk:
            raise ConnectionLost("the client closed the connection within its request")
        data += chunk


def respond(sock: socket.socket, response: Response, deadline: float, head_only: bool) -> None:
    """Send ``response`` (its headers only for a HEAD request) before ``deadline``."""
    reason = HTTPStatus(response.status).phrase
    headers = {"Content-Type": response.content_type, "Content-Length": str(len(response.body)), **HEADERS,
               **response.headers}
    head = f"HTTP/1.1 {response.status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sock.settimeout(wait_limit(None, deadline))
    sock.sendall(head.encode("latin-1") + (b"" if head_only else response.body))
