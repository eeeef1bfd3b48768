"""Direct transfers: ``x.to_device(b)`` from one compute peer to another, the bytes going peer to
peer. Real ``ember serve`` processes on 127.0.0.1; the sans-I/O objects fed directly below."""

from __future__ import annotations

import secrets
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ember as em
from ember.array import Array
from ember.errors import ProtocolError
from ember.ops.table import Meta
from ember.remote import fetching, links
from ember.remote.failures import Failure
from ember.remote.host import Host, hosted_devices
from ember.remote.memory import TENSOR_OVERHEAD as O  # noqa: N811  (bytes counted per tensor id, beside its data)
from ember.remote.transfers import LINGER, Fetch, Grant, Transfers
from ember.wire import protocol as wire
from ember.wire.protocol import Frame, Limits

from .conftest import torch_available
from .peers import Peer
from .test_connections import device_of
from .test_tls import TOKEN

MiB = 1 << 20
LOOPBACK = "127.0.0.1"  # what every destination here fetches from (--fetch-from): the peers of these tests
needs_torch = pytest.mark.skipif(not torch_available(), reason="needs torch")


@pytest.fixture(scope="module")
def source():
    with Peer("--device", "numpy") as running:
        yield running


@pytest.fixture(scope="module")
def destination():
    with Peer("--device", "torch:cpu" if torch_available() else "numpy", "--fetch-from", LOOPBACK) as running:
        yield running


def _sent(peer) -> int:
    """How many tensors ``peer`` has sent to other peers (its log says so for each)."""
    return sum("sent a granted tensor" in line for line in list(peer.log))


def _eventually(condition, timeout: float = 5.0) -> bool:
    """Whether ``condition()`` holds, asked until it does or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def _sent_once_logged(peer, count: int, timeout: float = 10.0) -> int:
    """``_sent(peer)`` once it reaches ``count`` (or ``timeout`` passes): the source logs a send after
    it, and its log reaches this process through a pipe, so a result read on the destination may be
    back before the line is."""
    _eventually(lambda: _sent(peer) >= count, timeout)
    return _sent(peer)


def _counters(device) -> dict:
    return {k: v for k, v in em.stats(device).items() if k in ("bytes_up", "bytes_down", "round_trips")}


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


# --- between two peers ---------------------------------------------------------------------------

@needs_torch
def test_eight_mib_go_from_a_numpy_peer_to_a_torch_peer_without_passing_through_the_client(source, destination):
    a, b = em.device(source.url()), em.device(destination.url())
    host = np.random.default_rng(0).standard_normal(MiB)  # 8 MiB of float64
    x = em.asarray(host, device=a)
    em.sync(a)
    em.sync(b)
    before_a, before_b, sent = _counters(a), _counters(b), _sent(source)
    y = x.to_device(b)
    assert (y.device, y.shape, y.dtype) == (b, (MiB,), em.float64)
    em.sync(b)  # the fetch is done (a failure would raise here)
    moved_a, moved_b = _delta(before_a, _counters(a)), _delta(before_b, _counters(b))
    assert moved_a["bytes_down"] == 0 and moved_a["round_trips"] == 0 and 0 < moved_a["bytes_up"] < 1024  # a grant
    assert moved_b["bytes_down"] < 1024 and moved_b["round_trips"] == 1 and 0 < moved_b["bytes_up"] < 1024  # a fetch
    np.testing.assert_array_equal(em.asnumpy(y), host)
    assert _sent_once_logged(source, sent + 1) == sent + 1
    assert any(f"sent a granted tensor of {host.nbytes} bytes" in line for line in source.log)


@needs_torch
def test_a_chain_a_move_and_a_chain_cost_one_round_trip_at_the_read(source, destination):
    a, b = em.device(source.url()), em.device(destination.url())
    host = np.linspace(-1, 1, 1000, dtype=np.float32)
    x = em.asarray(host, device=a)
    em.sync(a)
    em.sync(b)
    before_a, before_b = _counters(a), _counters(b)
    y = em.tanh(x * 3 + 1)                      # ops on A
    z = em.sum(y.to_device(b) ** 2, axis=0)     # a move, ops on B
    assert z.device == b and em.stats(a)["round_trips"] == before_a["round_trips"]
    assert em.stats(b)["round_trips"] == before_b["round_trips"]  # nothing has waited yet
    np.testing.assert_allclose(float(z), np.sum(np.tanh(host * 3 + 1) ** 2), rtol=1e-5)
    assert _delta(before_a, _counters(a))["round_trips"] == 0 and _delta(before_b, _counters(b))["round_trips"] == 1
    assert _delta(before_a, _counters(a))["bytes_down"] == 0


def test_a_move_over_websocket_to_a_peer_of_the_same_backend(source, destination):
    a, b = em.device(source.url("ws")), em.device(destination.url("ws"))
    x = em.asarray(np.arange(12, dtype=np.int32).reshape(3, 4), device=a)
    np.testing.assert_array_equal(em.asnumpy(x.mT.to_device(b) * 2), np.arange(12).reshape(3, 4).T * 2)


def test_empty_tensors_move_too(source, destination):
    a, b = em.device(source.url()), em.device(destination.url())
    for shape in [(0,), (0, 3), (4, 0, 2)]:
        moved = em.zeros(shape, device=a).to_device(b)
        assert em.asnumpy(moved + 1).shape == shape


def test_an_array_of_a_closed_session_moves_nowhere_and_both_peers_go_on(source, destination):
    """Moving an array whose session has ended (closed here; a restart or a timeout alike) fails with
    its loss, to another peer as to the host, and sends nothing: the source's new session and the
    destination's go on."""
    a, b = em.device(source.url()), em.device(destination.url())
    x = em.asarray(np.arange(3.0), device=a)
    a.engine.close()
    sent = _sent(source)
    for target in (b, "numpy"):
        with pytest.raises(em.ConnectionLost, match=r"^to_device: .*the array lives in a lost session with .*; its "
                                                   r"data is gone \(the session with .* was closed\)"):
            x.to_device(target)
    moved = em.asarray(np.arange(3.0), device=a).to_device(b)
    np.testing.assert_array_equal(em.asnumpy(moved * 2.0), [0.0, 2.0, 4.0])
    assert _sent_once_logged(source, sent + 1) == sent + 1  # the second move only


