"""The TCP shell: moves frames over a connected socket. Protocol logic lives in protocol.py.

Large tensor segments are received straight into their arrays (``recv_into``); small stages
go through a scratch buffer so a small frame costs one system call. A small frame comes from
``encode_frame`` as one buffer and goes in one ``send``; a larger one is sent scatter-gather
(``sendmsg``), so its tensors' bytes are never joined into one buffer. Over TLS, which has no
``sendmsg``, small buffers are joined into one write and large ones written as they are. Plain
TCP on 64-bit Linux keeps the socket blocking, with the kernel's timeouts (``TcpConnection``).
"""

from __future__ import annotations

import math
import os
import select
import socket
import ssl
import struct
import sys
import time
from collections import deque

from ..errors import ArgumentError, ConnectionLost, EmberError, ProtocolError
from .protocol import Frame, FrameReader, Limits
from .tls import wrap_client

_DIRECT = 1 << 16  # receive regions at least this large go straight into their array
_IOV_MAX = 512
_JOIN = 1 << 16    # over TLS, buffers smaller than this are joined into one write (one record, not many)
# plain TCP on 64-bit Linux: a blocking socket with the kernel's own timeouts (a struct timeval, two longs), so that a
# receive is one recv and a send one sendmsg; Python's timeouts poll the socket before each (a system call more).
# Elsewhere (a 32-bit time_t or timeval of another layout) Python's timeouts, as on every other system.
_TIMEVAL = struct.Struct("@ll")
_KERNEL_TIMEOUTS = sys.platform == "linux" and _TIMEVAL.size == 16
_POLLED_SEND = 1 << 20  # frames this large are sent with Python's timeouts all the same (TcpConnection.send)


class TimedOut(ConnectionLost):
    """Nothing arrived within a wait's timeout or before a deadline: the connection is lost, and
    the shells can tell this from a close."""


def wait_limit(timeout: float | None, deadline: float | None) -> float | None:
    """How long the next wait for bytes may last: ``timeout`` seconds, but never past ``deadline``
    (a ``time.monotonic()`` value); None leaves the socket's own timeout. TimedOut once the
    deadline has passed."""
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimedOut("the deadline passed")
    return left if timeout is None else min(timeout, left)


# how long a wait for an expected frame polls before it sleeps, by default (EMBER_SPIN_US): Linux's own default for a
# guest's halt polling (cpuidle-haltpoll's guest_halt_poll_ns), which a VM without it (guest_halt_poll_ns=0) lacks
SPIN_US = 200


def spin_window() -> float:
    """EMBER_SPIN_US: how long, in seconds, a wait for a frame expected soon polls before it
    sleeps in the kernel (default 200 µs; 0 never polls). See :func:`spin_wait`."""
    text = os.environ.get("EMBER_SPIN_US", "")
    try:
        micros = float(text) if text.strip() else SPIN_US
    except ValueError:
        micros = -1.0
    if not 0 <= micros <= 1e6:
        raise ArgumentError(f"EMBER_SPIN_US must be microseconds from 0 to 1000000 (0: never poll), got {text!r}")
    return micros * 1e-6


_yield_cpu = getattr(os, "sched_yield", lambda: time.sleep(0))  # sched_yield is POSIX


def spin_wait(connection, seconds: float) -> bool:
    """Whether a frame is ``connection.readable()`` within ``seconds``, polled without sleeping and
    handing the CPU to any other runnable thread between polls (``sched_yield``).

    For a reply expected within microseconds: a thread that sleeps in the kernel must be woken,
    and where the CPU it slept on has gone idle (a VM's vCPU halts), that wake-up costs tens of
    microseconds, more than a small op's whole round trip. Yielding keeps a peer that shares the
    CPU running. Then the caller receives as it would have: polling either reads nothing or
    (plain TCP with the kernel's timeouts) reads what came into the connection's own frame reader,
    and a socket closed meanwhile (a server stopping), or the stream's end, counts as readable, for
    the receive to report."""
    if seconds <= 0:
        return False
    end = time.perf_counter() + seconds
    try:
        while not connection.readable():
            if time.perf_counter() >= end:
                return False
            _yield_cpu()
    except (OSError, ValueError):  # ValueError: select() of a socket closed by another thread
        pass
    return True


def _timeval(seconds: float | None) -> bytes:
    """A kernel socket timeout: zero is none; a positive one is at least a microsecond."""
    if seconds is None:
        return _TIMEVAL.pack(0, 0)
    return _TIMEVAL.pack(*divmod(max(1, math.ceil(seconds * 1e6)), 1_000_000))


