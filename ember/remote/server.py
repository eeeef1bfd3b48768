"""Compute peers: ``serve`` / ``Server`` host the local devices of one backend.

The I/O shell: it listens, completes TLS when it serves it, tells TCP from WebSocket clients
on one port (and answers plain HTTP requests for the peer's status: ``http.py``, ``status.py``),
and moves frames between sockets and the sans-I/O
:class:`~ember.remote.session.Host` (the handshake) and :class:`~ember.remote.session.Session`
(one per connection, its own table of tensors). It bounds what a connection may cost before it
is authenticated (small frames, one deadline for the whole handshake, a cap on connections),
closes idle sessions, and keeps clients whose batch runs long informed that it is alive.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import queue
import select
import socket
import ssl
import threading
import time
from dataclasses import replace

from ..errors import ArgumentError, ConnectionLost, EmberError, ProtocolError
from ..wire import protocol as wire
from ..wire import tcp, websocket
from ..wire.protocol import HANDSHAKE_LIMITS, Limits
from ..wire.tcp import TcpConnection, TimedOut, spin_wait, spin_window, wait_limit
from ..wire.tls import HANDSHAKE_RECORD, client_context, server_context
from ..wire.websocket import accept as accept_websocket
from . import http, status
from .session import Budget, BufferPool, Host, hosted_devices
from .transfers import TTL, Fetch, Transfers

log = logging.getLogger("ember.serve")

HANDSHAKE_SECONDS = 10   # TLS, the WebSocket upgrade and the init frame: all within this, from the connection
IDLE_SECONDS = 15 * 60   # a session that receives nothing for this long is closed
MAX_SESSIONS = 64        # sessions at once (and as many connections still in their handshake)
FETCH_SECONDS = 120      # a fetch from another peer: each wait for bytes, and all its tries together
FETCH_LINK_SECONDS = 30  # a fetch connection whose last fetch got its tensor stays open this long for the next one …
FETCH_LINKS_KEPT = 4     # … and a peer keeps this many of them idle to each source
WORKER_SECONDS = 10      # a thread that performed a fetch waits this long for the next
SAMPLE_SECONDS = 2       # how often the throughput the status page draws is sampled
_ALIVE = wire.encode_frame({"t": "alive"})

#: what a peer accepts unless told otherwise: headers of at most 4 MiB (a batch, or a graph of tens of
#: thousands of ops), since a header expands in memory to up to ~70 times its size (a map per byte)
PEER_LIMITS = Limits(max_header_bytes=4 << 20)


# glibc's malloc options (malloc.h), and the values its own dynamic thresholds stop at on 64-bit
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_BYTES = 64 << 20  # free memory an arena keeps on top before it hands it back to the kernel
MMAP_BYTES = 32 << 20        # allocations this large and above get their own mapping


def keep_freed_memory() -> bool:
    """Have this process's malloc keep freed memory for the next tensors; a peer process calls it
    at start (``ember serve``). True where it took (glibc), False elsewhere.

    Each session runs on its own thread, so glibc gives it its own arena, and an arena hands the
    free memory on top of its heap back to the kernel (``madvise(MADV_DONTNEED)``) once it passes
    a threshold that glibc adjusts as it goes. Whether an eager chain's freed 4 MB arrays sit
    there depends on the order of earlier allocations: in some runs of ``ember bench remote``
    the peer gave back and faulted in again about 23 MB per chain of 100 ops on 1M float32
    (5,766 page faults, 1.5× the chain's time). Fixed thresholds, the largest glibc's own
    adjustment reaches, keep up to 64 MiB an arena for reuse."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mapping threshold first: setting either turns glibc's adjustment of both off
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES))


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
    - Bounds: until its handshake is done a connection may send only frames of 64 KiB, and must
      complete it — TLS, WebSocket upgrade, init frame — within ``handshake_timeout`` seconds
      in all. At most ``max_sessions`` sessions are open at once (more are refused with
      ``PeerBusy``) and as many connections may be in their handshake (more are closed at
      once). A session that receives nothing for ``idle_timeout`` seconds is closed (None or 0:
      never); a client waiting on its own long batch is not idle: the peer is not reading then,
      and sends it ``alive`` frames if it asked for keepalives.
    - Transfers (``x.to_device`` between peers, see ``ember.remote.transfers``): a capability this
      peer grants expires after ``transfer_ttl`` seconds. Fetching from a TLS peer, this peer
      trusts the CA certificates in ``tls_ca`` (PEM), else in ``EMBER_TLS_CA``, else the system's.
    """

    def __init__(self, device="numpy", listen: str = "127.0.0.1:7878", *, token: str | None = None, authorize=None,
                 insecure: bool = False, limits: Limits = PEER_LIMITS, tls_cert: str | None = None,
                 tls_key: str | None = None, max_sessions: int = MAX_SESSIONS, idle_timeout: float | None = IDLE_SECONDS,
                 handshake_timeout: float = HANDSHAKE_SECONDS, max_memory: int | None = None,
                 tls_ca: str | None = None, transfer_ttl: float = TTL):
        devices = hosted_devices(device)
        if not (isinstance(transfer_ttl, (int, float)) and 0 <= transfer_ttl < 1e9):
            raise ArgumentError(f"transfer_ttl is seconds ≥ 0, got {transfer_ttl!r}")
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
        self.tls_ca = tls_ca or os.environ.get("EMBER_TLS_CA") or None  # whom this peer trusts when it fetches
        self._fetch_tls = client_context(self.tls_ca) if tls_ca else None  # a bad file is refused before binding
        missing = [(what, how) for what, how, present in (
            ("TLS", "--tls-cert FILE --tls-key FILE (tls_cert=, tls_key=)", self.tls),
            ("a token", "--token-file FILE or --tokens-file FILE (token=, authorize=)", token or authorize)) if not present]
        if missing and not insecure and not is_loopback(self.host):
            raise ArgumentError(f"refusing to listen on {listen} without {' or '.join(w for w, _ in missing)}: anyone who "
                                f"reaches it could use this machine's devices or read their traffic; pass "
                                f"{' and '.join(h for _, h in missing)}, or --insecure (insecure=True)")
        budget = Budget(max_memory)
        if limits.max_session_bytes > budget.limit:  # a session can hold no more than the whole peer: say so at once
            limits = replace(limits, max_session_bytes=budget.limit)
        self.limits = limits
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout or None
        self.handshake_timeout = handshake_timeout
        self.spin = spin_window()  # EMBER_SPIN_US: after a frame, how long to poll for the next one
        self.hosting = Host(devices, token or None, limits, budget, authorize=authorize, max_sessions=max_sessions,
                            transfers=Transfers(transfer_ttl))
        self._listener: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._links: set[_Link] = set()
        self._handshakes = 0  # connections not yet past their handshake
        self._fetch_links = 0  # connections of other peers kept open for their next fetch (a thread each)
        self._kept: dict[tuple, list] = {}  # (scheme, host, port) -> idle connections to that source, with their time
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._heartbeat = _Heartbeat()
        self._workers = _Workers()

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

    def stats(self) -> dict:
        """The open sessions, their live tensors, and their clients by name (or address)."""
        with self.hosting.registry.lock:
            clients = sorted(self.hosting.clients.values())
        return {**self.hosting.registry.stats(), "clients": clients}

    def start(self) -> Server:
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
        self._workers.stop()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.connection.close()
        with self._lock:
            kept, self._kept = self._kept, {}
        for connection, _ in (entry for entries in kept.values() for entry in entries):
            connection.close()
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

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, address = self._listener.accept()
            except OSError:
                return
            with self._lock:
                crowded = self._handshakes >= self.max_sessions
                if not crowded:
                    self._handshakes += 1
            if crowded:  # that many handshakes at once: no thread, no buffer, no answer
                sock.close()
                continue
            thread = threading.Thread(target=self._serve_connection, args=(sock, _format_address(address)),
                                      name="ember-session", daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _open(self, sock: socket.socket, pool: BufferPool, deadline: float, address: str):
        """The frame connection of an accepted socket, on its own thread, before ``deadline``: TLS
        first (when served and when the client starts it), then TCP, WebSocket or a plain HTTP
        request (answered here: the connection is then None) by the first bytes. Also whether the
        client skipped the TLS this peer requires."""
        first = _peek(sock, 4, deadline)
        received = b""
        tls = self.tls is not None and first[:1] == HANDSHAKE_RECORD
        try:
            if tls:
                sock.settimeout(wait_limit(None, deadline))  # the whole TLS handshake, not each read
                sock = self.tls.wrap_socket(sock, server_side=True)
                first = received = _receive_exactly(sock, 4, deadline)  # an SSLSocket cannot peek: handed on
            if first in http.STARTS:
                request = http.read_request(sock, received, deadline)
                if not request.upgrade:
                    self._answer_http(sock, request, address, deadline, plain_on_tls=self.tls is not None and not tls)
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

    def _serve_connection(self, sock: socket.socket, address: str) -> None:
        link = session = None
        who = address
        handshaking = True
        try:
            pool = self.hosting.pool  # one pool for the peer, within its memory budget
            deadline = time.monotonic() + self.handshake_timeout
            connection, plain_on_tls = self._open(sock, pool, deadline, address)
            if connection is None:  # an HTTP request, answered
                return
            link = _Link(connection)
            with self._lock:
                self._links.add(link)
            init = connection.receive()
            if init.header.get("t") == "fetch" and not plain_on_tls:  # another peer, fetching a granted tensor
                if self._answer_fetch(link, init, address, deadline) and self._hold_fetch_link():
                    with self._lock:  # its capability was good: the connection is no handshake now
                        self._handshakes -= 1
                        handshaking = False
                    try:
                        self._answer_fetches(link, address)
                    finally:
                        with self._lock:
                            self._fetch_links -= 1
                return
            if plain_on_tls:  # refused after its init frame is read, so the refusal is not lost to a reset
                replies = [({"t": "refuse", "kind": "TLSError",
                             "reason": "this peer requires TLS: connect with embers:// (TCP) or wss:// (WebSocket)"}, [])]
            else:
                session, replies = self.hosting.open(init, pool, address)
            with self._lock:  # done, before the client hears of it: it may connect again at once
                self._handshakes -= 1
                handshaking = False
            link.send(replies)
            if session is None:
                refusal = replies[0][0]
                log.warning("%s: refused (%s): %s", address, refusal["kind"], refusal["reason"])
                return
            info = replies[0][0]
            with self.hosting.registry.lock:
                name = self.hosting.clients.get(session, address)
            who = name if name == address else f"{name} ({address})"
            log.info("%s: session opened on device %s (%s)", who, init.header.get("device", 0), info["device"])
            connection.deadline = None  # the handshake is done: the session's own limits and timeout
            connection.set_limits(self.limits)
            connection.reader.allocate = session.allocate  # received tensors count against its quota and the budget
            session.runner = self._start_fetch  # fetches from other peers run beside the session
            connection.set_timeout(self.idle_timeout)
            if info.get("keepalive"):
                link.interval = info["keepalive"]
                self._heartbeat.add(link)
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
        except (EmberError, OSError):
            pass  # the client went away, or missed its handshake deadline
        except Exception:  # never let one session take the server down
            log.exception("%s: unexpected error in a session", who)
        finally:
            if session is not None:
                self.hosting.close(session)
                log.info("%s: session closed", who)
            if link is not None:
                self._heartbeat.remove(link)
                link.connection.close()
                with self._lock:
                    self._links.discard(link)
            else:
                sock.close()
            with self._lock:
                if handshaking:
                    self._handshakes -= 1
                self._threads.discard(threading.current_thread())

    def _answer_http(self, sock, request: http.HttpRequest, address: str, deadline: float, plain_on_tls: bool) -> None:
        """Answer a plain HTTP request: the status page, /status.json or /metrics (status.py decides)."""
        if plain_on_tls:
            response = status.Response(400, "this peer serves only TLS: use https://\n")
        else:
            response = request.refusal or status.answer(self.hosting, request.method, request.path,
                                                        request.header("Authorization"), address, time.time())
        log.debug("%s: HTTP %s %.100s: %d", address, request.method, request.path, response.status)
        http.respond(sock, response, deadline, head_only=request.method == "HEAD")

    # -- transfers between peers: the I/O of ember.remote.transfers --
    def _answer_fetch(self, link: _Link, init, address: str, deadline: float) -> bool:
        """Answer another peer's fetch: wait (within the handshake deadline: the connection has not
        authenticated until its capability is known) for the grant, then send the tensor or a
        refusal. The connection counts as a handshake all along. True when the tensor was sent."""
        transfers = self.hosting.transfers
        while True:
            generation = transfers.generation
            answer = self.hosting.answer_fetch(init, final=time.monotonic() >= deadline or self._stopping.is_set())
            if answer is not None:
                break
            transfers.wait(generation, deadline - time.monotonic())
        replies, grant = answer
        try:
            link.send(replies)
        finally:
            if grant is not None:
                grant.release()
        refusal = replies[0][0].get("reason")
        log.info("%s: %s", address, f"transfer refused: {refusal}" if refusal else
                 f"sent a granted tensor of {replies[0][1][0].nbytes} bytes")
        return grant is not None  # a grant comes only with its tensor

    def _hold_fetch_link(self) -> bool:
        """Whether a fetch connection that was answered with its tensor may stay open for the next
        fetch: as many as sessions may be open at once, and none while the peer stops."""
        with self._lock:
            if self._fetch_links >= self.max_sessions or self._stopping.is_set():
                return False
            self._fetch_links += 1
            return True

    def _answer_fetches(self, link: _Link, address: str) -> None:
        """Answer the further fetches of a peer whose first one presented a good capability, each
        checked as the first was, until one is refused, anything else comes, or none for
        FETCH_LINK_SECONDS: a peer fetching again (an ``all_reduce``'s rounds, a training loop's
        moves) pays no new connection, thread or TLS handshake."""
        connection = link.connection
        connection.deadline = None
        connection.set_timeout(FETCH_LINK_SECONDS)
        while True:
            try:
                frame = connection.receive()
            except TimedOut:
                return
            if frame.header.get("t") != "fetch":
                return
            if not self._answer_fetch(link, frame, address, time.monotonic() + self.handshake_timeout):
                return

    def _start_fetch(self, job: Fetch) -> None:
        """A session's runner: perform ``job`` on a thread of its own, so the session goes on."""
        target = self._fetch_locally if job.local else self._fetch_remotely
        self._workers.run(target, job)

    def _fetch_locally(self, job: Fetch) -> None:
        deadline = time.monotonic() + FETCH_SECONDS
        transfers = self.hosting.transfers
        try:
            while True:
                generation = transfers.generation
                if self.hosting.fetch_locally(job, final=time.monotonic() >= deadline or self._stopping.is_set()):
                    return
                transfers.wait(generation, deadline - time.monotonic())
        except Exception as error:  # never leave the session waiting
            job.fail_with(error)

    def _fetch_remotely(self, job: Fetch) -> None:
        """Connect to the source peer (TLS checked against this peer's CA), present the capability and
        receive the one tensor; again while the source has not seen the grant yet, for FETCH_SECONDS.
        A connection whose fetch got its tensor is kept for the next fetch from that source (the
        source keeps it FETCH_LINK_SECONDS); one the source closed meanwhile is replaced at once."""
        deadline = time.monotonic() + FETCH_SECONDS
        source = (job.scheme, job.host, job.port)
        try:
            while True:
                frame = None
                connection = self._kept_link(source)
                if connection is not None:
                    try:
                        frame = self._ask(connection, job)
                    except TimedOut:  # the source took the request and went silent: no second try
                        connection.close()
                        raise
                    except ConnectionLost:  # the source closed it idle, or restarted: a new connection
                        connection.close()
                if frame is None:
                    connection = self._connect_to(job)
                    try:
                        frame = self._ask(connection, job)
                    except BaseException:
                        connection.close()
                        raise
                if frame.header.get("t") == "tensor":
                    self._keep_link(source, connection)
                else:
                    connection.close()  # a refusal ends the source's side too
                if job.receive(frame, final=time.monotonic() >= deadline or self._stopping.is_set()):
                    return
        except Exception as error:  # a source that cannot be reached, died, spoke nonsense or failed TLS
            job.fail_with(error)

    def _connect_to(self, job: Fetch):
        secure = job.scheme in ("embers", "wss")
        if secure and self._fetch_tls is None:
            self._fetch_tls = client_context(self.tls_ca)
        module = websocket if job.scheme in ("ws", "wss") else tcp
        # nothing large before the source answers; then exactly the tensor it granted, received into a
        # buffer of the peer's pool (its bytes are counted already: a reused one is given back to the
        # budget, and goes back to the pool when the tensor is dropped)
        return module.connect(job.host, job.port, HANDSHAKE_LIMITS, timeout=FETCH_SECONDS,
                              tls=self._fetch_tls if secure else None, allocate=self.hosting.pool.allocate)

    @staticmethod
    def _ask(connection, job: Fetch):
        """Send ``job``'s request on ``connection`` and receive the source's answer."""
        connection.send(wire.encode_frame(job.request()))
        connection.set_limits(job.reply_limits())
        return connection.receive()

    def _kept_link(self, source: tuple):
        """An idle connection to ``source`` kept from an earlier fetch, if one is young enough that
        the source has not closed it (half its FETCH_LINK_SECONDS), else None."""
        now = time.monotonic()
        with self._lock:
            kept = self._kept.get(source)
            while kept:
                connection, since = kept.pop()
                if now - since < FETCH_LINK_SECONDS / 2:
                    return connection
                connection.close()
        return None

    def _keep_link(self, source: tuple, connection) -> None:
        with self._lock:
            kept = self._kept.setdefault(source, [])
            if len(kept) < FETCH_LINKS_KEPT and not self._stopping.is_set():
                kept.append((connection, time.monotonic()))
                return
        connection.close()


