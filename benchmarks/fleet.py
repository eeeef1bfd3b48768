"""The fleet benchmark: three loopback compute peers (``ember serve`` child processes) moving
tensors among themselves, peer to peer.

(a) ``x.to_device(b)`` of a 256 MiB float32 tensor from peer A to peer B (the bytes go A → B)
    vs a raw-socket copy of as many bytes between two child processes (target ≥ 0.8×), and vs
    the same move through the client (read from A, upload to B); a 64 KiB move as the small case;
(b) ``ember.distributed.all_reduce`` of 64 MiB float32 over 3 peers vs gathering the three to
    the client, summing there and uploading the total back to each; 1 MiB as the small case;
(c) the data-parallel step of the spirals MLP (``ember.spirals.train_data_parallel``) on 1, 2
    and 3 peers.

Every row also counts the bytes the client sent and received (``em.stats`` of every session taking
part, per call): peer-to-peer rows carry only message headers. The peers share this machine's
CPUs (and the raw baseline's too), so more peers cannot run faster here: the rows report ratios,
not speed-ups.

The raw baseline is ``python -m ember.benchmarks.rawsocket`` (a sink into a reused buffer) fed by
a child running this module (``python -m ember.benchmarks.fleet PORT``), which sends N bytes per
line it reads from stdin and answers each with a line.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from dataclasses import dataclass

import numpy as np

import ember as em
import ember.distributed as dist
from ember.remote.spawn import PeerProcess
from ember.spirals import train_data_parallel

from .rawsocket import _COMMAND
from .timing import Report, Row, Timings, cpu_ticks, medians, stolen_share

MIB = 1 << 20
PEERS = 3
COUNTERS = ("bytes_up", "bytes_down")


@dataclass
class FleetRow(Row):
    """A row with the client's traffic (``em.stats``' bytes, summed over the sessions taking part)
    for one call of the ember candidate and, where the baseline goes through the client, of the
    baseline; and the tensor bytes the call moves (its payload, 0 where not one tensor)."""
    client_bytes_up: int = 0
    client_bytes_down: int = 0
    baseline_client_bytes_up: int = 0
    baseline_client_bytes_down: int = 0
    payload: int = 0
    peer_to_peer: bool = False


class RawPair:
    """Two raw-socket child processes: a sink (``ember.benchmarks.rawsocket``) and a sender
    connected to it (this module), which copies N bytes to the sink when told to."""

    def __init__(self):
        self.sink = subprocess.Popen([sys.executable, "-m", "ember.benchmarks.rawsocket"], stdout=subprocess.PIPE,
                                     text=True)
        port = self.sink.stdout.readline().strip()
        self.sender = subprocess.Popen([sys.executable, "-m", "ember.benchmarks.fleet", port],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def copy(self, n: int) -> None:
        """A → B: ``n`` bytes from the sender to the sink, acknowledged by the sink."""
        self.sender.stdin.write(f"{n}\n")
        self.sender.stdin.flush()
        if self.sender.stdout.readline().strip() != "ok":
            raise RuntimeError("the raw-socket sender stopped")

    def close(self) -> None:
        for process in (self.sender, self.sink):  # the sender's exit closes its socket, which ends the sink
            if process.stdin:
                process.stdin.close()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
            process.stdout.close()


def _send_loop(port: int) -> None:
    """The sender of :class:`RawPair`: for each line N on stdin, send N bytes to the sink at
    ``port`` (from one buffer, written once so no page fault is timed), wait for its byte, say ok."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = np.ones(0, np.uint8)
    for line in sys.stdin:
        n = int(line)
        if buffer.nbytes < n:
            buffer = np.ones(n, np.uint8)
        sock.sendall(_COMMAND.pack(b"sink", n))
        sock.sendall(memoryview(buffer)[:n])
        sock.recv(1)
        print("ok", flush=True)
    sock.close()


def _traffic(devices) -> dict[str, int]:
    totals = dict.fromkeys(COUNTERS, 0)
    for d in devices:
        stats = em.stats(d)
        for k in COUNTERS:
            totals[k] += stats[k]
    return totals


