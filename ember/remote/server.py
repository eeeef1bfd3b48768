"""Compute peers: ``serve`` / ``Server`` host the local devices of one backend.

The I/O shell: it listens, tells TCP from WebSocket clients on one port, and moves frames
between sockets and the sans-I/O :class:`~ember.remote.session.Host` (the handshake) and
:class:`~ember.remote.session.Session` (one per connection, its own table of tensors).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading

from ..errors import ArgumentError, EmberError, ProtocolError
from ..wire import protocol as wire
from ..wire.protocol import Limits
from ..wire.tcp import TcpConnection
from ..wire.websocket import accept as accept_websocket
from .session import BufferPool, Host, hosted_devices

log = logging.getLogger("ember.serve")


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
    closes every session. A non-loopback address needs a ``token`` unless ``insecure=True``.
    Hosting is validated before any socket is bound.
    """

    def __init__(self, device="numpy", listen: str = "127.0.0.1:7878", *, token: str | None = None,
                 insecure: bool = False, limits: Limits = Limits(), timeout: float | None = None):
        devices = hosted_devices(device)
        self.host, self.port = _parse_listen(listen)
        if not is_loopback(self.host) and not token and not insecure:
            raise ArgumentError(f"refusing to listen on {listen} without a token: anyone who reaches it could use this "
                                f"machine's devices; pass a token (--token-file) or insecure=True (--insecure)")
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

    def _serve_connection(self, sock: socket.socket) -> None:
        connection = None
        session = None
        try:
            sock.settimeout(10)  # the handshake must come promptly
            first = sock.recv(4, socket.MSG_PEEK)
            pool = BufferPool()
            connection = accept_websocket(sock, self.limits, pool.allocate) if first == b"GET " else \
                TcpConnection(sock, self.limits, 10, pool.allocate)
            with self._lock:
                self._connections.add(connection)
            session, replies = self.hosting.open(connection.receive(), pool)
            for header, segments in replies:
                connection.send(wire.encode_frame(header, segments))
            if session is None:
                return
            sock.settimeout(self.timeout)
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


def serve(device="numpy", listen: str = "127.0.0.1:7878", *, token: str | None = None, insecure: bool = False,
          limits: Limits = Limits()) -> None:
    """Host ``device``'s backend as a compute peer on ``listen``; blocks until Ctrl-C.

    Raises HostDeviceError (before binding anything) for a capture or remote device.
    """
    Server(device, listen, token=token, insecure=insecure, limits=limits).serve_forever()

