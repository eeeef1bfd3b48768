"""What a connection may hold of a peer before it is authenticated, and a peer out of files:
real peers on 127.0.0.1, and the sans-I/O ``ember.remote.slots`` under hypothesis.

Strangers connect from other loopback addresses (127.0.0.2, …), which the peer counts as other
addresses, so a test can show a stranger's sockets leave everyone else served. Issue 44's rows:
1 (a peer out of files stopped accepting for good), 5 (idle sockets or bogus fetches took every
handshake slot, and clients were reset — told "does not seem to serve TLS" over TLS) and 11 (a
client that closed inside its first four bytes held its slot until the deadline).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import struct
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ember as em
from ember.devices import RemoteDevice
from ember.remote import connections as connections_module
from ember.remote.access import host_key
from ember.remote.slots import SHARE, Pool, Reserve, Slots
from ember.wire import protocol as wire
from ember.wire.tls import CLOSED_IN_HANDSHAKE, client_context

from .peers import Peer
from .test_connections import closes, device_of, refusal, session

resource = pytest.importorskip("resource")  # file limits: POSIX

STRANGER = "127.0.0.2"  # a loopback address of its own: the peer counts its connections apart from 127.0.0.1's


def frame(header: dict) -> bytes:
    return b"".join(wire.encode_frame(header))


INIT = frame({"t": "init", "v": wire.VERSION, "device": 0, "token": None})
FETCH = {"t": "fetch", "v": wire.VERSION, "session": "s"}  # and a capability nobody granted


def connect_from(address: str, source: str = "127.0.0.1", timeout: float = 20) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout, source_address=(source, 0))


def holding(address: str, count: int, source: str, first: bytes = b"EMBR") -> list[socket.socket]:
    """``count`` connections from ``source`` that send ``first`` and then nothing: each holds a
    handshake slot until the peer's deadline (four bytes sent: the first-bytes deadline is met)."""
    sockets = []
    for _ in range(count):
        sock = connect_from(address, source)
        if first:
            sock.sendall(first)
        sockets.append(sock)
    return sockets


def close_all(sockets) -> None:
    for sock in sockets:
        sock.close()


def eventually(predicate, seconds: float = 10) -> bool:
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def served(peer) -> bool:
    """Whether a new session with ``peer`` opens now (False: PeerBusy)."""
    try:
        session(peer).close()
    except em.PeerBusy:
        return False
    return True


def busy_for(source: str, pool: str = r"connection\(s\) in their handshake", size: int = 64) -> str:
    return (rf"this peer is busy for {re.escape(source)}: {size // SHARE} {pool} from that address already, the most "
            rf"one address may hold \(a quarter of the {size} slots; ")


# --- row 1: a peer out of files pauses, says why, and serves again -------------------------------

@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="setting another process's file limit: Linux")
def test_a_peer_out_of_files_pauses_and_serves_the_clients_that_waited_once_files_come_back(monkeypatch):
    """Was: accept() failed with EMFILE and the accept loop returned; the process lived on, said
    nothing and never accepted again. Now it logs why it pauses, tries again, and the client that
    connected meanwhile (it waited in the listen backlog) is served once files come back."""
    monkeypatch.setattr("ember.engines.dialing.DEFAULT_TIMEOUT", 40.0)
    with Peer("--max-sessions", "400", "--handshake-timeout", "60") as peer:
        files = len(os.listdir(f"/proc/{peer.pid}/fd"))
        resource.prlimit(peer.pid, resource.RLIMIT_NOFILE, (files + 12, files + 12))  # a dozen files to spare
        hogs: list[socket.socket] = []
        served: list[float] = []
        waiting = threading.Thread(target=lambda: served.append(float(em.sum(em.ones(3, device=device_of(peer.url()))))),
                                   daemon=True)
        try:
            while not any("accepting connections failed" in line for line in peer.log):
                assert len(hogs) < 100, f"the peer never ran out of files: {list(peer.log)[-5:]}"
                hogs += holding(peer.address, 1, "127.0.0.1")
                time.sleep(0.05)
            waiting.start()  # connects while the peer has no file for it
            time.sleep(1)
        finally:
            close_all(hogs)
        waiting.join(60)
        log = "".join(peer.log)
        print(f"\nFIGURE {len(hogs)} held connections exhausted a limit of {files + 12} files; the peer logged:\n"
              + "".join(line for line in peer.log if "accepting" in line))
        assert served == [3.0], log[-2000:]
        assert re.search(r"accepting connections failed: \[Errno 24\] Too many open files \(this process may have "
                         rf"{files + 12} files open: RLIMIT_NOFILE\); trying again after pauses of 0.01 s growing to 1 s",
                         log), log[-2000:]
        assert re.search(r"accepting connections again, after \d+ failed tries in \d+\.\d s", log)
        assert float(em.sum(em.ones(2, device=device_of(peer.url())))) == 2.0  # and everyone after
        assert log.count("accepting connections failed") == 1 and peer.tracebacks == 0