def test_a_fetched_tensor_is_received_into_the_destinations_buffer_pool_and_its_buffer_serves_the_next():
    # a fresh 256 MiB buffer costs tens of milliseconds of page faults on the destination (ember bench fleet)
    with em.Server("numpy", "127.0.0.1:0") as src, em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        a, b = em.device(f"ember://{src.address}/0"), em.device(f"ember://{dst.address}/0")
        host = np.arange(MiB, dtype=np.float32)  # 4 MiB: pooled sizes start at 1 MiB
        x = em.asarray(host, device=a)
        pool, budget = dst.hosting.pool, dst.hosting.budget
        y = x.to_device(b)
        em.sync(b)
        del y
        em.sync(b)  # the drop goes with it: the buffer, held by nothing else, goes to the pool
        assert pool.total == 4 * MiB and budget.used >= 4 * MiB
        z = x.to_device(b)
        em.sync(b)
        assert pool.total == 0  # the next fetch of that size took it
        np.testing.assert_array_equal(em.asnumpy(z), host)
        del z
        em.sync(b)
        assert pool.total == 4 * MiB
        assert budget.used == pool.total + sum(s.quota.used + s.quota.credit for s in dst.hosting.registry.sessions)
        for d in (a, b):
            d.engine.close()


def test_a_failed_source_op_surfaces_at_the_read_on_the_destination(source, destination):
    a, b = em.device(source.url()), em.device(destination.url())
    bad = em.linalg.inv(em.zeros((2, 2), device=a))
    moved = bad.to_device(b) + 1
    with pytest.raises(em.ExecutionError, match=r"^transfer from ember://127\.0\.0\.1:\d+: inv: Singular matrix"):
        em.asnumpy(moved)
    with pytest.raises(em.ExecutionError, match="^inv: Singular matrix"):
        em.sync(a)  # reported on the source too, once
    _still_usable(a, b)


# --- inside one peer ---------------------------------------------------------------------------

def test_a_move_between_two_sessions_of_one_peer_stays_inside_it(source):
    a, other = em.device(source.url("ember")), em.device(source.url("ws"))  # one peer, two sessions
    assert a == other and a is not other and a.engine is not other.engine
    assert a.engine.info["peer"] == other.engine.info["peer"]
    host = np.random.default_rng(1).standard_normal((512, 512))
    x = em.asarray(host, device=a)
    em.sync(a)
    before, sent = _counters(a), _sent(source)
    y = (x + 1).to_device(other)
    np.testing.assert_array_equal(em.asnumpy(y), host + 1)
    assert _delta(before, _counters(a))["bytes_down"] == 0
    assert _sent(source) == sent  # claimed from the peer's own table: no connection, no host copy


# --- the connections peers fetch over: kept for the next fetch, within limits -------------------

def _fresh(server) -> em.Device:
    """A device of an in-process ``server``, with no session left over from an earlier one on its port."""
    return device_of(f"ember://{server.address}/0")


def _move(a, b, values) -> np.ndarray:
    return em.asnumpy(em.asarray(values, device=a).to_device(b) * 2)


def _kept(destination, source) -> int:
    """How many idle connections to ``source`` the in-process ``destination`` keeps."""
    host, port = source.address.rsplit(":", 1)
    return len(destination.fetcher.links.idle.get(("ember", host, int(port)), []))


def test_moves_from_one_source_share_one_connection_which_counts_as_no_handshake():
    """The destination keeps the connection of a fetch that got its tensor, and the source keeps
    answering on it: five moves, one connection, one source thread. Its capability shown, it no
    longer counts as a handshake: a peer that admits one handshake at a time still answers a new
    connection (its status page) while the link is open."""
    with em.Server("numpy", "127.0.0.1:0", max_sessions=1) as src, \
            em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        a, b = _fresh(src), _fresh(dst)
        for k in range(5):
            np.testing.assert_array_equal(_move(a, b, np.arange(4.0) + k), (np.arange(4.0) + k) * 2)
        assert (src.sources.links, src._handshakes, _kept(dst, src)) == (1, 0, 1)
        host, port = src.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"GET /status.json HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(12) == b"HTTP/1.1 200"
        a.engine.close()
        b.engine.close()
    assert src.sources.links == 0 and dst.fetcher.links.idle == {}  # stopping closed both ends


def test_a_source_closes_a_quiet_fetch_link_and_the_next_move_connects_anew(monkeypatch):
    monkeypatch.setattr(links, "FETCH_LINK_SECONDS", 1.0)
    with em.Server("numpy", "127.0.0.1:0") as src, em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        a, b = _fresh(src), _fresh(dst)
        np.testing.assert_array_equal(_move(a, b, np.ones(3)), [2.0, 2.0, 2.0])
        assert _eventually(lambda: src.sources.links == 1)  # the source holds it once the tensor is sent
        assert _eventually(lambda: src.sources.links == 0)  # and closes it after 1 s without a fetch
        np.testing.assert_array_equal(_move(a, b, np.ones(3)), [2.0, 2.0, 2.0])  # the stale one is not tried
        assert _kept(dst, src) == 1 and _eventually(lambda: src.sources.links == 1)
        a.engine.close()
        b.engine.close()


def test_a_kept_connection_the_source_closed_is_replaced_and_the_move_succeeds():
    """A source that admits one session keeps one fetch link: the second destination's connection
    is closed once its tensor is sent, so that destination's kept connection is dead when it fetches
    again; it connects anew and the move succeeds. A source restarted at the same address meets the
    same."""
    with em.Server("numpy", "127.0.0.1:0", max_sessions=1) as src, \
            em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as first, \
            em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as second:
        a, b, c = _fresh(src), _fresh(first), _fresh(second)
        np.testing.assert_array_equal(_move(a, b, np.arange(3.0)), [0.0, 2.0, 4.0])
        np.testing.assert_array_equal(_move(a, c, np.arange(3.0)), [0.0, 2.0, 4.0])
        assert src.sources.links == 1 and _kept(second, src) == 1  # kept by the destination, closed by the source
        np.testing.assert_array_equal(_move(a, c, np.arange(3.0) + 1), [2.0, 4.0, 6.0])
        address = src.address
        a.engine.close()
        src.stop()
        with em.Server("numpy", address) as again:
            assert _kept(first, again) == 1  # to the stopped source
            np.testing.assert_array_equal(_move(_fresh(again), b, np.arange(2.0)), [0.0, 2.0])
            assert _eventually(lambda: again.sources.links == 1)
        b.engine.close()
        c.engine.close()


def test_a_refused_fetch_ends_its_kept_connection_and_the_next_move_connects_anew():
    with em.Server("numpy", "127.0.0.1:0") as src, em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        a, b = _fresh(src), _fresh(dst)
        host = np.arange(6.0)
        x, capability, meta = _granted(a, b, host)
        np.testing.assert_array_equal(em.asnumpy(_fetched(b, a, capability, meta)), host)
        assert _eventually(lambda: src.sources.links == 1)
        with pytest.raises(em.AccessDenied, match="the capability was used already"):
            em.asnumpy(_fetched(b, a, capability, meta))  # asked on the kept connection: refused, and it ends
        assert _eventually(lambda: src.sources.links == 0) and _kept(dst, src) == 0
        np.testing.assert_array_equal(_move(a, b, host), host * 2)
        a.engine.close()
        b.engine.close()


