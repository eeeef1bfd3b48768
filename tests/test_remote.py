"""Compute peers: a real ``ember serve`` process on 127.0.0.1, over TCP and WebSocket."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from ember.benchmarks.core import chain

import ember as em
from ember.remote import protocol as wire

from .conftest import REMOTE_SCHEMES
from .peers import Peer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nothing_listens(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(params=REMOTE_SCHEMES)
def remote(request, peer):
    return em.device(peer.url(request.param))


def test_a_chain_and_one_read_cost_one_round_trip(remote):
    host = np.linspace(0, 1, 1000, dtype=np.float32)
    x = em.asarray(host, device=remote)
    em.sync(remote)
    before = em.stats(remote)
    y = chain(em, x, 1000)
    assert y.shape == (1000,) and y.dtype == em.float32 and y.device == remote   # known without the peer
    assert em.stats(remote)["round_trips"] == before["round_trips"]
    result = em.asnumpy(y)
    after = em.stats(remote)
    assert after["round_trips"] - before["round_trips"] == 1
    assert after["ops"] - before["ops"] == 1000
    assert after["bytes_up"] > before["bytes_up"] and after["bytes_down"] - before["bytes_down"] >= 4000
    np.testing.assert_allclose(result, chain(np, host, 1000), rtol=1e-6)


def test_reads_of_every_kind(remote):
    x = em.asarray([[1.5, -2.0], [3.0, 4.0]], device=remote)
    assert float(x[0, 0]) == 1.5 and int(em.asarray(3, device=remote)) == 3 and bool(x[1, 1] > 0)
    np.testing.assert_array_equal(np.asarray(x), [[1.5, -2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(np.from_dlpack(x), [[1.5, -2.0], [3.0, 4.0]])
    local = x.to_device("numpy")
    assert local.device == em.device("numpy") and float(em.sum(local)) == 6.5
    assert em.asarray(local, device=remote).device == remote
    np.testing.assert_array_equal(em.asnumpy(x[x > 0]), [1.5, 3.0, 4.0])  # a data-dependent shape
    assert em.nonzero(x > 2)[0].shape == (2,)
    values, counts = em.unique_counts(em.asarray([3, 1, 3, 3], device=remote))
    np.testing.assert_array_equal(em.asnumpy(counts), [1, 3])


def test_peer_side_failure_surfaces_at_the_read_and_the_session_continues(remote):
    good = em.asarray([1.0, 2.0], device=remote)
    bad = em.linalg.inv(em.zeros((2, 2), device=remote))   # fails on the peer, fire-and-forget
    downstream = bad @ bad + 1                               # inherits the failure
    with pytest.raises(em.ExecutionError, match=r"^inv: Singular matrix"):
        em.asnumpy(downstream)
    with pytest.raises(RuntimeError, match="inv"):
        em.sync(remote)
    np.testing.assert_array_equal(em.asnumpy(good * 2), [2.0, 4.0])  # the session and other tensors live on
    em.sync(remote)  # the failure was reported once; the next sync is clean


def test_dropped_arrays_are_freed_on_the_peer(remote):
    engine = remote.engine
    base = engine.peer_stats()["session_tensors"]
    arrays = [em.ones(10, device=remote) for _ in range(20)]
    assert engine.peer_stats()["session_tensors"] == base + 20
    del arrays
    assert engine.peer_stats()["session_tensors"] == base


def test_threads_share_a_remote_device(remote):
    errors = []

    def work(k):
        try:
            x = em.full((100,), float(k), device=remote)
            for _ in range(50):
                x = x + 1
            assert float(em.sum(x)) == 100 * (k + 50)
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


def test_works_inside_a_running_event_loop(remote):
    async def notebook_cell():
        x = em.arange(10, device=remote)
        return float(em.mean(x * 2))

    assert asyncio.run(notebook_cell()) == 9.0


def test_upload_and_download_large_tensors(remote):
    host = np.random.default_rng(0).random((512, 1024), dtype=np.float32)  # 2 MiB: sent straight from memory
    x = em.asarray(host, device=remote)
    host[0, 0] = -1.0  # changing the caller's array afterwards changes nothing remotely
    back = em.asnumpy(x)
    assert back[0, 0] != -1.0
    np.testing.assert_array_equal(back[1:], host[1:])


# --- serving rules -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ("capture", "cannot host a remote server on a capture device"),
    ("ember://127.0.0.1:9/0", "cannot host a remote server on a remote device"),
])
def test_hosting_is_validated_before_binding(spec, message):
    port = free_port()
    with pytest.raises(em.HostDeviceError, match=message):
        em.Server(spec, f"127.0.0.1:{port}")
    with pytest.raises(em.HostDeviceError, match=message):
        em.serve(spec, listen=f"127.0.0.1:{port}")
    result = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--device", spec, "--listen", f"127.0.0.1:{port}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert ("host the underlying backend instead" in result.stderr) or ("run `ember serve` on the machine" in result.stderr)
    assert nothing_listens(port)


def test_autodiff_wrappers_are_stripped_before_hosting():
    from ember.remote.server import hosted_devices
    assert [str(d) for d in hosted_devices(em.autodiff("numpy"))] == ["numpy"]
    server = em.Server(em.autodiff("numpy"), "127.0.0.1:0").start()
    try:
        assert float(em.sum(em.ones(3, device=em.device(f"ember://{server.address}/0")))) == 3.0
    finally:
        server.stop()


def test_non_loopback_needs_a_token():
    with pytest.raises(em.ArgumentError, match="without a token"):
        em.Server("numpy", "0.0.0.0:0")
    em.Server("numpy", "0.0.0.0:0", insecure=True)  # validated only: never started in tests
    em.Server("numpy", "0.0.0.0:0", token="t")
    result = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--listen", "0.0.0.0:0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--insecure" in result.stderr


def test_index_refusal(peer):
    with pytest.raises(em.DeviceError, match=r"hosts 1 device\(s\) \(numpy\); index 3 does not exist"):
        em.ones(1, device=em.device(peer.url(index=3)))
    listed = subprocess.run([sys.executable, "-m", "ember.cli", "devices", f"ember://{peer.address}"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and f"ember://{peer.address}/0" in listed.stdout and "numpy" in listed.stdout


@pytest.mark.parametrize("scheme", REMOTE_SCHEMES)
def test_token_refusal(tmp_path, scheme, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with Peer("--token-file", str(token_file)) as guarded:
        with pytest.raises(em.AccessDenied, match="bad or missing token"):
            em.ones(1, device=em.device(guarded.url(scheme)))
        with pytest.raises(PermissionError):
            em.ones(1, device=em.device(guarded.url(scheme, token="wrong")))
        x = em.ones(2, device=em.device(guarded.url(scheme, token="s3cret")))
        assert float(em.sum(x)) == 2.0
        monkeypatch.setenv("EMBER_TOKEN", "s3cret")
        y = em.ones(3, device=em.device(f"{scheme}://localhost:{guarded.address.split(':')[1]}/0"))
        assert float(em.sum(y)) == 3.0


# --- failures of the peer, the client and the wire -------------------------------------------------

@pytest.mark.parametrize("scheme", REMOTE_SCHEMES)
def test_peer_killed_mid_stream_raises_connection_lost(scheme):
    with Peer() as doomed:
        device = em.device(doomed.url(scheme))
        x = em.ones(1000, device=device)
        float(em.sum(x))
        y = x * 2  # pending, not yet sent
        doomed.kill()
        start = time.monotonic()
        with pytest.raises(em.ConnectionLost):
            em.asnumpy(y)
        with pytest.raises(ConnectionError):
            em.asnumpy(x + 1)  # later calls fail too
        with pytest.raises(em.ConnectionLost):
            em.ones(3, device=device)  # a new session cannot be opened either
        assert time.monotonic() - start < 10


CLIENT = textwrap.dedent("""
    import sys, ember as em
    d = em.device(sys.argv[1])
    keep = [em.ones((100, 100), device=d) * k for k in range(50)]
    em.sync(d)
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_client_killed_mid_stream_frees_its_tensors(peer):
    observer = em.device(peer.url("ws"))
    base = observer.engine.peer_stats()["live_tensors"]
    client = subprocess.Popen([sys.executable, "-c", CLIENT, peer.url()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert client.stdout.readline().strip() == "ready"
        assert observer.engine.peer_stats()["live_tensors"] >= base + 50
        client.kill()
        client.wait(10)
        deadline = time.monotonic() + 10
        while observer.engine.peer_stats()["live_tensors"] != base and time.monotonic() < deadline:
            time.sleep(0.05)
        assert observer.engine.peer_stats()["live_tensors"] == base
    finally:
        client.kill()
        client.wait(10)
        client.stdout.close()
        client.stdin.close()


CHAIN_CLIENT = textwrap.dedent("""
    import sys, numpy as np, ember as em
    d = em.device(sys.argv[1])
    k = int(sys.argv[2])
    host = np.linspace(0, 1, 1000) + k
    x = em.asarray(host, device=d)
    for _ in range(250):
        x = x * 1.0001; x = x + 0.5; x = em.sin(x); x = x - 0.25
        host = host * 1.0001; host = host + 0.5; host = np.sin(host); host = host - 0.25
    assert np.allclose(em.asnumpy(x), host, rtol=0, atol=1e-12), "wrong result"
    assert em.stats(d)["round_trips"] == 1, em.stats(d)
    print("ok", k)
""")


def test_sixteen_concurrent_clients(peer):
    clients = [subprocess.Popen([sys.executable, "-c", CHAIN_CLIENT, peer.url(("ember", "ws")[k % 2]), str(k)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(16)]
    results = []
    for client in clients:
        out, err = client.communicate(timeout=300)
        results.append((client.returncode, out.strip(), err[-500:]))
    assert all(code == 0 and out == f"ok {k}" for k, (code, out, _) in enumerate(results)), results


def _raw_session(address: str):
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_by_peer(sock) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    return data


def test_malformed_and_oversized_frames_are_refused_while_others_work(peer):
    good = em.device(peer.url())
    x = em.arange(5, device=good)
    attacks = [
        b"GARBAGE!" * 4,                                                           # not an ember peer
        wire.MAGIC + (2**31).to_bytes(4, "little") + (0).to_bytes(8, "little"),    # a 2 GiB header
        wire.MAGIC + (4).to_bytes(4, "little") + (2**62).to_bytes(8, "little"),    # an absurd payload
        b"".join(wire.encode_frame({"t": "init", "v": 1}))[:-1] + b"\xc1",          # malformed msgpack
        b"".join(wire.encode_frame({"t": "init", "v": 1, "device": 0, "token": None}))
        + b"".join(wire.encode_frame({"t": "batch", "m": (("op", "matmul", (1, 2), (3,), {}),),
                                      "seg": (("float64", (2**40,)),)})),          # an oversized tensor
        b"".join(wire.encode_frame({"t": "init", "v": 1, "device": 0, "token": None}))
        + b"".join(wire.encode_frame({"t": "batch", "m": (("op",),)})),             # a malformed message
        b"".join(wire.encode_frame({"t": "init", "v": 99, "device": 0, "token": None})),  # a future version
    ]
    for attack in attacks:
        with _raw_session(peer.address) as sock:
            sock.sendall(attack)
            reply = _closed_by_peer(sock)  # the peer answers (error or refusal) and closes; it never hangs
            assert b"refuse" in reply or b"error" in reply or reply == b""
        assert float(em.sum(x)) == 10.0  # the other session keeps working throughout
    assert peer.process.poll() is None


def test_a_bad_op_from_a_raw_client_poisons_only_its_outputs(peer):
    frames = wire.FrameReader()
    with _raw_session(peer.address) as sock:
        def exchange(header, segments=()):
            sock.sendall(b"".join(bytes(b) for b in wire.encode_frame(header, list(segments))))
            while True:
                got = frames.feed(sock.recv(65536))
                if got:
                    return got[0]
        info = exchange({"t": "init", "v": wire.VERSION, "device": 0, "token": None})
        assert info.header["t"] == "info" and info.header["backend"] == "numpy"
        reply = exchange({"t": "batch", "m": (
            ("put", 1, 0),
            ("op", "no_such_op", (1,), (2,), {}),
            ("op", "full", (), (3,), {"shape": (10**12,), "fill_value": 1.0}),  # beyond the tensor limit
            ("op", "negative", (1,), (4,), {}),
            ("get", 7, 2), ("get", 8, 3), ("get", 9, 4),
        )}, [np.arange(3.0)])
        kinds = [(m[0], m[1]) for m in reply.header["m"]]
        assert kinds == [("error", 7), ("error", 8), ("data", 9)]
        assert "unknown op" in reply.header["m"][0][3] and "exceeds the peer's tensor limit" in reply.header["m"][1][3]
        np.testing.assert_array_equal(reply.segments[0], [-0.0, -1.0, -2.0])


def test_protocol_reader_on_byte_fixtures():
    header = {"t": "batch", "m": (("op", "add", (1, (2.5, "float32")), (3,), {"k": em.int8, "z": 1j}),)}
    data = b"".join(bytes(b) for b in wire.encode_frame(header, [np.arange(4, dtype=np.int16)]))
    reader = wire.FrameReader()
    frames = []
    for i in range(len(data)):  # byte by byte: the reader never needs whole frames
        frames += reader.feed(data[i:i + 1])
    (frame,) = frames
    assert frame.header["m"][0][2] == (1, (2.5, "float32"))
    assert frame.header["m"][0][4] == {"k": em.int8, "z": 1j}
    np.testing.assert_array_equal(frame.segments[0], [0, 1, 2, 3])
    with pytest.raises(em.ProtocolError, match="exceeds the limit"):
        wire.FrameReader(wire.Limits(max_tensor_bytes=4)).feed(data)
    with pytest.raises(em.ProtocolError, match="unknown msgpack extension"):
        wire.unpack(b"\xd4\x63\x00")


def test_buffer_pool_reuses_only_unshared_buffers():
    from ember.remote.server import BufferPool
    pool = BufferPool(minimum=1024)
    a = pool.allocate((64, 64), np.dtype(np.float32))
    address = a.__array_interface__["data"][0]
    view = a.reshape(-1)
    pool.release(a)                      # a view still shares the memory: kept out of the pool
    assert pool.total == 0
    del view
    pool.release(a)
    assert pool.total == 64 * 64 * 4
    del a
    b = pool.allocate((32, 128), np.dtype(np.float32))   # same size: the buffer comes back
    assert b.__array_interface__["data"][0] == address and pool.total == 0
    small = pool.allocate((4,), np.dtype(np.float64))
    pool.release(small)
    assert pool.total == 0               # small tensors are not worth keeping
