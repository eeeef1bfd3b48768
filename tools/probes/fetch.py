"""Probe issue 44's rows 2, 3, 4 and 7 against a real ``ember serve``: the fetch path between peers.

    python tools/probes/fetch.py                          # this tree
    git archive 2a8b11e | tar -xC OLD; cd OLD; PYTHONPATH=OLD python $CHECKOUT/tools/probes/fetch.py   # the tree issue 44 found

(from another directory: ``python -m ember.cli serve``, which the probe starts, looks in the
current directory before PYTHONPATH.)

Prints one Markdown table row per attack. The destination B is an ``ember serve`` child process
(``PeerProcess``) told to fetch from loopback (``--fetch-from 127.0.0.1``) where the tree has the
flag; the sources are played here by small socket servers speaking ember frames
(``ember.wire.protocol``): one that sends a tensor, one that always answers "not granted yet,
retry", one that never answers, a line-based service, an SSH-like banner, an HTTP server answering
403. The client asks B to fetch with ``RemoteEngine.fetch``, as ``x.to_device`` does, naming the
address and identity it likes. Uses only what both trees have. Linux only (/proc).
"""

from __future__ import annotations

import inspect
import os
import secrets
import selectors
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np

import ember as em
from ember.array import Array
from ember.ops.table import Meta
from ember.remote.server import Server
from ember.remote.spawn import PeerProcess
from ember.wire import protocol as wire

MiB = 1 << 20
PEER = "probe-source"  # the identity the fake sources give, and the client names
COMMANDS = b"\r\nSET k v\r\nQUIT\r\n".ljust(32, b"#")  # a capability of line-protocol commands
HAS_FETCH_FROM = "fetch_from" in inspect.signature(Server.__init__).parameters


def process(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {"rss": int(fields["VmRSS"].split()[0]) / 1024, "peak": int(fields["VmHWM"].split()[0]) / 1024,
            "threads": int(fields["Threads"]), "files": len(os.listdir(f"/proc/{pid}/fd"))}


def row(number: str, sent: str, measured: str) -> None:
    print(f"| {number} | {sent} | {measured} |", flush=True)


def destination(*args: str) -> PeerProcess:
    """B: a peer that fetches from loopback (where the tree knows --fetch-from)."""
    return PeerProcess(*(("--fetch-from", "127.0.0.1") if HAS_FETCH_FROM else ()), *args)


def fetch(device, port: int, capability: bytes | None = None, meta=Meta((4,), em.float64), scheme: str = "ember",
          host: str = "127.0.0.1"):
    """Ask ``device``'s peer to fetch a tensor from ``host``:``port``, named as the peer PEER."""
    source = SimpleNamespace(device=SimpleNamespace(scheme=scheme, host=host, port=port), info={"peer": PEER})
    return Array._new(device.engine.fetch(source, capability or secrets.token_bytes(32), meta), meta, device)


def outcome(array) -> str:
    try:
        em.asnumpy(array)
        return "fetched"
    except Exception as error:
        return f"{type(error).__name__}: {str(error)[:300]}"


def frame(header: dict, segments=()) -> bytes:
    return b"".join(bytes(b) for b in wire.encode_frame(header, list(segments)))


class Sources:
    """Fake source peers on ``count`` loopback ports: one thread accepts on all of them (a
    selector), one thread serves each connection. ``mode``: ``send`` (each capability gets
    ``array``), ``stall`` (all of ``array`` but its last 8 bytes, then nothing), ``retry`` (each
    gets "not granted yet, retry", then the connection closes), ``silent`` (no answer ever),
    ``lines`` (a line-based service such as Redis: it greets with ``banner``, answers each line
    with an error echoing it, and closes at ``QUIT``), ``http403``. An ember source names itself
    PEER when asked (the hello of the new tree); the old tree presents the capability at once.
    Counts connections: in all, open now, the most at once, and per second; keeps the first
    bytes received."""

    def __init__(self, mode: str, count: int = 1, array: np.ndarray | None = None, banner: bytes = b""):
        self.mode, self.array, self.banner = mode, array, banner
        self.selector = selectors.DefaultSelector()
        self.listeners = []
        for _ in range(count):
            listener = socket.create_server(("127.0.0.1", 0), backlog=128)
            listener.setblocking(False)
            self.selector.register(listener, selectors.EVENT_READ)
            self.listeners.append(listener)
        self.ports = [s.getsockname()[1] for s in self.listeners]
        self.connections = self.open = self.most = 0
        self.seconds: dict[int, int] = {}
        self.received = bytearray()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.running = True
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def close(self):
        self.running = False
        self.thread.join(5)
        for listener in self.listeners:
            listener.close()
        self.selector.close()
        for sock in list(self.sockets):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self):
        while self.running:
            for key, _ in self.selector.select(0.05):
                try:
                    conn, _ = key.fileobj.accept()
                except OSError:
                    continue
                conn.setblocking(True)
                with self.lock:
                    self.connections += 1
                    self.open += 1
                    self.most = max(self.most, self.open)
                    second = int(time.monotonic() - self.started)
                    self.seconds[second] = self.seconds.get(second, 0) + 1
                    self.sockets.append(conn)
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, sock):
        reader = wire.FrameReader()
        pending = b""
        try:
            if self.banner:
                sock.sendall(self.banner)
            while data := sock.recv(1 << 16):
                with self.lock:
                    if len(self.received) < 4096:
                        self.received += data[:4096]
                if self.mode == "lines":  # as Redis's inline protocol: an error per line, echoing it; QUIT closes
                    pending = (pending + data).split(b"\r\n")
                    for line in pending[:-1]:
                        if line.upper() == b"QUIT":
                            sock.sendall(b"+OK\r\n")
                            return
                        sock.sendall(b"-ERR unknown command '" + line[:40] + b"'\r\n")
                    pending = pending[-1]
                    continue
                if self.mode == "http403":
                    if b"\r\n\r\n" in data:
                        sock.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 9\r\n\r\nforbidden")
                        return
                    continue
                for received in reader.feed(data):
                    header = received.header
                    if "capability" not in header:  # the new tree's hello
                        sock.sendall(frame({"t": "peer", "v": wire.VERSION, "peer": PEER}))
                        continue
                    if self.mode == "retry":
                        sock.sendall(frame({"t": "refuse", "kind": "AccessDenied", "retry": True,
                                            "reason": "unknown capability: this peer has not granted it (yet)"}))
                        return
                    if self.mode == "send":
                        sock.sendall(frame({"t": "tensor"}, [self.array]))
                    if self.mode == "stall":  # all of it but its last 8 bytes, then nothing
                        sock.sendall(frame({"t": "tensor"}, [self.array])[:-8])
        except Exception:
            pass
        finally:
            sock.close()
            with self.lock:
                self.open -= 1
                self.sockets.remove(sock)


