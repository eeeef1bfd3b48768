"""Collectives over several compute peers (``ember.distributed``) and data-parallel training.

Real ``ember serve`` processes on 127.0.0.1 — two numpy peers and a torch one where torch is
installed; the plans, which are pure data, checked by simulation below.
"""

from __future__ import annotations

import math
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ember as em
import ember.distributed as dist
from ember.array import Array
from ember.ops.table import Meta
from ember.spirals import train, train_data_parallel

from .conftest import torch_available
from .peers import Peer

EXAMPLE = Path(__file__).parent.parent / "examples" / "data_parallel.py"
OPS = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}


@pytest.fixture(scope="module")
def peers():
    """Three peers: numpy, numpy, and torch where it is installed (numpy otherwise)."""
    backends = ["numpy", "numpy", "torch:cpu" if torch_available() else "numpy"]
    started = []
    try:
        for backend in backends:
            started.append(Peer("--device", backend, "--fetch-from", "127.0.0.1"))  # they fetch from each other
        yield started
    finally:
        for peer in started:
            peer.stop()


def _devices(peers, scheme="ember"):
    return [em.device(p.url(scheme)) for p in peers]


def _counters(devices) -> list[dict]:
    return [{k: em.stats(d)[k] for k in ("bytes_up", "bytes_down", "round_trips")} for d in devices]


def _spread(devices, hosts, where):
    """``hosts[i]`` on ``devices[where[i]]``, every upload done: later counters see only what follows."""
    arrays = [em.asarray(h, device=devices[w]) for h, w in zip(hosts, where)]
    for d in devices:
        em.sync(d)
    return arrays


def _sent(peers, at_least: int = 1 << 18) -> int:
    """How many tensors of ``at_least`` bytes the peers have sent to other peers (each logs every
    one it sends; only one test sends tensors that large, so the other tests' late lines do not count)."""
    sizes = [int(m.group(1)) for p in peers for line in list(p.log) if (m := _SENT.search(line))]
    return sum(size >= at_least for size in sizes)


_SENT = re.compile(r"sent a granted tensor of (\d+) bytes")


# --- values against NumPy --------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4, 5), (), (2,), (0, 3)])
@pytest.mark.parametrize("op", list(OPS))
def test_all_reduce_equals_numpy_on_the_gathered_data_with_several_arrays_per_peer(peers, op, shape):
    devices = _devices(peers)
    where = [0, 1, 2, 0, 2, 1, 0]  # several arrays per peer, interleaved
    rng = np.random.default_rng(len(shape))
    hosts = [rng.uniform(0.5, 1.5, shape) for _ in where]
    results = dist.all_reduce(_spread(devices, hosts, where), op=op)
    expected = OPS[op](np.stack(hosts), axis=0)
    assert [r.device for r in results] == [devices[w] for w in where]
    assert all(r.shape == shape and r.dtype == em.float64 for r in results)
    values = [em.asnumpy(r) for r in results]
    for value in values:
        np.testing.assert_allclose(value, expected, rtol=1e-13, atol=0)
        np.testing.assert_array_equal(value, values[0])  # every peer holds the same bits


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_integer_reductions_are_exact(peers, op):
    devices = _devices(peers)
    where = [2, 0, 1, 1]
    hosts = [np.arange(-5, 7, dtype=np.int32).reshape(3, 4) * (i + 1) for i in range(len(where))]
    results = dist.all_reduce(_spread(devices, hosts, where), op=op)
    expected = OPS[op](np.stack(hosts), axis=0).astype(np.int32)
    for r in results:
        assert r.dtype == em.int32
        np.testing.assert_array_equal(em.asnumpy(r), expected)


def test_all_gather_stacks_the_inputs_in_their_order_on_every_device(peers):
    devices = _devices(peers)
    where = [1, 0, 1, 2, 0]
    hosts = [np.full((2, 3), i, np.float32) + np.arange(3, dtype=np.float32) for i in range(len(where))]
    results = dist.all_gather(_spread(devices, hosts, where))
    assert [r.device for r in results] == [devices[w] for w in where]
    for r in results:
        assert (r.shape, r.dtype) == ((5, 2, 3), em.float32)
        np.testing.assert_array_equal(em.asnumpy(r), np.stack(hosts))


