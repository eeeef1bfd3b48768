"""Probe issue 44's rows 6, 10 and 12 against a real ``ember serve``: what a session makes the peer
hold beyond its tensors' data (ids, failed outputs, graphs and their ops), the scratch and reply
copies an op or a read makes, and the idle buffers the pool keeps once every client has left.

    python tools/probes/accounting.py                                                 # this tree
    git archive 2a8b11e | tar -xC OLD; cd OLD; PYTHONPATH=OLD python $CHECKOUT/tools/probes/accounting.py  # issue 44 found
    python tools/probes/accounting.py --measure   # the per-id figures session.py counts (tracemalloc, in-process)

(from another directory: ``python -m ember.cli serve``, which the probe starts, looks in the
current directory before PYTHONPATH.)

Prints one Markdown table row per attack: the peer's RSS before → after (VmRSS; VmHWM for a
peak), what the session says it holds (``stats``), the peer's CPU time where it matters, and the
first error the session reported. Frames are sent raw over TCP after an ``init`` handshake. Uses
only what both trees have. Linux only (/proc). About a minute.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

import numpy as np

import ember as em
from ember.remote.spawn import PeerProcess
from ember.wire import protocol as wire
from ember.wire import tcp

MiB = 1 << 20


def process(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    with open(f"/proc/{pid}/stat") as f:
        ticks = f.read().rsplit(")", 1)[1].split()
    return {"rss": int(fields["VmRSS"].split()[0]) / 1024, "hwm": int(fields["VmHWM"].split()[0]) / 1024,
            "threads": int(fields["Threads"]), "files": len(os.listdir(f"/proc/{pid}/fd")),
            "cpu": (int(ticks[11]) + int(ticks[12])) / os.sysconf("SC_CLK_TCK")}


def row(number: str, sent: str, measured: str) -> None:
    print(f"| {number} | {sent} | {measured.replace('|', '/')} |", flush=True)


class Raw:
    """A session spoken to in raw frames, as any client could."""

    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.connection = tcp.connect(host, int(port), wire.HANDSHAKE_LIMITS, timeout=300)
        self.connection.send(wire.encode_frame({"t": "init", "v": wire.VERSION, "device": 0, "token": None}))
        info = self.connection.receive().header
        assert info["t"] == "info", info
        self.limits = info["limits"]
        self.connection.set_limits(wire.Limits.from_dict(info["limits"]))

    def send(self, messages, segments=()) -> None:
        self.connection.send(wire.encode_frame({"t": "batch", "m": tuple(messages)}, list(segments)))

    def ask(self, messages=(), segments=()) -> tuple[dict, list]:
        """Send ``messages`` with a ``stats`` and a ``sync`` behind them: (the stats, every other reply)."""
        self.send((*messages, ("stats", 0), ("sync", 1)), segments)
        frame = self.connection.receive()
        if frame.header.get("t") != "reply":
            return {}, [frame.header]
        replies = frame.header["m"]
        stats = next((r[2] for r in replies if r[0] == "stats"), {})
        return stats, [r for r in replies if r[0] != "stats"]

    def close(self) -> None:
        self.connection.close()


def first_error(replies: list) -> str:
    for reply in replies:
        if isinstance(reply, dict):  # a frame that ends the session
            return f"{reply.get('kind')}: {str(reply.get('reason'))[:160]} (connection closed)"
        if reply[0] == "error":
            return f"{reply[2]}: {reply[3][:160]}"
    return "no error"


def outcome(peer, before: dict, stats: dict, replies: list, peak: bool = False) -> str:
    after = process(peer.pid)
    key = "hwm" if peak else "rss"
    return (f"{'peak ' if peak else ''}RSS {before[key]:.0f} → {after[key]:.0f} MB (+{after[key] - before[key]:.0f}); "
            f"session says {stats.get('session_used_bytes', stats.get('session_bytes', '?'))} bytes, "
            f"{stats.get('session_tensors', '?')} tensors, "
            f"{stats.get('session_graphs', '?')} graphs; CPU {after['cpu'] - before['cpu']:.1f} s; {first_error(replies)}")


def chain(gid, ops: int) -> tuple:
    records = tuple(("negative", (k,), (k + 1,), {}) for k in range(ops))
    return ("graph", gid, ((0, em.float64, (4,)),), (ops,), records, ())


# --- row 6 ---------------------------------------------------------------------------------------------

def graphs_of_2000_ops() -> None:
    with PeerProcess() as peer:
        session, before = Raw(peer.address), process(peer.pid)
        for first in range(0, 400, 50):  # 50 graphs a frame (~1.8 MB of header)
            session.send([chain(gid, 2000) for gid in range(first, first + 50)])
        stats, replies = session.ask()
        row("6", "400 graphs of 2,000 ops", outcome(peer, before, stats, replies))
        session.ask([("forget", gid) for gid in range(400)])
        stats, replies = session.ask()
        held = stats.get("session_used_bytes", stats.get("session_bytes"))
        row("6", "… then `forget` of all 400", f"session says {held} bytes, {stats.get('session_graphs')} graphs")
        session.close()


def string_graph_ids() -> None:
    with PeerProcess() as peer:
        session, before = Raw(peer.address), process(peer.pid)
        for k in range(40):
            session.send([chain(f"{k:03d}" + "g" * (3 << 20), 1)])
            stats, replies = session.ask()
            if replies and isinstance(replies[0], dict):  # refused: the peer closed this connection; the next one
                session.close()
                session = Raw(peer.address)
        row("6", "40 graph ids that are 3 MB strings", outcome(peer, before, stats, replies))
        session.close()


def huge_graph() -> None:
    with PeerProcess() as peer:
        session, before = Raw(peer.address), process(peer.pid)
        stats, replies = session.ask([chain(1, 110_000), ("put", 2, 0), ("run", 1, (2,), (3,)), ("get", 9, 3)],
                                     [np.ones(4)])
        row("6", "one 110k-op graph (and a run of it)", outcome(peer, before, stats, replies, peak=True))
        session.close()


def unknown_input_outputs() -> None:
    with PeerProcess() as peer:
        session, before = Raw(peer.address), process(peer.pid)
        for first in range(1000, 1000 + 2_800_000, 100_000):  # one op of 100k outputs a frame
            session.send([("op", "negative", (7,), tuple(range(first, first + 100_000)), {})])
        stats, replies = session.ask([("get", 9, 1000 + 2_800_000 - 1)])
        row("6", "2.8M outputs of ops on an unknown input (28 ops of 100k outputs)", outcome(peer, before, stats, replies))
        session.close()


def empty_tensors() -> None:
    with PeerProcess() as peer:
        session, before = Raw(peer.address), process(peer.pid)
        for first in range(0, 600_000, 50_000):
            session.send([("put", first + k, k) for k in range(50_000)], [np.ones(0) for _ in range(50_000)])
        stats, replies = session.ask()
        row("6", "600k empty tensors", outcome(peer, before, stats, replies))
        session.close()


# --- row 10 --------------------------------------------------------------------------------------------

def padded_conv2d() -> None:
    with PeerProcess("--max-tensor-bytes", str(MiB)) as peer:
        session, before = Raw(peer.address), process(peer.pid)
        one = np.ones((1, 1, 1, 1))
        stats, replies = session.ask([("put", 1, 0), ("put", 2, 1),
                                      ("op", "conv2d", (1, 2), (3,), {"padding": 2500, "stride": 2500}), ("get", 9, 3)],
                                     [one, one])
        row("10", "`conv2d` of a 1-element input, `padding=2500`, peer `--max-tensor-bytes 1MiB`",
            outcome(peer, before, stats, replies, peak=True))
        session.close()


def transposed_reads(*flags: str) -> None:
    with PeerProcess("--max-tensor-bytes", str(MiB), *flags) as peer:
        session, before = Raw(peer.address), process(peer.pid)
        session.send([("put", 1, 0), *(("op", "permute_dims", (1,), (10 + k,), {"axes": (1, 0)}) for k in range(300))],
                     [np.ones((512, 256))])
        session.send([("get", k, 10 + k) for k in range(300)])  # ~10 KB of headers
        frame = session.connection.receive()
        kinds = [r[0] for r in frame.header.get("m", ())]
        stats, replies = session.ask()
        errors = [r for r in frame.header.get("m", ()) if r[0] == "error"]
        peer_flags = f" (peer `{' '.join(flags)}`)" if flags else ""
        row("10", f"300 reads of 300 transposed views of one 1 MiB tensor, one batch{peer_flags}",
            outcome(peer, before, stats, errors, peak=True) + f"; {kinds.count('data')} reads answered")
        session.close()


# --- row 12 --------------------------------------------------------------------------------------------

def distinct_sizes_then_leave() -> None:
    with PeerProcess() as peer:
        before = process(peer.pid)
        session = Raw(peer.address)
        for k in range(300):  # 300 distinct sizes from 1 MiB (the pool keeps buffers from 1 MiB): ~660 MB in all
            nbytes = MiB + k * 8192
            session.send([("put", k, 0)], [np.ones(nbytes // 8)])
            session.send([("drop", (k,))])
        session.ask()
        held = process(peer.pid)
        session.close()
        time.sleep(3)  # past one sample of the peer's (every 2 s)
        after = process(peer.pid)
        with urllib.request.urlopen(f"http://{peer.address}/status.json", timeout=10) as reply:
            memory = json.load(reply)["memory"]
        row("12", "300 uploads of distinct sizes (1–3.4 MiB), each dropped; then the client leaves",
            f"RSS {before['rss']:.0f} → {held['rss']:.0f} MB with the client, {after['rss']:.0f} MB 3 s after it left; "
            f"the budget counts {memory['used_bytes'] / MiB:.0f} MiB in use with no session open")


def measure() -> None:
    """The figures behind memory.py's TENSOR_OVERHEAD and friends: tracemalloc over real frames fed to a session."""
    import gc
    import tracemalloc

    import ember.dtypes as dt
    from ember.remote.host import Host, hosted_devices
    from ember.remote.memory import Budget
    from ember.wire.protocol import Frame, FrameReader, Limits

    def opened():
        host = Host(hosted_devices("numpy"), None, Limits(max_tensor_bytes=1 << 30), Budget(1 << 34))
        return host.open(Frame({"t": "init", "v": wire.VERSION}, []))[0]

    def send(session, messages, segments=()):
        data = b"".join(bytes(b) for b in wire.encode_frame({"t": "batch", "m": tuple(messages)}, list(segments)))
        (frame,) = FrameReader(session.limits, session.allocate).feed(data)
        return frame

    def traced(label, count, frames_of, prepare=(), decoded=False):
        """Per item: what the session holds after ``frames_of``'s frames, and at the peak. Frames are
        decoded while traced (the arrays of a frame's tensors are made then, and kept), unless
        ``decoded``: then the peak leaves out the header's own memory, the reader's."""
        session = opened()
        for messages, segments in prepare:
            session.handle(send(session, messages, segments))
        frames = list(frames_of(session)) if decoded else None
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for frame in frames if decoded else frames_of(session):
            session.handle(frame)
        del frames
        gc.collect()
        kept, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"| {label} | {(kept - base) / count:.0f} B kept | {(peak - base) / count:.0f} B at the peak |")

    print("| what (per item) | held after | peak while handled |\n| --- | --- | --- |")
    for n in (10_000, 50_000):
        traced(f"an op's output (1 element), {n}", n, lambda s: (send(s, [("op", "negative", (1,), (10**6 + k + j,), {})
                                                                         for j in range(1000)]) for k in range(0, n, 1000)),
               prepare=[([("put", 1, 0)], [np.ones(1)])])
        traced(f"an empty tensor put, {n}", n, lambda s: (send(s, [("put", 10**6 + k + j, j) for j in range(1000)],
                                                             [np.ones(0) for _ in range(1000)]) for k in range(0, n, 1000)))
        traced(f"a failed output (unknown input), {n}", n, lambda s: (send(s, [("op", "negative", (7,), (10**6 + k + j,), {})
                                                                              for j in range(1000)]) for k in range(0, n, 1000)))
    for ops in (10_000, 50_000):
        records = tuple(("add", (k, (1.5, "float64")), (k + 1,), {}) for k in range(ops))
        traced(f"a graph op (with a literal), graph of {ops}", ops,
               lambda s: [send(s, [("graph", 5, ((0, dt.float64, (4,)),), (ops,), records, ())])], decoded=True)
    traced("a 1-op graph, 5,000 of them", 5000,
           lambda s: [send(s, [("graph", g, ((0, dt.float64, (4,)),), (1,), (("negative", (0,), (1,), {}),), ())])
                      for g in range(5000)], decoded=True)


def main() -> None:
    if "--measure" in sys.argv:
        measure()
        return
    print(f"ember from {os.path.dirname(em.__file__)}\n")
    print("| row | what was sent | what the peer did |\n| --- | --- | --- |")
    for attack in (graphs_of_2000_ops, string_graph_ids, huge_graph, unknown_input_outputs, empty_tensors, padded_conv2d,
                   transposed_reads, lambda: transposed_reads("--max-memory", str(1 << 30)), distinct_sizes_then_leave):
        attack()


if __name__ == "__main__":
    main()
