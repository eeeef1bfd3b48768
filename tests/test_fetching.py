"""The fetch path between peers cannot be turned into a weapon (issue 44, rows 1–4 and 7): a peer
fetches only from the peers it trusts (``--fetch-from``), says nothing the client chose to anything
that has not named itself as the ember peer the client named, backs off when told to retry, and
counts what a fetch holds — bytes, thread, connection — until it is gone.

Real peers (``ember serve`` processes, in-process servers) on 127.0.0.1, with small socket servers
of this file playing the sources (an ember source that says retry, stalls or sends; a line-based
service; a listener that never accepts); the sans-I/O session fed real frames below."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ember as em
from ember.array import Array
from ember.errors import ArgumentError, ProtocolError
from ember.ops.table import Meta
from ember.remote import fetching, links
from ember.remote.host import Host, hosted_devices
from ember.remote.server import PEER_LIMITS
from ember.remote.transfers import NOT_AN_EMBER_PEER, UNREACHABLE, Fetch, Transfers, TrustedPeers
from ember.wire import protocol as wire
from ember.wire.protocol import Frame, Limits

from .peers import Peer
from .test_connections import device_of, memory_mb
from .test_transfers import _balanced, _batch

MiB = 1 << 20
LOOPBACK = "127.0.0.1"
FAKE_PEER = "fake-peer-identity"


# --- the sources this file plays -------------------------------------------------------------------

class FakeSource:
    """A loopback TCP server playing the source of a fetch, one thread a connection. ``mode``:
    ``retry`` (names itself ``peer``, then answers every capability "not granted yet, retry" and
    closes), ``busy`` (answers the hello "PeerBusy, retry"), ``stall`` (names itself, then sends
    the tensor but its last 8 bytes, and no more), ``send`` (sends ``array`` for each
    capability), ``silent`` (names itself, then never answers), ``lines`` (a line-based service:
    sends ``banner``, answers nothing), ``http403``.
    It counts connections (``connections``, ``open``, the ``most`` open at once), keeps the
    bytes received, and the capabilities presented to it."""

    def __init__(self, mode: str, peer: str = FAKE_PEER, array: np.ndarray | None = None, banner: bytes = b""):
        self.mode, self.peer, self.array, self.banner = mode, peer, array, banner
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = self.open = self.most = self.stalled = 0
        self.capabilities: list[bytes] = []
        self.received = bytearray()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        for sock in list(self.sockets):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self):
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                self.open += 1
                self.most = max(self.most, self.open)
                self.sockets.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _keep(self, data: bytes) -> None:
        with self.lock:
            self.received += data

    def _serve(self, sock):
        try:
            if self.mode in ("lines", "http403"):
                if self.banner:
                    sock.sendall(self.banner)
                while data := sock.recv(65536):
                    self._keep(data)
                    if self.mode == "http403" and b"\r\n\r\n" in self.received:
                        sock.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 9\r\n\r\nforbidden")
                        return
                return
            reader = wire.FrameReader()
            while data := sock.recv(65536):
                self._keep(data)
                for frame in reader.feed(data):
                    if not self._answer(sock, frame.header):
                        return
        except OSError:
            pass
        finally:
            sock.close()
            with self.lock:
                self.open -= 1

    def _answer(self, sock, header) -> bool:
        """Answer one frame; False once this connection is done."""
        if "capability" not in header and self.mode == "busy":  # as a peer whose fetch slots are taken
            sock.sendall(b"".join(wire.encode_frame({"t": "refuse", "kind": "PeerBusy", "retry": True,
                                                     "reason": "this peer answers 8 fetches at once"})))
            return False
        if header.get("t") == "got":  # the destination has the tensor
            return True
        if "capability" not in header:  # a hello
            sock.sendall(b"".join(wire.encode_frame({"t": "peer", "v": wire.VERSION, "peer": self.peer})))
            return True
        with self.lock:
            self.capabilities.append(header["capability"])
        if self.mode == "retry":
            sock.sendall(b"".join(wire.encode_frame({"t": "refuse", "kind": "AccessDenied", "retry": True,
                                                     "reason": "unknown capability: this peer has not granted it (yet)"})))
            return False
        if self.mode == "stall":  # all of the tensor but its last 8 bytes
            whole = b"".join(bytes(b) for b in wire.encode_frame({"t": "tensor"}, [self.array]))
            sock.sendall(whole[:-8])
            with self.lock:
                self.stalled += 1
            return True  # and reads on: the end of the stream is noticed
        if self.mode == "send":
            sock.sendall(b"".join(bytes(b) for b in wire.encode_frame({"t": "tensor"}, [self.array])))
            return True
        return True  # silent: never an answer


class Unanswered:
    """A loopback address whose connections never complete: a listener that accepts nothing and
    whose backlog is full (the kernel then drops new handshakes, as a host that never answers)."""

    def __init__(self):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.port = self.listener.getsockname()[1]
        self.fillers = []
        for _ in range(4):  # fill the backlog (0 means one, or a few, by kernel)
            filler = socket.socket()
            filler.setblocking(False)
            try:
                filler.connect(("127.0.0.1", self.port))
            except BlockingIOError:
                pass
            self.fillers.append(filler)
        time.sleep(0.2)

    def close(self):
        for s in (*self.fillers, self.listener):
            s.close()


def _eventually(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def _fetch_from(b, scheme: str, port: int, peer: str = FAKE_PEER, capability: bytes | None = None,
                meta: Meta = Meta((4,), em.float64), host: str = "127.0.0.1") -> Array:
    """A tensor of ``b`` fetched from ``scheme://host:port``, named as the peer ``peer``: what a
    client holding ``b``'s token may ask for, whatever is at that address."""
    source = SimpleNamespace(device=SimpleNamespace(scheme=scheme, host=host, port=port), info={"peer": peer})
    return Array._new(b.engine.fetch(source, capability or secrets.token_bytes(32), meta), meta, b)