def test_all_gather_of_empty_arrays_and_of_one_peer(peers):
    devices = _devices(peers)
    empty = dist.all_gather(_spread(devices, [np.zeros((0, 2))] * 3, [0, 1, 2]))
    assert all(em.asnumpy(r).shape == (3, 0, 2) for r in empty)
    alone = dist.all_gather(_spread(devices, [np.ones(2), np.zeros(2)], [1, 1]))
    np.testing.assert_array_equal(em.asnumpy(alone[0]), [[1.0, 1.0], [0.0, 0.0]])


def test_broadcast_puts_the_array_on_each_device_asked_for(peers):
    devices = _devices(peers)
    host = np.random.default_rng(3).standard_normal((3, 3))
    (x,) = _spread(devices, [host], [1])
    targets = [devices[2], devices[0], devices[1], devices[2], peers[0].url("ws")]  # its own device, a repeat, a 2nd session
    results = dist.broadcast(x, targets)
    assert results[2] is x and results[0] is results[3]
    assert [r.device for r in results] == [em.device(t) for t in targets]
    assert results[4].device is em.device(peers[0].url("ws")) and results[4].device is not devices[0]
    for r in results:
        np.testing.assert_array_equal(em.asnumpy(r), host)


def test_two_sessions_of_one_peer_are_two_participants(peers):
    tcp, ws = em.device(peers[0].url("ember")), em.device(peers[0].url("ws"))
    results = dist.all_reduce([em.asarray(np.arange(4.0), device=tcp), em.asarray(np.ones(4), device=ws)], op="max")
    assert [r.device for r in results] == [tcp, ws] and results[0].device is not results[1].device
    for r in results:
        np.testing.assert_array_equal(em.asnumpy(r), [1.0, 1.0, 2.0, 3.0])


def test_results_are_new_arrays_even_for_one_array(peers):
    (x,) = _spread(_devices(peers), [np.arange(3.0)], [0])
    (total,) = dist.all_reduce([x])
    total += 1  # rebinds the result, not the input
    np.testing.assert_array_equal(em.asnumpy(x), [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(em.asnumpy(total), [1.0, 2.0, 3.0])


def test_arrays_on_autodiff_devices_are_taken_by_value(peers):
    a, b = _devices(peers)[:2]
    x = em.asarray(np.ones(3), device=em.autodiff(a)).requires_grad_()
    results = dist.all_reduce([x * 2, em.asarray(np.arange(3.0), device=b)])
    assert results[0].device is a  # collectives record no gradient: the result is plain
    np.testing.assert_array_equal(em.asnumpy(results[0]), [2.0, 3.0, 4.0])


# --- peer to peer: no tensor byte through the client, no round trip before the read ----------------

@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "broadcast"])
def test_no_tensor_byte_passes_through_the_client_and_nothing_waits_before_the_read(peers, collective):
    devices = _devices(peers)
    rng = np.random.default_rng(7)
    where = [0, 0, 1, 2]
    hosts = [rng.standard_normal(1 << 17) for _ in where]  # 1 MiB each
    arrays = _spread(devices, hosts, where)
    before, sent = _counters(devices), _sent(peers)
    if collective == "all_reduce":
        results, expected, plan = dist.all_reduce(arrays, op="mean"), np.mean(hosts, axis=0), dist.ring_all_reduce(3)
    elif collective == "all_gather":
        results, expected, plan = dist.all_gather(arrays), np.stack(hosts), dist.direct_all_gather(3)
    else:
        results, expected, plan = dist.broadcast(arrays[2], devices), hosts[2], dist.tree_broadcast(3)
    issued = _counters(devices)
    for b, i in zip(before, issued):
        assert i["round_trips"] == b["round_trips"] and i["bytes_down"] == b["bytes_down"]
        assert i["bytes_up"] - b["bytes_up"] < 16 << 10  # headers: grants, fetches and ops, no tensor
    np.testing.assert_allclose(em.asnumpy(results[-1]), expected, rtol=1e-12, atol=1e-15)
    read = _counters(devices)
    last = devices.index(results[-1].device)
    assert [r["round_trips"] - b["round_trips"] for r, b in zip(read, before)] == [int(k == last) for k in range(3)]
    for r in results:
        np.testing.assert_allclose(em.asnumpy(r), expected, rtol=1e-12, atol=1e-15)
    deadline = time.monotonic() + 30  # the peers log each tensor they sent, on their own threads
    while _sent(peers) < sent + plan.transfers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sent(peers) == sent + plan.transfers  # each transfer of the plan went from one peer to another (≥ 340 KiB)


