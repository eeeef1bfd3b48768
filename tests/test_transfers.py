"""Direct transfers: ``x.to_device(b)`` from one compute peer to another, the bytes going peer to
peer. Real ``ember serve`` processes on 127.0.0.1; the sans-I/O objects fed directly below."""

from __future__ import annotations

import secrets
import socket
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ember as em
from ember.array import Array
from ember.errors import ProtocolError
from ember.ops.table import Meta
from ember.remote.session import Host, hosted_devices
from ember.remote.transfers import LINGER, Fetch, Transfers
from ember.wire import protocol as wire
from ember.wire.protocol import Frame, Limits

from .conftest import torch_available
from .peers import Peer
from .test_tls import TOKEN, pki  # noqa: F401  (a fixture)

MiB = 1 << 20
needs_torch = pytest.mark.skipif(not torch_available(), reason="needs torch")


@pytest.fixture(scope="module")
def source():
    with Peer("--device", "numpy") as running:
        yield running


@pytest.fixture(scope="module")
def destination():
    with Peer("--device", "torch:cpu" if torch_available() else "numpy") as running:
        yield running


def _sent(peer) -> int:
    """How many tensors ``peer`` has sent to other peers (its log says so for each)."""
    return sum("sent a granted tensor" in line for line in list(peer.log))


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
    assert _sent(source) == sent + 1 and any(f"sent a granted tensor of {host.nbytes} bytes" in line for line in source.log)


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


def test_a_fetched_tensor_is_received_into_the_destinations_buffer_pool_and_its_buffer_serves_the_next():
    # a fresh 256 MiB buffer costs tens of milliseconds of page faults on the destination (ember bench fleet)
    with em.Server("numpy", "127.0.0.1:0") as src, em.Server("numpy", "127.0.0.1:0") as dst:
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
        assert budget.used == pool.total + sum(s.used + s.credit for s in dst.hosting.registry.sessions)
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
        with pytest.raises(em.ConnectionLost, match=rf"^transfer from ember://{relay.address}: cannot connect to "):
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
    with Peer("--device", "numpy", "--tls-ca", pki.ca) as trusting, Peer("--device", "numpy") as naive:
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
    return session.used == session.live_bytes() + session.replying + session.granted


def test_a_grant_and_a_local_fetch_between_two_sessions():
    host = _host()
    source, destination = _open(host), _open(host)
    capability = secrets.token_bytes(32)
    _batch(source, ("op", "full", (), (1,), {"shape": (4,), "fill_value": 2.5, "dtype": em.float64}),
           ("grant", 1, capability, destination.id), ("drop", (1,)))
    assert source.granted == 32 and _balanced(source)  # the dropped tensor's bytes stay counted by its grant
    _batch(destination, ("fetch", 7, em.float64, (4,), "ember", "peer.example", 7878, capability, host.identity))
    (job,) = destination.fetches
    assert job.local and destination.sizes[7] == 32 and _balanced(destination)
    assert host.fetch_locally(job, final=False)
    ((_, rid, index),) = [r for r in _batch(destination, ("get", 3, 7))]
    _batch(source, ("sync", 4))
    assert source.granted == 0 and source.used == 0 and _balanced(source)  # the grant ended: its bytes came back
    assert host.fetch_locally(Fetch(8, job.meta, "ember", "h", 1, capability, destination.id, True))
    assert _batch(destination, ("sync", 5)) == [("ok", 5)]  # nothing was waiting there


def test_the_source_answers_a_fetch_once_and_only_to_its_session():
    host = _host()
    owner, bound = _open(host), _open(host)
    capability = secrets.token_bytes(32)
    _batch(owner, ("op", "full", (), (1,), {"shape": (2,), "fill_value": 1.0, "dtype": em.float64}),
           ("grant", 1, capability, bound.id))

    def ask(session, presented=capability, **extra):
        return host.answer_fetch(Frame({"t": "fetch", "v": wire.VERSION, "capability": presented, "session": session,
                                        **extra}, []))

    (refusal,), none = ask("someone else")
    assert none is None and refusal[0]["reason"] == "the capability was granted to another session"
    assert host.answer_fetch(Frame({"t": "fetch", "v": wire.VERSION, "capability": secrets.token_bytes(32),
                                    "session": bound.id}, []), final=False) is None  # not granted yet: wait
    (reply,), grant = ask(bound.id)
    assert reply[0] == {"t": "tensor"} and reply[1][0].tolist() == [1.0, 1.0]
    grant.release()
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
    assert owner.granted == 128
    now[0] = 10.0
    assert transfers.claim(caps[0], other.id) == "the capability expired (10 s after it was granted)"
    _batch(owner, ("grant", 1, caps[2], other.id))
    host.close(owner)
    assert transfers.claim(caps[2], other.id).startswith("the capability was revoked")
    now[0] = 10.0 + LINGER + 1
    assert transfers.claim(caps[1], other.id) is None and not transfers.table  # forgotten: unknown again


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
    assert replies[0][0]["t"] in ("refuse", "tensor")
    if grant is not None:
        grant.release()
    replies = _batch(session, ("sync", 1), ("op", "multiply", (1, (2.0, "float64")), (2,), {}), ("get", 2, 2))
    assert replies[-1][0] == "data" and _balanced(session)
    host.close(session)
    assert host.budget.used == host.pool.total
