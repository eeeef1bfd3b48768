"""Compute peers: ``serve`` / ``Server`` host the local devices of one backend.

The server shell: its configuration (validated before any socket is bound), start and stop, the
accept loop — which survives running out of files or memory: it backs off and keeps accepting —
and admission: each accepted connection takes a handshake slot, a share of them per address
(``slots.py``), or past them a place among the connections refused as busy, and goes to a thread
of its own. What happens on that thread (TLS, telling TCP, WebSocket and HTTP apart, the handshake
with the sans-I/O :class:`~ember.remote.host.Host`, the session loop, other peers' fetches,
keepalives, the ``PeerBusy`` answer) is ``connections.py``'s; this peer's own fetches are
``fetching.py``'s.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import threading
import time
from dataclasses import replace

from ..errors import ArgumentError
from ..wire.protocol import Limits
from ..wire.tcp import spin_window
from ..wire.tls import server_context
from .access import host_key
from .connections import Connections, Refusal
from .fetching import Fetcher
from .heartbeat import Heartbeat, Link
from .host import Host, hosted_devices
from .memory import Budget, default_quota
from .process import raise_file_limit, return_freed_memory
from .resume import RESUME_WINDOW
from .slots import Slots
from .sources import Sources
from .transfers import TTL, Transfers

log = logging.getLogger("ember.serve")

HANDSHAKE_SECONDS = 10   # TLS, the WebSocket upgrade and the init frame: all within this, from the connection
IDLE_SECONDS = 15 * 60   # a session that receives nothing for this long is closed
MAX_SESSIONS = 64        # sessions at once (and as many connections still in their handshake: slots.py)
ACCEPT_PAUSES = (0.01, 1.0)  # after a failed accept, the first pause; each failure after doubles it, up to the second
SAMPLE_SECONDS = 2       # how often the throughput the status page draws is sampled

#: what a peer accepts unless told otherwise: headers of at most 4 MiB (a batch, or a graph of tens of
#: thousands of ops), since a header expands in memory to up to ~70 times its size (a map per byte)
PEER_LIMITS = Limits(max_header_bytes=4 << 20)


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
    closes every session. Everything is validated before any socket is bound.

    - Access: ``token`` admits clients presenting it; ``authorize`` is asked at every handshake
      instead, ``authorize(address, token, device)`` with the client's "host:port", the token it
      presented and the device index it asked for, and returns the client's name (a str), None
      or True to admit it, or raises ``AccessDenied(reason)`` (or returns False) to refuse it;
      anything else it raises refuses with a generic reason, logged without the token (see
      ``ember.remote.access``, whose ``TokenFile`` reads ``--tokens-file``). Logs and
      :meth:`stats` name clients by that name, else by their address — never by their token.
    - TLS: with ``tls_cert`` and ``tls_key`` (PEM files) every connection must use TLS
      (``embers://``, ``wss://``). A non-loopback address needs TLS and a token or an
      authorizer unless ``insecure=True``.
    - Bounds: until its handshake is done a connection may send only frames of 64 KiB, must send
      its first four bytes within FIRST_BYTES_SECONDS (``connections.py``), and must complete its
      handshake — TLS, WebSocket upgrade, init frame — within ``handshake_timeout`` seconds in
      all. At most ``max_sessions`` sessions are open at once and as many connections may be in
      their handshake, a quarter of them from one address; other peers' fetches waiting for
      their grant have slots of their own (``ember.remote.slots``). A connection past these is
      answered ``PeerBusy`` naming the limit, in the framing it speaks (an HTTP request gets a
      503). A session that receives nothing for ``idle_timeout`` seconds is closed (None or 0:
      never); a client waiting on its own long batch is not idle: the peer is not reading then,
      and sends it ``alive`` frames if it asked for keepalives. All sessions share
      ``max_memory``; one may hold ``limits.max_session_bytes`` of it (unset: a quarter,
      ``memory.default_quota``).
    - Scarcity: ``start()`` raises the process's soft limit of open files to its hard limit; when
      files or memory run out all the same, accepting pauses (10 ms, doubling to 1 s) and goes on,
      logged once when it starts and once when it ends.
    - Transfers (``x.to_device`` between peers, see ``ember.remote.transfers``): a capability this
      peer grants expires after ``transfer_ttl`` seconds. This peer fetches tensors only from the
      peers ``fetch_from`` lists (``--fetch-from``: addresses, networks or host names, each with or
      without a port, as a comma-separated str or a list — ``"127.0.0.1,10.0.0.0/8,gpu-box:7878"``);
      none by default, when only its own sessions move tensors between them. Fetching from a TLS
      peer, it trusts the CA certificates in ``tls_ca`` (PEM), else in ``EMBER_TLS_CA``, else the system's.
    """

    def __init__(self, device="numpy", listen: str = "127.0.0.1:7878", *, token: str | None = None, authorize=None,
                 insecure: bool = False, limits: Limits = PEER_LIMITS, tls_cert: str | None = None,
                 tls_key: str | None = None, max_sessions: int = MAX_SESSIONS, idle_timeout: float | None = IDLE_SECONDS,
                 handshake_timeout: float = HANDSHAKE_SECONDS, max_memory: int | None = None,
                 tls_ca: str | None = None, transfer_ttl: float = TTL, fetch_from=(), resume_window: float = RESUME_WINDOW):
        devices = hosted_devices(device)
        if not (isinstance(transfer_ttl, (int, float)) and 0 <= transfer_ttl < 1e9):
            raise ArgumentError(f"transfer_ttl is seconds ≥ 0, got {transfer_ttl!r}")
        if not (isinstance(resume_window, (int, float)) and 0 <= resume_window < 1e9):
            raise ArgumentError(f"resume_window is seconds ≥ 0 (0: sessions do not resume), got {resume_window!r}")
        self.host, self.port = _parse_listen(listen)
        if token and authorize:
            raise ArgumentError("pass a token or an authorizer, not both (--token-file or --tokens-file)")
        if not (isinstance(max_sessions, int) and max_sessions >= 1):
            raise ArgumentError(f"max_sessions must be a whole number ≥ 1, got {max_sessions!r}")
        if not (idle_timeout is None or idle_timeout >= 0) or not handshake_timeout > 0:
            raise ArgumentError(f"timeouts are seconds > 0 (an idle timeout of 0 means none), got idle {idle_timeout!r} "
                                f"and handshake {handshake_timeout!r}")
        if bool(tls_cert) != bool(tls_key):
            raise ArgumentError("TLS needs a certificate and its private key: pass both --tls-cert FILE and "
                                "--tls-key FILE (tls_cert=, tls_key=)")
        self.tls = server_context(tls_cert, tls_key) if tls_cert else None
        tls_ca = tls_ca or os.environ.get("EMBER_TLS_CA") or None  # whom this peer trusts when it fetches
        missing = [(what, how) for what, how, present in (
            ("TLS", "--tls-cert FILE --tls-key FILE (tls_cert=, tls_key=)", self.tls),
            ("a token", "--token-file FILE or --tokens-file FILE (token=, authorize=)", token or authorize)) if not present]
        if missing and not insecure and not is_loopback(self.host):
            raise ArgumentError(f"refusing to listen on {listen} without {' or '.join(w for w, _ in missing)}: anyone who "
                                f"reaches it could use this machine's devices or read their traffic; pass "
                                f"{' and '.join(h for _, h in missing)}, or --insecure (insecure=True)")
        budget = Budget(max_memory)
        if limits.max_session_bytes == Limits.max_session_bytes:  # not set: a share, so no one client fills the peer
            limits = replace(limits, max_session_bytes=default_quota(budget))
        elif limits.max_session_bytes > budget.limit:  # a session can hold no more than the whole peer: say so at once
            limits = replace(limits, max_session_bytes=budget.limit)
        self.limits = limits
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout or None
        self.handshake_timeout = handshake_timeout
        self.spin = spin_window()  # EMBER_SPIN_US: after a frame, how long to poll for the next one
        self.hosting = Host(devices, token or None, limits, budget, authorize=authorize, max_sessions=max_sessions,
                            transfers=Transfers(transfer_ttl), resume_window=resume_window)
        self._listener: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._links: set[Link] = set()  # the connections served now (closed by stop()), under _lock
        self.slots = Slots(max_sessions)  # connections not yet past their handshake (slots.py), under _lock
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._heartbeat = Heartbeat()
        self.sources = Sources(self.hosting, self._stopping, max_sessions, handshake_timeout)  # others' fetches
        self.fetcher = Fetcher(self.hosting, self._stopping, tls_ca, fetch_from)  # this peer's sessions' fetches
        self.connections = Connections(self.hosting, self.sources, self.fetcher.start, tls=self.tls, limits=limits,
                                       stopping=self._stopping.is_set,
                                       idle_timeout=self.idle_timeout, handshake_timeout=handshake_timeout,
                                       spin=self.spin, slots=self.slots, lock=self._lock, links=self._links,
                                       heartbeat=self._heartbeat)

    @property
    def address(self) -> str:
        """"host:port" the server listens on (after start)."""
        return f"{self.host}:{self.port}"

    @property
    def _handshakes(self) -> int:
        """Connections in their handshake now."""
        return self.slots.handshakes.in_use

    @property
    def devices(self) -> list:
        """The hosted devices, by index."""
        return self.hosting.devices

    @property
    def backend_name(self) -> str:
        return self.hosting.backend_name

    def stats(self) -> dict:
        """The open sessions, their live tensors, and their clients by name (or address)."""
        with self.hosting.registry.lock:
            clients = sorted(session.client for session in self.hosting.registry.sessions)
        return {**self.hosting.registry.stats(), "clients": clients}

    def start(self) -> Server:
        raise_file_limit()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self.hosting.sample(time.time())
        for target, name in ((self._accept_loop, "ember-accept"), (self._heartbeat.run, "ember-heartbeat"),
                             (self._sample_loop, "ember-sample")):
            thread = threading.Thread(target=target, name=name, daemon=True)
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
        self._heartbeat.stop()
        self.hosting.transfers.close()  # fetches waiting for a grant give up
        self.fetcher.stop()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            links = list(self._links)
            refusals = list(self.slots.refusals.waiting)
        for link in links:
            link.connection.close()
        for refusal in refusals:  # connections being refused end now, not at their deadline
            refusal.end()
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(timeout=5)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _sample_loop(self) -> None:
        while not self._stopping.wait(SAMPLE_SECONDS):
            self.hosting.sample(time.time())
            self.hosting.expire(time.monotonic())  # parked sessions past the resume window
            pool = self.hosting.pool
            pool.expire()  # idle buffers not reused for POOL_IDLE_SECONDS go back (all, once no session is open)
            if pool.let_go:  # … and their pages to the kernel
                pool.let_go = 0
                return_freed_memory()

    def _accept_loop(self) -> None:
        """Accept connections until ``stop()`` closes the listener, whatever else fails: out of files
        or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM), accept() fails until some come back, and the
        connections wait in the listen backlog meanwhile, so the loop pauses and tries again."""
        trouble = _Outage("accepting connections")
        while not self._stopping.is_set():
            try:
                sock, address = self._listener.accept()
            except OSError as error:
                if self._stopping.is_set():  # stop() shut the listener down
                    return
                self._stopping.wait(trouble.failed(error))
                continue
            trouble.over()
            try:
                self._admit(sock, address)
            except Exception as error:  # a thread that cannot start (RuntimeError), memory: the next may
                sock.close()
                self._stopping.wait(trouble.failed(error))

    def _admit(self, sock: socket.socket, address) -> None:
        """Serve an accepted connection on a thread of its own in a handshake slot, or, when its
        address's share or all of them are taken, refuse it as busy on a thread of its own in a
        place of the reserve for refusals, ending the oldest refusal there if need be (a slot or
        place is given back when its thread ends)."""
        who, key = _format_address(address), host_key(str(address[0]) if address else "")
        refusal = displaced = None
        with self._lock:
            busy = self.slots.handshakes.take(key)
            if busy is not None:
                refusal = Refusal(sock, key)
                displaced = self.slots.refusals.take(refusal)
        if busy is None:
            target, args = self.connections.serve, (sock, who, key)
        else:
            self.connections.busy_log.note(f"{who}: refused: {busy}")
            if displaced is not None:  # the oldest refusal in the reserve ends now: its place is this one's
                displaced.end()
            target, args = self.connections.refuse, (refusal, who, busy)
        thread = threading.Thread(target=self._run, args=(target, *args), name="ember-session", daemon=True)
        with self._lock:
            self._threads.add(thread)
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._threads.discard(thread)
                if busy is None:
                    self.slots.handshakes.give_back(key)
                else:
                    self.slots.refusals.give_back(refusal)
            raise

    def _run(self, target, *args) -> None:
        """A connection's thread: ``target(*args)`` (``Connections.serve`` or ``refuse``, which give its
        slot or place back), and the thread leaves the server's as it ends."""
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())


