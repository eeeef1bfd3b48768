"""Compute peers: ``serve`` / ``Server`` host the local devices of one backend.

The I/O shell: it listens, completes TLS when it serves it, tells TCP from WebSocket clients
on one port, and moves frames between sockets and the sans-I/O
:class:`~ember.remote.session.Host` (the handshake) and :class:`~ember.remote.session.Session`
(one per connection, its own table of tensors).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
import threading

from ..errors import ArgumentError, EmberError, ProtocolError
from ..wire import protocol as wire
from ..wire.protocol import Limits
from ..wire.tcp import TcpConnection
from ..wire.tls import HANDSHAKE_RECORD, server_context
from ..wire.websocket import accept as accept_websocket
from .session import BufferPool, Host, hosted_devices

log = logging.getLogger("ember.serve")

HANDSHAKE_SECONDS = 10  # a connection's TLS handshake and init frame must arrive within this


def _parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ArgumentError(f"listen address must be HOST:PORT, got {listen!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    """A compute peer serving ``device``'s backend on ``listen`` ("HOST:PORT"; port 0 picks one).

    ``start()`` returns once the socket listens; ``address`` is then "host:port"; ``stop()``
    closes every session. With ``tls_cert`` and ``tls_key`` (PEM files) every connection must
    use TLS (``embers://``, ``wss://``). A non-loopback address needs TLS and a ``token``
    unless ``insecure=True``. Everything is validated before any socket is bound.
    """

    def __init__(self, device="numpy", listen: str = "127.0.0.1:7878", *, token: str | None = None,
                 insecure: bool = False, limits: Limits = Limits(), timeout: float | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None):
        devices = hosted_devices(device)
        self.host, self.port = _parse_listen(listen)
        if bool(tls_cert) != bool(tls_key):
            raise ArgumentError("TLS needs a certificate and its private key: pass both --tls-cert FILE and "
                                "--tls-key FILE (tls_cert=, tls_key=)")
        self.tls = server_context(tls_cert, tls_key) if tls_cert else None
        missing = [(what, how) for what, how, present in (
            ("TLS", "--tls-cert FILE --tls-key FILE (tls_cert=, tls_key=)", self.tls),
            ("a token", "--token-file FILE (token=)", token)) if not present]
        if missing and not insecure and not is_loopback(self.host):
            raise ArgumentError(f"refusing to listen on {listen} without {' or '.join(w for w, _ in missing)}: anyone who "
                                f"reaches it could use this machine's devices or read their traffic; pass "
                                f"{' and '.join(h for _, h in missing)}, or --insecure (insecure=True)")
        self.limits = limits
        self.timeout = timeout
        self.hosting = Host(devices, token or None, limits)
        self._listener: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._connections: set = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    @property
    def address(self) -> str:
        """"host:port" the server listens on (after start)."""
        return f"{self.host}:{self.port}"

    @property
    def devices(self) -> list:
        """The hosted devices, by index."""
        return self.hosting.devices

    @property
    def backend_name(self) -> str:
        return self.hosting.backend_name

    def start(self) -> Server:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        thread = threading.Thread(target=self._accept_loop, name="ember-accept", daemon=True)
        thread.start()
        self._threads.add(thread)
        log.info("serving %s on %s", ", ".join(str(d) for d in self.devices), self.address)
        return self

    def serve_forever(self) -> None:
        """Start (if needed) and block until ``stop()`` or Ctrl-C."""
        if self._listener is None:
            self.start()
        try:
            self._stopping.wait()
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def request_stop(self) -> None:
        """Make ``serve_forever`` return (safe from a signal handler)."""
        self._stopping.set()

    def stop(self) -> None:
        """Stop listening and close every session (their tensors are freed)."""
        self._stopping.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.close()
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(timeout=5)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve_connection, args=(sock,), name="ember-session", daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _open(self, sock: socket.socket, pool: BufferPool):
        """The frame connection of an accepted socket, on its own thread: TLS first (when served and
        when the client starts it), then TCP or WebSocket by the first bytes. Also whether the client
        skipped the TLS this peer requires."""
        first = sock.recv(4, socket.MSG_PEEK)
        received = b""
        tls = self.tls is not None and first[:1] == HANDSHAKE_RECORD
        try:
            if tls:
                sock = self.tls.wrap_socket(sock, server_side=True)  # the handshake, within the socket's timeout
                first = received = _receive_exactly(sock, 4)  # an SSLSocket cannot peek: these bytes are handed on
            if first == b"GET ":
                connection = accept_websocket(sock, self.limits, pool.allocate, received)
            else:
                connection = TcpConnection(sock, self.limits, HANDSHAKE_SECONDS, pool.allocate, received)
        except BaseException:
            sock.close()
            raise
        return connection, self.tls is not None and not tls

    def _serve_connection(self, sock: socket.socket) -> None:
        connection = None
        session = None
        try:
            sock.settimeout(HANDSHAKE_SECONDS)
            pool = BufferPool()
            connection, plain_on_tls = self._open(sock, pool)
            with self._lock:
                self._connections.add(connection)
            init = connection.receive()
            if plain_on_tls:  # refused after its init frame is read, so the refusal is not lost to a reset
                replies = [({"t": "refuse", "kind": "TLSError",
                             "reason": "this peer requires TLS: connect with embers:// (TCP) or wss:// (WebSocket)"}, [])]
            else:
                session, replies = self.hosting.open(init, pool)
            for header, segments in replies:
                connection.send(wire.encode_frame(header, segments))
            if session is None:
                return
            connection.sock.settimeout(self.timeout)
            while True:
                frame = connection.receive()
                if frame.header.get("t") == "close":
                    return
                for header, segments in session.handle(frame):
                    connection.send(wire.encode_frame(header, segments))
        except ProtocolError as error:
            log.warning("closing a session: %s", error)
            if connection is not None:
                try:
                    connection.send(wire.encode_frame({"t": "error", "kind": "ProtocolError", "reason": str(error)}))
                except EmberError:
                    pass
        except ssl.SSLError as error:  # a client that refused the certificate, or spoke something else
            log.warning("closing a TLS connection: %s", error.reason or error)
        except (EmberError, OSError):
            pass  # the client went away
        except Exception:  # never let one session take the server down
            log.exception("unexpected error in a session")
        finally:
            if session is not None:
                self.hosting.close(session)
            if connection is not None:
                connection.close()
                with self._lock:
                    self._connections.discard(connection)
            else:
                sock.close()
            with self._lock:
                self._threads.discard(threading.current_thread())


def _receive_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break  # the client left: the connection's first read reports it
        data += chunk
    return data


def serve(device="numpy", listen: str = "127.0.0.1:7878", *, token: str | None = None, insecure: bool = False,
          limits: Limits = Limits(), tls_cert: str | None = None, tls_key: str | None = None) -> None:
    """Host ``device``'s backend as a compute peer on ``listen``; blocks until Ctrl-C. With
    ``tls_cert`` and ``tls_key`` (PEM files) it speaks only TLS.

    Raises HostDeviceError (before binding anything) for a capture or remote device, and
    ArgumentError for a TLS or listening setup it refuses (see :class:`Server`).
    """
    Server(device, listen, token=token, insecure=insecure, limits=limits, tls_cert=tls_cert,
           tls_key=tls_key).serve_forever()