def _fetch_threads() -> set:
    return {thread for thread in threading.enumerate() if thread.name == "ember-fetch"}


def test_a_destination_keeps_the_thread_of_a_finished_fetch_for_the_next_and_ends_it_when_it_stops():
    """Starting a thread costs about a third of a small move here: a fetch runs on an idle thread of
    an earlier one. Three moves in turn take one thread, which ends with the peer."""
    before = _fetch_threads()
    with em.Server("numpy", "127.0.0.1:0") as src, em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        a, b = _fresh(src), _fresh(dst)
        for k in range(3):
            np.testing.assert_array_equal(_move(a, b, np.arange(3.0) + k), (np.arange(3.0) + k) * 2)
            assert _eventually(lambda: dst.fetcher._workers._idle == 1)  # its thread waits for the next
        assert len(_fetch_threads() - before) == 1
        a.engine.close()
        b.engine.close()
    assert _eventually(lambda: not _fetch_threads() - before)


def test_a_fetch_thread_idle_for_its_time_ends(monkeypatch):
    monkeypatch.setattr(fetching, "WORKER_SECONDS", 0.2)
    before = _fetch_threads()
    with em.Server("numpy", "127.0.0.1:0") as src, em.Server("numpy", "127.0.0.1:0", fetch_from=LOOPBACK) as dst:
        a, b = _fresh(src), _fresh(dst)
        np.testing.assert_array_equal(_move(a, b, np.ones(2)), [2.0, 2.0])
        assert _eventually(lambda: dst.fetcher._workers._idle == 0 and not _fetch_threads() - before)
        np.testing.assert_array_equal(_move(a, b, np.ones(2)), [2.0, 2.0])  # on a new thread
        a.engine.close()
        b.engine.close()


# --- refusals: each a typed error at the read, both sessions going on ---------------------------

def _granted(a, b, host):
    """``host`` on ``a``, granted to ``b``'s session with a fresh capability: (x, capability, meta)."""
    x = em.asarray(host, device=a)
    capability = secrets.token_bytes(32)
    a.engine.grant(x._handle, capability, b.engine.session)
    return x, capability, Meta(host.shape, em.float64)


def _fetched(b, a, capability, meta) -> Array:
    return Array._new(b.engine.fetch(a.engine, capability, meta), meta, b)


def _still_usable(*devices):
    for d in devices:
        assert float(em.sum(em.arange(4.0, device=d))) == 6.0


def test_a_capability_authorizes_one_read(source, destination):
    a, b = em.device(source.url()), em.device(destination.url())
    host = np.arange(6.0)
    x, capability, meta = _granted(a, b, host)
    np.testing.assert_array_equal(em.asnumpy(_fetched(b, a, capability, meta)), host)
    again = _fetched(b, a, capability, meta) * 2
    with pytest.raises(em.AccessDenied, match=r"^transfer from ember://127\.0\.0\.1:\d+: the capability was used "
                                              r"already: each one authorizes a single read$"):
        em.asnumpy(again)
    _still_usable(a, b)


def test_a_capability_granted_to_another_session_is_refused(source, destination):
    a, b, stranger = em.device(source.url()), em.device(destination.url()), em.device(destination.url("ws"))
    host = np.arange(4.0)
    x, capability, meta = _granted(a, b, host)
    with pytest.raises(em.AccessDenied, match="the capability was granted to another session$"):
        em.asnumpy(_fetched(stranger, a, capability, meta))
    np.testing.assert_array_equal(em.asnumpy(_fetched(b, a, capability, meta)), host)  # still the right one's
    _still_usable(a, b, stranger)


def test_an_expired_capability_is_refused(destination):
    with Peer("--device", "numpy", "--transfer-ttl", "0") as hasty:  # every capability expires as it is granted
        a, b = em.device(hasty.url()), em.device(destination.url())
        y = em.asarray(np.ones(3), device=a).to_device(b)
        with pytest.raises(em.AccessDenied, match=r"the capability expired \(0 s after it was granted\)$"):
            em.asnumpy(y)
        _still_usable(a, b)
        a.engine.close()


class Forwarder:
    """A TCP relay to ``address`` on a port of its own: the client reaches a peer through it; once
    it stops listening, nobody else can (the relayed connections live on)."""

    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for one, other in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(one, other), daemon=True).start()

    @staticmethod
    def _pipe(one, other):
        try:
            while data := one.recv(1 << 16):
                other.sendall(data)
        except OSError:
            pass
        finally:
            try:
                other.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def stop_listening(self):
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread; the port refuses from now on
        except OSError:
            pass
        self.listener.close()

    def close(self):
        self.stop_listening()
        for s in self.sockets:
            s.close()


def test_a_destination_that_cannot_reach_the_source_fails_the_move_only(source, destination):
    relay = Forwarder(source.address)
    try:
        a, b = em.device(f"ember://{relay.address}/0"), em.device(destination.url())
        x = em.asarray(np.arange(3.0), device=a)
        em.sync(a)           # the client's session goes through the relay …
        relay.stop_listening()  # … which B, told the same address, cannot reach
        y = x.to_device(b)
        with pytest.raises(em.ConnectionLost, match=rf"^transfer from ember://{relay.address}: unreachable from this peer$"):
            em.asnumpy(y + 1)
        _still_usable(a, b)
        np.testing.assert_array_equal(em.asnumpy(x), [0.0, 1.0, 2.0])
        a.engine.close()
    finally:
        relay.close()


def test_a_source_killed_while_the_destination_waits_on_it_fails_the_move_only(destination):
    doomed = Peer("--device", "numpy")
    try:
        a, b = em.device(doomed.url()), em.device(destination.url())
        x = em.asarray(np.arange(3.0), device=a)
        em.sync(a)
        # a fetch the source has no grant for yet: B waits on it while it dies
        y = _fetched(b, a, secrets.token_bytes(32), Meta((3,), em.float64))
        doomed.kill()
        with pytest.raises(em.ConnectionLost, match=r"^transfer from ember://127\.0\.0\.1:\d+: "):
            em.asnumpy(y)
        _still_usable(b)
        with pytest.raises(em.ConnectionLost):
            em.asnumpy(x)
    finally:
        doomed.stop()


# --- TLS and tokens apply peer to peer ------------------------------------------------------------

@pytest.fixture(scope="module")
def guarded_tls_source(pki, tmp_path_factory):  # noqa: F811
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    with Peer(*pki.local.serve_args(), "--token-file", str(token_file)) as running:
        yield running


