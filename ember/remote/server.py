"""Compute peers: ``serve`` / ``Server`` host the local devices of one backend.

The I/O shell: it listens, completes TLS when it serves it, tells TCP from WebSocket clients
on one port (and answers plain HTTP requests for the peer's status: ``http.py``, ``status.py``),
and moves frames between sockets and the sans-I/O
:class:`~ember.remote.session.Host` (the handshake) and :class:`~ember.remote.session.Session`
(one per connection, its own table of tensors). It bounds what a connection may cost before it
is authenticated (small frames, a short deadline for the first bytes and one for the whole
handshake, slots with a share per address: ``slots.py``, and a ``PeerBusy`` answer past them),
survives running out of files or memory (it backs off and keeps accepting), closes idle sessions,
and keeps clients whose batch runs long informed that it is alive.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import logging
import math
import os
import select
import socket
import ssl
import threading
import time
from dataclasses import replace

from ..errors import ArgumentError, EmberError, ProtocolError
from ..wire import protocol as wire
from ..wire.protocol import HANDSHAKE_LIMITS, Limits
from ..wire.tcp import TcpConnection, TimedOut, spin_wait, spin_window, wait_limit
from ..wire.tls import HANDSHAKE_RECORD, server_context
from ..wire.websocket import accept as accept_websocket
from . import http, status
from .access import host_key
from .fetching import Fetcher
from .host import Host, hosted_devices
from .memory import Budget, BufferPool, default_quota
from .slots import Slots
from .sources import Sources
from .transfers import TTL, Transfers

log = logging.getLogger("ember.serve")

HANDSHAKE_SECONDS = 10   # TLS, the WebSocket upgrade and the init frame: all within this, from the connection
FIRST_BYTES_SECONDS = 3  # the first four bytes (what the client speaks) within this, and within the handshake's
REFUSAL_SECONDS = 2      # a connection refused as busy: its first bytes, TLS and first frame, all within this
IDLE_SECONDS = 15 * 60   # a session that receives nothing for this long is closed
MAX_SESSIONS = 64        # sessions at once (and as many connections still in their handshake: slots.py)
ACCEPT_PAUSES = (0.01, 1.0)  # after a failed accept, the first pause; each failure after doubles it, up to the second
LOG_EVERY = 10           # seconds: a trouble that repeats (busy refusals, lost connections) is logged at most this often
#: what a process runs out of: accept() (or a connection's receive) fails until files or memory come back
SCARCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
SAMPLE_SECONDS = 2       # how often the throughput the status page draws is sampled
_ALIVE = wire.encode_frame({"t": "alive"})
_TLS_REQUIRED = "this peer requires TLS: connect with embers:// (TCP) or wss:// (WebSocket)"

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


def return_freed_memory() -> bool:
    """Hand the free pages of every malloc arena back to the kernel (glibc's ``malloc_trim``): after
    the buffer pool let idle buffers go, which :func:`keep_freed_memory` would otherwise keep in
    the process. True where it ran (glibc), False elsewhere."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
    return True


def raise_file_limit() -> tuple[int, int] | None:
    """Raise this process's soft limit of open files to its hard limit (each connection costs the
    peer a file; a soft limit of 1,024 is common, the hard one often far higher). The soft limit
    before and after, or None where the platform has no such limits; logged at debug level."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # an unlimited hard limit (macOS) is not a number setrlimit takes: the kernel's own cap there is 10,240 by default
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 10240)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        log.debug("open files: the soft limit is %s already (hard limit %s)", soft, hard)
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (OSError, ValueError) as error:
        log.debug("open files: could not raise the soft limit %d to %d: %s", soft, wanted, error)
        return soft, soft
    log.debug("open files: raised the soft limit from %d to %d (the hard limit)", soft, wanted)
    return soft, wanted


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
      its first four bytes within FIRST_BYTES_SECONDS, and must complete its handshake — TLS,
      WebSocket upgrade, init frame — within ``handshake_timeout`` seconds in all. At most
      ``max_sessions`` sessions are open at once and as many connections may be in their
      handshake, a quarter of them from one address; other peers' fetches waiting for their
      grant have slots of their own (``ember.remote.slots``). A connection past these is answered
      ``PeerBusy`` naming the limit, in the framing it speaks (an HTTP request gets a 503). A
      session that receives nothing for ``idle_timeout`` seconds is closed (None or 0: never); a
      client waiting on its own long batch is not idle: the peer is not reading then, and sends
      it ``alive`` frames if it asked for keepalives. All sessions share ``max_memory``; one may
      hold ``limits.max_session_bytes`` of it (unset: a quarter, ``memory.default_quota``).
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
                 tls_ca: str | None = None, transfer_ttl: float = TTL, fetch_from=()):
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
                            transfers=Transfers(transfer_ttl))
        self._listener: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._links: set[_Link] = set()
        self.slots = Slots(max_sessions)  # connections not yet past their handshake (slots.py), under _lock
        self._busy_log = _Throttled(LOG_EVERY)  # connections refused as busy
        self._lost_log = _Throttled(LOG_EVERY)  # connections lost to a lack of files or memory
        self._unchecked_log = _Throttled(LOG_EVERY)  # handshakes refused unchecked: their address must wait
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._heartbeat = _Heartbeat()
        self.sources = Sources(self.hosting, self._stopping, max_sessions, handshake_timeout)  # others' fetches
        self.fetcher = Fetcher(self.hosting, self._stopping, tls_ca, fetch_from)  # this peer's sessions' fetches

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
                refusal = _Refusal(sock, key)
                displaced = self.slots.refusals.take(refusal)
        if busy is None:
            target, args = self._serve_connection, (sock, who, key)
        else:
            self._busy_log.note(f"{who}: refused: {busy}")
            if displaced is not None:  # the oldest refusal in the reserve ends now: its place is this one's
                displaced.end()
            target, args = self._refuse, (refusal, who, busy)
        thread = threading.Thread(target=target, args=args, name="ember-session", daemon=True)
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

    def _refuse(self, refusal: _Refusal, address: str, reason: str) -> None:
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
            with self._lock:
                self.slots.refusals.give_back(refusal)
                self._threads.discard(threading.current_thread())

    def _open(self, sock: socket.socket, pool: BufferPool, deadline: float, address: str, busy: str | None = None,
              holder: _Refusal | None = None):
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

    def _serve_connection(self, sock: socket.socket, address: str, key: str) -> None:
        link = session = None
        who = address
        held = self.slots.handshakes  # the pool this connection holds a slot of (None once it is past them)
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
                with self._lock:  # it waits for its grant in a slot of the fetches', not in a client's
                    busy = self.slots.fetches.take(key)
                    if busy is None:
                        held.give_back(key)
                        held = self.slots.fetches
                if busy is not None:  # refused with retry: the fetching peer asks again after a pause
                    self._busy_log.note(f"{address}: refused a fetch: {busy}")
                    link.send([({"t": "refuse", "kind": "PeerBusy", "reason": busy, "retry": True}, [])])
                    return
                if self.sources.answer(link, init, address, deadline) and self.sources.hold():
                    with self._lock:  # its capability was good: the connection is no handshake now
                        held.give_back(key)
                        held = None
                    try:
                        self.sources.answer_more(link, address)
                    finally:
                        self.sources.let_go()
                return
            if plain_on_tls:  # refused after its init frame is read, so the refusal is not lost to a reset
                replies = [({"t": "refuse", "kind": "TLSError", "reason": _TLS_REQUIRED}, [])]
            else:
                session, replies = self.hosting.open(init, pool, address)
            with self._lock:  # done, before the client hears of it: it may connect again at once
                held.give_back(key)
                held = None
            link.send(replies)
            if session is None:
                refusal = replies[0][0]
                if "wait" in refusal:  # a flood of guesses: a line now and then, not one each
                    self._unchecked_log.note(f"{address}: refused ({refusal['kind']}): {refusal['reason']}")
                else:
                    log.warning("%s: refused (%s): %s", address, refusal["kind"], refusal["reason"])
                return
            info = replies[0][0]
            name = session.client  # its authorizer's name for it, else its address
            who = name if name == address else f"{name} ({address})"
            log.info("%s: session opened on device %s (%s)", who, init.header.get("device", 0), info["device"])
            connection.deadline = None  # the handshake is done: the session's own limits and timeout
            connection.set_limits(self.limits)
            connection.reader.allocate = session.allocate  # received tensors count against its quota and the budget
            session.runner = self.fetcher.start  # fetches from other peers run beside the session
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
        except (EmberError, OSError) as error:  # the client went away, or missed its handshake deadline …
            scarce = _scarcity(error)
            if scarce is not None:  # … or this process ran out of memory or buffers: that is the peer's to say
                self._lost_log.note(f"{who}: connection lost: {scarce}")
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
                if held is not None:
                    held.give_back(key)
                self._threads.discard(threading.current_thread())

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


class _Refusal:
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


class _Throttled:
    """Warnings logged at most once every ``interval`` seconds, each saying how many were left out
    since the one before: a flood of refusals costs the log a line now and then."""

    def __init__(self, interval: float):
        self.interval = interval
        self.last = -math.inf
        self.left_out = 0
        self.lock = threading.Lock()

    def note(self, message: str) -> None:
        with self.lock:
            now = time.monotonic()
            if now - self.last < self.interval:
                self.left_out += 1
                return
            left_out, self.left_out, self.last = self.left_out, 0, now
        log.warning("%s%s", message, f" (and {left_out} more like it since the last such line)" if left_out else "")


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


def _scarcity(error: BaseException) -> OSError | None:
    """The lack of files, memory or buffers (SCARCE) behind ``error`` — itself, or the OSError a
    ConnectionLost was raised in place of — if that is what it is."""
    for cause in (error, error.__cause__, error.__context__):
        if isinstance(cause, OSError) and cause.errno in SCARCE:
            return cause
    return None


def _writable(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    return bool(poller.poll(0))


def _format_address(address) -> str:
    host, port = address[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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


def serve(device="numpy", listen: str = "127.0.0.1:7878", **options) -> None:
    """Host ``device``'s backend as a compute peer on ``listen``; blocks until Ctrl-C. ``options``
    are :class:`Server`'s: ``token``, ``authorize``, ``tls_cert`` and ``tls_key``, ``insecure``,
    ``limits``, ``max_sessions``, ``idle_timeout``, ``handshake_timeout``, ``max_memory``, ``tls_ca``,
    ``transfer_ttl``, ``fetch_from`` (the peers it may fetch tensors from; none by default).

    Raises HostDeviceError (before binding anything) for a capture or remote device, and
    ArgumentError for a TLS, access or listening setup it refuses (see :class:`Server`).
    """
    Server(device, listen, **options).serve_forever()
