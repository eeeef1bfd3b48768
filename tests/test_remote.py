"""Compute peers: a real ``ember serve`` process on 127.0.0.1, over TCP and WebSocket."""

from __future__ import annotations

import asyncio
import math
import os
import re
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from ember.benchmarks.core import chain

import ember as em
from ember import devices
from ember.devices import RemoteDevice
from ember.engines.remote import connect
from ember.remote.memory import TENSOR_OVERHEAD
from ember.remote.server import PEER_LIMITS
from ember.wire import client as wire_client
from ember.wire import protocol as wire
from ember.wire import tcp, websocket

from .conftest import REMOTE_SCHEMES, too_large
from .peers import Peer
from .traffic import register_message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nothing_listens(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


def messages_sent(engine, action) -> list:
    """The messages of the frames ``engine`` sends while ``action()`` runs (as the engine hands them to
    its connection, before a WebSocket wraps them)."""
    sent, original = [], engine.connection.send
    engine.connection.send = lambda buffers: sent.append(b"".join(map(bytes, buffers))) or original(buffers)
    try:
        action()
    finally:
        engine.connection.send = original
    reader = wire.FrameReader(wire.Limits())
    return [m for frame in sent for decoded in reader.feed(frame) for m in decoded.header["m"]]


@pytest.fixture(params=REMOTE_SCHEMES)
def remote(request, peer):
    return em.device(peer.url(request.param))


def test_tensors_larger_than_a_receive_arrive_whole_and_small_frames_follow_them(remote):
    """A WebSocket connection reads into a buffer of its own, 256 KiB at a time: a tensor of many
    such reads, in a message of several fragments, comes back whole, and so do the small frames
    after it, on either transport."""
    from ember.wire import websocket
    host = np.random.default_rng(1).random(3 * websocket._FRAGMENT // 8 + 12_345)  # float64: 3 fragments and a part
    assert host.nbytes > 8 * websocket._CHUNK
    x = em.asarray(host, device=remote)
    np.testing.assert_array_equal(em.asnumpy(x * 2.0), host * 2.0)
    for k in range(3):
        assert float(em.asnumpy(x[k] + 1.0)) == host[k] + 1.0


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


def test_a_loop_sends_the_same_runs_of_ops_and_the_peer_replays_them_compiled(remote, monkeypatch):
    # batches end by their count alone: a batch older than BATCH_SECONDS (2 ms, a slow moment of a loaded machine)
    # would go early and start the runs after it at another op
    monkeypatch.setattr(wire_client, "BATCH_SECONDS", 60.0)
    host = np.linspace(0, 1, 1000, dtype=np.float32)
    x = em.asarray(host, device=remote)
    engine = remote.engine
    before = engine.peer_stats()["session_runs_replayed"]

    def loop():
        for _ in range(3):  # 16 runs of 64 ops each time (a batch is 64 ops), the first a run of 64 as well
            np.testing.assert_allclose(em.asnumpy(chain(em, x, 1000)), chain(np, host, 1000), rtol=1e-6)
    messages = messages_sent(engine, loop)
    stats = engine.peer_stats()
    assert stats["session_runs_replayed"] - before >= 15  # the third time: all of them
    assert stats["session_tensors"] == 1  # x: the chains' intermediates were let go, and never stored
    runs = [m for m in messages if m[0] == "ops"]
    assert len(runs) >= 48 and len({m[3] for m in runs}) <= 2  # the same bytes, at other ids
    assert len({m[1] for m in runs}) == len(runs)
    records, let_go = wire.unpack(runs[0][3])
    assert len(records) == 64 and let_go == tuple(range(62))  # the last two were still held when it was sent


def test_runs_that_differ_only_in_the_sign_of_a_zero_are_sent_each_as_it_is(remote):
    host = np.linspace(0.5, 1, 8)
    x = em.asarray(host, device=remote)
    for _ in range(3):  # equal runs reuse their bytes: these compare equal (-0.0 == 0.0) and must not
        for zero in (0.0, -0.0):
            y = x * zero
            for _ in range(3):
                y = y + zero
            np.testing.assert_array_equal(np.signbit(em.asnumpy(y)), np.signbit(host * zero + zero + zero + zero))
            filled = em.full((4,), zero, dtype=em.float64, device=remote)  # the zero in an attribute
            np.testing.assert_array_equal(np.signbit(em.asnumpy(filled)), np.signbit(np.full(4, zero)))


def test_equal_runs_reuse_their_bytes_only_when_they_let_the_same_outputs_go(remote):
    host = np.linspace(0.5, 1, 8)
    x = em.asarray(host, device=remote)
    for _ in range(3):
        y = x * 2
        z = y + 1
        del y  # let go in the run
        np.testing.assert_array_equal(em.asnumpy(z), host * 2 + 1)
        y = x * 2
        z = y + 1  # the same records, y kept
        np.testing.assert_array_equal(em.asnumpy(z), host * 2 + 1)
        np.testing.assert_array_equal(em.asnumpy(y), host * 2)


def test_an_output_a_later_message_reads_is_dropped_after_it_not_let_go_in_its_run(remote):
    host = np.linspace(0.5, 1, 8)
    x = em.asarray(host, device=remote)
    jitted = em.jit(lambda v: v * 2)  # a registered graph: its run message follows the run that made its input
    for _ in range(3):
        a = x + 1
        out = jitted(a)
        del a
        np.testing.assert_array_equal(em.asnumpy(out), (host + 1) * 2)
    assert remote.engine.peer_stats()["session_tensors"] == 2  # x and out


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
    # data-dependent outputs (their shapes asked of the peer) have the metas the local device gives them
    local_x = x.to_device("numpy")
    for function in (lambda a: (a[a > 0],), lambda a: em.nonzero(a > 2), em.unique_counts):
        for here, there in zip(function(local_x), function(x), strict=True):
            assert (there.shape, there.dtype) == (here.shape, here.dtype) and there.device == remote


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


def test_a_chain_of_large_arrays_holds_on_the_peer_what_it_holds_locally():
    """Arrays the program drops within a batch are freed within it: a 100-op chain on 1,000,000 float32 (4 MB
    each, 64 ops a batch) fits a session quota of 24 MiB, where holding a batch's intermediates would take 256 MB;
    afterwards the peer holds the input and the result."""
    with Peer("--max-session-bytes", str(24 << 20)) as running:
        remote = em.device(running.url())
        host = np.random.default_rng(0).random(1_000_000, dtype=np.float32)
        x = em.asarray(host, device=remote)
        out = chain(em, x, 100)
        np.testing.assert_array_equal(em.asnumpy(out), em.asnumpy(chain(em, em.asarray(host), 100)))
        stats = remote.engine.peer_stats()
        assert (stats["session_tensors"], stats["session_bytes"]) == (2, 2 * (host.nbytes + TENSOR_OVERHEAD))


def test_jitted_calls_nothing_reads_let_their_dropped_outputs_go_within_the_batch(monkeypatch):
    """A loop of jitted calls on 1,000,000 float32 (an output of 4 MB each, the last one dropped at
    each call) in one batch fits a session quota of 24 MiB: once the batch's runs have made
    DROP_BYTES, the drops go ahead of the next run, where holding them to the batch's end would
    take 160 MB."""
    monkeypatch.setattr(wire_client, "BATCH_SECONDS", 60.0)  # the forty calls wait for the read
    with Peer("--max-session-bytes", str(24 << 20)) as running:
        remote = em.device(running.url())
        host = np.random.default_rng(0).random(1_000_000, dtype=np.float32)
        x = em.asarray(host, device=remote)
        step = em.jit(lambda a: a * 2.0 + 1.0)
        em.sync(remote)
        batches = em.stats(remote)["batches"]
        for _ in range(40):
            y = step(x)
        np.testing.assert_array_equal(em.asnumpy(y), host * np.float32(2) + np.float32(1))
        # one message registers the graph, then each call a run and the drop of the output before it, and the read
        assert em.stats(remote)["batches"] - batches == math.ceil((1 + 40 + 39 + 1) / wire_client.BATCH_OPS)
        stats = remote.engine.peer_stats()
        assert (stats["session_tensors"], stats["session_bytes"]) == (2, 2 * (host.nbytes + TENSOR_OVERHEAD))


@pytest.mark.parametrize("made", [wire_client.DROP_BYTES, wire_client.DROP_BYTES // 2], ids=["drop-bytes", "half"])
@pytest.mark.parametrize("kind", ["op", "run"])
def test_messages_nothing_reads_let_their_dropped_outputs_go_once_the_ops_made_drop_bytes(monkeypatch, kind, made):
    """Ops sent as messages of their own (here ``unstack``, two outputs) and runs of a registered graph
    count the bytes they make: once those since the last drops reach DROP_BYTES, the drops go ahead of
    the next message. Forty calls whose outputs are dropped at the next call but one fit a session
    quota of 8 MiB, where holding them to the read would take 40 × ``made``; the frames say when the
    drops went: at every call from the third when each makes DROP_BYTES, at every other one when
    each makes half."""
    monkeypatch.setattr(wire_client, "BATCH_SECONDS", 60.0)  # one batch: a batch's end queues the drops too
    monkeypatch.setattr(wire_client, "BATCH_OPS", 1000)
    with Peer("--max-session-bytes", str(8 << 20)) as running:
        remote = em.device(running.url())
        host = np.random.default_rng(0).random((2, made // 8), dtype=np.float32)  # made bytes
        x = em.asarray(host, device=remote)
        step, outputs = (em.unstack, 2) if kind == "op" else (em.jit(lambda a: a * 2.0), 1)
        step(x)  # once before: for the jitted step, its graph's registration
        em.sync(remote)

        def loop():
            for _ in range(40):
                out = step(x)
            np.testing.assert_array_equal(em.asnumpy(out[1]), host[1] * (1.0 if kind == "op" else 2.0))
        messages = messages_sent(remote.engine, loop)
        drops = [m for m in messages if m[0] == "drop"]
        # call k finds call k - 2's outputs dropped (``out`` holds call k - 1's); the read finds the 39th's
        assert len(drops) == (38 if made == wire_client.DROP_BYTES else 19) + 1
        assert sorted(i for m in drops for i in m[1]) == [h for m in messages if m[0] == kind for h in m[3]][:-outputs]
        stats = remote.engine.peer_stats()
        assert (stats["session_tensors"], stats["session_bytes"]) == (1, host.nbytes + TENSOR_OVERHEAD)  # x


def test_a_graph_let_go_is_forgotten_by_the_peer_and_each_graph_registers_once(remote):
    """Each jitted function's graph registers once a session; once the program lets the function (and
    so its graph) go, the next batch tells the peer to forget it."""
    import gc
    x = em.asarray(np.arange(3.0), device=remote)
    engine = remote.engine
    gc.collect()  # graphs of the tests before, with this session
    registered, before = engine.stats()["graphs_registered"], engine.peer_stats()["session_graphs"]
    double, halve = em.jit(lambda a: a * 2.0), em.jit(lambda a: a / 2.0)
    for _ in range(2):
        np.testing.assert_array_equal(em.asnumpy(double(x) + halve(x)), np.arange(3.0) * 2.5)
    assert engine.stats()["graphs_registered"] - registered == 2
    assert engine.peer_stats()["session_graphs"] - before == 2
    del double
    gc.collect()
    assert engine.peer_stats()["session_graphs"] - before == 1
    np.testing.assert_array_equal(em.asnumpy(halve(x)), np.arange(3.0) / 2.0)


def test_a_jitted_chain_of_large_arrays_on_a_peer_gives_eager_values_exactly():
    """A registered graph runs through the peer's compiled plan, which splits the chain's 99 in-place steps on 1M
    float32 across two threads (EMBER_NUM_THREADS): bit for bit what eager execution gives, call after call, in
    the 24 MiB quota eager execution needs (a run reserves the op path's peak, 8 MB, not its 400 MB of arrays)."""
    with Peer("--max-session-bytes", str(24 << 20), env={"EMBER_NUM_THREADS": "2"}) as running:
        remote = em.device(running.url())
        host = np.random.default_rng(0).random(1_000_000, dtype=np.float32)
        jitted = em.jit(lambda x: chain(em, x, 100))
        expected = em.asnumpy(chain(em, em.asarray(host), 100))
        x = em.asarray(host, device=remote)
        for _ in range(2):  # registered, then run by reference
            np.testing.assert_array_equal(em.asnumpy(jitted(x)), expected)
        assert remote.engine.stats()["graph_runs"] == 2 and remote.engine.stats()["graphs_registered"] == 1


def _page_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt: pages the process touched afresh


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and tunes glibc's malloc")
def test_a_peer_keeps_freed_memory_for_the_next_arrays_instead_of_faulting_it_in_again():
    """Was: a session's thread's malloc arena gave the free top of its heap back to the kernel and faulted it in
    again, page by page, when the next arrays came: 2,700 faults a round here; in ember bench remote, 5,766 a
    100-op chain on 1M float32, 1.5× its time. A fresh peer: thresholds from no history of its own."""
    with Peer() as running:
        remote = em.device(running.url())
        x = em.zeros(25_000, dtype=em.float32, device=remote)
        faults = []
        for _ in range(4):
            before = _page_faults(running.pid)
            held = [x + i for i in range(400)]  # 40 MB in arrays of 100 kB, held on the peer …
            em.sync(remote)
            del held
            em.sync(remote)  # … and freed together
            faults.append(_page_faults(running.pid) - before)
        print(f"\nFIGURE page faults of a peer, four rounds of 40 MB made and freed: {faults}")
        assert faults[0] > 5000  # the first round faults its 40 MB in (4 kB pages): the measure sees them
        assert max(faults[1:]) < 500, faults  # later rounds reuse it


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_a_download_reuses_the_memory_of_one_the_program_dropped_and_never_of_one_it_keeps(remote):
    """Was: each 4 MB read faulted in fresh memory about every other time (945 page faults, up to 1.5 ms of a
    2.5 ms read), as glibc handed the freed array back to the kernel."""
    host = np.arange(1_000_000, dtype=np.float32)
    x = em.asarray(host, device=remote)
    kept = em.asnumpy(x + 1)
    dropped = em.asnumpy(x + 2)
    del dropped
    em.sync(remote)
    taken = np.ones(1_000_000, np.float32)  # would take the memory malloc got back, had the download let it go
    before = _page_faults(os.getpid())
    again = em.asnumpy(x + 3)
    faults = _page_faults(os.getpid()) - before
    np.testing.assert_array_equal(kept, host + 1)  # the kept read was not written over
    np.testing.assert_array_equal(again, host + 3)
    assert taken.sum() == 1_000_000
    if remote.scheme == "ember":  # over WebSocket the websockets library's own buffers of the message fault too
        assert faults < 100, faults  # 4 MB of fresh memory would be ~980


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/environ")
@pytest.mark.parametrize("asked", [None, "28"])
def test_a_spawned_peer_lets_blas_threads_sleep_unless_its_caller_says_otherwise(asked, monkeypatch):
    """A peer spawned beside its client shares its CPUs: OpenBLAS's workers polling ~0.1 s after each call
    took them (a data-parallel step on 2 local peers: 37-41 ms, against 10-12 ms with the timeout)."""
    if asked is None:
        monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", asked)
    with Peer() as running:
        with open(f"/proc/{running.pid}/environ", "rb") as f:
            environment = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    assert environment[b"OPENBLAS_THREAD_TIMEOUT"] == (asked or "4").encode()


def test_a_jitted_chain_on_a_peer_equals_local_eager_execution(remote):
    """A registered graph is compiled like a local one (values let go after their last use, the chain run in one
    buffer, literals converted once): its results are local eager NumPy's, bit for bit."""
    host = np.random.default_rng(1).random(10_000, dtype=np.float32)
    jitted = em.jit(lambda x: chain(em, x, 100) * 2 - 1)
    expected = em.asnumpy(chain(em, em.asarray(host), 100) * 2 - 1)
    for _ in range(2):
        np.testing.assert_array_equal(em.asnumpy(jitted(em.asarray(host, device=remote))), expected)


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
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors


def test_ops_logged_out_of_their_ids_order_by_threads_compute_and_let_go_right(remote):
    """Ops are logged without a lock: between one thread's taking an id and logging its op, another thread may
    log an op of a later id. Here that other thread's op runs inside the id counter, deterministically; the runs
    it makes are tests/test_client_protocol.py's, what the peer computes of them this test's."""
    host = np.arange(4.0, dtype=np.float32)
    x = em.asarray(host, device=remote)
    engine = remote.engine
    counter, interleaved = engine._ids, []

    class Ids:  # the counter, with another thread's op logged right after the k-th id is taken
        def __init__(self, k, op):
            self.calls, self.k, self.op = 0, k, op

        def __next__(self):
            tid = next(counter)
            self.calls += 1
            if self.calls == self.k:
                interleaved.append(self.op())
            return tid

    em.sync(remote)
    engine._ids = Ids(2, lambda: x * 3)
    a = x + 1
    b = a * 2  # logged after x * 3, whose id is later: the run's outputs are out of order
    c = b - x
    engine._ids = counter
    del a, b  # let go in the run: the outputs are found one by one
    np.testing.assert_array_equal(em.asnumpy(c), (host + 1) * 2 - host)
    np.testing.assert_array_equal(em.asnumpy(interleaved.pop()), host * 3)
    assert engine.peer_stats()["session_tensors"] == 2  # x and c

    engine._ids = Ids(1, lambda: x * 5)
    d = x - 1  # its id is taken first, x * 5 logged first: d's op starts a run of its own
    engine._ids = counter
    e = d + interleaved[0]
    np.testing.assert_array_equal(em.asnumpy(e), host - 1 + host * 5)


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
    from ember.remote.host import hosted_devices
    assert [str(d) for d in hosted_devices(em.autodiff("numpy"))] == ["numpy"]
    server = em.Server(em.autodiff("numpy"), "127.0.0.1:0").start()
    try:
        assert float(em.sum(em.ones(3, device=em.device(f"ember://{server.address}/0")))) == 3.0
    finally:
        server.stop()


def test_arrays_of_two_sessions_with_one_peer_mix_only_once_moved(peer):
    """Two device strings for one peer that differ only in their token are equal devices with a
    session each: an op mixing their arrays is refused, saying so and naming the move that mends it
    (to the Device object: a device string omits the token), and both sessions go on."""
    mine, theirs = em.device(peer.url()), em.device(peer.url(token="another-token-0123456789"))
    x, y = em.asarray(np.ones(3), device=mine), em.asarray(np.full(3, 2.0), device=theirs)
    assert mine == theirs and mine.engine is not theirs.engine
    for name, mixing in (("add", lambda: x + y), ("getitem", lambda: x[y > 0])):  # an op of one output, or of a shape asked
        with pytest.raises(em.DeviceError, match=re.escape(
                f"{name}: an input lives in another session with {mine}, opened with another token; move it into this "
                f"one with x.to_device(device), passing the Device its other inputs are on (a device string omits the token)")):
            mixing()
    np.testing.assert_array_equal(em.asnumpy(x + y.to_device(mine)), [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(em.asnumpy(y * 2.0), [4.0, 4.0, 4.0])


def test_index_refusal(peer):
    with pytest.raises(em.DeviceError, match=r"hosts 1 device\(s\) \(numpy\); index 3 does not exist"):
        em.ones(1, device=em.device(peer.url(index=3)))
    listed = subprocess.run([sys.executable, "-m", "ember.cli", "devices", f"ember://{peer.address}"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and f"ember://{peer.address}/0" in listed.stdout and "numpy" in listed.stdout


TOKEN = "s3cret-0123456789ab"  # ember serve takes tokens of 16 characters and more


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A peer that requires TOKEN."""
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    with Peer("--token-file", str(token_file)) as running:
        yield running


@pytest.mark.parametrize("token", [TOKEN[:-1], "s", "", TOKEN.upper(), TOKEN.capitalize(), TOKEN + "!", TOKEN + " ", None, 123,
                                   True, TOKEN.encode(), (TOKEN,), {"token": TOKEN}], ids=repr)
@pytest.mark.parametrize("scheme", REMOTE_SCHEMES)
def test_only_the_exact_token_opens_a_session(guarded, scheme, token, monkeypatch):
    monkeypatch.setattr("ember.engines.dialing.DEFAULT_TIMEOUT", 5.0)  # a peer that never answers fails, and soon
    host, port = guarded.address.rsplit(":", 1)
    kept = em.ones(3, device=em.device(guarded.url(scheme, token=TOKEN)))  # a session open across the refusals
    start = time.monotonic()
    with pytest.raises(em.AccessDenied, match="refused the session: bad or missing token"):
        connect(RemoteDevice(scheme, host, int(port), 0, token))
    assert time.monotonic() - start < 2
    assert float(em.sum(kept)) == 3.0  # the peer serves its other clients on
    connect(RemoteDevice(scheme, host, int(port), 0, TOKEN)).close()  # and opens sessions for the exact token


@pytest.mark.parametrize("scheme", REMOTE_SCHEMES)
def test_the_token_comes_from_the_device_string_or_the_environment(guarded, scheme, monkeypatch):
    monkeypatch.delenv("EMBER_TOKEN", raising=False)
    # a process keeps each device string's device, with the token the environment held when it was first
    # parsed: one an earlier test left for this port (ports are reused) would carry that test's token
    monkeypatch.delitem(devices._DEVICES, guarded.url(scheme), raising=False)
    with pytest.raises(em.AccessDenied, match="bad or missing token"):
        em.ones(1, device=em.device(guarded.url(scheme)))
    with pytest.raises(PermissionError):
        em.ones(1, device=em.device(guarded.url(scheme, token="wrong")))
    assert float(em.sum(em.ones(2, device=em.device(guarded.url(scheme, token=TOKEN))))) == 2.0
    monkeypatch.setenv("EMBER_TOKEN", TOKEN)
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


@pytest.mark.parametrize("scheme", REMOTE_SCHEMES)
@pytest.mark.parametrize("end", ["stop", "kill"])
def test_a_peer_restarted_at_the_same_address_is_met_with_a_new_session(scheme, end):
    """A cached device whose peer ended and whose address another peer took: the first use after that
    opens a session with the new peer, checked against its limits, not written into the dead connection."""
    first = Peer()
    try:
        device = em.device(first.url(scheme))
        old = em.asarray(np.ones(1000, np.uint8), device=device)
        assert int(em.sum(old)) == 1000
    finally:
        getattr(first, end)()
    with Peer("--listen", first.address, "--max-tensor-bytes", "100") as second:
        assert em.device(second.url(scheme)) is device  # the same cached device
        with pytest.raises(em.ResourceLimitError, match="upload: a tensor of 1000 bytes exceeds .* limit of 100 bytes"):
            em.asarray(np.zeros(1000, np.uint8), device=device)
        fresh = em.asarray(np.arange(10, dtype=np.uint8), device=device)
        np.testing.assert_array_equal(em.asnumpy(fresh + 1), np.arange(1, 11))
        with pytest.raises(em.ConnectionLost, match=r"^add: an input lives in a lost session with .*; its data is gone "
                                                   r"\(lost the connection to .*: the peer closed the .*; the "
                                                   r"session cannot be resumed: the peer restarted since the session "
                                                   r"began"):
            old + 1
        assert float(em.sum(em.ones(5, device=device))) == 5.0  # the new session lives on


def test_an_op_right_after_a_read_leaves_the_check_for_a_restarted_peer_owed():
    """The device asks a quiet connection whether its peer ended it before the next batch. Was: an op
    made right after a read (too soon to ask) used that question up, and the next use after the peer
    restarted went into the dead connection (a broken pipe, in CI, for a cached device whose peer's
    port a later test's peer took)."""
    first = Peer()
    try:
        device = em.device(first.url())
        assert float(em.sum(em.ones(3, device=device))) == 3.0
        pending = em.ones(2, device=device)  # within QUIET_SECONDS of the read: too soon to ask
    finally:
        first.kill()
    with Peer("--listen", first.address):
        np.testing.assert_array_equal(em.asnumpy(em.asarray(np.arange(3.0), device=device) + 1), [1.0, 2.0, 3.0])
        with pytest.raises(em.ConnectionLost, match="lost"):
            em.asnumpy(pending)  # made in the session that ended with its peer


def test_a_peer_stops_at_once_with_sessions_open():
    with Peer() as stopping:
        devices = [em.device(stopping.url(scheme)) for scheme in REMOTE_SCHEMES]
        assert [float(em.sum(em.ones(2, device=d))) for d in devices] == [2.0, 2.0]
        start = time.monotonic()
        stopping.stop()
        assert stopping.process.returncode == 0 and time.monotonic() - start < 3  # SIGTERM sufficed: no SIGKILL


CLIENT = textwrap.dedent("""
    import sys, ember as em
    d = em.device(sys.argv[1])
    keep = [em.ones((100, 100), device=d) * k for k in range(50)]
    em.sync(d)
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_client_killed_mid_stream_frees_its_tensors_once_its_resume_window_passes():
    with Peer("--resume-window", "1") as peer:
        _killed_client_frees_its_tensors(peer)


def _killed_client_frees_its_tensors(peer):
    observer = em.device(peer.url("ws"))
    base = observer.engine.peer_stats()["live_tensors"]
    client = subprocess.Popen([sys.executable, "-c", CLIENT, peer.url()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert client.stdout.readline().strip() == "ready"
        assert observer.engine.peer_stats()["live_tensors"] >= base + 50
        client.kill()
        client.wait(10)
        time.sleep(0.5)  # parked: kept for its client, within the window
        assert observer.engine.peer_stats()["live_tensors"] >= base + 50
        deadline = time.monotonic() + 10  # the window (1 s) and the peer's check of it (every 2 s)
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


# --- the peer's boundaries: raw bytes over the real transports, every wait bounded -------------------

INIT = {"t": "init", "v": wire.VERSION, "device": 0, "token": None}
LIMIT = 1024  # the tensor limit of small_peer


@pytest.fixture(scope="module")
def small_peer():
    """A peer whose tensor limit is LIMIT bytes."""
    with Peer("--max-tensor-bytes", str(LIMIT)) as running:
        yield running


def _frame(header: dict, segments=()) -> bytes:
    return b"".join(bytes(b) for b in wire.encode_frame(header, list(segments)))


def _prefix(header_bytes: int, payload_bytes: int) -> bytes:
    return struct.pack("<4sIQ", wire.MAGIC, header_bytes, payload_bytes)


def _raw_socket(address: str, timeout: float = 5):
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def _closed_by_peer(sock, data: bytes) -> tuple[bytes, float]:
    """Send ``data``; what the peer answers until it closes the connection, and the seconds that took. A peer that
    keeps the connection open past the socket's timeout fails the test."""
    start = time.monotonic()
    sock.sendall(data)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        pytest.fail(f"the peer neither answered nor closed within {sock.gettimeout()} s of {data[:24]!r}")
    return received, time.monotonic() - start


def _eof(sock) -> bool:
    """Whether the peer has closed ``sock`` (a timeout raises)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


class RawSession:
    """A session driven frame by frame over a real transport (TCP or WebSocket); every wait is bounded."""

    def __init__(self, address: str, scheme: str = "ember", timeout: float = 5):
        host, port = address.rsplit(":", 1)
        self.connection = (websocket if scheme == "ws" else tcp).connect(host, int(port), timeout=timeout)
        self.info = self.send(INIT).header
        assert self.info["t"] == "info", self.info

    def send(self, header: dict, segments=()) -> wire.Frame:
        """Send a frame; the peer's next frame."""
        self.connection.send(wire.encode_frame(header, list(segments)))
        return self.connection.receive()

    def batch(self, *messages, segments=()) -> wire.Frame:
        return self.send({"t": "batch", "m": messages}, segments)

    def refused(self, data: bytes) -> tuple[dict, float]:
        """Send raw ``data``; the peer's answer, once it has also closed the connection, and the seconds that took.
        A peer that refuses at a frame's prefix closes without reading the rest, so sending the rest may fail
        (a broken pipe): its answer is read all the same."""
        start = time.monotonic()
        try:
            self.connection.send([data])
        except em.ConnectionLost:
            pass
        answer = self.connection.receive().header
        with pytest.raises(em.ConnectionLost, match="closed"):  # not "timed out"
            self.connection.receive()
        assert _eof(self.connection.sock)
        return answer, time.monotonic() - start

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc) -> None:
        self.connection.close()


# the fake peers' loopback address, which no real peer of the tests listens on: a port the OS gives again is not the
# address of a session an earlier test left in the device cache (a stale session would dial the fake to resume)
FAKE_HOST = "127.0.0.9"


def _answering_an_init(reply: bytes | None):
    """A fake peer on a fresh port of FAKE_HOST that reads a client's init and answers ``reply``
    (None: nothing), then waits for the client to close; the port, and a list that gets what the
    client sent last (b"": it closed the connection)."""
    listener = socket.create_server((FAKE_HOST, 0))
    ended = []

    def serve():
        with listener:
            sock, _ = listener.accept()
            with sock:
                sock.settimeout(20)
                sock.recv(65536)  # the init
                if reply is not None:
                    sock.sendall(reply)
                try:
                    ended.append(sock.recv(1))
                except OSError:
                    ended.append(None)
    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], ended


@pytest.mark.parametrize("reply, error, message", [
    (struct.pack("<4sIQ", wire.MAGIC, 1 << 20, 0), em.ProtocolError,  # a header of 1 MiB announced
     f"a header of {1 << 20} bytes exceeds the limit of {wire.HANDSHAKE_LIMITS.max_header_bytes}"),
    (wire.encode_frame({"t": "welcome"})[0], em.ProtocolError, "refused the session: unexpected reply 'welcome'"),
    (wire.encode_frame({"t": "refuse", "kind": "NoSuchKind", "reason": "go away"})[0], em.ProtocolError,
     "refused the session: go away"),
    (wire.encode_frame({"t": "refuse", "kind": "AccessDenied", "reason": "bad token"})[0], em.AccessDenied,
     "refused the session: bad token"),
    (None, em.ConnectionLost, r"^ember://127\.0\.0\.9:\d+/0 did not answer the session's init within 0\.5 s \(EMBER_TIMEOUT\)$"),
    (None, tcp.TimedOut, r"^ws://127\.0\.0\.9:\d+: no answer to the WebSocket upgrade within 0\.5 s$"),  # a ConnectionLost
], ids=["large", "unexpected", "unknown kind", "refused", "silent", "silent to an upgrade"])
def test_a_client_takes_only_an_info_reply_to_its_init_and_small(monkeypatch, reply, error, message):
    """What answers a client's init is read with the handshake's small limits and within the
    client's timeout (EMBER_TIMEOUT): a reply announcing a large header, a reply of another kind, a
    refusal (as the error its kind names, or a ProtocolError for a kind this client does not know)
    or silence (to the init, or to a WebSocket upgrade before it) fails the session at once, naming
    why, and closes the connection."""
    monkeypatch.setattr("ember.engines.dialing.DEFAULT_TIMEOUT", 0.5)
    port, ended = _answering_an_init(reply)
    scheme = "ws" if "upgrade" in message else "ember"
    start = time.monotonic()
    with pytest.raises(error, match=message) as refused:
        em.ones(1, device=em.device(f"{scheme}://{FAKE_HOST}:{port}/0"))
    assert type(refused.value) is error and time.monotonic() - start < 15
    del refused
    for _ in range(100):
        if ended:
            break
        time.sleep(0.1)
    assert ended == [b""]


def test_a_peer_that_does_not_keep_alive_is_waited_for_up_to_the_timeout(monkeypatch):
    """A peer whose info does not grant keepalives (one of an older version) sends no alive frames:
    its session's reads wait up to EMBER_TIMEOUT, not the keepalive window the client asked for."""
    monkeypatch.setenv("EMBER_KEEPALIVE", "3")
    info = {"t": "info", "v": wire.VERSION, "session": "0" * 32, "peer": "1" * 32, "dtypes": ["float64"],
            "limits": wire.Limits().as_dict()}
    port, _ = _answering_an_init(wire.encode_frame(info)[0])
    device = em.device(f"ember://{FAKE_HOST}:{port}/0")
    assert device.engine.window is None
    device.engine.close()


def test_a_new_sessions_counters_start_at_zero_and_count_its_frames(peer):
    """``em.stats`` of a session just opened (a new token: a session of its own) is all zeros; an
    upload and its read then count one batch each way, their bytes and one round trip."""
    import uuid
    fresh = em.device(peer.url(token=uuid.uuid4().hex))
    assert em.stats(fresh) == {"ops": 0, "round_trips": 0, "bytes_up": 0, "bytes_down": 0, "batches": 0,
                               "graphs_registered": 0, "graph_runs": 0, "keepalives": 0, "resumes": 0,
                               "resume_seconds": 0.0, "batches_replayed": 0}
    np.testing.assert_array_equal(em.asnumpy(em.asarray(np.arange(4.0), device=fresh)), np.arange(4.0))
    stats = em.stats(fresh)
    assert (stats["round_trips"], stats["batches"], stats["ops"]) == (1, 1, 0)
    assert stats["bytes_up"] > 32 and stats["bytes_down"] == wire.PREFIX_SIZE + 32  # the prefix, one float64 tensor


def test_a_session_reads_with_the_limits_its_peer_announced():
    with Peer("--max-tensor-bytes", "4096") as running:
        engine = em.device(running.url()).engine
        assert engine.limits.max_tensor_bytes == 4096
        assert engine.connection.reader.limits == engine.limits


def test_each_scheme_speaks_its_transport_and_downloads_reuse_their_buffers(remote):
    """``ember://`` is plain frames over TCP and ``ws://`` WebSocket messages (the peer serves both
    on one port), each waiting for a reply awake as long as EMBER_SPIN_US says; either way a
    download of 1 MiB or more lands in a buffer of the connection's, reused once the program has
    let the last array go."""
    assert remote.engine.connection.transport == {"ember": "tcp", "ws": "websocket"}[remote.scheme]
    assert remote.engine.spin == tcp.spin_window()  # a wait for a reply polls as EMBER_SPIN_US says
    x = em.asarray(np.arange(1 << 20, dtype=np.float32), device=remote)  # 4 MiB
    first = em.asnumpy(x + 1.0)
    where = first.__array_interface__["data"][0]
    del first
    second = em.asnumpy(x + 2.0)
    assert second.__array_interface__["data"][0] == where and second[3] == 5.0


def test_malformed_and_oversized_frames_are_refused_at_once_while_others_work(peer):
    good = em.device(peer.url())
    x = em.arange(5, device=good)
    small = wire.HANDSHAKE_LIMITS.max_frame_bytes  # until the peer has answered the init frame, frames are small
    attacks = [  # (the bytes a new connection sends, what the peer's refusal names)
        (b"GARBAGE!" * 4, "bad frame magic"),
        (_prefix(2**31, 0), f"a header of 2147483648 bytes exceeds the limit of {small}"),
        (_prefix(4, 2**62), f"a frame of {2**62 + 4} bytes exceeds the limit of {small}"),
        (_frame(INIT)[:-1] + b"\xc1", "malformed header"),
        (_frame(INIT) + _frame({"t": "batch", "m": (("op", "matmul", (1, 2), (3,), {}),), "seg": (("float64", (2**40,)),)}),
         f"a tensor of {2**43} bytes exceeds the limit of {small} bytes"),  # sent before the info reply came
        (_frame(INIT) + _frame({"t": "batch", "m": (("op",),)}),
         "the 'op' message is [kind, name, inputs, outputs, attrs], got 1 items"),
        (_frame({**INIT, "v": 99}), "protocol version 99 is not supported"),
    ]
    for attack, reason in attacks:
        with _raw_socket(peer.address) as sock:
            received, seconds = _closed_by_peer(sock, attack)
        reader = wire.FrameReader()
        *before, last = [frame.header for frame in reader.feed(received)]
        assert reader.buffer().nbytes == wire.PREFIX_SIZE  # nothing left half-sent
        assert last["t"] in ("error", "refuse") and reason in last["reason"] and all(h["t"] == "info" for h in before)
        assert seconds < 2  # at once: the peer's handshake timeout is 10 s
        assert float(em.sum(x)) == 10.0  # the other session keeps working throughout
    assert peer.process.poll() is None


_LIMITS = PEER_LIMITS
OVERSIZED = {  # raw bytes sent in a session -> what the peer's error names
    "header": (_prefix(_LIMITS.max_header_bytes + 1, 0),
               f"a header of {_LIMITS.max_header_bytes + 1} bytes exceeds the limit of {_LIMITS.max_header_bytes}"),
    "frame": (_prefix(16, _LIMITS.max_frame_bytes - 15),
              f"a frame of {_LIMITS.max_frame_bytes + 1} bytes exceeds the limit of {_LIMITS.max_frame_bytes}"),
    "tensor": (_frame({"t": "batch", "m": (("put", 1, 0),)}, [np.zeros(LIMIT + 1, np.uint8)]),
               f"a tensor of {LIMIT + 1} bytes exceeds the limit of {LIMIT} bytes"),
    "rank": (_frame({"t": "batch", "m": (), "seg": (("uint8", (1,) * 65),)}), "bad segment shape"),
    "msgpack length": (_prefix(5, 0) + b"\xdd\x80\x00\x00\x00", "malformed header"),  # 2**31 items in 5 bytes
}


@pytest.mark.parametrize("limit", OVERSIZED)
@pytest.mark.parametrize("scheme", REMOTE_SCHEMES)
def test_every_limit_is_refused_at_once(small_peer, scheme, limit):
    data, reason = OVERSIZED[limit]
    with RawSession(small_peer.address, scheme) as session:
        answer, seconds = session.refused(data)
    assert answer["t"] == "error" and answer["kind"] == "ProtocolError" and reason in answer["reason"], answer
    assert seconds < 2  # a session has no timeout on the peer; the wait here gives up after 5 s


def test_websocket_and_http_limits_are_refused_at_once(small_peer):
    with RawSession(small_peer.address, "ws") as session:
        start = time.monotonic()
        session.connection.sock.sendall(b"\x82\xff" + (2**40).to_bytes(8, "big") + b"mask")  # a binary frame of 1 TiB
        with pytest.raises(em.ConnectionLost, match="closed"):
            session.connection.receive()
        assert _eof(session.connection.sock) and time.monotonic() - start < 2
        close = session.connection.protocol.close_rcvd
        assert close.code == 1009 and re.fullmatch(too_large(2**40, r"\d+"), close.reason)
    for request, status in ((b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\n", b"414"),
                            (b"GET / HTTP/1.1\r\n" + b"X-Header: 1\r\n" * 200, b"431")):
        with _raw_socket(small_peer.address) as sock:
            received, seconds = _closed_by_peer(sock, request)
        assert received.startswith(b"HTTP/1.1 " + status) and seconds < 2


def test_the_tensor_limit_through_the_client(small_peer):
    device = em.device(small_peer.url())
    exact = em.asarray(np.arange(LIMIT, dtype=np.uint8), device=device)  # exactly the limit: accepted
    with pytest.raises(em.ResourceLimitError, match=f"upload: a tensor of {LIMIT + 1} bytes exceeds .* limit of {LIMIT} bytes"):
        em.asarray(np.zeros(LIMIT + 1, np.uint8), device=device)  # refused before it is sent
    with pytest.raises(em.ResourceLimitError, match=rf"^full: an output of shape \({LIMIT + 1},\) uint8 exceeds the peer's "
                                               rf"tensor limit of {LIMIT} bytes"):
        em.asnumpy(em.zeros(LIMIT + 1, dtype=em.uint8, device=device))
    wide = em.jit(lambda v: em.sum(em.broadcast_to(v, (200, 2))))  # an intermediate of 3200 bytes
    with pytest.raises(em.ResourceLimitError, match=r"graph: broadcast_to: an output of shape \(200, 2\) float64 exceeds"):
        em.asnumpy(wide(em.ones(2, device=device)))
    np.testing.assert_array_equal(em.asnumpy(exact + 1), np.arange(LIMIT, dtype=np.uint8) + 1)  # the session lives on


def test_a_registered_graph_refuses_runs_that_do_not_fit_it(peer):
    with em.capture() as cap:
        a, b = cap.input((2, 3), em.float64, "a"), cap.input((3,), em.float64, "b")
        cap.output(a * b + 1, "y")
    tensors = {1: np.ones((2, 3)), 2: np.arange(3.0), 3: np.ones((2, 3), np.float32), 4: np.ones((3, 3)), 5: np.ones(3)}
    runs = [  # (graph, input ids, output ids), the error kind, its message
        ((7, (1,), (9,)), "ProtocolError", "run: graph 7 takes 2 inputs and gives 1 outputs; got 1 input ids and 1 output ids"),
        ((7, (1, 2, 2), (9,)), "ProtocolError", "got 3 input ids and 1 output ids"),
        ((7, (1, 2), (9, 10)), "ProtocolError", "got 2 input ids and 2 output ids"),
        ((7, (4, 2), (9,)), "ShapeError", "run: input 0 expects (2, 3) float64, got (3, 3) float64"),
        ((7, (3, 2), (9,)), "ShapeError", "run: input 0 expects (2, 3) float64, got (2, 3) float32"),
        ((7, (1, 99), (9,)), "ExecutionError", "run: unknown tensor id 99"),
        ((7, (1, 5), (9,)), "ExecutionError", "run: unknown tensor id 5"),    # dropped
        ((7, (42, 2), (9,)), "ExecutionError", "run: unknown tensor id 42"),  # another session's
        ((8, (1, 2), (9,)), "ExecutionError", "run: unknown graph 8"),
    ]
    with RawSession(peer.address) as session, RawSession(peer.address) as other:
        assert other.batch(("put", 42, 0), ("sync", 1), segments=[np.ones((2, 3))]).header["m"] == (("ok", 1),)
        ready = session.batch(register_message(7, cap.graph), *(("put", i, k) for k, i in enumerate(tensors)), ("drop", (5,)),
                              ("sync", 1), segments=list(tensors.values()))
        assert ready.header["m"] == (("ok", 1),)
        for run, kind, message in runs:
            reply = session.batch(("run", *run), ("get", 2, 9), ("sync", 3), ("run", 7, (1, 2), (10,)), ("get", 4, 10))
            got, synced, data = reply.header["m"]
            assert got[:3] == ("error", 2, kind) and message in got[3], got
            assert synced == ("error", 3, kind, got[3])  # the next sync reports it too
            assert data == ("data", 4, 0)  # the session and the graph serve on
            np.testing.assert_array_equal(reply.segments[0], tensors[1] * tensors[2] + 1)


def test_a_bad_op_from_a_raw_client_poisons_only_its_outputs(peer):
    with RawSession(peer.address) as session:
        assert session.info["backend"] == "numpy"
        reply = session.batch(
            ("put", 1, 0),
            ("op", "no_such_op", (1,), (2,), {}),
            ("op", "full", (), (3,), {"shape": (10**12,), "fill_value": 1.0}),  # beyond the tensor limit
            ("op", "negative", (1,), (4,), {}),
            ("get", 7, 2), ("get", 8, 3), ("get", 9, 4),
            segments=[np.arange(3.0)])
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