@pytest.mark.parametrize("scheme", ["embers", "wss"])
def test_a_tls_source_is_verified_with_the_destinations_ca_and_needs_no_token(guarded_tls_source, pki, scheme,  # noqa: F811
                                                                              monkeypatch):
    monkeypatch.delenv("EMBER_TLS_CA", raising=False)
    a = em.device(guarded_tls_source.url(scheme, token=TOKEN), tls_ca=pki.ca)
    host = np.arange(8.0)
    x = em.asarray(host, device=a)
    with Peer("--device", "numpy", "--tls-ca", pki.ca, "--fetch-from", LOOPBACK) as trusting, \
            Peer("--device", "numpy", "--fetch-from", LOOPBACK) as naive:
        b, c = em.device(trusting.url()), em.device(naive.url())
        np.testing.assert_array_equal(em.asnumpy(x.to_device(b)), host)  # B presented no token: the capability did
        with pytest.raises(em.TLSError, match=rf"^transfer from {scheme}://127\.0\.0\.1:\d+: .*not trusted"):
            em.asnumpy(x.to_device(c))  # C trusts only the system's CAs
        _still_usable(a, b, c)
        b.engine.close()
        c.engine.close()


# --- the sans-I/O objects --------------------------------------------------------------------------

def _host(**limits) -> Host:
    return Host(hosted_devices("numpy"), None, Limits(**limits), transfers=Transfers(ttl=60))


def _open(host):
    session, _ = host.open(Frame({"t": "init", "v": wire.VERSION}, []))
    return session


def _batch(session, *messages):
    return [m for header, _ in session.handle(Frame({"t": "batch", "m": messages}, [])) for m in header["m"]]


def _balanced(session) -> bool:
    """Whether the session's quota counts exactly what it holds between frames (tests/test_accounting.py's sum)."""
    return session.quota.used == (session.table.live_bytes() + session.replying + session.table.granted + session.runs_bytes
                            + sum(graph.held for graph in session.registered.graphs.values()))


def test_a_grant_and_a_local_fetch_between_two_sessions():
    host = _host()
    source, destination = _open(host), _open(host)
    capability = secrets.token_bytes(32)
    _batch(source, ("op", "full", (), (1,), {"shape": (4,), "fill_value": 2.5, "dtype": em.float64}),
           ("grant", 1, capability, destination.id), ("drop", (1,)))
    assert source.table.granted == 32 and _balanced(source)  # the dropped tensor's bytes stay counted by its grant
    _batch(destination, ("fetch", 7, em.float64, (4,), "ember", "peer.example", 7878, capability, host.identity))
    (job,) = destination.fetches
    assert job.local and destination.table.sizes[7] == 32 + O and _balanced(destination)
    assert host.fetch_locally(job, final=False)
    ((_, rid, index),) = [r for r in _batch(destination, ("get", 3, 7))]
    _batch(source, ("sync", 4))
    assert source.table.granted == 0 and source.quota.used == 0 and _balanced(source)  # the grant ended: its bytes came back
    assert host.fetch_locally(Fetch(8, job.meta, "ember", "h", 1, capability, destination.id, True))
    assert _batch(destination, ("sync", 5)) == [("ok", 5)]  # nothing was waiting there


def test_the_source_answers_a_fetch_once_and_only_to_its_session():
    host = _host()
    owner, bound = _open(host), _open(host)
    capability = secrets.token_bytes(32)
    _batch(owner, ("op", "full", (), (1,), {"shape": (2,), "fill_value": 1.0, "dtype": em.float64}),
           ("grant", 1, capability, bound.id))

    def ask(session, presented=capability, **extra):
        return host.answer_fetch(_fetch_frame(presented, session, **extra))

    (refusal,), none = ask("someone else")
    assert none is None and refusal[0]["reason"] == "the capability was granted to another session"
    assert host.answer_fetch(_fetch_frame(secrets.token_bytes(32), bound.id), final=False) is None  # not granted yet: wait
    (reply,), grant = ask(bound.id)
    assert reply[0] == {"t": "tensor"} and reply[1][0].tolist() == [1.0, 1.0]
    assert host.answer_fetch(_fetch_frame(capability, bound.id), final=False) is None  # being sent: ask again later
    (refusal,), _ = ask(bound.id)
    assert refusal[0]["reason"].startswith("unknown capability") and refusal[0]["retry"] is True
    host.transfers.unclaim(grant)  # the connection was cut before the destination said "got": granted again
    (reply,), grant = ask(bound.id)
    assert reply[1][0].tolist() == [1.0, 1.0] and owner.table.granted == 16
    host.transfers.confirm(grant)  # it arrived
    host.transfers.unclaim(grant)  # too late: a used grant stays used
    (refusal,), _ = ask(bound.id)
    assert refusal[0]["kind"] == "AccessDenied" and "used already" in refusal[0]["reason"]
    (refusal,), _ = ask(bound.id, presented=b"short")
    assert refusal[0]["kind"] == "AccessDenied" and "32 bytes" in refusal[0]["reason"]


def test_grants_expire_end_with_their_session_and_are_forgotten_later():
    now = [0.0]
    transfers = Transfers(ttl=10, clock=lambda: now[0])
    host = Host(hosted_devices("numpy"), None, Limits(), transfers=transfers)
    owner, other = _open(host), _open(host)
    caps = [secrets.token_bytes(32) for _ in range(3)]
    _batch(owner, ("op", "full", (), (1,), {"shape": (8,), "fill_value": 1.0, "dtype": em.float64}),
           *[("grant", 1, c, other.id) for c in caps[:2]])
    assert owner.table.granted == 128
    now[0] = 10.0
    assert transfers.claim(caps[0], other.id) == "the capability expired (10 s after it was granted)"
    _batch(owner, ("grant", 1, caps[2], other.id))
    host.close(owner)
    assert transfers.claim(caps[2], other.id).startswith("the capability was revoked")
    now[0] = 10.0 + LINGER + 1
    assert transfers.claim(caps[1], other.id) is None and not transfers.table  # forgotten: unknown again


def _fetch_frame(capability, session, **header) -> Frame:
    """The frame another peer presents to fetch a granted tensor (``Fetch.request``'s header)."""
    return Frame({"t": "fetch", "v": wire.VERSION, "capability": capability, "session": session, **header}, [])


def _fetch_message(tid, shape, capability, source=("ember", "h", 1), peer="p"):
    """A session's ``fetch`` message: tensor ``tid`` (float64, ``shape``) from ``scheme, host, port``."""
    return ("fetch", tid, em.float64, shape, *source, capability, peer)


def _with(message: tuple, k: int, value) -> tuple:
    """``message`` with field ``k`` replaced by ``value``."""
    return (*message[:k], value, *message[k + 1:])


