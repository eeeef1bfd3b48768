"""The wide-area benchmark: a compute peer across a real network's latency, counted in round trips.

A loopback ``ember serve`` peer sits behind a delay line (benchmarks/delayline.py: 10 ms each way
by default, 1 Gbit/s each way), and every row is a median time divided by the line's round trip
time (RTT) as a raw TCP echo through the same line measures it, interleaved with the rows:

(a) a 1000-op chain on 1,000 float32, then one read (target ≤ 1.5 RTT);
(b) one small op and its read (target ≤ 1.1 RTT);
(c) a jitted training step of the spirals MLP (ember/spirals.py) with its loss read (≤ 1.2 RTT);
(d) a 64 MiB upload, beyond the time the link takes to carry it — a raw upload through the same
    line, less one RTT for its acknowledgement (target ≤ 2 RTT);
(e) for contrast, an RPC-per-op client: each op of the chain waited for (here: a sync after each
    of 10 ops, extrapolated to 1000).

Each row also records the round trips ember counted for it (``em.stats``), and the notes give the
same workloads straight to the peer, without the line: what a row costs beyond its round trips
is mostly that time. The peer's BLAS is single-threaded unless OPENBLAS_NUM_THREADS says otherwise
(see PEER_ENV).
"""

from __future__ import annotations

import os

import numpy as np

import ember as em
from ember.remote.spawn import PeerProcess
from ember.spirals import Training

from .core import chain
from .delayline import DelayLine
from .rawsocket import RawPeer
from .timing import Report, Row, medians

MIB = 1 << 20
DELAY = 0.010          # seconds each way
BANDWIDTH = 125e6      # bytes per second each way: 1 Gbit/s
RPC_OPS = 10           # ops waited for one by one in (e)
# The peer's BLAS runs on one thread unless the environment says otherwise: on a small shared host,
# OpenBLAS's second thread waits for a busy core, and the step's small matmuls took 40 ms, not 1.6.
PEER_ENV = {"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}


class _Workloads:
    """The rows' workloads on one device; each call leaves its round trips in ``trips``."""

    def __init__(self, device):
        self.device = device
        self.trips: dict[str, int] = {}
        self.small = em.asarray(np.random.default_rng(0).random(1000, dtype=np.float32), device=device)
        self.one = em.asarray(np.ones(4, np.float32), device=device)
        self.training = Training(device, use_jit=True)

    def counted(self, name: str, function):
        def run():
            before = em.stats(self.device)["round_trips"]
            function()
            self.trips[name] = em.stats(self.device)["round_trips"] - before
        return run

    def chain(self) -> None:
        em.asnumpy(chain(em, self.small, 1000))

    def one_op(self) -> None:
        em.asnumpy(self.one + 1)

    def train_step(self) -> None:
        self.training.step()

    def rpc_per_op(self) -> None:
        x = self.one
        for _ in range(RPC_OPS):
            x = x + 1
            em.sync(self.device)

    def upload(self, host: np.ndarray) -> None:
        em.asarray(host, device=self.device)
        em.sync(self.device)


def run(quick: bool = False, delay: float = DELAY, bandwidth: float | None = BANDWIDTH) -> Report:
    """Measure (a)–(e) through a delay line of ``delay`` seconds each way and ``bandwidth`` bytes per
    second; ``quick`` uses fewer rounds and an 8 MiB upload."""
    report = Report("wan")
    repeats = 3 if quick else 11
    size = (8 if quick else 64) * MIB
    with PeerProcess(env=PEER_ENV) as peer, DelayLine(delay, bandwidth) as line:
        echo, bulk = RawPeer(through=line.route), RawPeer(through=line.route)
        try:
            echo.start_echo(64)
            wan = _Workloads(em.device(f"ember://{line.route(peer.address)}/0"))
            near = _Workloads(em.device(peer.url()))   # the same peer, straight
            t = medians({"echo": echo.echo,
                         "chain": wan.counted("chain", wan.chain), "chain near": near.chain,
                         "one": wan.counted("one", wan.one_op), "one near": near.one_op,
                         "step": wan.counted("step", wan.train_step), "step near": near.train_step,
                         "rpc": wan.counted("rpc", wan.rpc_per_op)}, repeats, warmup=2)
            rtt = t["echo"]
            report.add(Row("(a) 1000-op chain + read", t["chain"], "RTT", rtt, "≤ 1.50x", round_trips=wan.trips["chain"],
                           stolen=t.stolen))
            report.add(Row("(b) one small op + read", t["one"], "RTT", rtt, "≤ 1.10x", round_trips=wan.trips["one"],
                           stolen=t.stolen))
            report.add(Row("(c) jitted MLP training step + loss read", t["step"], "RTT", rtt, "≤ 1.20x",
                           round_trips=wan.trips["step"], stolen=t.stolen))

            host = np.random.default_rng(1).random(size // 4, dtype=np.float32)
            up = medians({"echo": echo.echo, "raw": lambda: bulk.upload(host),
                          "ember": wan.counted("upload", lambda: wan.upload(host))}, max(3, repeats // 2))
            carried = max(up["raw"] - up["echo"], 0.0)  # the raw upload waits one RTT for its acknowledgement
            report.add(Row(f"(d) {size // MIB} MiB upload, beyond the link's time", up["ember"] - carried, "RTT", up["echo"],
                           "≤ 2.00x", round_trips=wan.trips["upload"], stolen=up.stolen))
            report.add(Row(f"(d) {size // MIB} MiB upload, throughput", size / up["ember"], "raw", size / up["raw"], "reported",
                           unit="B/s", higher_is_better=True, stolen=up.stolen))
            report.add(Row("(e) RPC per op: 1000-op chain, extrapolated", t["rpc"] * 1000 / RPC_OPS, "RTT", rtt,
                           "contrast", round_trips=wan.trips["rpc"] * 1000 // RPC_OPS, stolen=t.stolen))
        finally:
            echo.close()
            bulk.close()
    link = f"{bandwidth * 8 / 1e9:g} Gbit/s" if bandwidth else "uncapped"
    report.notes.append(f"delay line: {delay * 1e3:g} ms each way, {link}; measured RTT (raw echo through it) "
                        f"{rtt * 1e3:.2f} ms; ratios are RTT multiples; the peer's OPENBLAS_NUM_THREADS="
                        f"{PEER_ENV['OPENBLAS_NUM_THREADS']}")
    report.notes.append(f"straight to the peer, no line: chain {t['chain near'] * 1e3:.2f} ms, one op "
                        f"{t['one near'] * 1e3:.2f} ms, training step {t['step near'] * 1e3:.2f} ms")
    report.notes.append(f"round trips counted: chain {wan.trips['chain']}, one op {wan.trips['one']}, training step "
                        f"{wan.trips['step']}, upload {wan.trips['upload']}; RPC per op {wan.trips['rpc']} for "
                        f"{RPC_OPS} ops, {t['rpc'] / RPC_OPS / rtt:.2f} RTT each")
    return report
