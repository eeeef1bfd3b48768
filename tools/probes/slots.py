"""Probe issue 44's rows 1, 5 and 11 against a real ``ember serve``: what a stranger's connections
hold of a peer before they are authenticated, and a peer out of files.

    python tools/probes/slots.py                          # this tree
    git archive 2a8b11e | tar -xC OLD; cd OLD; PYTHONPATH=OLD python $CHECKOUT/tools/probes/slots.py   # the tree issue 44 found

(from another directory: ``python -m ember.cli serve``, which the probe starts, looks in the
current directory before PYTHONPATH.)

Prints one Markdown table row per attack. Uses only what both trees have (``PeerProcess``, the
client, raw sockets); strangers come from other loopback addresses (127.0.0.2, …). Linux only
(/proc, prlimit). Row 1 exhausts the peer's files with idle connections (each sent the four bytes
of a frame's magic, then nothing), not the issue's fetches from a never-answering address: the
fetch path is probed apart.
"""

from __future__ import annotations

import os
import resource
import secrets
import socket
import sys
import tempfile
import threading
import time

import ember as em
from ember.engines import remote as remote_engine
from ember.remote.spawn import PeerProcess
from ember.wire import protocol as wire

CLIENT_TIMEOUT = 10.0  # how long a probing client waits for the peer's answer


def process(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {"rss": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"]),
            "files": len(os.listdir(f"/proc/{pid}/fd"))}


def connect_from(address: str, source: str, timeout: float = 5) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout, source_address=(source, 0))


def close_all(sockets) -> None:
    for sock in sockets:
        sock.close()


def frame(header: dict) -> bytes:
    return b"".join(wire.encode_frame(header))


def attempt(url: str, ca: str | None = None) -> str:
    """What a real client gets from ``url`` (a new session, one small computation), and how soon."""
    start = time.monotonic()
    try:
        device = em.device(url, tls_ca=ca) if ca else em.device(url)
        if device._engine is not None:
            device._engine.close()
            device._engine = None
        value = float(em.sum(em.ones(3, device=device)))
        outcome = f"served ({value:g})"
    except Exception as error:  # what the user would see
        outcome = f"{type(error).__name__}: {str(error)[:400]}"
    return f"{outcome} after {time.monotonic() - start:.2f} s"


def row(number: str, sent: str, measured: str) -> None:
    print(f"| {number} | {sent} | {measured} |", flush=True)


def certificates(folder: str) -> tuple[str, str, str]:
    import trustme
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    paths = [os.path.join(folder, name) for name in ("ca.pem", "cert.pem", "key.pem")]
    ca.cert_pem.write_to_path(paths[0])
    for k, blob in enumerate(leaf.cert_chain_pems):
        blob.write_to_path(paths[1], append=k > 0)
    leaf.private_key_pem.write_to_path(paths[2])
    return paths[0], paths[1], paths[2]


def row_1() -> None:
    """Idle connections until the peer, under a 1,024-file limit, runs out of files; a client that
    connects then; the idle ones closed: is that client served, and later ones?"""
    with PeerProcess("--max-sessions", "1200", "--handshake-timeout", "60") as peer:
        resource.prlimit(peer.pid, resource.RLIMIT_NOFILE, (1024, 1024))
        before = process(peer.pid)
        hogs = []
        sources = [f"127.0.0.{k}" for k in range(1, 5)]  # a quarter of the slots each, where the peer counts shares
        while process(peer.pid)["files"] < 1024 and len(hogs) < 1100:
            try:
                sock = connect_from(peer.address, sources[len(hogs) % 4], timeout=3)
                sock.sendall(b"EMBR")
            except OSError as error:  # the listen backlog is full: the peer accepts no more
                print(f"row 1: connection {len(hogs) + 1} failed: {error}", file=sys.stderr)
                break
            hogs.append(sock)
            if len(hogs) % 100 == 0:
                time.sleep(0.2)  # let the peer's threads catch up
        time.sleep(1)
        peak = process(peer.pid)
        outcome: list[str] = []
        waiting = threading.Thread(target=lambda: outcome.append(attempt(peer.url())), daemon=True)
        waiting.start()
        time.sleep(1)
        close_all(hogs)
        waiting.join(CLIENT_TIMEOUT + 10)
        later = attempt(peer.url())
        after = process(peer.pid)
        said = " / ".join(line.strip().removeprefix("ember serve: ")[:160] for line in peer.log if "accepting" in line)
        row("1", f"{len(hogs)} idle connections (4 bytes each), peer under a 1,024-file limit; a client connects, then "
                 f"the idle ones close",
            f"RSS {before['rss']:.0f}→{peak['rss']:.0f}→{after['rss']:.0f} MB, files {before['files']}→{peak['files']}→"
            f"{after['files']}, threads {before['threads']}→{peak['threads']}→{after['threads']}; the waiting client: "
            f"{outcome[0] if outcome else 'no answer'}; a later one: {later}; the log: {said or 'nothing'}")