def _refusal(kind: str, reason: str, **extra):
    """answer_fetch's return value for a refusal."""
    return [({"t": "refuse", "kind": kind, "reason": reason, **extra}, [])], None


def test_every_answer_to_a_fetch_frame_word_for_word(monkeypatch):
    host = _host()
    owner, reader = _open(host), _open(host)
    caps = [secrets.token_bytes(32) for _ in range(5)]
    _batch(owner, ("op", "full", (), (1,), {"shape": (2,), "fill_value": 1.5, "dtype": em.float64}),
           ("grant", 1, caps[0], reader.id), ("grant", 9, caps[1], reader.id),  # tensor 9 does not exist
           ("grant", 1, caps[2], reader.id), ("grant", 1, caps[3], reader.id))
    assert owner.table.granted == 48  # three grants of tensor 1's 16 bytes; the failed one holds none

    def answer(capability, final=True, **header):
        return host.answer_fetch(_fetch_frame(capability, reader.id, **header), final=final)

    assert answer(caps[0], v=wire.VERSION + 1) == _refusal(
        "ProtocolError", f"protocol version {wire.VERSION + 1} is not supported: this peer speaks version {wire.VERSION}")
    unknown = secrets.token_bytes(32)
    assert answer(unknown, final=False) is None  # perhaps not granted yet: the shell waits and asks again
    assert host.answer_fetch(_fetch_frame(unknown, reader.id)) == _refusal(  # final by default
        "AccessDenied", "unknown capability: this peer has not granted it (yet)", retry=True)
    assert answer(unknown) == _refusal("AccessDenied", "unknown capability: this peer has not granted it (yet)",
                                       retry=True)
    assert answer(caps[1]) == _refusal("ExecutionError", "unknown tensor id 9 (dropped, or from another session)")
    (reply,), grant = answer(caps[0])
    assert reply[0] == {"t": "tensor"} and reply[1][0].tolist() == [1.5, 1.5]
    host.transfers.confirm(grant)  # the destination said "got"
    assert answer(caps[0]) == _refusal("AccessDenied", "the capability was used already: each one authorizes a single read")

    def broken(self):
        raise failure
    monkeypatch.setattr("ember.remote.transfers.Grant.download", broken)
    failure = em.DeviceError("the device went away")
    assert answer(caps[2]) == _refusal("DeviceError", "reading the granted tensor: the device went away")
    failure = RuntimeError("out of host memory")  # not an ember error: an ExecutionError for the fetching side
    assert answer(caps[3]) == _refusal("ExecutionError", "reading the granted tensor: out of host memory")
    _batch(owner, ("sync", 2))
    assert owner.table.granted == 0 and _balanced(owner)  # every grant, failed or refused, gave its bytes back


def test_every_outcome_of_a_fetch_between_sessions_of_one_peer_word_for_word():
    host = _host()
    owner, reader = _open(host), _open(host)
    caps = [secrets.token_bytes(32) for _ in range(4)]
    _batch(owner, ("op", "full", (), (1,), {"shape": (2,), "fill_value": 1.5, "dtype": em.float64}),
           ("grant", 1, caps[0], reader.id), ("grant", 9, caps[1], reader.id), ("grant", 1, caps[2], "another"),
           ("op", "reshape", (1,), (3,), {"shape": (3,)}), ("grant", 3, caps[3], reader.id))  # 3 holds a ShapeError

    def fetch(capability, final=True):
        job = Fetch(5, Meta((2,), em.float64), "ember", "peer.example", 7878, capability, reader.id, True)
        return host.fetch_locally(job, final=final), job

    over, job = fetch(secrets.token_bytes(32), final=False)
    assert not over and not job.done.is_set()  # perhaps not granted yet: asked again later
    job = Fetch(5, Meta((2,), em.float64), "ember", "peer.example", 7878, secrets.token_bytes(32), reader.id, True)
    assert host.fetch_locally(job) and job.wait().kind == "AccessDenied"  # final by default
    for capability, kind, message in [
            (secrets.token_bytes(32), "AccessDenied", "unknown capability: the peer has not granted it"),
            (caps[1], "ExecutionError", "unknown tensor id 9 (dropped, or from another session)"),
            (caps[2], "AccessDenied", "the capability was granted to another session"),
            (caps[3], "ShapeError", "reshape: cannot reshape an array of shape (2,) (size 2) into shape (3,)")]:
        over, job = fetch(capability)
        outcome = job.wait()
        assert over and (outcome.kind, outcome.message) == (kind, f"transfer from ember://peer.example:7878: {message}")
    over, job = fetch(caps[0])
    assert over and job.wait().tolist() == [1.5, 1.5]  # the native array itself
    _batch(owner, ("sync", 2))
    assert owner.table.granted == 16 and _balanced(owner)  # the used grant gave its bytes back; the unclaimed one keeps its


FULL = ("op", "full", (), (1,), {"shape": (2,), "fill_value": 1.5, "dtype": em.float64})  # tensor 1: 16 bytes


def _refused(session, message) -> str:
    with pytest.raises(ProtocolError) as refused:
        _batch(session, message)
    return str(refused.value)


def test_every_malformed_grant_is_refused_word_for_word_at_its_boundaries():
    host = _host()
    owner = _open(host)
    _batch(owner, FULL)
    grant = ("grant", 1, b"k" * 32, "s")
    for capability in (b"k" * 31, b"k" * 33):
        assert _refused(owner, _with(grant, 2, capability)) == "a capability is 32 random bytes"
    for session in ("", "s" * 65):
        assert _refused(owner, _with(grant, 3, session)) == "a grant names the session it is for"
    for k, value, refusal in [  # a field of another type: the message's record names it (wire/messages.py)
            (2, "k" * 32, f"capability must be bytes, got {'k' * 32!r}"),
            (2, bytearray(32), f"capability must be bytes, got {bytearray(32)!r:.40}"),  # at most 40 characters of it
            (2, None, "capability must be bytes, got None"), (3, b"s", "session must be a string, got b's'"),
            (3, 7, "session must be a string, got 7"), (3, None, "session must be a string, got None"),
            (1, -1, "id must be a non-negative integer, got -1"), (1, True, "id must be a non-negative integer, got True")]:
        assert _refused(owner, _with(grant, k, value)) == f"the 'grant' message's {refusal}"
    _batch(owner, _with(grant, 3, "s" * 64), ("grant", 1, b"l" * 32, "t"), ("grant", 0, b"j" * 32, "t"))  # the longest and
    # shortest names; id 0
    assert owner.table.granted == 32 and _balanced(owner)  # tensor 1 twice; id 0 holds nothing, a failure without bytes
    assert _batch(owner, ("sync", 1)) == [("ok", 1)]