def _raised(array) -> Exception:
    with pytest.raises(em.EmberError) as raised:
        em.asnumpy(array)
    return raised.value


def _fresh(server) -> em.Device:
    return device_of(f"ember://{server.address}/0")


def _fetch_threads() -> int:
    return sum(thread.name == "ember-fetch" for thread in threading.enumerate())


def _threads_and_files(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


# --- row 3: a peer fetches only from the peers it trusts, and speaks first to none -------------------

def test_a_peer_told_nothing_fetches_from_no_other_peer_and_its_own_sessions_still_move_tensors():
    with Peer() as source, Peer() as untold:
        a, b, b2 = em.device(source.url()), em.device(untold.url()), em.device(untold.url("ws"))
        x = em.asarray(np.arange(3.0), device=a)
        error = _raised(x.to_device(b))
        assert isinstance(error, em.AccessDenied) and str(error) == (
            f"transfer from ember://{source.address}: this peer fetches from no other peer: start it with --fetch-from "
            f"naming the peers it may fetch from (addresses, networks or host names; Server(fetch_from=))")
        y = em.asarray(np.arange(3.0), device=b)
        np.testing.assert_array_equal(em.asnumpy(y.to_device(b2) + 1), [1.0, 2.0, 3.0])  # one peer: no network
        assert not any("sent a granted tensor" in line or "transfer refused" in line for line in source.log)


@pytest.mark.parametrize("scheme", ["ember", "ws"])
def test_no_byte_the_client_chose_reaches_a_service_that_is_no_ember_peer(scheme, monkeypatch):
    """Row 3: a capability of CRLF-separated commands, fetched from a line-based service the
    destination trusts (the whole loopback): the service gets the hello alone (over ws, an upgrade
    whose Host is the address), and the client learns only "not an ember peer"."""
    monkeypatch.setattr(fetching, "CONNECT_SECONDS", 1.0)
    commands = b"\r\nSET k v\r\nQUIT\r\n".ljust(32, b"#")
    with FakeSource("lines") as service, FakeSource("lines", banner=b"SSH-2.0-OpenSSH_9.6\r\n") as ssh, \
            FakeSource("http403") as web, em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        b = _fresh(dst)
        for listener in (service, ssh, web):
            if listener is web and scheme == "ember":
                continue
            error = _raised(_fetch_from(b, scheme, listener.port, capability=commands))
            assert isinstance(error, em.ConnectionLost)
            assert str(error) == f"transfer from {scheme}://127.0.0.1:{listener.port}: {NOT_AN_EMBER_PEER}"
            hello = b"".join(wire.encode_frame({"t": "fetch", "v": wire.VERSION}))
            assert _eventually(lambda: hello in listener.received or b"\r\n\r\n" in listener.received)
            received = bytes(listener.received)
            assert b"SET k v" not in received and commands not in received
            if scheme == "ember":
                assert received == hello  # the hello, no more
            else:
                head = received.split(b"\r\n\r\n")[0].decode().split("\r\n")
                assert head[0] == "GET / HTTP/1.1" and f"Host: 127.0.0.1:{listener.port}" in head
        b.engine.close()


def test_a_closed_port_is_only_unreachable_and_an_address_outside_the_list_gets_no_connection():
    with FakeSource("lines") as outside, em.Server("numpy", "127.0.0.1:0") as src:
        listed = f"127.0.0.1:{src.port}"
        with em.Server("numpy", "127.0.0.1:0", fetch_from=listed) as dst:
            b = _fresh(dst)
            error = _raised(_fetch_from(b, "ember", outside.port))
            assert isinstance(error, em.AccessDenied) and str(error) == (
                f"transfer from ember://127.0.0.1:{outside.port}: 127.0.0.1:{outside.port} is none of the peers this "
                f"peer fetches from (its --fetch-from)")
            assert outside.connections == 0
            a = _fresh(src)
            np.testing.assert_array_equal(em.asnumpy(em.asarray(np.ones(2), device=a).to_device(b)), [1.0, 1.0])
            a.engine.close()
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()  # nothing listens there
        with em.Server("numpy", "127.0.0.1:0", fetch_from=f"{listed},127.0.0.1:{port}") as dst:
            b = _fresh(dst)
            error = _raised(_fetch_from(b, "ember", port))
            assert isinstance(error, em.ConnectionLost) and str(error) == (
                f"transfer from ember://127.0.0.1:{port}: {UNREACHABLE}")  # no errno, no "Connection refused"
            b.engine.close()


def test_the_capability_goes_only_to_the_peer_the_client_named():
    with FakeSource("send", peer="someone else", array=np.ones(4)) as impostor, \
            em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        b = _fresh(dst)
        error = _raised(_fetch_from(b, "ember", impostor.port, peer=FAKE_PEER))
        assert isinstance(error, em.ConnectionLost) and str(error).endswith(
            "another ember peer answers at this address than the one the transfer names (it restarted, or another "
            "took its address)")
        assert impostor.capabilities == []  # it said who it is: nothing was presented to it
        np.testing.assert_array_equal(em.asnumpy(_fetch_from(b, "ember", impostor.port, peer="someone else")), np.ones(4))
        assert len(impostor.capabilities) == 1
        b.engine.close()


def test_a_host_name_is_resolved_by_the_destination_and_checked_as_the_address_it_stands_for():
    with em.Server("numpy", "127.0.0.1:0") as src, em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as by_address, \
            em.Server("numpy", "127.0.0.1:0", fetch_from="localhost") as by_name:
        by_localhost = device_of(f"ember://localhost:{src.port}/0")  # the client names the source by a name
        for dst in (by_address, by_name):
            b = _fresh(dst)
            x = em.asarray(np.arange(4.0), device=by_localhost)
            np.testing.assert_array_equal(em.asnumpy(x.to_device(b)), np.arange(4.0))
            y = em.asarray(np.arange(2.0), device=_fresh(src))
            np.testing.assert_array_equal(em.asnumpy(y.to_device(b)), [0.0, 1.0])
            b.engine.close()
        by_localhost.engine.close()


def test_a_fetch_naming_a_host_that_is_no_host_name_is_a_protocol_error():
    host = _host()
    session = _open(host)
    for odd in ("h\r\nSET k v", "a b", "x:y/z", "\x00", "é.example", ""):
        with pytest.raises(ProtocolError, match="^a fetch names the source peer as scheme, host, port and identity$"):
            session.handle(Frame({"t": "batch", "m": (_message(5, (1,), host=odd),)}, []))
    assert not session.fetches and session.quota.used == 0


# --- row 4: retries back off; one session's fetches open few connections --------------------------

def test_a_source_that_always_says_retry_is_asked_again_after_doubling_waits_a_bounded_number_of_times(monkeypatch):
    """Row 4: before, ~2,000 reconnects a second for 120 s. Now waits of 0.1 s doubling: at most 5
    connections in the first 2 s, whatever the load; a drop ends them. With TRIES=3 (and short waits)
    the third answer stands."""
    with FakeSource("retry") as source, em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        b = _fresh(dst)
        y = _fetch_from(b, "ember", source.port)
        time.sleep(2.0)
        assert 1 <= source.connections <= 5, source.connections
        del y
        em.sync(b)  # the drop goes: the fetch is cancelled, its wait ends
        assert _eventually(lambda: dst.fetcher._running == {})
        settled = source.connections
        time.sleep(1.0)
        assert source.connections == settled
        monkeypatch.setattr(fetching, "TRIES", 3)
        monkeypatch.setattr(fetching, "RETRY_SECONDS", 0.01)
        before = source.connections
        error = _raised(_fetch_from(b, "ember", source.port))
        assert isinstance(error, em.AccessDenied) and str(error).endswith("unknown capability: this peer has not granted "
                                                                          "it (yet)")
        assert source.connections - before == 3
        b.engine.close()


def test_a_busy_source_is_asked_again_after_the_back_off_and_its_refusal_stands_at_the_last_try(monkeypatch):
    monkeypatch.setattr(fetching, "TRIES", 3)
    monkeypatch.setattr(fetching, "RETRY_SECONDS", 0.01)
    with FakeSource("busy") as source, em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        b = _fresh(dst)
        error = _raised(_fetch_from(b, "ember", source.port))
        assert isinstance(error, em.PeerBusy) and str(error) == (
            f"transfer from ember://127.0.0.1:{source.port}: this peer answers 8 fetches at once")
        assert source.connections == 3 and source.capabilities == []
        b.engine.close()


def _batch_of_fetches(b, port: int, n: int, meta=Meta((4,), em.float64)) -> list[Array]:
    """``n`` fetches from ``port`` in one batch (one frame)."""
    engine = b.engine
    source = SimpleNamespace(device=SimpleNamespace(scheme="ember", host="127.0.0.1", port=port), info={"peer": FAKE_PEER})
    with engine._lock:
        flush, engine.flush = engine.flush, lambda: None  # each fetch would send at once
        try:
            arrays = [Array._new(engine.fetch(source, secrets.token_bytes(32), meta), meta, b) for _ in range(n)]
        finally:
            engine.flush = flush
        engine.flush()
    return arrays


class _Most(Counter):
    """A Counter that remembers the largest count it ever held (the fetcher's connections in use, by source)."""

    most = 0

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.most = max(self.most, value)


def test_a_hundred_fetches_in_one_batch_open_at_most_four_connections_to_a_source_and_their_drop_closes_them():
    with FakeSource("silent") as source, em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        dst.fetcher._in_use = in_use = _Most()  # every count the destination held, not a sample
        b = _fresh(dst)
        before = _fetch_threads()
        arrays = _batch_of_fetches(b, source.port, 100)
        assert _eventually(lambda: source.open == fetching.LINKS_PER_SOURCE)
        time.sleep(0.5)
        assert source.most == fetching.LINKS_PER_SOURCE and source.connections == fetching.LINKS_PER_SOURCE
        assert _fetch_threads() - before <= fetching.WORKERS_PER_SESSION
        (session,) = dst.hosting.registry.sessions
        assert len(dst.fetcher._waiting) == 100 - fetching.WORKERS_PER_SESSION
        del arrays
        em.sync(b)  # every drop: the running fetches are cancelled, their connections shut, the queued ones gone
        assert _eventually(lambda: source.open == 0 and dst.fetcher._running == {} and not dst.fetcher._waiting)
        # never more than four in use at the destination, while the drops let queued ones start (the source itself
        # may count one more for a moment: it sees a shut connection close only when it reads it)
        assert in_use.most == fetching.LINKS_PER_SOURCE
        em.sync(b)
        assert session.table.granted == 0 and session.quota.used == session.table.live_bytes() + session.replying
        b.engine.close()


# --- rows 1 and 2: what a fetch holds is counted until it is gone -----------------------------------

def test_sixteen_dropped_fetches_of_32_mib_cost_the_peer_no_more_than_its_session_quota():
    """Row 2: before, RSS 52 → 541 MB while the session reported 0 bytes: each dropped fetch went on
    receiving into a buffer nobody counted (here the source sends all but 8 bytes and stalls: 16
    buffers of 32 MiB, held for 120 s). Now a drop cancels the fetch (its connection is shut) and
    its bytes stay counted until its worker ends, so the quota (64 MiB) bounds them all."""
    array = np.ones(4 * MiB)  # 32 MiB
    meta = Meta(array.shape, em.float64)
    with FakeSource("stall", array=array) as staller, FakeSource("send", array=array) as sender, \
            Peer("--fetch-from", LOOPBACK, "--max-session-bytes", str(64 * MiB), "--max-memory", str(256 * MiB)) as dst:
        b = em.device(dst.url())
        em.sync(b)
        before = memory_mb(dst.pid)
        for _ in range(16):
            y = _fetch_from(b, "ember", staller.port, meta=meta)
            time.sleep(0.1)  # its bytes arrive (before: and stay, in a buffer nobody counts)
            del y
        with contextlib.suppress(em.ResourceLimitError):
            em.sync(b)  # those that found the quota still held by dropped ones still running were refused: reported here
        assert _eventually(lambda: staller.open == 0)  # each drop shut its fetch's connection
        grown = memory_mb(dst.pid)["VmHWM"] - before["VmRSS"]
        assert grown < 120, grown  # two fetches' buffers at most (before: 16, ~512 MB)
        assert _eventually(lambda: _fits(b, sender.port, meta, array.size))  # the quota has room again: all came back
        b.engine.close()


def _fits(b, port: int, meta: Meta, size: int) -> bool:
    """Whether a fetch of ``meta`` from ``port`` succeeds now (the last dropped one's worker may still be ending)."""
    try:
        return float(em.sum(_fetch_from(b, "ember", port, meta=meta))) == size
    except em.ResourceLimitError:
        return False


def test_fetches_of_dropped_tensors_against_an_address_that_never_answers_take_few_threads_and_files():
    """Row 1's fetch half: before, 1,200 × (fetch, drop) made a thread and a file each. Now at most
    WORKERS_PER_SESSION threads and LINKS_PER_SOURCE sockets, whatever the number of fetches."""
    unanswered = Unanswered()
    try:
        with Peer("--fetch-from", LOOPBACK) as dst:
            b = em.device(dst.url())
            em.sync(b)
            threads, files = _threads_and_files(dst.pid)
            most = (0, 0)
            for k in range(300):
                y = _fetch_from(b, "ember", unanswered.port)
                del y
                if k % 20 == 0:
                    em.sync(b)
                    now = _threads_and_files(dst.pid)
                    most = (max(most[0], now[0] - threads), max(most[1], now[1] - files))
            em.sync(b)
            now = _threads_and_files(dst.pid)
            most = (max(most[0], now[0] - threads), max(most[1], now[1] - files))
            assert most[0] <= fetching.WORKERS_PER_SESSION + 1, most  # the fetch threads (and the kept links' timer)
            assert most[1] <= fetching.LINKS_PER_SOURCE + 2, most
            assert float(em.sum(em.ones(3, device=b))) == 3.0  # the session goes on
            b.engine.close()
    finally:
        unanswered.close()


def test_no_connection_is_opened_for_a_fetch_without_file_headroom(monkeypatch):
    monkeypatch.setattr(fetching, "FILES_HEADROOM", 0.0)
    with FakeSource("send", array=np.ones(4)) as source, em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        b = _fresh(dst)
        error = _raised(_fetch_from(b, "ember", source.port))
        assert isinstance(error, em.ResourceLimitError) and "files open (RLIMIT_NOFILE); a fetch opens no connection past " \
                                                            "0% of them" in str(error)
        assert source.connections == 0
        b.engine.close()


def test_closing_a_session_shuts_its_fetches_connections():
    with FakeSource("silent") as source, em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        b = _fresh(dst)
        y = _fetch_from(b, "ember", source.port)
        assert _eventually(lambda: len(source.capabilities) == 1 and source.open == 1)
        b.engine.close()  # before: the fetch's connection waited out its 120 s
        assert _eventually(lambda: source.open == 0 and dst.fetcher._running == {}, 5)
        assert _eventually(lambda: dst.hosting.budget.used == dst.hosting.pool.total)
        del y


# --- row 7: kept connections expire on time and are capped in total ---------------------------------

def test_kept_connections_are_closed_on_time_and_capped_in_total(monkeypatch):
    monkeypatch.setattr(links, "KEPT_LINKS", 3)
    monkeypatch.setattr(links, "FETCH_LINK_SECONDS", 2.0)  # the destination keeps each for 1 s
    sources = [em.Server("numpy", "127.0.0.1:0").start() for _ in range(5)]
    try:
        with em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
            b = _fresh(dst)
            for src in sources:
                a = _fresh(src)
                np.testing.assert_array_equal(em.asnumpy(em.asarray(np.ones(2), device=a).to_device(b)), [1.0, 1.0])
                a.engine.close()
            assert sum(map(len, dst.fetcher.links.idle.values())) <= 3  # the oldest went as the fourth and fifth came
            assert _eventually(lambda: dst.fetcher.links.idle == {}, 5)  # before: kept until reused, however long
            assert _eventually(lambda: all(src.sources.links == 0 for src in sources), 5)  # the sources saw them close
            b.engine.close()
    finally:
        for src in sources:
            src.stop()


# --- the sans-I/O session: bytes of a cancelled fetch, the cap, the hello ----------------------------

def _host(**limits) -> Host:
    return Host(hosted_devices("numpy"), None, Limits(**limits), transfers=Transfers(ttl=60))


def _open(host):
    session, _ = host.open(Frame({"t": "init", "v": wire.VERSION}, []))
    return session


def _message(tid, shape, capability=None, host="peer.example", peer="other"):
    return ("fetch", tid, em.float64, shape, "ember", host, 7878, capability or secrets.token_bytes(32), peer)


def test_a_dropped_or_overwritten_fetch_keeps_its_bytes_counted_until_its_worker_ends():
    """Row 2: before, a drop gave a fetch's bytes back at once while its worker went on receiving
    into its buffer. Now the worker is interrupted, and the bytes come back once it ends."""
    host = _host()
    session = _open(host)
    _batch(session, _message(5, (4,)), _message(6, (2,)), _message(7, (1,)), _message(8, (3,)))
    running = session.fetches[:3]
    interrupted: list[int] = []
    for job in running:
        assert job.begin(interrupt=functools.partial(interrupted.append, job.tid))
    _batch(session, ("drop", (5, 8)), ("op", "full", (), (6,), {"shape": (1,), "fill_value": 1.0, "dtype": em.float64}))
    assert interrupted == [5, 6]  # their connections are shut
    # 5 and 6 run on; 8 never began
    assert session.table.granted == 32 + 16 and 5 not in session.table.sizes and _balanced(session)
    assert [job.cancelled for job in session.fetches] == [True, True, False, True]
    assert [job.over for job in session.fetches] == [False, False, False, True]
    running[0].end()
    assert list(session.table.ended) == [32]
    session.handle(Frame({"t": "batch", "m": ()}, []))  # the next frame takes them back
    assert session.table.granted == 16 and _balanced(session)
    host.close(session)  # 6 and 7 still run: their bytes stay taken from the budget …
    assert host.budget.used == host.pool.total + 16 + 8 and interrupted == [5, 6, 7, 6]
    running[1].end()
    running[2].end()
    assert host.budget.used == host.pool.total  # … until their workers end


def test_fetches_of_dropped_tensors_count_against_the_cap_until_their_workers_end(monkeypatch):
    monkeypatch.setattr("ember.remote.moves.FETCHES_PER_SESSION", 3)
    host = _host()
    session = _open(host)
    _batch(session, *(_message(tid, (1,)) for tid in (1, 2, 3)))
    for job in session.fetches:
        job.begin(interrupt=lambda: None)
    _batch(session, ("drop", (1, 2, 3)), _message(4, (1,)), _message(5, (1,)), _message(6, (1,)), _message(7, (1,)))
    assert [job.tid for job in session.fetches] == [1, 2, 3]  # before: the drop made room for three more threads
    assert _batch(session, ("get", 1, 4))[0][2:] == ("ResourceLimitError", (
        "transfer from ember://peer.example:7878: 3 transfers to this session are running already (those of dropped "
        "tensors until they stop); read some of their tensors first"))
    session.fetches[0].end()
    _batch(session, _message(8, (1,)))
    assert [job.tid for job in session.fetches] == [1, 2, 3, 8] and _balanced(session)


def test_the_source_names_itself_to_a_hello_and_a_fetch_checks_who_answered():
    host = _host()
    assert host.answer_fetch(Frame({"t": "fetch", "v": wire.VERSION}, [])) == (
        [({"t": "peer", "v": wire.VERSION, "peer": host.identity}, [])], None)
    assert host.answer_fetch(Frame({"t": "fetch", "v": 1}, []))[0][0][0]["kind"] == "ProtocolError"
    job = Fetch(1, Meta((1,), em.float64), "ember", "h", 1, b"c" * 32, "s", False, peer="p")
    assert job.hello() == {"t": "fetch", "v": wire.VERSION}  # nothing the client chose
    assert job.check_source(Frame({"t": "peer", "v": wire.VERSION, "peer": "p"}, [])) is None
    for header, expected in [
            ({"t": "peer", "v": wire.VERSION, "peer": "q"}, ("ConnectionLost", "another ember peer answers at this address "
                                                                               "than the one the transfer names (it "
                                                                               "restarted, or another took its address)")),
            ({"t": "peer", "v": 99, "peer": "p"}, ("ConnectionLost", NOT_AN_EMBER_PEER)),
            ({"t": "tensor"}, ("ConnectionLost", NOT_AN_EMBER_PEER)),
            ({"t": "peer", "v": wire.VERSION, "peer": 7}, ("ConnectionLost", NOT_AN_EMBER_PEER)),
            ({"t": "refuse", "kind": "PeerBusy", "reason": "full"}, ("PeerBusy", "full")),
            ({"t": "refuse", "kind": "TLSError", "reason": 5}, ("TLSError", "refused"))]:
        assert job.check_source(Frame(header, [])) == expected


def test_fetch_from_lists_addresses_networks_and_names_and_refuses_anything_else():
    trusted = TrustedPeers.parse("127.0.0.1, 10.0.0.0/8,gpu-box:7878,[::1]:7879,fd00::/8,::ffff:192.0.2.0/120")
    resolve = {"gpu-box": ["192.0.2.7", "2001:db8::7"]}.get
    for address, port, admitted in [("127.0.0.1", 1, True), ("127.0.0.2", 1, False), ("10.255.0.1", 7878, True),
                                    ("192.0.2.7", 7878, True), ("192.0.2.7", 7879, True), ("2001:db8::7", 7878, True),
                                    ("2001:db8::7", 1, False), ("::1", 7879, True), ("::1", 7878, False),
                                    ("fd00::5", 2, True), ("::ffff:127.0.0.1", 3, True), ("192.0.2.200", 4, True),
                                    ("8.8.8.8", 53, False), ("169.254.169.254", 80, False)]:
        assert trusted.admits(address, port, lambda name: resolve(name, [])) is admitted, (address, port)
    assert not TrustedPeers.parse("") and not TrustedPeers.parse(()) and TrustedPeers.parse(["a", "b:1"]).names == (
        ("a", None), ("b", 1))
    for bad, message in [("a b", "'a b' is no address (10.0.0.7), network (10.0.0.0/8) or host name, with or without a "
                                 ":PORT"),
                         ("h:0", "'h:0' has no port 1–65535 after its colon"),
                         ("h:http", "'h:http' has no port 1–65535 after its colon"),
                         ("[::1]7878", "'[::1]7878' is no [ADDRESS]:PORT"),
                         ("10.0.0.0/33", "'10.0.0.0/33' is no address (10.0.0.7), network (10.0.0.0/8) or host name, "
                                         "with or without a :PORT")]:
        with pytest.raises(ArgumentError) as refused:
            TrustedPeers.parse(bad)
        assert str(refused.value) == f"--fetch-from: {message}"
    with pytest.raises(ArgumentError, match="^--fetch-from: "):
        em.Server("numpy", "127.0.0.1:0", fetch_from="not a host")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789abcdef.:/[], -", max_size=40), st.ip_addresses(), st.integers(1, 65535))
def test_any_fetch_from_text_is_parsed_or_refused_and_admits_answers_yes_or_no(spec, address, port):
    try:
        trusted = TrustedPeers.parse(spec)
    except ArgumentError:
        return
    assert trusted.admits(str(address), port, lambda name: []) in (True, False)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["fetch", "begin", "end", "drop", "write", "put", "frame"]),
                          st.integers(1, 4)), max_size=30), st.booleans())
