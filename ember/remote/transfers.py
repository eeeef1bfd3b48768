"""Direct transfers between compute peers, without I/O: capabilities, grants and fetches.

``x.to_device(b)`` with ``x`` in session SA of peer A and ``b`` a device of peer B (session SB)
moves the bytes from A to B, not through the client. The client draws a *capability* — 32
random bytes — and sends two messages, neither awaited: ``grant`` to SA (tensor ``x`` may be
read once with this capability, by session SB) and ``fetch`` to SB (fetch that tensor from A
with it, as tensor ``y``). A's :class:`Transfers` table keeps the :class:`Grant`; B's session
hands its shell a :class:`Fetch` to perform — connect to A, present the capability, receive one
tensor — and reads the outcome when ``y`` is first used. Between two sessions of one peer the
shell claims the grant from its own table instead: no network, no host round trip.

A grant is single-use, bound to the fetching session's id and expires ``ttl`` seconds after A
granted it (300 s by default). A used or expired capability is remembered for a while
(:data:`LINGER`), so a late or repeated presentation is refused at once and named.

A peer fetches only from the peers it is told to trust (:class:`TrustedPeers`, ``--fetch-from``):
the capability is the one byte string a client chooses that a fetch sends, and it goes only to a
trusted address that first said it is the ember peer the client named. These objects do no I/O;
:mod:`ember.remote.fetching` performs fetches and answers them.
"""

from __future__ import annotations

import ipaddress
import math
import re
import threading
import time

from ..errors import ArgumentError, EmberError
from ..ops.table import Meta
from ..wire import protocol as wire
from ..wire.protocol import HANDSHAKE_LIMITS, Frame, Limits
from .failures import Failure

TTL = 300.0               # seconds a grant stays valid (ember serve --transfer-ttl)
LINGER = 60.0             # seconds a used or expired capability is remembered after its grant ended
GRANTS_PER_SESSION = 1024  # grants a session may have pending at once
FETCHES_PER_SESSION = 256  # fetches a session may have pending at once, dropped ones whose worker still runs included
SCHEMES = ("ember", "ws", "embers", "wss")
SETTLE_SECONDS = 600.0    # the longest a session waits for its shell to finish a fetch (a shell bounds its own I/O)


class Grant:
    """A tensor session ``owner`` lets another session read once: the value (a native array, or the
    failure that took its place), the session it is bound to, and when it expires. ``nbytes`` are
    counted against the owner's quota until the grant ends."""

    __slots__ = ("capability", "session", "value", "expires", "owner", "nbytes", "state", "ended")

    def __init__(self, capability: bytes, session: str, value, owner, nbytes: int):
        self.capability, self.session, self.value = capability, session, value
        self.owner, self.nbytes = owner, nbytes
        self.expires = 0.0
        self.state = "granted"   # granted → sending → used (or granted again), expired, revoked
        self.ended = 0.0         # when it stopped being granted

    def download(self):
        """The granted value as a host NumPy array (on the thread answering the fetch)."""
        return self.owner.engine.download(self.value)

    def release(self) -> None:
        """Let the value go and hand its bytes back to the owner's count (from any thread: the owner
        takes them back when it handles its next frame)."""
        self.value = None
        nbytes, self.nbytes = self.nbytes, 0
        if nbytes:
            self.owner.ended.append(nbytes)