def _counted(function, devices) -> dict[str, int]:
    """The client's bytes up and down over ``devices``' sessions for one call of ``function``."""
    before = _traffic(devices)
    function()
    after = _traffic(devices)
    return {k: after[k] - before[k] for k in COUNTERS}


def _mib(n: int) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n >> 10} KiB"


def _moves(report: Report, raw: RawPair, a, b, size: int, repeats: int, target: str) -> None:
    """(a) at ``size`` bytes: peer to peer, through the client, raw sockets."""
    host = np.random.default_rng(size).random(size // 4, dtype=np.float32)
    x = em.asarray(host, device=a)
    em.sync(a)
    assert np.array_equal(em.asnumpy(x.to_device(b)), host), "the move changed the tensor"

    # each keeps its result until the sync is answered (a tensor dropped while it is fetched is not
    # waited for); it is dropped with the next call's messages
    def p2p():
        y = x.to_device(b)
        em.sync(b)  # the fetch is done: a sync settles every transfer
        return y

    def via_client():
        y = em.asarray(em.asnumpy(x), device=b)
        em.sync(b)
        return y

    t = medians({"raw": lambda: raw.copy(size), "p2p": p2p, "client": via_client}, repeats)
    traffic = {name: _counted(f, (a, b)) for name, f in (("p2p", p2p), ("client", via_client))}
    label = f"(a) move {_mib(size)} A → B"
    report.add(FleetRow(f"{label}, peer to peer", size / t["p2p"], "raw", size / t["raw"], target, unit="B/s",
                        higher_is_better=True, client_bytes_up=traffic["p2p"]["bytes_up"],
                        client_bytes_down=traffic["p2p"]["bytes_down"], payload=size, peer_to_peer=True, stolen=t.stolen))
    report.add(FleetRow(f"{label}, peer to peer vs via client", t["p2p"], "client", t["client"], "reported",
                        client_bytes_up=traffic["p2p"]["bytes_up"], client_bytes_down=traffic["p2p"]["bytes_down"],
                        baseline_client_bytes_up=traffic["client"]["bytes_up"],
                        baseline_client_bytes_down=traffic["client"]["bytes_down"], payload=size, peer_to_peer=True,
                        stolen=t.stolen))
    report.notes.append(f"(a) {_mib(size)}: client bytes up/down per move: peer to peer "
                        f"{traffic['p2p']['bytes_up']}/{traffic['p2p']['bytes_down']}, via the client "
                        f"{traffic['client']['bytes_up']}/{traffic['client']['bytes_down']}")


def _all_reduces(report: Report, devices, size: int, repeats: int) -> None:
    """(b) at ``size`` bytes per peer: ring all_reduce peer to peer vs gather, sum, scatter by the client."""
    hosts = [np.random.default_rng(100 + i).random(size // 4, dtype=np.float32) for i in range(len(devices))]
    xs = [em.asarray(h, device=d) for h, d in zip(hosts, devices)]
    expected = np.sum(hosts, axis=0)
    for out in dist.all_reduce(xs, op="sum"):
        np.testing.assert_allclose(em.asnumpy(out), expected, rtol=1e-5)

    def p2p():
        outs = dist.all_reduce(xs, op="sum")
        for d in devices:
            em.sync(d)
        return outs

    def via_client():
        total = em.asnumpy(xs[0]) + em.asnumpy(xs[1])
        for x in xs[2:]:
            total += em.asnumpy(x)
        outs = [em.asarray(total, device=d) for d in devices]
        for d in devices:
            em.sync(d)
        return outs

    t = medians({"p2p": p2p, "client": via_client}, repeats)
    traffic = {name: _counted(f, devices) for name, f in (("p2p", p2p), ("client", via_client))}
    report.add(FleetRow(f"(b) all_reduce {_mib(size)} f32, {len(devices)} peers, vs via client", t["p2p"], "client",
                        t["client"], "reported", client_bytes_up=traffic["p2p"]["bytes_up"],
                        client_bytes_down=traffic["p2p"]["bytes_down"], baseline_client_bytes_up=traffic["client"]["bytes_up"],
                        baseline_client_bytes_down=traffic["client"]["bytes_down"], payload=size, peer_to_peer=True,
                        stolen=t.stolen))
    report.notes.append(f"(b) {_mib(size)}: client bytes up/down per all_reduce: peer to peer "
                        f"{traffic['p2p']['bytes_up']}/{traffic['p2p']['bytes_down']}, via the client "
                        f"{traffic['client']['bytes_up']}/{traffic['client']['bytes_down']}")


def _data_parallel(report: Report, devices, steps: int, rounds: int) -> None:
    """(c) seconds per data-parallel step on the first 1, 2, … peers, the counts interleaved per round."""
    counts = range(1, len(devices) + 1)
    for k in counts:  # warm each peer set (sessions, kernels, the broadcast's connections)
        train_data_parallel(devices[:k], steps=2)
    per_step: dict[int, list[float]] = {k: [] for k in counts}
    traffic: dict[int, dict[str, int]] = {}
    before = cpu_ticks()
    for _ in range(rounds):
        for k in counts:
            marks = []

            def mark(i, loss, k=k, marks=marks):
                if i == 0 or i == steps - 1:  # the steps after the first: no upload of shards or parameters
                    marks.append(_traffic(devices[:k]))

            per_step[k].append(train_data_parallel(devices[:k], steps=steps, on_step=mark)["seconds_per_step"])
            traffic[k] = {c: (marks[-1][c] - marks[0][c]) // max(steps - 1, 1) for c in COUNTERS}
    t = Timings((k, float(np.median(v))) for k, v in per_step.items())
    t.stolen = stolen_share(before, cpu_ticks())
    for k in counts:
        if k > 1:
            report.add(FleetRow(f"(c) data-parallel MLP step, {k} peers vs 1", t[k], "1 peer", t[1], "reported",
                                client_bytes_up=traffic[k]["bytes_up"], client_bytes_down=traffic[k]["bytes_down"],
                                peer_to_peer=True, stolen=t.stolen))
    report.notes.append("(c) per step: " + ", ".join(
        f"{k} peer{'s' if k > 1 else ''} {t[k] * 1e3:.2f} ms, client bytes up/down {traffic[k]['bytes_up']}/"
        f"{traffic[k]['bytes_down']}" for k in counts)
        + " (each step reads its loss; 2-64-64-2 GELU MLP, 400 points split across the peers, float64)")


def run(quick: bool = False) -> Report:
    """Measure (a), (b) and (c) on three fresh peers and a raw-socket pair, all stopped at the end."""
    report = Report("fleet")
    repeats = 3 if quick else 7
    with contextlib.ExitStack() as stack:
        peers = [stack.enter_context(PeerProcess("--fetch-from", "127.0.0.1")) for _ in range(PEERS)]  # fetching from each other
        devices = [em.device(p.url()) for p in peers]
        raw = RawPair()
        stack.callback(raw.close)
        a, b = devices[:2]
        _moves(report, raw, a, b, (16 if quick else 256) * MIB, repeats, "≥ 0.80x")
        _moves(report, raw, a, b, 64 << 10, 5 if quick else 51, "reported")
        _all_reduces(report, devices, (4 if quick else 64) * MIB, repeats)
        _all_reduces(report, devices, 1 * MIB, 5 if quick else 21)
        _data_parallel(report, devices, 5 if quick else 30, 2 if quick else 5)
        for d in devices:
            d.engine.close()
    report.notes.append(f"{PEERS} peers and the raw-socket pair are processes on this machine, sharing its CPUs: "
                        "compare ratios, not speed-ups; client bytes are per call, over every session taking part "
                        "(peer to peer: message headers only, no tensor)")
    return report


if __name__ == "__main__":
    _send_loop(int(sys.argv[1]))