# --- errors: typed, naming the operation and what is wrong, raised before anything is sent ---------

def test_mismatched_shapes_dtypes_and_non_peers_are_refused_by_name(peers):
    a, b, c = _devices(peers)
    x, y = em.asarray(np.ones((2, 3)), device=a), em.asarray(np.ones((2, 3)), device=b)
    port_b = peers[1].address.rsplit(":", 1)[1]
    with pytest.raises(em.ShapeError, match=rf"^all_reduce: arrays\[1\] has shape \(3, 2\) on ember://127\.0\.0\.1:{port_b}/0 "
                                            r"but arrays\[0\] has shape \(2, 3\) on ember://.*one shape$") as error:
        dist.all_reduce([x, em.asarray(np.ones((3, 2)), device=b)])
    assert isinstance(error.value, ValueError)
    with pytest.raises(em.DTypeError, match=r"^all_gather: arrays\[2\] is float32 on ember://127\.0\.0\.1:\d+/0 but "
                                            r"arrays\[0\] is float64 on .*one dtype") as error:
        dist.all_gather([x, y, em.asarray(np.ones((2, 3), np.float32), device=c)])
    assert isinstance(error.value, TypeError)
    with pytest.raises(em.DeviceError, match=r"^all_reduce: arrays\[1\] is on numpy, not on a compute peer: collectives "
                                             r"run peer to peer and move no tensor through the client") as error:
        dist.all_reduce([x, em.ones((2, 3))])
    assert isinstance(error.value, ValueError)
    with em.capture() as cap:
        z = cap.input((2, 3), em.float64)
        with pytest.raises(em.DeviceError, match=r"^all_gather: arrays\[0\] is on capture"):
            dist.all_gather([z, x])
    with pytest.raises(em.DeviceError, match=r"^broadcast: devices\[1\] is torch:cpu, not a compute peer"):
        dist.broadcast(x, [b, "torch:cpu"])
    with pytest.raises(em.ArgumentError, match=r"^all_reduce: op must be one of 'sum', 'mean', 'max', 'min', 'prod'; "
                                               r"got 'avg'$"):
        dist.all_reduce([x, y], op="avg")
    integers = [em.asarray(np.ones(2, np.int64), device=d) for d in (a, b)]
    with pytest.raises(em.DTypeError, match=r"^all_reduce\(op='mean'\): divide: inputs must have a floating dtype, got int64"):
        dist.all_reduce(integers, op="mean")
    with pytest.raises(em.DTypeError, match=r"^all_reduce\(op='max'\): maximum: .*complex128"):
        dist.all_reduce([em.asarray(np.ones(2, complex), device=d) for d in (a, b)], op="max")
    with pytest.raises(em.ArgumentError, match=r"^all_gather: expected at least one array"):
        dist.all_gather([])
    with pytest.raises(em.DTypeError, match=r"^all_reduce: arrays\[1\] is a ndarray, not an ember array"):
        dist.all_reduce([x, np.ones((2, 3))])


def test_a_refused_call_sends_nothing(peers):
    a, b = _devices(peers)[:2]
    x, y = em.asarray(np.ones(3), device=a), em.asarray(np.ones(4), device=b)
    for d in (a, b):
        em.sync(d)
    before = _counters([a, b])
    with pytest.raises(em.ShapeError):
        dist.all_reduce([x, y])
    with pytest.raises(em.DeviceError):
        dist.broadcast(x, [b, "numpy"])
    assert _counters([a, b]) == before


# --- a peer dying mid-collective ---------------------------------------------------------------------

def test_a_peer_dying_mid_collective_fails_the_reads_with_connection_lost_and_the_others_go_on(peers):
    a, b = _devices(peers)[:2]
    doomed = Peer("--device", "numpy", "--fetch-from", "127.0.0.1")
    try:
        c = em.device(doomed.url())
        x, y = em.asarray(np.arange(6.0), device=a), em.asarray(np.ones(6), device=b)
        # c's part is still on its way (a fetch with a capability nobody granted): the ring waits on c …
        stuck = Array._new(c.engine.fetch(a.engine, secrets.token_bytes(32), Meta((6,), em.float64)),
                           Meta((6,), em.float64), c)
        results = dist.all_reduce([x, y, stuck])
        doomed.kill()  # … when it dies
        for r in results[:2]:
            with pytest.raises(em.ConnectionLost, match=r"transfer from ember://127\.0\.0\.1:\d+: "):
                em.asnumpy(r)
        with pytest.raises(em.ConnectionLost):
            em.asnumpy(results[2])
        again = dist.all_reduce([x, y])  # the two survivors, and their sessions, go on
        for r in again:
            np.testing.assert_array_equal(em.asnumpy(r), np.arange(6.0) + 1)
    finally:
        doomed.stop()