class Transfers:
    """A peer's table of grants, by capability, shared by all its sessions and the threads that
    answer fetches (thread-safe). ``clock`` is ``time.monotonic`` unless a test replaces it."""

    def __init__(self, ttl: float = TTL, clock=time.monotonic):
        self.ttl, self.clock = ttl, clock
        self.table: dict[bytes, Grant] = {}
        self.pending: dict[object, int] = {}  # owner session -> its grants still granted
        self.changed = threading.Condition()
        self.generation = 0   # counts grants made, so a waiter misses none
        self.closed = False

    def grant(self, grant: Grant) -> str | None:
        """Record ``grant``; None, or why it was refused (too many pending, a capability in use)."""
        with self.changed:
            now = self.clock()
            self._purge(now)
            if self.pending.get(grant.owner, 0) >= GRANTS_PER_SESSION:
                return f"grant: {GRANTS_PER_SESSION} transfers of this session are pending already"
            if grant.capability in self.table:
                return "grant: this capability was granted already; draw a new one for each transfer"
            grant.expires = now + self.ttl
            self.table[grant.capability] = grant
            self.pending[grant.owner] = self.pending.get(grant.owner, 0) + 1
            self.generation += 1
            self.changed.notify_all()
        return None

    def claim(self, capability: bytes, session: str) -> Grant | str | None:
        """Take the grant of ``capability`` for ``session``: the grant (now being sent: the caller
        sends its value, then calls :meth:`confirm` once it arrived, or :meth:`unclaim` if it may not
        have), why it is refused, or None if it is unknown (not granted yet: its owner may still be
        computing; see :meth:`wait`) or being sent on a connection that may have been cut."""
        with self.changed:
            now = self.clock()
            self._purge(now)
            grant = self.table.get(capability)
            if grant is None or grant.state == "sending":
                return None
            if grant.state == "used":
                return "the capability was used already: each one authorizes a single read"
            if grant.state == "expired":
                return f"the capability expired ({self.ttl:g} s after it was granted)"
            if grant.state == "revoked":
                return "the capability was revoked: the session that granted it has closed"
            if grant.session != session:
                return "the capability was granted to another session"
            self._end(grant, "sending", now)
            return grant

    def confirm(self, grant: Grant) -> None:
        """``grant``'s value arrived (or a refusal in its place was sent): it is used, its value let go."""
        with self.changed:
            grant.state = "used"
        grant.release()

    def unclaim(self, grant: Grant) -> None:
        """``grant``'s value may not have arrived (the connection was cut while it was sent): it is
        granted again, so that the destination's next try reads it (docs/protocol.md, "Moves")."""
        with self.changed:
            if grant.state != "sending":
                return
            grant.state = "granted"
            self.pending[grant.owner] = self.pending.get(grant.owner, 0) + 1
            self.generation += 1
            self.changed.notify_all()

    def wait(self, generation: int, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a grant made after ``generation`` (read before a claim)."""
        with self.changed:
            self.changed.wait_for(lambda: self.generation != generation or self.closed, max(timeout, 0.0))

    def revoke(self, owner) -> None:
        """End every pending grant of session ``owner`` (it closed): their values are let go."""
        with self.changed:
            now = self.clock()
            for grant in self.table.values():
                if grant.owner is owner and grant.state == "granted":
                    self._end(grant, "revoked", now)
                    grant.release()

    def close(self) -> None:
        """Wake every waiter (the peer is stopping)."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def wake(self) -> None:
        """Wake every waiter to look again (a fetch waiting here was cancelled): as if a grant came."""
        with self.changed:
            self.generation += 1
            self.changed.notify_all()

    def _end(self, grant: Grant, state: str, now: float) -> None:
        grant.state, grant.ended = state, now
        left = self.pending.get(grant.owner, 1) - 1
        if left:
            self.pending[grant.owner] = left
        else:
            self.pending.pop(grant.owner, None)

    def _purge(self, now: float) -> None:
        """Expire grants past their time (letting their values go) and forget ended ones after LINGER."""
        if not self.table:
            return
        gone = []
        for capability, grant in self.table.items():
            if grant.state == "granted" and now >= grant.expires:
                self._end(grant, "expired", now)
                grant.release()
            elif grant.state not in ("granted", "sending") and now - grant.ended > LINGER:
                gone.append(capability)
        for capability in gone:
            del self.table[capability]

    def purge(self) -> None:
        """Expire what is due now (a session calls it before each frame while it has grants pending)."""
        with self.changed:
            self._purge(self.clock())


_HOST = re.compile(r"[A-Za-z0-9._-]+|[0-9A-Fa-f:.]+")  # a host name or an IP address: no space, no line break


def is_host(text) -> bool:
    """Whether ``text`` may name a host: a DNS name or an IP address (so no byte of it is a line
    break, a space or a colon-less port)."""
    return type(text) is str and 0 < len(text) <= 255 and _HOST.fullmatch(text) is not None


class TrustedPeers:
    """Whom a peer fetches tensors from (``--fetch-from``, ``Server(fetch_from=)``): addresses,
    networks and host names, each for every port or one (``127.0.0.1``, ``10.0.0.0/8``,
    ``gpu-box:7878``, ``[::1]:7878``). Empty by default: a peer then fetches only between its own
    sessions. A fetch's host name is resolved once, by the fetching peer (``resolve``), and the
    address it connects to is the one admitted here; a name in the list stands for the addresses
    it resolves to at the time of the fetch. Without I/O: the shell passes the resolver."""

    def __init__(self, networks: tuple = (), names: tuple = (), spec: str = ""):
        self.networks = networks  # (ip_network, port or None)
        self.names = names        # (host name, port or None)
        self.spec = spec          # as given, for messages

    @classmethod
    def parse(cls, spec) -> TrustedPeers:
        """``spec``: entries separated by commas (a str), or an iterable of entries. ArgumentError
        names an entry that is no address, network or host name, or whose port is not one."""
        entries = [e.strip() for e in (spec.split(",") if isinstance(spec, str) else (spec or ()))]
        if not all(isinstance(e, str) for e in entries):
            raise ArgumentError(f"fetch_from lists addresses, networks or host names as strings, got {spec!r:.200}")
        networks, names = [], []
        for entry in filter(None, entries):
            host, port = _split_port(entry)
            try:
                networks.append((_unmapped_network(ipaddress.ip_network(host, strict=False)), port))
                continue
            except ValueError:
                pass
            if not is_host(host) or ":" in host or "/" in host:
                raise ArgumentError(f"--fetch-from: {entry!r:.100} is no address (10.0.0.7), network (10.0.0.0/8) or "
                                    f"host name, with or without a :PORT")
            names.append((host.lower(), port))
        return cls(tuple(networks), tuple(names), ",".join(filter(None, entries)))

    def __bool__(self) -> bool:
        return bool(self.networks or self.names)

    def extend(self, spec) -> TrustedPeers:
        """These entries and those of ``spec`` (a fleet adding its peers)."""
        more = TrustedPeers.parse(spec)
        return TrustedPeers(self.networks + more.networks, self.names + more.names,
                            ",".join(filter(None, (self.spec, more.spec))))

    def admits(self, address: str, port: int, resolve) -> bool:
        """Whether this peer may connect to ``address`` (an IP address a fetch's host resolved to)
        on ``port``; ``resolve(name)`` gives the addresses a listed host name stands for."""
        ip = _unmapped(ipaddress.ip_address(address))
        for network, only in self.networks:
            if (only is None or only == port) and ip in network:
                return True
        for name, only in self.names:
            if (only is None or only == port) and any(_unmapped(ipaddress.ip_address(a)) == ip for a in resolve(name)):
                return True
        return False


def _split_port(entry: str) -> tuple[str, int | None]:
    """``host:port`` / ``[v6]:port`` / ``host`` → (host, port or None)."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise ArgumentError(f"--fetch-from: {entry!r:.100} is no [ADDRESS]:PORT")
        return host, _port(entry, rest[1:])
    if entry.count(":") == 1:  # one colon: a port (an IPv6 address has more)
        host, _, port = entry.partition(":")
        return host, _port(entry, port)
    return entry, None


def _port(entry: str, text: str) -> int:
    if not (text.isdigit() and 0 < int(text) < 65536):
        raise ArgumentError(f"--fetch-from: {entry!r:.100} has no port 1–65535 after its colon")
    return int(text)


def _unmapped(ip):
    """An IPv4-mapped IPv6 address as the IPv4 address it is (the list and the resolver may differ)."""
    return (ip.ipv4_mapped or ip) if ip.version == 6 else ip


def _unmapped_network(network):
    mapped = network.network_address.ipv4_mapped if network.version == 6 else None
    if mapped is not None and network.prefixlen >= 96:
        return ipaddress.ip_network(f"{mapped}/{network.prefixlen - 96}")
    return network


NOT_AN_EMBER_PEER = "not an ember peer"    # all a failed fetch says of what answered at the address …
UNREACHABLE = "unreachable from this peer"  # … or that nothing did: no echoed bytes, status or errno


class Fetch:
    """A tensor a session fetches from a peer with a capability: the effect its shell performs.

    The shell either connects to ``source`` (``scheme://host:port``, once :class:`TrustedPeers`
    admitted the address the host name resolved to), sends :meth:`hello` — nothing the client
    chose —, checks the source's answer with :meth:`check_source` (it must be the ember peer
    ``peer`` the client named), then sends :meth:`request`, receives one frame within
    :meth:`reply_limits` and hands it to :meth:`receive` — or, when ``local`` (the source is a
    session of this very peer), claims the grant from its own :class:`Transfers` and calls
    :meth:`deliver`. Any failure goes to :meth:`fail`. The session reads the outcome with
    :meth:`wait` when the tensor is first used.

    Its life, for the bytes the session counts for it: *queued* until a worker :meth:`begin` s it,
    *running* until the worker calls :meth:`end`, then *over*. :meth:`cancel` (the tensor was
    dropped, written again, or its session closed) ends a queued one at once; a running one is
    interrupted (``interrupt``, the shell's: it closes the fetch's connection) and hands its
    bytes back through the ``refund`` given once its worker ends — until then the buffer it
    receives into exists, so its bytes stay counted.
    """

    def __init__(self, tid: int, meta: Meta, scheme: str, host: str, port: int, capability: bytes, session: str,
                 local: bool, peer: str = ""):
        self.tid, self.meta = tid, meta
        self.scheme, self.host, self.port = scheme, host, port
        self.capability, self.session, self.local = capability, session, local
        self.peer = peer    # the source's identity, as the client named it: the answer to hello must be it
        self.value = None   # the host array (or, local, the native array) once done
        self.error: Failure | None = None
        self.done = threading.Event()
        self.halted = threading.Event()  # set by cancel: a worker's wait (a retry's back-off) ends
        self.state = "queued"            # queued → running → over
        self.cancelled = False
        self.interrupt = None            # the shell's, while running: stop this fetch's I/O (from another thread)
        self._refund = None              # called with the bytes once a cancelled running fetch ends
        self._lock = threading.Lock()

    @property
    def source(self) -> str:
        """The peer it fetches from, as ``scheme://host:port``."""
        return f"{self.scheme}://{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}"

    @property
    def over(self) -> bool:
        """Whether no worker performs it (any more): it never will, or it ended."""
        return self.state == "over"

    def hello(self) -> dict:
        """The first frame of a connection to the source: nothing in it is the client's, so a
        service that is no ember peer gets no byte the client chose (the source names itself)."""
        return {"t": "fetch", "v": wire.VERSION}

    def check_source(self, frame: Frame) -> tuple[str, str] | None:
        """The source's answer to :meth:`hello`: None when it is the ember peer the client named
        (then the capability may go to it), else the failure (kind, message). A refusal from an
        ember peer stands as it said it; anything else is only "not an ember peer"."""
        header = frame.header
        kind = header.get("t")
        if kind == "refuse" and not frame.segments:
            reason = header.get("reason")
            return header.get("kind"), reason if isinstance(reason, str) else "refused"
        if kind != "peer" or header.get("v") != wire.VERSION or frame.segments or type(header.get("peer")) is not str:
            return "ConnectionLost", NOT_AN_EMBER_PEER
        if header["peer"] != self.peer:
            return "ConnectionLost", ("another ember peer answers at this address than the one the transfer names (it "
                                      "restarted, or another took its address)")
        return None

    def request(self) -> dict:
        """The frame that presents the capability to the source peer: after its answer to
        :meth:`hello`, or on a connection kept from an earlier fetch from it."""
        return {"t": "fetch", "v": wire.VERSION, "capability": self.capability, "session": self.session}

    def reply_limits(self) -> Limits:
        """What the source's answer may be: a small header and exactly this tensor's bytes (for an
        empty tensor, the bytes of its other extents: the frame reader checks those too)."""
        nbytes = math.prod(n for n in self.meta.shape if n) * self.meta.dtype.itemsize
        small = HANDSHAKE_LIMITS.max_header_bytes
        return Limits(max_header_bytes=small, max_tensor_bytes=nbytes, max_frame_bytes=nbytes + small)

    def receive(self, frame: Frame, final: bool = True) -> bool:
        """The source's answer; True once the fetch is over, False when the source has not seen the
        grant yet and the shell should ask again (unless ``final``: then that refusal stands)."""
        header = frame.header
        kind = header.get("t")
        if kind == "tensor":
            segments = frame.segments
            expected = (self.meta.dtype.name, tuple(self.meta.shape))
            if len(segments) != 1 or segments[0] is None or wire.segment_descriptor(segments[0]) != expected:
                self.fail("ProtocolError", f"the source sent {_describe(segments)}, not the {self.meta.dtype} tensor "
                                           f"of shape {self.meta.shape} it granted")
            else:
                self._finish(segments[0])
            return True
        if kind == "refuse":
            if header.get("retry") is True and not final:
                return False
            reason = header.get("reason")
            self.fail(header.get("kind"), reason if isinstance(reason, str) else "refused")
            return True
        self.fail("ProtocolError", f"unexpected answer {kind!r:.40} from the source")
        return True

    def deliver(self, value) -> None:
        """The granted native array, claimed from this peer's own table (a local fetch)."""
        self._finish(value)

    def fail(self, kind, message: str) -> None:
        """End the fetch with an error of ``kind`` (an ember exception's name)."""
        if not (isinstance(kind, str) and kind in wire.ERROR_KINDS):
            kind = "ExecutionError"
        self.error = Failure(kind, f"transfer from {self.source}: {message[:1000]}")
        self.done.set()

    def fail_with(self, error: Exception) -> None:
        """End the fetch with ``error`` (a connection lost, a TLS failure …)."""
        kind = next((c.__name__ for c in type(error).__mro__ if c.__name__ in wire.ERROR_KINDS), "EmberError")
        self.fail(kind if isinstance(error, EmberError) else "ConnectionLost", str(error))

    def _finish(self, value) -> None:
        if not self.done.is_set():
            if not self.cancelled:  # nobody will take a cancelled fetch's value: it is not kept
                self.value = value
            self.done.set()

    def wait(self, timeout: float = SETTLE_SECONDS):
        """The outcome: the value, or the :class:`Failure` that ended the fetch (also when the shell
        did not finish within ``timeout`` seconds)."""
        if not self.done.wait(timeout):
            return Failure("ConnectionLost", f"transfer from {self.source}: not done after {timeout:g} s")
        return self.error if self.error is not None else self.value

    # -- its life, for the bytes counted for it: the session's thread cancels, a worker begins and ends --
    def begin(self, interrupt=None) -> bool:
        """A worker takes it: True, and it is running, unless it was cancelled while queued."""
        with self._lock:
            if self.state != "queued":
                return False
            self.state, self.interrupt = "running", interrupt
            return True

    def end(self) -> None:
        """Its worker is done with it (on the worker's thread): a cancelled one's bytes go back now."""
        with self._lock:
            self.state, self.interrupt = "over", None
            refund, self._refund = self._refund, None
        if refund is not None:
            refund(self.meta.nbytes)

    def cancel(self, refund) -> bool:
        """Nobody will read it. False when no worker runs it (queued, or over): its bytes may go back
        at once. True when one does: it is interrupted, and ``refund(nbytes)`` is called from the
        worker's thread once it ends (a later cancel replaces the refund: a closing session's bytes
        go straight to the budget)."""
        with self._lock:
            self.cancelled = True
            self.value = None
            self.halted.set()
            if self.state == "queued":
                self.state = "over"
            if self.state == "over":
                return False
            self._refund = refund
            interrupt = self.interrupt
        if interrupt is not None:
            interrupt()
        return True


def _describe(segments) -> str:
    if len(segments) != 1 or segments[0] is None:
        return f"{len(segments)} tensors"
    return f"a {segments[0].dtype} tensor of shape {tuple(segments[0].shape)}"
