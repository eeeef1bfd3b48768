#!/usr/bin/env python3
"""A long fuzz run against a real ``ember serve``: mutated real traffic, with its figures.

The frames a real client sent a real peer (tests/traffic.py records them) are mutated — bytes
flipped, cut, repeated or inserted, and values inside decoded messages replaced by odd ones —
and sent over TCP by several clients at once, each after a valid handshake (and some before
it: mutated handshakes). After each fuzzed frame the client asks for a sync and waits:

- *answered*: the peer replied (an error reply counts: the session lives on);
- *refused*: the peer closed the connection, having sent a ProtocolError (the client reconnects);
- *hang*: no answer and no close within the timeout (a bug);
- *crash*: the peer process died (a bug; it is restarted).

At the end a fresh client checks the peer still computes correctly, and the peer's peak memory
(VmHWM) is reported against its memory budget. docs/security.md records a run.

    python tools/fuzz.py                      # 100,000 fuzzed frames, 4 clients
    python tools/fuzz.py --frames 5000 --clients 2 --seed 7
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import ember as em  # noqa: E402
from ember.errors import ConnectionLost, EmberError  # noqa: E402
from ember.remote.spawn import PeerProcess  # noqa: E402
from ember.wire import protocol as wire  # noqa: E402
from ember.wire import tcp  # noqa: E402
from tests.traffic import ODD_VALUES, mutate, record_traffic  # noqa: E402

INIT = wire.encode_frame({"t": "init", "v": wire.VERSION, "device": 0})
SYNC = wire.encode_frame({"t": "batch", "m": (("sync", 1),)})


def _mutations(rng: random.Random) -> list:
    kinds = ["message", "message", "flip", "truncate", "repeat", "insert"]
    return [(kind, rng.randrange(1 << 20), rng.randrange(len(ODD_VALUES)) if kind == "message" else rng.randrange(1, 256))
            for kind in rng.choices(kinds, k=rng.randint(1, 4))]


class Client:
    """One fuzzing client: a connection that is reopened whenever the peer closes it."""

    def __init__(self, address: str, timeout: float):
        self.host, self.port = address.rsplit(":", 1)
        self.timeout = timeout
        self.connection = None

    def open(self, handshake=INIT):
        self.close()
        self.connection = tcp.connect(self.host, int(self.port), timeout=self.timeout)
        self.connection.send(handshake)
        return self.connection.receive().header

    def close(self):
        if self.connection is not None:
            self.connection.close()
            self.connection = None

    def case(self, data: bytes) -> str:
        """Send one fuzzed frame and a sync; what the peer did."""
        if self.connection is None:
            self.open()
        start = time.monotonic()
        try:
            self.connection.send([data])
            self.connection.send(SYNC)
            while True:  # replies to the fuzzed frame's own gets come first
                header = self.connection.receive().header
                if header.get("t") == "error":  # a refusal: the peer closes next
                    self.close()
                    return "refused"
                if header.get("t") == "reply" and any(m[:2] in (("ok", 1), ("error", 1)) for m in header.get("m", ())
                                                      if isinstance(m, tuple) and len(m) >= 2):
                    return "answered"
        except ConnectionLost as error:
            self.close()
            if "timed out" in str(error) or time.monotonic() - start >= self.timeout:
                return "hang"
            return "refused"
        except EmberError:
            self.close()
            return "refused"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=100_000, help="fuzzed frames to send (default 100,000)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds without an answer that count as a hang")
    parser.add_argument("--max-memory", type=int, default=512 << 20, help="the peer's memory budget (bytes)")
    args = parser.parse_args(argv)
    traffic = record_traffic()
    counts = {"answered": 0, "refused": 0, "hang": 0, "crash": 0, "handshakes fuzzed": 0}
    lock = threading.Lock()
    peer = PeerProcess("--max-memory", str(args.max_memory), "--max-tensor-bytes", str(64 << 20))
    peak = [0]
    started = time.monotonic()

    def watch_memory():
        while peer.process.poll() is None and not done.is_set():
            peak[0] = max(peak[0], _kib(peer.process.pid, "VmHWM"))
            time.sleep(0.5)

    def work(worker: int, frames: int):
        nonlocal peer
        rng = random.Random(args.seed * 1000 + worker)
        client = Client(peer.address, args.timeout)
        for _ in range(frames):
            if rng.random() < 0.02:  # a mutated handshake, before any session exists
                try:
                    client.open(mutate(b"".join(bytes(b) for b in INIT), _mutations(rng)))
                except EmberError:
                    pass
                client.close()
                with lock:
                    counts["handshakes fuzzed"] += 1
            outcome = client.case(mutate(rng.choice(traffic), _mutations(rng)))
            with lock:
                if peer.process.poll() is not None:
                    counts["crash"] += 1
                    peer = PeerProcess("--max-memory", str(args.max_memory))
                    client = Client(peer.address, args.timeout)
                counts[outcome] += 1
                total = sum(counts[o] for o in ("answered", "refused", "hang"))
                if total % 5000 == 0:
                    print(f"  {total} frames: {counts}", file=sys.stderr, flush=True)
        client.close()

    done = threading.Event()
    watcher = threading.Thread(target=watch_memory, daemon=True)
    watcher.start()
    share = [args.frames // args.clients + (1 if k < args.frames % args.clients else 0) for k in range(args.clients)]
    threads = [threading.Thread(target=work, args=(k, n)) for k, n in enumerate(share)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        device = em.device(peer.url())  # the peer still serves a fresh client correctly
        x = np.arange(12.0).reshape(3, 4)
        correct = np.array_equal(em.asnumpy(em.matmul(em.asarray(x, device=device), em.asarray(x.T, device=device))), x @ x.T)
        peak[0] = max(peak[0], _kib(peer.process.pid, "VmHWM"))
    finally:
        done.set()
        peer.stop()
    seconds = time.monotonic() - started
    print(f"fuzzed frames {args.frames} in {seconds:.0f} s ({args.frames / seconds:.0f}/s), clients {args.clients}, "
          f"seed {args.seed}")
    for outcome, n in counts.items():
        print(f"  {outcome:<18}{n}")
    print(f"  peer peak RSS     {peak[0] / 1024:.0f} MiB (memory budget {args.max_memory >> 20} MiB)")
    print(f"  afterwards        {'computes correctly' if correct else 'WRONG RESULT'}")
    return 0 if counts["hang"] == counts["crash"] == 0 and correct else 1


def _kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