def test_a_grant_over_the_quota_or_of_a_capability_in_use_is_refused_and_named():
    quota = 16 + O + 8
    host = _host(max_session_bytes=quota)
    owner, reader = _open(host), _open(host)
    _batch(owner, FULL, ("grant", 1, b"a" * 32, reader.id))  # (16 + O) + 16 bytes > quota: refused, the tensor lives on
    assert owner.table.granted == 0 and owner.quota.used == 16 + O and _balanced(owner)
    assert host.answer_fetch(_fetch_frame(b"a" * 32, reader.id)) == _refusal(
        "ResourceLimitError", f"grant of tensor 1: 16 more bytes would exceed this session's quota of {quota} bytes "
                              f"({16 + O} in use)")
    _batch(owner, ("drop", (1,)), ("op", "full", (), (2,), {"shape": (1,), "fill_value": 1.0, "dtype": em.float64}),
           ("grant", 2, b"b" * 32, reader.id), ("grant", 2, b"b" * 32, reader.id))  # the second presents it again
    # the refused second gave its 8 bytes back
    assert owner.table.granted == 8 and owner.quota.used == 16 + O and _balanced(owner)
    assert _batch(owner, ("sync", 3)) == [("error", 3, "ResourceLimitError", "grant: this capability was granted "
                                                                              "already; draw a new one for each transfer")]


ELSEWHERE = ("ember", "peer.example", 7878)  # a source peer, never connected to here
FETCH = _fetch_message(5, (2,), b"c" * 32, ELSEWHERE, "other peer")


def test_every_malformed_fetch_is_refused_word_for_word_at_its_boundaries():
    host = _host()
    session = _open(host)
    for k, value in [(2, "float64"), (2, None), (3, (1,) * 65), (3, (2, -1)), (3, (True,)), (3, (2.0,))]:
        assert _refused(session, _with(FETCH, k, value)) == "a fetch names the tensor's dtype and shape"
    for k, value in [(4, "http"), (5, ""), (5, "h" * 256), (6, 0), (6, 65536), (8, "p" * 65)]:
        assert _refused(session, _with(FETCH, k, value)) == "a fetch names the source peer as scheme, host, port and identity"
    for capability in (b"c" * 31, b"c" * 33):
        assert _refused(session, _with(FETCH, 7, capability)) == "a capability is 32 random bytes"
    for k, value, refusal in [  # a field of another type: the message's record names it (wire/messages.py)
            (3, [2], "shape must be a list, got [2]"), (4, None, "scheme must be a string, got None"),
            (5, b"h", "host must be a string, got b'h'"), (6, "7878", "port must be an integer, got '7878'"),
            (6, 7878.0, "port must be an integer, got 7878.0"), (6, True, "port must be an integer, got True"),
            (7, "c" * 32, f"capability must be bytes, got {'c' * 32!r}"),
            (8, None, "peer must be a string, got None"), (1, -5, "id must be a non-negative integer, got -5")]:
        assert _refused(session, _with(FETCH, k, value)) == f"the 'fetch' message's {refusal}"
    _batch(session, _with(FETCH, 3, (1,) * 64), _fetch_message(6, (0, 2), b"d" * 32, ("wss", "h" * 255, 65535), "p" * 64),
           _fetch_message(7, (), b"e" * 32, ("embers", "h", 1), ""))  # every boundary accepted
    assert [(job.tid, job.source, job.meta.shape) for job in session.fetches] == [
        (5, "ember://peer.example:7878", (1,) * 64), (6, f"wss://{'h' * 255}:65535", (0, 2)), (7, "embers://h:1", ())]
    assert session.table.sizes == {5: 8 + O, 6: O, 7: 8 + O} and _balanced(session)


def test_a_fetch_over_a_limit_is_refused_at_its_first_use_naming_the_transfer():
    quota = 4 * O + 40  # 1's failure (O), 2 and 3 (16 + O each), 4's failure (O): no room for 4 itself
    host = _host(max_tensor_bytes=16, max_session_bytes=quota)
    session = _open(host)
    _batch(session, *(_fetch_message(tid, shape, bytes([tid]) * 32, ELSEWHERE, "other peer")
                      for tid, shape in [(1, (3,)), (2, (2,)), (3, (2,)), (4, (2,))]))
    assert [job.tid for job in session.fetches] == [2, 3]  # 1 is too large, 4 finds the quota full
    assert session.quota.used == 4 * O + 32 and _balanced(session)
    assert _batch(session, ("get", 1, 1), ("get", 2, 4)) == [
        ("error", 1, "ResourceLimitError", "transfer from ember://peer.example:7878: an output of shape (3,) float64 "
                                           "exceeds the peer's tensor limit of 16 bytes"),
        ("error", 2, "ResourceLimitError", f"transfer from ember://peer.example:7878: {16 + O} more bytes would exceed "
                                           f"this session's quota of {quota} bytes ({3 * O + 32} in use)")]


def test_a_session_runs_at_most_so_many_fetches_at_once(monkeypatch):
    monkeypatch.setattr("ember.remote.moves.FETCHES_PER_SESSION", 3)
    host = _host()
    session = _open(host)
    jobs = [_fetch_message(k, (1,), bytes([k]) * 32) for k in range(1, 6)]
    _batch(session, *jobs[:4])
    assert [job.tid for job in session.fetches] == [1, 2, 3]
    assert _batch(session, ("get", 1, 4)) == [("error", 1, "ResourceLimitError", "transfer from ember://h:1: 3 transfers "
                                                                                 "to this session are running already "
                                                                                 "(those of dropped tensors until they "
                                                                                 "stop); read some of their tensors first")]
    session.fetches[0].fail("ConnectionLost", "no shell here")  # one is done (unread): room for another
    _batch(session, jobs[4])
    assert [job.tid for job in session.fetches] == [1, 2, 3, 5] and _balanced(session)


def test_a_fetch_into_an_id_in_use_replaces_its_tensor():
    host = _host()
    session = _open(host)
    _batch(session, ("op", "full", (), (5,), {"shape": (4,), "fill_value": 1.0, "dtype": em.float64}), FETCH)
    assert 5 not in session.table.tensors and session.table.sizes[5] == 16 + O
    assert session.quota.used == 16 + O and _balanced(session)
    (job,) = session.fetches
    job.receive(Frame({"t": "tensor"}, [np.array([3.0, 4.0])]))
    assert _batch(session, ("shape", 1, (5,)), ("get", 2, 5))[0] == ("shapes", 1, ((2,),))


def _fetch_into(session, *values):
    """Fetch tensors 5, 6 … into ``session`` and complete each fetch with its value."""
    start = len(session.fetches)
    for k, value in enumerate(values):
        _batch(session, _fetch_message(5 + k, np.shape(value), bytes([k + 1]) * 32))
    for job, value in zip(session.fetches[start:], values):
        job.receive(Frame({"t": "tensor"}, [np.asarray(value, np.float64)]))