class _Workers:
    """Threads that perform fetches, each kept idle for WORKER_SECONDS for the next one: a fetch
    starts at once on a thread of its own (it may wait long for its grant) without starting a
    thread each time (some 100 µs here, a third of a small move)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0  # threads waiting for a job that no job has been handed to
        self._lock = threading.Lock()
        self._stopped = False

    def run(self, target, job) -> None:
        """Call ``target(job)`` on an idle thread, or a new one."""
        with self._lock:
            self._jobs.put((target, job))
            if self._idle:
                self._idle -= 1
                return
        # not passed as an argument: the Thread object would hold the job, and its tensor, while it lives
        threading.Thread(target=self._work, name="ember-fetch", daemon=True).start()

    def stop(self) -> None:
        """End the idle threads, and each busy one once its job is done (the peer is stopping)."""
        with self._lock:
            self._stopped = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._jobs.put(None)

    def _work(self) -> None:
        task = self._jobs.get()  # the job it was started for, or one alike
        while task is not None:
            target, job = task
            target(job)
            del target, job, task  # a done fetch holds its tensor until its session takes it: not here too
            task = self._next()

    def _next(self):
        """The job handed to this thread next, or None when none came within WORKER_SECONDS."""
        with self._lock:
            if self._stopped:
                return None
            self._idle += 1
        try:
            return self._jobs.get(timeout=WORKER_SECONDS)
        except queue.Empty:
            with self._lock:
                if self._idle:  # no job was handed to this thread: it ends
                    self._idle -= 1
                    return None
            return self._jobs.get()  # one was, just now: it is on its way


class _Link:
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


class _Heartbeat:
    """One thread for all sessions that asked for keepalives: each of their links beats every
    half of the shortest interval."""

    def __init__(self):
        self.links: set[_Link] = set()
        self.wake = threading.Condition()
        self.stopped = False

    def add(self, link: _Link) -> None:
        with self.wake:
            self.links.add(link)
            self.wake.notify()  # its interval may be shorter than the current wait

    def remove(self, link: _Link) -> None:
        with self.wake:
            self.links.discard(link)

    def stop(self) -> None:
        with self.wake:
            self.stopped = True
            self.wake.notify()

    def run(self) -> None:
        with self.wake:
            while not self.stopped:
                self.wake.wait(min((link.interval for link in self.links), default=60.0) / 2)
                now = time.monotonic()
                for link in self.links:
                    link.beat(now)


def _writable(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    return bool(poller.poll(0))


def _format_address(address) -> str:
    host, port = address[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _peek(sock: socket.socket, n: int, deadline: float) -> bytes:
    """The first ``n`` bytes the client sent, left in the socket for whoever reads it next (fewer
    where it closed its end first). A request's first segment may hold fewer than the four bytes
    that tell TLS, HTTP and ember's frames apart (a slow link, a proxy, a hand at a terminal): the
    rest is awaited until ``deadline`` in sleeps, since the socket stays readable meanwhile: from 1 ms,
    doubling to 50 ms, so a client that stops there costs a few milliseconds of CPU in all."""
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


def serve(device="numpy", listen: str = "127.0.0.1:7878", **options) -> None:
    """Host ``device``'s backend as a compute peer on ``listen``; blocks until Ctrl-C. ``options``
    are :class:`Server`'s: ``token``, ``authorize``, ``tls_cert`` and ``tls_key``, ``insecure``,
    ``limits``, ``max_sessions``, ``idle_timeout``, ``handshake_timeout``, ``max_memory``, ``tls_ca``,
    ``transfer_ttl``.

    Raises HostDeviceError (before binding anything) for a capture or remote device, and
    ArgumentError for a TLS, access or listening setup it refuses (see :class:`Server`).
    """
    Server(device, listen, **options).serve_forever()