def test_the_soft_file_limit_is_raised_to_the_hard_one_at_start(caplog):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, 256) if hard == resource.RLIM_INFINITY else min(soft, hard // 2, 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        with caplog.at_level(logging.DEBUG, logger="ember.serve"), em.Server("numpy", "127.0.0.1:0"):
            raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert raised > lowered and (raised == hard or hard == resource.RLIM_INFINITY)
        assert f"open files: raised the soft limit from {lowered} to {raised}" in caplog.text
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- row 5: a stranger cannot take every slot; a full peer answers PeerBusy ------------------------

def test_a_strangers_idle_sockets_leave_other_addresses_served_and_its_own_answered_busy(pki):  # noqa: F811
    """64 sockets without a token, from one address (the handshake slots a peer has by default):
    was, every real client was reset ("peer closed"; over TLS: "does not seem to serve TLS")
    until they closed. Now that address holds a quarter of the slots, other addresses are served,
    and a client from the same address is refused with PeerBusy naming the limit, over TCP,
    WebSocket and TLS alike."""
    with Peer() as plain, Peer(*pki.local.serve_args()) as secure:
        for peer, schemes in ((plain, ("ember", "ws")), (secure, ("embers", "wss"))):
            stranger = holding(peer.address, 64, STRANGER) + holding(peer.address, 64, "127.0.0.1")
            try:
                for scheme in schemes:
                    with pytest.raises(em.PeerBusy, match=rf"refused the session: {busy_for('127.0.0.1')}") as busy:
                        em.ones(1, device=em.device(peer.url(scheme), tls_ca=pki.ca if peer is secure else None))
                    assert isinstance(busy.value, ConnectionRefusedError)
                other = connect_from(peer.address, "127.0.0.3")  # an address of its own: a slot of its own
                if peer is secure:
                    other = client_context(pki.ca).wrap_socket(other, server_hostname="127.0.0.1")
                with other:
                    other.sendall(INIT)
                    (answer,) = wire.FrameReader().feed(other.recv(65536))
                assert answer.header["t"] == "info", answer.header
            finally:
                close_all(stranger)


def test_a_full_peer_answers_busy_in_each_framing_and_the_busy_reason_names_the_limit():
    """With every handshake slot taken (by four addresses, a quarter each), a new connection is
    still read for its first bytes and answered: an init frame with PeerBusy, an HTTP request with
    a 503, another peer's fetch with PeerBusy and ``retry``."""
    with Peer("--max-sessions", "4") as peer:
        held = [sock for k in range(4) for sock in holding(peer.address, 1, f"127.0.0.{2 + k}")]
        try:
            time.sleep(0.2)  # all four are in their handshake
            full = r"this peer is busy: 4 connection\(s\) in their handshake already, the most it takes at once " \
                   r"\(--max-sessions 4\); try again later"
            with pytest.raises(em.PeerBusy, match=rf"refused the session: {full}"):
                session(peer)
            with connect_from(peer.address, "127.0.0.9") as sock:
                sock.sendall(b"GET /status.json HTTP/1.1\r\nHost: x\r\n\r\n")
                reply = b""
                while chunk := sock.recv(65536):
                    reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 Service Unavailable") and b"Retry-After: 1" in head
            assert re.fullmatch(full, body.decode().strip())
            with connect_from(peer.address, "127.0.0.9") as sock:
                sock.sendall(frame(FETCH | {"capability": secrets.token_bytes(wire.CAPABILITY_BYTES)}))
                answer = refusal(sock)
            assert answer["kind"] == "PeerBusy" and answer["retry"] is True and re.fullmatch(full, answer["reason"])
        finally:
            close_all(held)
        assert eventually(lambda: served(peer))  # the slots are given back as the peer sees the closes
        assert any("refused: this peer is busy" in line for line in peer.log) and peer.tracebacks == 0


def test_bogus_fetches_wait_in_slots_of_their_own_and_leave_the_clients_theirs():
    """Was: 70 fetches presenting capabilities nobody granted each held a handshake slot until the
    deadline (they may be granted yet), and clients were reset. Now a fetch moves to the fetch
    slots once its first frame shows it is one; one address holds a quarter of those, and the rest
    are refused PeerBusy with ``retry`` at once."""
    server = em.Server("numpy", "127.0.0.1:0").start()
    fetches = []
    try:
        for _ in range(70):
            sock = connect_from(server.address, STRANGER)
            sock.sendall(frame(FETCH | {"capability": secrets.token_bytes(wire.CAPABILITY_BYTES)}))
            fetches.append(sock)
        engine = session(server)  # from 127.0.0.1: its handshake slots are all free
        assert engine.peer_stats()["session_tensors"] == 0
        engine.close()
        assert eventually(lambda: STRANGER not in server.slots.handshakes.held)  # the fetches' are given back …
        waiting = server.slots.fetches.held[STRANGER]
        assert 0 < waiting <= server.slots.fetches.share  # … and a quarter of the fetches' at most wait for a grant
        answered = []
        for sock in fetches:
            sock.settimeout(0.5)
            try:
                answered.append(refusal(sock))
            except (TimeoutError, ValueError):  # still waiting for a grant, or ended unanswered (displaced)
                pass
        assert answered and all(a["kind"] == "PeerBusy" and a["retry"] is True for a in answered), answered[:3]
        print(f"\nFIGURE 70 bogus fetches from one address: {waiting} wait for a grant, {len(answered)} refused PeerBusy "
              f"at once, the client was served")
    finally:
        close_all(fetches)
        server.stop()


def test_the_newest_refused_connection_takes_the_place_of_the_oldest():
    """When even the reserve for refusals is taken (strangers' sockets sending nothing), a new
    connection still gets its answer: the oldest refusal is ended to make room."""
    with Peer("--max-sessions", "1") as peer:
        held = holding(peer.address, 1, STRANGER) + holding(peer.address, 12, STRANGER, first=b"")  # reserve: 4
        try:
            time.sleep(0.2)
            with pytest.raises(em.PeerBusy, match=r"this peer is busy: 1 connection\(s\) in their handshake already"):
                session(peer)  # without a place displaced for it, it would be closed unanswered
        finally:
            close_all(held)


# --- row 11: a client that leaves inside its first bytes gives its slot back at once ----------------

@pytest.mark.skipif(not hasattr(connections_module.select, "POLLRDHUP"), reason="noticing a close under unread bytes: Linux")
def test_a_client_that_closes_inside_its_first_four_bytes_frees_its_slot_at_once(monkeypatch):
    """Was: a client that sent 1–3 bytes and closed held its handshake slot until the deadline
    (10 s): a peek returns the bytes that are there, and says nothing of the close. Deadlines far
    off here, so only noticing the close can end these connections before the test's wait does."""
    monkeypatch.setattr(connections_module, "FIRST_BYTES_SECONDS", 120)
    server = em.Server("numpy", "127.0.0.1:0", handshake_timeout=120).start()
    sockets = []
    try:
        for k in range(12):
            sock = connect_from(server.address, timeout=30)
            sock.sendall(b"GET"[:1 + k % 3])
            sock.shutdown(socket.SHUT_WR)  # the client's side is closed: its bytes are all there will be
            sockets.append(sock)
        start = time.monotonic()
        assert all(closes(sock) for sock in sockets)  # the peer closed each (its recv would time out after 30 s)
        seconds = time.monotonic() - start
        assert eventually(lambda: server._handshakes == 0)
        print(f"\nFIGURE 12 clients that sent 1-3 bytes and closed: their slots freed after {seconds * 1e3:.0f} ms")
    finally:
        close_all(sockets)
        server.stop()


def test_a_client_silent_past_the_first_bytes_deadline_is_closed(monkeypatch):
    monkeypatch.setattr(connections_module, "FIRST_BYTES_SECONDS", 0.5)
    server = em.Server("numpy", "127.0.0.1:0", handshake_timeout=120).start()
    try:
        with connect_from(server.address, timeout=30) as silent, connect_from(server.address, timeout=30) as slow:
            slow.sendall(b"EM")
            assert closes(silent) and closes(slow)  # long before the handshake's 120 s
        assert float(em.sum(em.ones(2, device=device_of(f"ember://{server.address}/0")))) == 2.0
    finally:
        server.stop()


# --- the client's words when a peer closes on it -------------------------------------------------

def _closing_listener(reset: bool):
    """A listener that accepts one connection and closes it at once (``reset``: with an RST)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        with listener:
            sock, _ = listener.accept()
            time.sleep(0.2)  # the client's first bytes (its TLS hello, its init) have come
            sock.recv(65536)
            if reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a close that resets
            sock.close()
    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
@pytest.mark.parametrize("scheme", ["embers", "wss"])
def test_a_peer_that_closes_during_the_tls_handshake_is_not_called_plain(pki, scheme, reset):  # noqa: F811
    """Was: "the TLS handshake failed (EOF …): the peer does not seem to serve TLS" — what a full
    peer did to a TLS client. A close or a reset says only what it is, and what it may mean."""
    port = _closing_listener(reset)
    with pytest.raises(em.ConnectionLost, match=rf"^{scheme}://127.0.0.1:{port}: {re.escape(CLOSED_IN_HANDSHAKE)} \(.+\)$"):
        em.ones(1, device=RemoteDevice(scheme, "127.0.0.1", port, 0, None, pki.ca))  # no session of an earlier peer


def test_a_peer_that_closes_before_answering_the_init_may_be_busy():
    port = _closing_listener(reset=False)
    with pytest.raises(em.ConnectionLost, match=rf"^ember://127.0.0.1:{port}/0: the peer closed the connection before "
                                                r"answering the session's init \(it may be busy, .*\); try again later"):
        em.ones(1, device=RemoteDevice("ember", "127.0.0.1", port, 0, None))  # no session of an earlier peer on the port


# --- the slots, sans-I/O ------------------------------------------------------------------------

def test_addresses_count_by_host_and_ipv6_by_64():
    assert host_key("127.0.0.2") == "127.0.0.2"
    assert host_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert host_key("2001:db8::1") == host_key("2001:db8::ffff:1") == "2001:db8::/64"
    assert host_key("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert host_key("fe80::1%eth0") == "fe80::/64"
    assert host_key("") == ""


@given(st.integers(1, 80), st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=300))
def test_a_pool_never_gives_more_than_its_size_or_an_address_more_than_its_share(size, steps):
    pool, mine = Pool(size, "things", "--things"), []
    for take, who in steps:
        key = f"10.0.0.{who}"
        if take:
            before = pool.held[key]
            reason = pool.take(key)
            if reason is None:
                mine.append(key)
            elif pool.in_use >= size:
                assert reason.startswith(f"this peer is busy: {size} things already") and "(--things)" in reason
            else:
                assert before == pool.share == max(1, size // SHARE) and f"busy for {key}: {before} things" in reason
        elif mine:
            pool.give_back(mine.pop(who % len(mine)))
        assert pool.in_use == len(mine) == sum(pool.held.values()) <= size
        assert all(0 < n <= pool.share for n in pool.held.values())
    for key in mine:
        pool.give_back(key)
    assert pool.in_use == 0 and not pool.held


def test_a_slot_not_held_cannot_be_given_back():
    pool = Pool(4, "things", "--things")
    with pytest.raises(ValueError, match="no slot of '10.0.0.1' is held"):
        pool.give_back("10.0.0.1")


@given(st.integers(1, 10), st.lists(st.booleans(), max_size=60))
def test_the_reserve_keeps_the_newest_and_displaces_the_oldest(size, steps):
    reserve, order = Reserve(size), []
    for n, take in enumerate(steps):
        if take:
            displaced = reserve.take(n)
            if len(order) == size:
                assert displaced == order.pop(0)
            else:
                assert displaced is None
            order.append(n)
        elif order:
            reserve.give_back(order.pop())
            reserve.give_back(-1)  # one displaced already: nothing
        assert list(reserve.waiting) == order


def test_the_pools_of_a_default_peer():
    slots = Slots(64)
    assert (slots.handshakes.size, slots.handshakes.share, slots.fetches.size, slots.fetches.share,
            slots.refusals.size) == (64, 16, 16, 4, 8)
    assert (Slots(1).handshakes.share, Slots(1).fetches.size, Slots(1).refusals.size) == (1, 8, 4)