def test_every_path_that_reads_a_fetched_tensor_waits_for_its_fetch():
    host = _host()
    session = _open(host)
    _fetch_into(session, [1.0, 2.0], [3.0, 4.0], [5.0])
    replies = _batch(session, ("op", "add", (5, 6), (8,), {}), ("get", 1, 8))
    assert replies[0][0] == "data" and session.ops == 1  # the op waited for both fetches, and counts once
    gid = 1
    _batch(session, ("graph", gid, ((0, em.float64, (1,)),), (1,), (("negative", (0,), (1,), {}),), ()),
           ("run", gid, (7,), (9,)))
    assert [r[0] for r in _batch(session, ("get", 2, 9))] == ["data"] and session.registered.graph_runs == 1
    _fetch_into(session, [6.0])  # tensor 5 again: a sync settles it
    assert _batch(session, ("sync", 3)) == [("ok", 3)] and not session.table.incoming and 5 in session.table.tensors


def test_a_fetched_tensor_that_cannot_be_kept_is_poisoned_naming_the_transfer(monkeypatch):
    host = _host()
    session = _open(host)

    def refuse(host_array):
        raise failure
    monkeypatch.setattr(session.engine, "upload", refuse)
    for failure, kind in [(em.DeviceError("no room on the device"), "DeviceError"), (RuntimeError("odd"), "ExecutionError")]:
        _fetch_into(session, [1.0])
        assert _batch(session, ("get", 1, 5)) == [("error", 1, kind, f"transfer from ember://h:1: {failure}")]
        assert _batch(session, ("sync", 2)) == [("error", 2, kind, f"transfer from ember://h:1: {failure}")]
        session.fetches.clear()
    _fetch_into(session, [1.0, 2.0])
    session.fetches[0].fail("AccessDenied", "the capability was used already")
    session.fetches.clear()
    assert _batch(session, ("op", "negative", (5,), (6,), {}), ("get", 1, 6)) == [
        ("error", 1, "AccessDenied", "transfer from ember://h:1: the capability was used already")]
    assert session.errors["AccessDenied"] == 1 and _balanced(session)


def test_unknown_ids_are_refused_while_fetches_are_running():
    host = _host()
    session = _open(host)
    _batch(session, _fetch_message(5, (1,), b"c" * 32))  # never done: reads would wait
    gid = 1
    unknown = "unknown tensor id 99 (dropped, or from another session)"
    assert _batch(session, ("get", 1, 99), ("op", "negative", (99,), (6,), {}), ("get", 2, 6),
                  ("graph", gid, ((0, em.float64, (1,)),), (1,), (("negative", (0,), (1,), {}),), ()),
                  ("run", gid, (99,), (7,)), ("get", 3, 7)) == [
        ("error", 1, "ExecutionError", unknown), ("error", 2, "ExecutionError", f"negative: {unknown}"),
        ("error", 3, "ExecutionError", f"run: {unknown}")]
    _batch(session, ("op", "full", (), (8,), {"shape": (1,), "fill_value": 1.0, "dtype": em.float64}),
           ("op", "full", (), (8,), {"shape": (2,), "fill_value": 2.0, "dtype": em.float64}))  # 8 written again
    assert 5 in session.table.incoming and session.table.sizes[8] == 16 + O and _balanced(session)


def test_dropping_or_overwriting_a_tensor_being_fetched_forgets_its_fetch():
    host = _host()
    session = _open(host)
    _fetch_into(session, [1.0], [2.0], [3.0])
    _batch(session, ("drop", (5,)), ("op", "full", (), (6,), {"shape": (1,), "fill_value": 9.0, "dtype": em.float64}),
           ("op", "reshape", (6,), (7,), {"shape": (2,)}))  # refused (1 element into 2): a failure stored as 7
    assert not session.table.incoming and 5 not in session.table.tensors and _balanced(session)
    assert _batch(session, ("get", 1, 6))[0][0] == "data" and _batch(session, ("get", 2, 7))[0][:3] == ("error", 2,
                                                                                                      "ShapeError")


def test_a_fetch_checks_what_the_source_sends():
    meta = Meta((2, 2), em.float32)
    job = Fetch(1, meta, "embers", "::1", 7878, b"c" * 32, "s", False)
    assert job.source == "embers://[::1]:7878" and job.reply_limits().max_tensor_bytes == 16
    assert not job.receive(Frame({"t": "refuse", "kind": "AccessDenied", "reason": "not yet", "retry": True}, []),
                           final=False)
    assert job.receive(Frame({"t": "tensor"}, [np.zeros((4,), np.float32)]))
    outcome = job.wait()
    assert outcome.kind == "ProtocolError" and "a float32 tensor of shape (4,)" in outcome.message
    odd = Fetch(1, meta, "ember", "h", 1, b"c" * 32, "s", False)
    odd.receive(Frame({"t": "refuse", "kind": "os.system", "reason": 7}, []))
    assert (odd.wait().kind, odd.wait().message) == ("ExecutionError", "transfer from ember://h:1: refused")


ODD = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**64), st.text(max_size=4), st.binary(max_size=40),
                st.just(em.float64), st.tuples(st.integers(-1, 3)), st.just(b"k" * 32), st.just("ember"))


@given(grant=st.tuples(ODD, ODD, ODD), fetch=st.tuples(*[ODD] * 8), header=st.dictionaries(st.sampled_from(
    ["t", "v", "capability", "session"]), ODD))
def test_hostile_grants_fetches_and_fetch_frames_are_refused_and_the_accounting_balances(grant, fetch, header):
    host = _host(max_tensor_bytes=1 << 16)
    session = _open(host)
    _batch(session, ("op", "full", (), (1,), {"shape": (3,), "fill_value": 2.0, "dtype": em.float64}))
    for message in (("grant", *grant), ("fetch", *fetch)):
        try:
            _batch(session, message)
        except ProtocolError:
            pass
        assert _balanced(session)
    for job in session.fetches:
        job.fail("ConnectionLost", "no shell here")
    replies, grant = host.answer_fetch(Frame(header, []), final=True)
    assert replies[0][0]["t"] in ("refuse", "tensor", "peer")  # peer: a hello, which presents nothing
    if grant is not None:
        host.transfers.confirm(grant)
    replies = _batch(session, ("sync", 1), ("op", "multiply", (1, (2.0, "float64")), (2,), {}), ("get", 2, 2))
    assert replies[-1][0] == "data" and _balanced(session)
    host.close(session)
    assert host.budget.used == host.pool.total


# --- the grants table and a fetch, alone ------------------------------------------------------------

class _Owner:
    """What a Grant needs of the session that made it: the list its released bytes go back through."""

    def __init__(self):
        self.ended = []