def row_2() -> None:
    """16 × (fetch 32 MiB from a source that sends all of it but 8 bytes, then drop), under a 64 MiB
    session quota (a source that sends it all, as the issue's, leaves less to see: each buffer goes
    once its fetch is done)."""
    array = np.ones(4 * MiB)
    sources = Sources("stall", array=array)
    try:
        with destination("--max-session-bytes", str(64 * MiB), "--max-memory", str(256 * MiB)) as peer:
            b = em.device(peer.url())
            em.sync(b)
            before = process(peer.pid)
            for _ in range(16):
                y = fetch(b, sources.ports[0], meta=Meta(array.shape, em.float64))
                time.sleep(0.2)  # its bytes arrive (but the last 8)
                del y
            try:
                em.sync(b)
                said = "no error"
            except Exception as error:
                said = f"{type(error).__name__}: {str(error)[:160]}"
            reported = b.engine.peer_stats().get("session_bytes", "n/a")
            time.sleep(1)
            after = process(peer.pid)
            row("2", "16 × (fetch 32 MiB from a source that sends all but its last 8 bytes, 0.2 s, then drop), "
                     "`--max-session-bytes 64Mi --max-memory 256Mi`",
                f"RSS {before['rss']:.0f} → peak {after['peak']:.0f} MB (1 s later {after['rss']:.0f} MB); the session "
                f"reports {reported} bytes; the sync says: {said}; connections to the source still open: {sources.open}")
            b.engine.close()
    finally:
        sources.close()