def test_the_budget_balances_whatever_fetches_begin_end_and_are_dropped_written_or_closed(steps, end_all):
    host = _host(max_session_bytes=8192)
    session = _open(host)
    for action, tid in steps:
        if action == "fetch":
            _batch(session, _message(tid, (tid,)))
        elif action == "begin":
            for job in session.fetches:
                if job.tid == tid:
                    job.begin(interrupt=lambda: None)
        elif action == "end":
            for job in session.fetches:
                if job.tid == tid and job.state == "running":
                    job.fail("ConnectionLost", "gone")
                    job.end()
        elif action == "drop":
            _batch(session, ("drop", (tid,)))
        elif action == "write":
            _batch(session, ("op", "full", (), (tid,), {"shape": (1,), "fill_value": 1.0, "dtype": em.float64}))
        elif action == "put":
            array = np.ones(1)
            session.handle(Frame({"t": "batch", "m": (("put", tid, 0),)}, [array]))
        else:
            session.handle(Frame({"t": "batch", "m": ()}, []))
        assert _balanced(session) and session.quota.used <= 8192
    if end_all:
        for job in session.fetches:
            if job.state == "running":
                job.end()
    host.close(session)
    for job in session.fetches:
        if job.state == "running":
            job.end()
    assert host.budget.used == host.pool.total


def test_a_peer_with_fetch_from_on_the_command_line_fetches_from_it():
    with Peer() as source, Peer("--fetch-from", f"{LOOPBACK}") as told:
        a, b = em.device(source.url()), em.device(told.url())
        np.testing.assert_array_equal(em.asnumpy(em.asarray(np.arange(3.0), device=a).to_device(b)), [0.0, 1.0, 2.0])


def test_the_session_quota_and_limits_still_apply_to_a_fetch():
    limits = replace(PEER_LIMITS, max_tensor_bytes=16)
    with em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK, limits=limits) as dst:
        b = _fresh(dst)
        error = _raised(_fetch_from(b, "ember", 1, meta=Meta((3,), em.float64)))
        assert isinstance(error, em.ResourceLimitError)
        b.engine.close()