def _grant(owner, capability: bytes, session="s", nbytes=8):
    return Grant(capability, session, np.ones(1), owner, nbytes)


def test_the_grants_table_counts_each_sessions_pending_grants_exactly(monkeypatch):
    monkeypatch.setattr("ember.remote.transfers.GRANTS_PER_SESSION", 2)
    now = [100.0]
    table = Transfers(ttl=10, clock=lambda: now[0])
    assert (table.generation, table.closed, table.pending) == (0, False, {})
    alice, bob = _Owner(), _Owner()
    first, second, third = (_grant(alice, bytes([k]) * 32) for k in range(3))
    assert table.grant(first) is None and table.grant(_grant(bob, b"b" * 32)) is None
    assert (first.expires, first.state, first.ended) == (110.0, "granted", 0.0)
    assert table.grant(second) is None and table.pending == {alice: 2, bob: 1} and table.generation == 3
    assert table.grant(third) == "grant: 2 transfers of this session are pending already"  # at the cap, and no further
    assert table.generation == 3 and third.capability not in table.table
    assert table.claim(first.capability, "s") is first and first.state == "sending" and table.pending == {alice: 1, bob: 1}
    assert table.grant(third) is None and table.pending == {alice: 2, bob: 1}  # a claimed grant makes room
    table.unclaim(first)  # its connection was cut: granted again, and counted again
    assert first.state == "granted" and table.pending == {alice: 3, bob: 1} and table.generation == 5
    assert table.claim(first.capability, "s") is first and table.pending == {alice: 2, bob: 1}
    table.revoke(alice)  # alice's session closed: her granted ones end; the one being sent and bob's are untouched
    assert [g.state for g in (first, second, third)] == ["sending", "revoked", "revoked"] and table.pending == {bob: 1}
    assert alice.ended == [8, 8] and second.value is None and first.value is not None
    second.release()
    assert alice.ended == [8, 8]  # its bytes go back once
    table.confirm(first)  # the destination said "got": used, its bytes back
    assert first.state == "used" and first.value is None and alice.ended == [8, 8, 8]
    now[0] = 100.0 + LINGER  # ended LINGER seconds ago: still named …
    assert table.claim(second.capability, "s").startswith("the capability was revoked")
    now[0] = 100.0 + LINGER + 0.5  # … and after that forgotten; bob's grant expired long ago
    assert table.claim(second.capability, "s") is None and list(table.table) == [b"b" * 32]
    assert table.pending == {} and table.table[b"b" * 32].state == "expired"
    monkeypatch.setattr("ember.remote.transfers.GRANTS_PER_SESSION", 1)  # a session's first grant, at a cap of one
    carol = _Owner()
    assert table.grant(_grant(carol, b"c" * 32)) is None and table.grant(_grant(carol, b"d" * 32)) is not None


def test_a_waiter_wakes_at_the_next_grant_or_when_the_peer_stops_and_no_later_than_asked():
    table = Transfers()
    owner = _Owner()
    start = time.monotonic()
    table.wait(table.generation, 0.05)  # nothing granted: it waited its time …
    table.wait(table.generation, -1.0)  # … and a time already past is no wait, not an error
    assert 0.04 < time.monotonic() - start < 1
    seen = table.generation
    threading.Timer(0.05, table.grant, [_grant(owner, b"g" * 32)]).start()
    start = time.monotonic()
    table.wait(seen, 10)
    assert time.monotonic() - start < 5 and table.generation == seen + 1
    threading.Timer(0.05, table.close).start()
    start = time.monotonic()
    table.wait(table.generation, 10)
    assert time.monotonic() - start < 5 and table.closed


def test_a_fetch_asks_once_and_reads_each_answer_of_the_source():
    meta = Meta((0, 3), em.float32)
    job = Fetch(4, meta, "ember", "h", 7, b"c" * 32, "sess", False)
    assert job.request() == {"t": "fetch", "v": wire.VERSION, "capability": b"c" * 32, "session": "sess"}
    limits = job.reply_limits()  # an empty tensor's other extents still count: 3 float32
    assert (limits.max_tensor_bytes, limits.max_frame_bytes) == (12, 12 + wire.HANDSHAKE_LIMITS.max_header_bytes)
    assert limits.max_header_bytes == wire.HANDSHAKE_LIMITS.max_header_bytes
    assert job.value is None and not job.done.is_set()
    waited = job.wait(0.01)
    assert (waited.kind, waited.message) == ("ConnectionLost", "transfer from ember://h:7: not done after 0.01 s")
    assert job.receive(Frame({"t": "refuse", "kind": "AccessDenied", "reason": "not yet", "retry": True}, []))  # final
    assert (job.wait().kind, job.wait().message) == ("AccessDenied", "transfer from ember://h:7: not yet")
    job.receive(Frame({"t": "tensor"}, [np.zeros((0, 3), np.float32)]))
    assert type(job.wait()) is Failure and job.value is None  # over: what comes later is not taken

    def answered(header, segments=()):
        job = Fetch(4, Meta((2,), em.float32), "ember", "h", 7, b"c" * 32, "s", False)
        assert job.receive(Frame(header, list(segments)))
        return job.wait()

    assert answered({"t": "tensor"}, [np.ones(2, np.float32)]).tolist() == [1.0, 1.0]
    for header, segments, kind, message in [
            ({"t": "refuse", "kind": "ShapeError", "reason": "r" * 2000}, (), "ShapeError", "r" * 1000),
            ({"t": "nonsense" * 10}, (), "ProtocolError", f"unexpected answer {'nonsense' * 10!r:.40} from the source"),
            ({"t": "tensor"}, (np.ones(2, np.float32),) * 2, "ProtocolError",
             "the source sent 2 tensors, not the float32 tensor of shape (2,) it granted"),
            ({"t": "tensor"}, (), "ProtocolError", "the source sent 0 tensors, not the float32 tensor of shape (2,) it granted")]:
        outcome = answered(header, segments)
        assert (outcome.kind, outcome.message) == (kind, f"transfer from ember://h:7: {message}")


def test_a_fetch_that_fails_is_named_by_the_nearest_kind_the_wire_knows():
    class Narrower(em.ShapeError):  # not on the wire: its parent is
        pass

    for error, kind in [(em.TLSError("certificate not trusted"), "TLSError"), (Narrower("odd"), "ShapeError"),
                        (ConnectionResetError("reset by peer"), "ConnectionLost"), (em.EmberError("x"), "EmberError")]:
        job = Fetch(1, Meta((1,), em.float32), "ember", "h", 1, b"c" * 32, "s", False)
        job.fail_with(error)
        assert (job.wait().kind, job.wait().message) == (kind, f"transfer from ember://h:1: {error}")