def row_3() -> None:
    """An authenticated fetch naming a line-based service, an SSH banner, an HTTP server, a closed port."""
    for label, mode, banner, scheme in [("3a", "lines", b"", "ember"), ("3b", "lines", b"SSH-2.0-OpenSSH_9.6\r\n", "ember"),
                                        ("3c", "http403", b"", "ws"), ("3d", "lines", b"", "ws")]:
        service = Sources(mode, banner=banner)
        try:
            with destination() as peer:
                b = em.device(peer.url())
                start = time.monotonic()
                # over ws the client names the host "localhost": whose Host header does the service get?
                said = outcome(fetch(b, service.ports[0], capability=COMMANDS, scheme=scheme,
                                     host="localhost" if scheme == "ws" else "127.0.0.1"))
                took = time.monotonic() - start
                time.sleep(0.3)
                received = bytes(service.received)
                lines = received.count(b"\r\n")
                host = next((line.decode(errors="replace") for line in received.split(b"\r\n")
                             if line.lower().startswith(b"host:")), None)
                what = {"lines": "a line-based service (Redis-like)", "http403": "an HTTP server answering 403"}[mode]
                if banner:
                    what = "a service that greets with `SSH-2.0-…`"
                where = "localhost" if scheme == "ws" else "127.0.0.1"
                row(label, f"`{scheme}` fetch naming {what} on {where} with capability `\\r\\nSET k v\\r\\nQUIT\\r\\n…`",
                    f"it received {len(received)} bytes ({lines} CRLF lines; `SET k v` among them: "
                    f"{b'SET k v' in received}{'; ' + host if host else ''}); the client reads after {took:.1f} s: {said}")
                b.engine.close()
        finally:
            service.close()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with destination() as peer:
        b = em.device(peer.url())
        row("3e", "fetch naming a closed loopback port", outcome(fetch(b, port)))
        b.engine.close()
    if HAS_FETCH_FROM:  # the default: no --fetch-from
        service = Sources("lines")
        try:
            with PeerProcess() as peer:
                b = em.device(peer.url())
                said = outcome(fetch(b, service.ports[0], capability=COMMANDS))
                time.sleep(0.3)
                row("3f", "the same fetch to a peer started without `--fetch-from` (the default)",
                    f"the service received {len(service.received)} bytes; {said}")
                b.engine.close()
        finally:
            service.close()
    else:
        row("3f", "the same fetch to a peer started without `--fetch-from` (the default)", "n/a (no such flag)")


def row_4() -> None:
    """One fetch from a source that always says retry; 100 fetches in one batch from a silent source."""
    source = Sources("retry")
    try:
        with destination() as peer:
            b = em.device(peer.url())
            y = fetch(b, source.ports[0])
            time.sleep(5)
            counts = dict(source.seconds)
            threads = process(peer.pid)["threads"]
            del y
            em.sync(b)
            row("4a", "one fetch from a source that always answers \"refused, retry\"",
                f"{source.connections} connections in 5 s (per second: {', '.join(str(counts[k]) for k in sorted(counts))}); "
                f"B has {threads} threads")
            b.engine.close()
    finally:
        source.close()
    source = Sources("silent")
    try:
        with destination() as peer:
            b = em.device(peer.url())
            em.sync(b)
            before = process(peer.pid)
            engine = b.engine
            where = SimpleNamespace(device=SimpleNamespace(scheme="ember", host="127.0.0.1", port=source.ports[0]),
                                    info={"peer": PEER})
            meta = Meta((4,), em.float64)
            with engine._lock:  # one batch: each fetch would be sent at once
                flush, engine.flush = engine.flush, lambda: None
                try:
                    arrays = [Array._new(engine.fetch(where, secrets.token_bytes(32), meta), meta, b) for _ in range(100)]
                finally:
                    engine.flush = flush
                engine.flush()
            time.sleep(2)
            during = process(peer.pid)
            del arrays
            em.sync(b)
            time.sleep(1)
            after = process(peer.pid)
            row("4b", "100 fetches in one batch from a source that accepts and never answers",
                f"{source.most} connections open at once ({source.connections} in all); B threads {before['threads']} → "
                f"{during['threads']}, files {before['files']} → {during['files']}; 1 s after their drop: "
                f"{source.open} open, threads {after['threads']}, files {after['files']}")
            b.engine.close()
    finally:
        source.close()


def row_7(count: int = 300, wait: float = 20.0) -> None:
    """Fetches from ``count`` distinct sources, then the session closes: B's files ``wait`` s later."""
    sources = Sources("send", count=count, array=np.ones(4))
    try:
        with destination() as peer:
            b = em.device(peer.url())
            em.sync(b)
            before = process(peer.pid)
            for port in sources.ports:
                em.asnumpy(fetch(b, port))
            done = process(peer.pid)
            b.engine.close()
            time.sleep(wait)
            after = process(peer.pid)
            row("7", f"fetches from {count} distinct sources, then the session closes",
                f"B files {before['files']} → {done['files']} → {after['files']} {wait:g} s after the close "
                f"(sources' connections still open: {sources.open})")
    finally:
        sources.close()


def main() -> None:
    print(f"tree: {os.path.dirname(os.path.dirname(em.__file__))} (--fetch-from: {HAS_FETCH_FROM})")
    print("| row | what was sent | measured |")
    print("| --- | --- | --- |")
    for probe in (row_2, row_3, row_4, row_7):
        probe()


if __name__ == "__main__":
    main()