def tune(sock: socket.socket) -> None:
    """No Nagle delay; keepalive so a vanished host is noticed even while idle."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def readiness(sock: socket.socket):
    """A function answering, without waiting, whether bytes (or the end of the stream) wait on
    ``sock``, so a read would not block, decrypted TLS bytes too. Where the platform has
    ``poll``, the socket is registered once: a poll costs half a ``select`` of it, and a wait for
    a reply asks many times (:func:`spin_wait`). A closed socket counts as readable."""
    pending = getattr(sock, "pending", None)  # TLS: bytes decrypted but not yet read
    if not hasattr(select, "poll"):
        return lambda: bool(pending and pending()) or bool(select.select([sock], [], [], 0)[0])
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poll = poller.poll
    if pending is not None:
        return lambda: bool(pending() or poll(0))
    return lambda: bool(poll(0))


class SocketShell:
    """What both shells do with their socket alike: its timeouts, and a look for a frame.

    ``timeout`` (seconds, None: none) bounds each send and each wait for bytes. Plain TCP on
    64-bit Linux keeps the socket blocking and has the kernel enforce it (``SO_SNDTIMEO``,
    ``SO_RCVTIMEO``): a receive is then one ``recv`` and a send one ``send``, where Python's
    timeouts poll the socket before each call. A socket under TLS, or elsewhere, keeps Python's (a
    blocking TLS socket would retry a partial record past any kernel timeout). With the kernel's
    timeouts, a look for a frame reads what has come at once, without waiting (:meth:`_read_now`),
    where a poll and then a receive would cost a system call more."""

    sock: socket.socket
    timeout: float | None = None
    deadline: float | None = None  # a time.monotonic() value no read waits past (a server's handshake)
    _kernel = False
    _receive_limit: float | None = None  # the kernel's receive timeout now (None: none)
    _ended = False  # the stream's end came (a look found it) …
    _failed: EmberError | None = None  # … or malformed bytes: the next receive raises it

    def close(self) -> None:
        """Shut the socket down (a receive blocked in another thread returns) and close it; again, nothing."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected, or closed already
            pass
        self.sock.close()

    def _take_timeouts(self, timeout: float | None) -> None:
        self._tls = isinstance(self.sock, ssl.SSLSocket)
        self._kernel = _KERNEL_TIMEOUTS and not self._tls
        self.set_timeout(timeout)

    def set_timeout(self, seconds: float | None) -> None:
        """The longest a send, or a wait for bytes, lasts (None: no limit); then TimedOut."""
        self.timeout = seconds
        if not self._kernel:
            self.sock.settimeout(seconds)
            return
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))
        self._limit_receive(seconds)

    def _limit_receive(self, seconds: float | None) -> None:
        if seconds != self._receive_limit:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
            self._receive_limit = seconds

    def _limit_wait(self, timeout: float | None, python: bool = False) -> bool:
        """Bound the next wait for bytes by ``timeout`` seconds (None: the connection's), never past
        ``deadline``: with the kernel's timeouts by its receive timeout, kept for the next receive
        (sends have one of their own), unless ``python`` asks for Python's (large transfers moved
        more with them). Whether it set a Python timeout, which :meth:`_end_wait` takes back."""
        limit = wait_limit(timeout, self.deadline)
        if limit is None:
            limit = self.timeout
        if self._kernel and not python:
            self._limit_receive(limit)
            return False
        if self._kernel or limit != self.timeout:
            self.sock.settimeout(limit)
            return True
        return False

    def _end_wait(self) -> None:
        """Take back the Python timeout :meth:`_limit_wait` set."""
        self.sock.settimeout(None if self._kernel else self.timeout)

    def _read_now(self) -> bool:
        """Whether a frame, the stream's end or a failure waits for the receive, after reading
        what has come into ``_scratch`` without waiting and giving the shell its ``n`` bytes
        (``_take(n)``, which answers whether a frame waits)."""
        try:
            n = self.sock.recv_into(self._scratch, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True  # receive() reports it
        if not n:
            self._ended = True
            return True
        try:
            return self._take(n)
        except (ProtocolError, ConnectionLost) as error:  # the receive raises it, as if it had read the bytes itself
            self._failed = error
            return True


class TcpConnection(SocketShell):
    """Frames over a TCP socket, plain or TLS, for either end; ``received`` holds bytes of the
    stream already read from the socket (a server telling TCP from WebSocket over TLS). While
    ``deadline`` is set (a ``time.monotonic()`` value: a server's handshake), no read waits past it.

    ``timeout`` bounds each send and each wait for bytes, as :class:`SocketShell` says; frames of
    1 MiB or more, and tensors of 64 KiB or more, move with Python's timeouts, which moved more a second."""

    transport = "tcp"

    def __init__(self, sock: socket.socket, limits: Limits = Limits(), timeout: float | None = None, allocate=None,
                 received: bytes = b""):
        tune(sock)
        self.sock = sock
        self.reader = FrameReader(limits, allocate) if allocate else FrameReader(limits)
        self._frames: deque[Frame] = deque(self.reader.feed(received))
        self._scratch = memoryview(bytearray(_DIRECT))  # small reads land here; a view, sliced for each
        self._waiting = readiness(sock)
        self._take_timeouts(timeout)

    def set_limits(self, limits: Limits) -> None:
        self.reader.limits = limits

    def send(self, buffers: list) -> int:
        """Send a frame's buffers; returns the bytes sent."""
        total = 0
        try:
            if len(buffers) == 1 and type(buffers[0]) is bytes:  # a small frame (encode_frame): most often one write
                data = buffers[0]
                total = self.sock.send(data)
                if total == len(data):
                    return total
                buffers = [memoryview(data)[total:]]
            views = [memoryview(b).cast("B") for b in buffers]
            total += sum(v.nbytes for v in views)
            if self._tls:
                self._send_joined(views)
            elif self._kernel and total >= _POLLED_SEND and self.timeout is not None:
                # a large frame is sent as Python's timeouts send it (poll, then send what fits): one blocking sendmsg
                # of 256 MiB moved a third less a second
                self.sock.settimeout(self.timeout)
                try:
                    self._send_gathered(views)
                finally:
                    self.sock.settimeout(None)
            else:
                self._send_gathered(views)
        except (OSError, ValueError) as error:
            raise ConnectionLost(f"connection lost while sending: {error}") from None
        return total

    def _send_gathered(self, views: list) -> None:
        while views:
            sent = self.sock.sendmsg(views[:_IOV_MAX])
            while sent:
                if sent >= views[0].nbytes:
                    sent -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0
            while views and not views[0].nbytes:
                views.pop(0)

    def _send_joined(self, views: list) -> None:
        """An SSLSocket has no ``sendmsg``: runs of small buffers are joined, large ones sent as they are."""
        small: list = []
        for view in views:
            if view.nbytes < _JOIN:
                small.append(view)
                continue
            if small:
                self.sock.sendall(b"".join(small))
                small = []
            self.sock.sendall(view)
        if small:
            self.sock.sendall(b"".join(small))

    def readable(self) -> bool:
        """Whether a frame, or the connection's end, waits to be received (asked without waiting).
        With the kernel's timeouts, between tensors, what has come is read at once, without
        waiting (a poll and then a receive would cost a system call more)."""
        if self._frames or self._ended or self._failed:
            return True
        if not self._kernel or self.reader.awaiting() >= _DIRECT:
            return self._waiting()
        return self._read_now()

    def _take(self, n: int) -> bool:
        self._frames.extend(self.reader.feed(self._scratch[:n]))
        return bool(self._frames)

    def receive(self, timeout: float | None = None) -> Frame:
        """The next frame (blocking). Each wait for bytes lasts at most ``timeout`` seconds (default:
        the connection's timeout) and never past ``deadline``; then TimedOut."""
        restore = False  # whether this receive set a Python timeout, to take back
        try:
            while not self._frames:
                if self._failed is not None:  # found by readable()
                    raise self._failed
                if self._ended:
                    raise ConnectionLost("the peer closed the connection")
                direct = self.reader.awaiting() >= _DIRECT  # a large tensor's bytes go straight into its array
                # as a large frame is sent (TcpConnection.send), a large tensor is received with Python's timeouts
                restore = self._limit_wait(timeout, python=restore or direct) or restore
                try:
                    if direct:
                        n = self.sock.recv_into(self.reader.buffer())
                        frames = self.reader.advance(n) if n else None
                    else:
                        n = self.sock.recv_into(self._scratch)
                        frames = self.reader.feed(self._scratch[:n]) if n else None
                except (TimeoutError, BlockingIOError):  # BlockingIOError: the kernel's timeout
                    raise TimedOut("timed out waiting for the peer") from None
                except OSError as error:
                    raise ConnectionLost(f"connection lost: {error}") from None
                if not n:
                    raise ConnectionLost("the peer closed the connection")
                self._frames.extend(frames)
        finally:
            if restore:
                self._end_wait()
        return self._frames.popleft()


def connect(host: str, port: int, limits: Limits = Limits(), timeout: float | None = None,
            tls: ssl.SSLContext | None = None, allocate=None) -> TcpConnection:
    """A TCP frame connection to ``host:port``, inside TLS when given a client context; received
    tensors go into ``allocate(shape, dtype)``'s arrays when given (a peer's buffer pool)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as error:
        raise ConnectionLost(f"cannot connect to {host}:{port}: {error}") from None
    if tls is not None:
        sock = wrap_client(sock, tls, host, port, "embers")
    return TcpConnection(sock, limits, timeout, allocate)