class _Outage:
    """A failure that repeats while it lasts (accept() out of files): logged once as it starts,
    saying what ran out, and once as it ends; :meth:`failed` answers how long to pause."""

    def __init__(self, what: str):
        self.what = what
        self.failures = 0
        self.since = 0.0
        self.pause = 0.0

    def failed(self, error: BaseException) -> float:
        if not self.failures:
            self.since = time.monotonic()
            log.warning("%s failed: %s; trying again after pauses of %g s growing to %g s (new connections wait in the "
                        "listen backlog meanwhile)", self.what, _describe(error), *ACCEPT_PAUSES)
        self.failures += 1
        self.pause = min(ACCEPT_PAUSES[1], max(ACCEPT_PAUSES[0], 2 * self.pause))
        return self.pause

    def over(self) -> None:
        if self.failures:
            log.warning("%s again, after %d failed tries in %.1f s", self.what, self.failures,
                        time.monotonic() - self.since)
            self.failures, self.pause = 0, 0.0


def _describe(error: BaseException) -> str:
    """``error``, and what ran out where it is a lack of files (naming the limit)."""
    text = str(error)
    if isinstance(error, OSError) and error.errno == errno.EMFILE:
        try:
            import resource
            text += f" (this process may have {resource.getrlimit(resource.RLIMIT_NOFILE)[0]} files open: RLIMIT_NOFILE)"
        except (ImportError, OSError, ValueError):
            pass
    elif isinstance(error, OSError) and error.errno == errno.ENFILE:
        text += " (the system's limit of open files: fs.file-max)"
    return text


def _format_address(address) -> str:
    host, port = address[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def serve(device="numpy", listen: str = "127.0.0.1:7878", **options) -> None:
    """Host ``device``'s backend as a compute peer on ``listen``; blocks until Ctrl-C. ``options``
    are :class:`Server`'s: ``token``, ``authorize``, ``tls_cert`` and ``tls_key``, ``insecure``,
    ``limits``, ``max_sessions``, ``idle_timeout``, ``handshake_timeout``, ``max_memory``, ``tls_ca``,
    ``transfer_ttl``, ``fetch_from`` (the peers it may fetch tensors from; none by default).

    Raises HostDeviceError (before binding anything) for a capture or remote device, and
    ArgumentError for a TLS, access or listening setup it refuses (see :class:`Server`).
    """
    Server(device, listen, **options).serve_forever()
