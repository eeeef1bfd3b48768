#!/usr/bin/env python3
"""A long fuzz run against a real ``ember serve``: mutated real traffic, with its figures.

The frames a real client sent a real peer (tests/traffic.py records them) are mutated — bytes
flipped, cut, repeated or inserted, and values inside decoded messages replaced by odd ones —
and sent over TCP by several clients at once, each after a valid handshake (and some before
it: mutated handshakes). After each fuzzed frame the client asks for a sync and waits:

- *answered*: the peer answered the sync (an error reply counts: the session lives on);
- *refused*: the peer sent an error frame (a ProtocolError, a refused handshake) and closed;
- *closed*: the peer closed without a word — a frame the mutation cut short ended at the
  client's end of stream, or a handshake it could not parse;
- *hang*: the connection was neither answered nor closed within the timeout (a bug);
- *crash*: the peer process died (a bug; it is restarted).

Each case is a fresh connection: after the fuzzed frame and a sync the client closes its sending
side, so a mutation that announces more bytes than it sends cannot make the peer wait.

At the end a fresh client checks the peer still computes correctly, and the peer's peak memory
(VmHWM) is reported against its memory budget. docs/security.md records a run.

    python tools/fuzz.py                      # 100,000 fuzzed frames, 4 clients
    python tools/fuzz.py --frames 5000 --clients 2 --seed 7
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import ember as em  # noqa: E402
from ember.errors import EmberError  # noqa: E402
from ember.remote.spawn import PeerProcess  # noqa: E402
from ember.wire import protocol as wire  # noqa: E402
from tests.traffic import ODD_VALUES, mutate, record_traffic  # noqa: E402

INIT = wire.encode_frame({"t": "init", "v": wire.VERSION, "device": 0})
SYNC = b"".join(bytes(b) for b in wire.encode_frame({"t": "batch", "m": (("sync", 1),)}))


def _mutations(rng: random.Random) -> list:
    # half the cases change values inside a well-formed frame, which reach the session's handlers
    kinds = ["message"] if rng.random() < 0.5 else ["message", "flip", "truncate", "repeat", "insert"]
    return [(kind, rng.randrange(1 << 20), rng.randrange(len(ODD_VALUES)) if kind == "message" else rng.randrange(1, 256))
            for kind in rng.choices(kinds, k=rng.randint(1, 4))]


def case(address: str, data: bytes, timeout: float, handshake: bytes | None = None) -> str:
    """One fuzz case on a fresh connection: a handshake (``handshake``, or a valid one), the fuzzed
    frame and a sync, then the client stops sending; what the peer did before it closed."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        sock.sendall(handshake or b"".join(bytes(b) for b in INIT))
        reader = wire.FrameReader(wire.Limits(max_frame_bytes=1 << 30))
        if handshake is None:
            _frames(sock, reader, 1)  # the info frame
        sock.sendall(data + SYNC)
        sock.shutdown(socket.SHUT_WR)  # a frame cut short by the mutation ends here: the peer must not wait forever
        answered = refused = False
        start = time.monotonic()
        while True:
            frames = _frames(sock, reader, 1)
            if frames is None:  # the peer closed
                return "answered" if answered else "refused" if refused else "closed"
            if time.monotonic() - start > timeout:
                return "hang"
            for frame in frames:
                kind = frame.header.get("t")
                refused = refused or kind in ("error", "refuse")
                answered = answered or (kind == "reply" and any(
                    isinstance(m, tuple) and m[:2] in (("ok", 1), ("error", 1)) for m in frame.header.get("m", ())))
    except TimeoutError:
        return "hang"
    except (ConnectionError, OSError, EmberError):
        return "closed"
    finally:
        sock.close()


def _frames(sock: socket.socket, reader, at_least: int) -> list | None:
    """Frames read until at least one arrives; None when the peer closed."""
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        frames = reader.feed(chunk)
        if len(frames) >= at_least:
            return frames


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=100_000, help="fuzzed frames to send (default 100,000)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds without an answer that count as a hang")
    parser.add_argument("--max-memory", type=int, default=512 << 20, help="the peer's memory budget (bytes)")
    args = parser.parse_args(argv)
    traffic = record_traffic()
    counts = {"answered": 0, "refused": 0, "closed": 0, "hang": 0, "crash": 0, "handshakes fuzzed": 0,
              "peer tracebacks": 0}
    lock = threading.Lock()
    peer_args = ("--max-memory", str(args.max_memory), "--max-tensor-bytes", str(64 << 20))
    peer = PeerProcess(*peer_args)
    peak = [0]
    started = time.monotonic()

    def watch_memory():
        while peer.process.poll() is None and not done.is_set():
            peak[0] = max(peak[0], _kib(peer.process.pid, "VmHWM"))
            time.sleep(0.5)

    def work(worker: int, frames: int):
        nonlocal peer
        rng = random.Random(args.seed * 1000 + worker)
        for _ in range(frames):
            handshake = None
            if rng.random() < 0.05:  # a mutated handshake: the frame must then find no session
                handshake = mutate(b"".join(bytes(b) for b in INIT), _mutations(rng))
            outcome = case(peer.address, mutate(rng.choice(traffic), _mutations(rng)), args.timeout, handshake)
            with lock:
                if peer.process.poll() is not None:
                    counts["crash"] += 1
                    counts["peer tracebacks"] += peer.tracebacks
                    peer = PeerProcess(*peer_args)
                counts[outcome] += 1
                counts["handshakes fuzzed"] += handshake is not None
                total = sum(counts[o] for o in ("answered", "refused", "closed", "hang"))
                if total % 10_000 == 0:
                    print(f"  {total} frames: {counts}", file=sys.stderr, flush=True)

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
        counts["peer tracebacks"] += peer.tracebacks
    seconds = time.monotonic() - started
    print(f"fuzzed frames {args.frames} in {seconds:.0f} s ({args.frames / seconds:.0f}/s), clients {args.clients}, "
          f"seed {args.seed}")
    for outcome, n in counts.items():
        print(f"  {outcome:<18}{n}")
    print(f"  peer peak RSS     {peak[0] / 1024:.0f} MiB (memory budget {args.max_memory >> 20} MiB)")
    print(f"  afterwards        {'computes correctly' if correct else 'WRONG RESULT'}")
    return 0 if counts["hang"] == counts["crash"] == counts["peer tracebacks"] == 0 and correct else 1


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