# --- data-parallel training ------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_training_follows_the_single_device_loss_curve(peers, n):
    steps = 5
    single = train("numpy", steps=steps, dtype=np.float64)["losses"]
    result = train_data_parallel([p.url() for p in peers[:n]], steps=steps, dtype=np.float64)
    difference = np.max(np.abs(np.asarray(result["losses"]) - np.asarray(single)))
    assert difference < 1e-6, difference
    assert result["losses"][-1] < result["losses"][0]
    replicas = [[em.asnumpy(p) for p in params] for params in result["params"]]
    for peer, other in zip(peers[1:n], replicas[1:]):
        if peer is peers[1] or not torch_available():  # the same step on the same bits: one backend's replicas are one
            assert all(np.array_equal(mine, theirs) for mine, theirs in zip(replicas[0], other))
        else:  # torch's Adam step may round an ulp away from NumPy's
            for mine, theirs in zip(replicas[0], other):
                np.testing.assert_allclose(theirs, mine, rtol=1e-12, atol=1e-15)


def test_the_example_starts_its_peers_trains_checks_and_stops_them():
    completed = subprocess.run([sys.executable, str(EXAMPLE), "--peers", "2", "--steps", "3", "--log-every", "1",
                                "--check"], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "step     2  loss " in completed.stdout
    difference = float(re.search(r"largest difference from one device: (\S+)", completed.stdout).group(1))
    assert difference < 1e-6
    ports = re.findall(r"ember://127\.0\.0\.1:(\d+)/0", completed.stdout.splitlines()[0])
    assert len(ports) == 2
    for port in ports:  # its peers are gone with it
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()


# --- the plans, simulated ------------------------------------------------------------------------------

def _simulate(plan: dist.Plan, reducing: bool) -> list[list[frozenset]]:
    """Which groups' contributions each group's chunk holds, after ``plan``; asserts none counts twice."""
    if reducing:
        state = [[frozenset({g}) for _ in range(plan.chunks)] for g in range(plan.groups)]
    else:
        state = [[frozenset(range(plan.groups)) if plan.owner[c] == g else frozenset() for c in range(plan.chunks)]
                 for g in range(plan.groups)]
    for transfers in plan.reduce:
        start = [list(row) for row in state]
        for t in transfers:
            assert start[t.source][t.chunk].isdisjoint(state[t.target][t.chunk]), "a contribution counted twice"
            state[t.target][t.chunk] = state[t.target][t.chunk] | start[t.source][t.chunk]
    for c, g in enumerate(plan.owner):
        assert state[g][c] == frozenset(range(plan.groups)), "the owner's chunk is not complete"
    for transfers in plan.gather:
        start = [list(row) for row in state]
        for t in transfers:
            assert start[t.source][t.chunk], "a chunk sent before it arrived"
            state[t.target][t.chunk] = start[t.source][t.chunk]
    return state


@given(st.integers(1, 12))
def test_every_plan_leaves_every_chunk_complete_on_every_group(n):
    everything = frozenset(range(n))
    ring, gather, tree = dist.ring_all_reduce(n), dist.direct_all_gather(n), dist.tree_broadcast(n)
    for plan, reducing in ((ring, True), (gather, False), (tree, False)):
        assert all(chunk == everything for row in _simulate(plan, reducing) for chunk in row)
        assert all(t.source != t.target for r in plan.reduce + plan.gather for t in r)
    for transfers in ring.reduce:  # a ring: each group sends once and receives once a round, to its neighbour
        assert sorted(t.source for t in transfers) == sorted(t.target for t in transfers) == list(range(n))
        assert all(t.target == (t.source + 1) % n for t in transfers)
    assert (ring.chunks, ring.transfers, len(ring.reduce)) == (n, 2 * n * (n - 1), n - 1)
    assert (gather.transfers, len(gather.gather)) == (n * (n - 1), int(n > 1))
    assert (tree.transfers, len(tree.gather)) == (n - 1, math.ceil(math.log2(n)))
