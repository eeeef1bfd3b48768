"""TLS on both transports: real ``ember serve`` peers on 127.0.0.1 with certificates from a
throwaway CA (trustme), which the system's store does not trust."""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ember as em
from ember.wire import protocol as wire
from ember.wire import tcp

from .peers import Peer
from .test_remote import free_port, nothing_listens

TLS_SCHEMES = ["embers", "wss"]
TOKEN = "s3cret-0123456789ab"  # ember serve takes tokens of 16 characters and more
PROMPT = 5  # seconds: a refusal must come long before any timeout


@pytest.fixture(scope="module")
def tls_peer(pki):
    with Peer(*pki.local.serve_args()) as running:
        yield running


@pytest.fixture(scope="module")
def guarded_tls_peer(pki, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    with Peer(*pki.local.serve_args(), "--token-file", str(token_file)) as running:
        yield running


@pytest.fixture(params=TLS_SCHEMES)
def scheme(request, monkeypatch):
    monkeypatch.delenv("EMBER_TLS_CA", raising=False)
    return request.param


@pytest.fixture(scope="module")
def elsewhere_peer(pki):
    """A peer whose certificate names example.org only."""
    with Peer(*pki.elsewhere.serve_args()) as running:
        yield running


@pytest.fixture(scope="module")
def expired_peer(pki):
    with Peer(*pki.expired.serve_args()) as running:
        yield running


def _port(peer) -> int:
    return int(peer.address.rsplit(":", 1)[1])


# --- TLS peers at work -----------------------------------------------------------------------------

def test_a_computation_over_tls(tls_peer, pki, scheme):
    assert "with TLS" in tls_peer.output[0] and f"embers://{tls_peer.address}/0" in tls_peer.output[0]
    d = em.device(tls_peer.url(scheme), tls_ca=pki.ca)
    host = np.arange(6.0).reshape(2, 3)
    x = em.asarray(host, device=d)
    np.testing.assert_allclose(em.asnumpy(em.tanh(x @ x.mT / 50) + 1), np.tanh(host @ host.T / 50) + 1)
    with pytest.raises(em.ExecutionError, match="^inv: Singular matrix"):
        em.asnumpy(em.linalg.inv(em.zeros((2, 2), device=d)))
    assert d.engine.connection.transport == {"embers": "tcp", "wss": "websocket"}[scheme]  # inside TLS


def test_large_tensors_travel_both_ways_over_tls(tls_peer, pki, scheme):
    d = em.device(tls_peer.url(scheme), tls_ca=pki.ca)
    host = np.random.default_rng(7).random(64 << 18, dtype=np.float32)  # 64 MiB
    x = em.asarray(host, device=d)
    back = em.asnumpy(x - 1)
    np.testing.assert_array_equal(back, host - 1)
    assert em.stats(d)["bytes_down"] >= host.nbytes


def test_a_look_for_a_frame_over_tls_never_waits(tls_peer, pki, scheme):
    """Over TLS a look asks the TLS object for bytes it has decrypted, then the socket, and waits for
    neither: a thousand looks at a quiet session take a few milliseconds (a look that waited a
    millisecond would take a second)."""
    d = em.device(tls_peer.url(scheme), tls_ca=pki.ca)
    assert float(em.sum(em.ones(3, device=d))) == 3.0  # nothing is left to come (a sync would report an earlier test's failure)
    connection = d.engine.connection
    start = time.monotonic()
    assert not any(connection.readable() for _ in range(1000))
    assert time.monotonic() - start < 0.5


def test_a_frame_of_small_and_large_tensors_arrives_whole_over_tls(tls_peer, pki, scheme):
    """A TLS socket has no scatter-gather send: a frame's runs of small buffers are joined into one
    write, large ones written as they are. Small uploads, copied into the batch with larger ones,
    go in one frame that starts, goes on and ends with small buffers, and come back bit for bit."""
    d = em.device(tls_peer.url(scheme), tls_ca=pki.ca)
    rng = np.random.default_rng(3)
    # float64: 96 B and 8 B (joined with the header), 240 KB, 24 B, 64 KiB (tcp._JOIN: written alone), 40 B and 16 B
    hosts = [rng.random(n) for n in (12, 1, 30_000, 3, 8192, 5, 2)]
    arrays = [em.asarray(h, device=d) for h in hosts]  # held in the batch until a read sends it
    batches = em.stats(d)["batches"]
    for host, array in zip(hosts, arrays):
        np.testing.assert_array_equal(em.asnumpy(array), host)
    assert em.stats(d)["batches"] == batches + len(hosts)  # the uploads went with the first read


def test_an_in_process_server_serves_tls(pki, scheme):
    with em.Server("numpy", "127.0.0.1:0", tls_cert=pki.local.cert, tls_key=pki.local.key) as server:
        d = em.device(f"{scheme}://{server.address}/0", tls_ca=pki.ca)
        assert float(em.sum(em.arange(5, device=d))) == 10.0
        d.engine.close()


def test_the_token_travels_inside_tls(guarded_tls_peer, pki, scheme):
    d = em.device(guarded_tls_peer.url(scheme, token=TOKEN), tls_ca=pki.ca)
    assert float(em.sum(em.ones(3, device=d))) == 3.0
    with pytest.raises(em.AccessDenied, match="bad or missing token") as refused:
        em.ones(1, device=em.device(guarded_tls_peer.url(scheme, token="wrong"), tls_ca=pki.ca))
    assert type(refused.value) is em.AccessDenied  # TLS succeeded: only the token was refused


def test_a_tls_peer_stops_at_once_with_sessions_open(pki):
    with Peer(*pki.local.serve_args()) as stopping:
        devices = [em.device(stopping.url(scheme), tls_ca=pki.ca) for scheme in TLS_SCHEMES]
        assert [float(em.sum(em.ones(2, device=d))) for d in devices] == [2.0, 2.0]
        start = time.monotonic()
        stopping.stop()
        assert stopping.process.returncode == 0 and time.monotonic() - start < 3  # SIGTERM sufficed: no SIGKILL
        with pytest.raises(em.ConnectionLost):
            em.asnumpy(em.ones(2, device=devices[0]) + 1)


@pytest.mark.parametrize("end", ["stop", "kill"])
def test_a_tls_peer_restarted_at_the_same_address_is_met_with_a_new_session(pki, scheme, end):
    first = Peer(*pki.local.serve_args())
    try:
        device = em.device(first.url(scheme), tls_ca=pki.ca)
        assert float(em.sum(em.ones(1000, device=device))) == 1000.0
    finally:
        getattr(first, end)()
    with Peer(*pki.local.serve_args(), "--listen", first.address, "--max-tensor-bytes", "100"):
        with pytest.raises(em.ResourceLimitError, match="upload: a tensor of 1000 bytes exceeds .* limit of 100 bytes"):
            em.asarray(np.zeros(1000, np.uint8), device=device)  # the new peer's limits, over a new TLS session
        assert float(em.sum(em.ones(5, device=device))) == 5.0


# --- certificates the client refuses ---------------------------------------------------------------

def test_an_unknown_ca_is_refused_and_named(tls_peer, scheme):
    with pytest.raises(em.TLSError) as refused:
        em.ones(1, device=em.device(tls_peer.url(scheme, token=TOKEN)))  # the system's store: trustme is unknown to it
    message = str(refused.value)
    assert message.startswith(f"{scheme}://{tls_peer.address}: the peer's certificate is not trusted "
                              f"(self-signed or unknown CA)")
    assert "EMBER_TLS_CA=FILE" in message and "tls_ca=FILE" in message
    assert TOKEN not in message
    assert isinstance(refused.value, em.AccessDenied) and isinstance(refused.value, PermissionError)


def test_the_ca_comes_from_the_environment(tls_peer, pki, scheme, monkeypatch):
    monkeypatch.setenv("EMBER_TLS_CA", pki.ca)
    # a string not parsed before: the environment is read when a device string is first parsed
    d = em.device(f"{scheme}://localhost:{_port(tls_peer)}/0")
    assert d.tls_ca == pki.ca
    assert float(em.sum(em.ones(4, device=d))) == 4.0


def test_the_ca_is_part_of_the_shared_device(tls_peer, pki, scheme, tmp_path, monkeypatch):
    url = tls_peer.url(scheme)
    trusting = em.device(url, tls_ca=pki.ca)
    assert trusting is em.device(url, tls_ca=Path(pki.ca))
    assert trusting is not em.device(url) and trusting == em.device(url)  # two sessions, one device
    monkeypatch.chdir(Path(pki.ca).parent)
    assert em.device(url, tls_ca="ca.pem") is trusting  # a relative path names the file, not the text
    assert str(trusting) == url
    with pytest.raises(em.DeviceError, match="tls_ca applies to TLS device strings"):
        em.device(url.replace(scheme, scheme[:-1], 1), tls_ca=pki.ca)
    with pytest.raises(em.DeviceError, match="tls_ca applies to TLS device strings"):
        em.device("numpy", tls_ca=pki.ca)
    with pytest.raises(em.TLSError, match="cannot load the CA file"):
        em.ones(1, device=em.device(url, tls_ca=tmp_path / "missing.pem"))


def test_a_certificate_for_another_name_is_refused(elsewhere_peer, pki, scheme):
    with pytest.raises(em.TLSError, match=rf"^{scheme}://{elsewhere_peer.address}: the peer's certificate is not valid "
                                          rf"for 127\.0\.0\.1 \(hostname mismatch\)"):
        em.ones(1, device=em.device(elsewhere_peer.url(scheme), tls_ca=pki.ca))


def test_an_expired_certificate_is_refused(expired_peer, pki, scheme):
    with pytest.raises(em.TLSError, match=rf"^{scheme}://{expired_peer.address}: the peer's certificate has expired"):
        em.ones(1, device=em.device(expired_peer.url(scheme), tls_ca=pki.ca))


# --- plain and TLS do not mix, and say so at once ---------------------------------------------------

@pytest.mark.parametrize("plain", ["ember", "ws"])
def test_a_plain_client_of_a_tls_peer_is_refused_at_once(tls_peer, plain, monkeypatch):
    monkeypatch.setattr("ember.engines.dialing.DEFAULT_TIMEOUT", 600.0)
    start = time.monotonic()
    with pytest.raises(em.TLSError, match="this peer requires TLS: connect with embers:// .TCP. or wss://"):
        em.ones(1, device=em.device(tls_peer.url(plain)))
    assert time.monotonic() - start < PROMPT


def test_a_plain_fetch_from_a_tls_peer_is_refused_before_its_capability_is_looked_at(tls_peer):
    """Another peer fetching a granted tensor must come over TLS too, or the tensor would cross the
    network in the clear: a plain fetch is refused at once as a TLS error, whatever it presents."""
    host, port = tls_peer.address.rsplit(":", 1)
    connection = tcp.connect(host, int(port), timeout=5)
    start = time.monotonic()
    try:
        connection.send(wire.encode_frame({"t": "fetch", "v": wire.VERSION, "session": "s",
                                           "capability": secrets.token_bytes(wire.CAPABILITY_BYTES)}))
        answer = connection.receive().header
    finally:
        connection.close()
    assert answer["t"] == "refuse" and answer["kind"] == "TLSError" and "this peer requires TLS" in answer["reason"], answer
    assert time.monotonic() - start < PROMPT


def test_a_tls_client_of_a_plain_peer_fails_at_once(peer, pki, scheme, monkeypatch):
    monkeypatch.setattr("ember.engines.dialing.DEFAULT_TIMEOUT", 600.0)
    start = time.monotonic()
    with pytest.raises(em.TLSError, match=rf"^{scheme}://{peer.address}: the TLS handshake failed .*does not seem to "
                                          rf"serve TLS"):
        em.ones(1, device=em.device(peer.url(scheme), tls_ca=pki.ca))
    assert time.monotonic() - start < PROMPT


@pytest.mark.parametrize("transport", ["tcp", "websocket"])
def test_a_handshake_with_a_silent_peer_ends_at_the_timeout(pki, transport):
    """A TLS client whose peer accepts and says nothing waits for its handshake no longer than the
    timeout it was given, and says where and why."""
    from ember.wire import tcp, tls, websocket
    module = tcp if transport == "tcp" else websocket
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        outcome = []

        def client():
            start = time.monotonic()
            try:
                module.connect("127.0.0.1", port, timeout=0.5, tls=tls.client_context(pki.ca))
            except em.ConnectionLost as error:
                outcome.append((str(error), time.monotonic() - start))
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        silent, _ = listener.accept()
        try:
            thread.join(30)
            assert outcome and outcome[0][1] < PROMPT, outcome
            assert outcome[0][0].endswith(f"s://127.0.0.1:{port}: timed out during the TLS handshake")
        finally:
            silent.close()


def test_a_stalled_handshake_does_not_hold_up_other_clients(tls_peer, pki):
    host, port = tls_peer.address.rsplit(":", 1)
    stalled = [socket.create_connection((host, int(port))) for _ in range(3)]
    try:
        for s in stalled[1:]:
            s.sendall(b"\x16\x03\x01")  # the start of a TLS record, then nothing
        done = threading.Event()
        result = []

        def client():
            d = em.device(f"embers://localhost:{port}/1", tls_ca=pki.ca)  # index 1 does not exist: a full handshake
            start = time.monotonic()
            try:
                em.ones(1, device=d)
            except em.DeviceError:
                result.append(time.monotonic() - start)
            done.set()

        threading.Thread(target=client, daemon=True).start()
        assert done.wait(30) and result and result[0] < PROMPT
    finally:
        for s in stalled:
            s.close()


# --- serving rules ---------------------------------------------------------------------------------

def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.cli", "serve", *args], capture_output=True, text=True, timeout=60)


def test_a_certificate_needs_its_key(pki, tmp_path):
    port = free_port()
    for args in (("--tls-cert", pki.local.cert), ("--tls-key", pki.local.key)):
        result = _serve("--listen", f"127.0.0.1:{port}", *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert "TLS needs a certificate and its private key: pass both --tls-cert FILE and --tls-key FILE" in result.stderr
    result = _serve("--listen", f"127.0.0.1:{port}", "--tls-cert", pki.local.cert, "--tls-key", str(tmp_path / "none.key"))
    assert result.returncode == 2 and "cannot load the TLS certificate" in result.stderr
    with pytest.raises(em.ArgumentError, match="--tls-key FILE"):
        em.Server("numpy", f"127.0.0.1:{port}", tls_cert=pki.local.cert)
    assert nothing_listens(port)


def test_a_non_loopback_address_needs_tls_and_a_token(pki, tmp_path):
    """Checked before binding: these servers are constructed, never started."""
    tls = {"tls_cert": pki.local.cert, "tls_key": pki.local.key}
    for keywords, missing in (({}, "TLS or a token"), ({"token": "t"}, "TLS"), (tls, "a token")):
        with pytest.raises(em.ArgumentError, match=f"refusing to listen on 0.0.0.0:0 without {missing}: "):
            em.Server("numpy", "0.0.0.0:0", **keywords)
    em.Server("numpy", "0.0.0.0:0", token="t", **tls)
    em.Server("numpy", "0.0.0.0:0", insecure=True)
    em.Server("numpy", "127.0.0.1:0")  # loopback needs neither

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    port = free_port()
    for args, advice in ((("--token-file", str(token_file)), "pass --tls-cert FILE --tls-key FILE"),
                         (pki.local.serve_args(), "pass --token-file FILE"),
                         ((), "--tls-cert FILE --tls-key FILE (tls_cert=, tls_key=) and --token-file FILE")):
        result = _serve("--listen", f"0.0.0.0:{port}", *args)
        assert result.returncode == 2 and advice in result.stderr and "or --insecure" in result.stderr
        assert "Traceback" not in result.stderr
    assert nothing_listens(port)