def row_5(ca: str, cert: str, key: str) -> None:
    with PeerProcess() as plain, PeerProcess("--tls-cert", cert, "--tls-key", key) as secure:
        for source, who in (("127.0.0.1", "the same address as the client"), ("127.0.0.2", "another address")):
            for peer, scheme in ((plain, "ember"), (secure, "embers")):
                before = process(peer.pid)
                idle = [connect_from(peer.address, source) for _ in range(64)]
                time.sleep(0.3)
                during = process(peer.pid)
                got = attempt(peer.url(scheme), ca if scheme == "embers" else None)
                close_all(idle)
                row("5", f"64 idle sockets, no token, from {who}; then a real `{scheme}://` client",
                    f"files {before['files']}→{during['files']}, threads {before['threads']}→{during['threads']}; the "
                    f"client: {got}")
        bogus = []
        for _ in range(70):
            sock = connect_from(plain.address, "127.0.0.2")
            sock.sendall(frame({"t": "fetch", "v": wire.VERSION, "session": "s", "capability": secrets.token_bytes(32)}))
            bogus.append(sock)
        time.sleep(0.3)
        during = process(plain.pid)
        got = attempt(plain.url())
        answered = []
        for sock in bogus:
            sock.settimeout(0.2)
            try:
                data = sock.recv(65536)
                answered.append(wire.FrameReader().feed(data)[0].header.get("kind") if data else "closed")
            except (OSError, IndexError, Exception):
                answered.append("waiting")
        close_all(bogus)
        kinds = {kind: answered.count(kind) for kind in sorted(set(map(str, answered)))}
        row("5", "70 fetches with capabilities nobody granted, from another address; then a real `ember://` client",
            f"files {during['files']}, threads {during['threads']}; the client: {got}; the fetches: {kinds}")


def row_11() -> None:
    with PeerProcess() as peer:
        time.sleep(0.3)
        before = process(peer.pid)
        sockets = []
        for k in range(16):
            sock = connect_from(peer.address, "127.0.0.1")
            sock.sendall(b"GET"[:1 + k % 3])
            sock.close()
            sockets.append(sock)
        start = time.monotonic()
        peak = process(peer.pid)
        while process(peer.pid)["files"] > before["files"] and time.monotonic() - start < 20:
            time.sleep(0.01)
        seconds = time.monotonic() - start
        after = process(peer.pid)
        row("11", "16 connections: 1–3 bytes, then the client closes",
            f"files {before['files']}→{peak['files']}→{after['files']}, threads {before['threads']}→{peak['threads']}→"
            f"{after['threads']}; slots held {seconds:.2f} s after the closes")


def main() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this probe holds over a thousand sockets
    remote_engine.DEFAULT_TIMEOUT = CLIENT_TIMEOUT
    print(f"tree: {os.path.dirname(os.path.dirname(em.__file__))}", file=sys.stderr)
    print("| row | what was sent | RSS / files / threads / time / the error text |")
    print("| --- | --- | --- |")
    with tempfile.TemporaryDirectory() as folder:
        row_11()
        row_5(*certificates(folder))
        row_1()


if __name__ == "__main__":
    main()
