"""The remote benchmark, on a loopback compute peer (``ember serve`` in a child process).

(a) a 1000-op chain on 1,000 float32 elements, then one read — remote vs the local numpy device
    (target ≤ 2×);
(b) upload and download of a 256 MiB float32 tensor vs raw-socket throughput measured in the
    same run against a raw-socket child process (target ≥ 0.8×), over TCP and WebSocket;
(c) the latency of one small op and its read vs a raw TCP echo round trip, each transport beside the
    echo alone and then the three in turn, placed freely by the scheduler, then pinned to one CPU and
    to two;
(d) the same 256 MiB upload and download over TCP+TLS (``embers://``, a second peer with a
    throwaway certificate) vs plain TCP, the two interleaved on their own;
(e) 100 elementwise ops on 1,000,000 float32, then one read, on the peer (eager, and under
    ``em.jit``) vs the local numpy device eager;
(f) (a)'s chain, and 100 one-element reads, inside ``em.profile()`` vs outside (target ≤ 1.05×).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import numpy as np

import ember as em
from ember.remote.spawn import PeerProcess

from .core import chain
from .rawsocket import RawPeer
from .timing import Report, Row, medians

MIB = 1 << 20


def _tls_peer(stack: contextlib.ExitStack, report: Report):
    """An ``embers://`` device of a TLS peer whose certificate comes from a throwaway CA (trustme),
    or None with a note when trustme is missing."""
    try:
        import trustme
    except ImportError:
        report.notes.append("(d) skipped: trustme is not installed: pip install 'ember[bench]'")
        return None
    folder = stack.enter_context(tempfile.TemporaryDirectory())
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(f"{folder}/ca.pem")
    leaf.cert_chain_pems[0].write_to_path(f"{folder}/cert.pem")
    leaf.private_key_pem.write_to_path(f"{folder}/key.pem")
    peer = stack.enter_context(PeerProcess("--tls-cert", f"{folder}/cert.pem", "--tls-key", f"{folder}/key.pem"))
    return em.device(peer.url("embers"), tls_ca=f"{folder}/ca.pem")


def _placed_latencies(peer_pid: int, raw: RawPeer, op_and_read, repeats: int):
    """(c) again with this process and both servers' threads pinned to one CPU, then to two:
    where the scheduler puts them decides whether a wake-up is a context switch or a wake of
    another CPU (on a VM, tens of µs when that vCPU has halted), so the free row above moves
    with the placement. Nothing where CPU affinity cannot be set or there is one CPU."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return
    cpus = sorted(os.sched_getaffinity(0))
    tasks = [int(tid) for pid in (peer_pid, raw.process.pid) for tid in os.listdir(f"/proc/{pid}/task")]
    try:
        for placement, here, there in (("one CPU", {cpus[0]}, {cpus[0]}), ("two CPUs", {cpus[0]}, {cpus[1]})):
            os.sched_setaffinity(0, here)
            for task in tasks:
                os.sched_setaffinity(task, there)
            yield placement, medians({"raw": raw.echo, "tcp": op_and_read}, repeats, warmup=20)
    finally:
        for task in (0, *tasks):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(task, cpus)


BULK_TARGET = {"TCP": "≥ 0.90x", "WebSocket": "reported"}  # WebSocket is the transport for proxies, not bulk data


def run(quick: bool = False) -> Report:
    """Measure (a), (b), (c) and (d) against fresh child processes."""
    report = Report("remote")
    repeats = 5 if quick else 15
    with PeerProcess() as peer, contextlib.ExitStack() as stack:
        tcp, ws = em.device(peer.url("ember")), em.device(peer.url("ws"))
        tls = _tls_peer(stack, report)
        local = em.device("numpy")
        host = np.random.default_rng(0).random(1000, dtype=np.float32)
        # devices compare by hardware (ws and tcp are one device), so key by name
        xs = {name: em.asarray(host, device=d) for name, d in (("local", local), ("tcp", tcp), ("ws", ws))}
        t = medians({name: (lambda x=x: em.asnumpy(chain(em, x, 1000))) for name, x in xs.items()}, repeats)
        report.add(Row("(a) 1000-op chain + read, remote TCP", t["tcp"], "local", t["local"], "≤ 1.50x", stolen=t.stolen))
        report.add(Row("(a) 1000-op chain + read, remote WebSocket", t["ws"], "local", t["local"], "≤ 1.50x", stolen=t.stolen))
        trips = em.stats(tcp)["round_trips"]
        em.asnumpy(chain(em, xs["tcp"], 1000))
        report.notes.append(f"(a) round trips for the chain and its read: {em.stats(tcp)['round_trips'] - trips}")

        def profiled(work):
            with em.profile():
                work()

        def reads():
            for i in range(100):
                float(xs["tcp"][i])

        def chained():
            em.asnumpy(chain(em, xs["tcp"], 1000))

        t = medians({"plain": chained, "profiled": lambda: profiled(chained),
                     "reads": reads, "reads profiled": lambda: profiled(reads)}, repeats * 2)
        report.add(Row("(f) 1000-op chain + read, TCP, under em.profile()", t["profiled"], "unprofiled", t["plain"], "≤ 1.05x",
                       stolen=t.stolen))
        report.add(Row("(f) 100 reads of one element, TCP, under em.profile()", t["reads profiled"], "unprofiled",
                       t["reads"], "reported", stolen=t.stolen))

        big_host = np.random.default_rng(2).random(1_000_000, dtype=np.float32)
        big_local, big_remote = em.asarray(big_host, device=local), em.asarray(big_host, device=tcp)
        jitted = em.jit(lambda x: chain(em, x, 100))
        t = medians({"local": lambda: em.asnumpy(chain(em, big_local, 100)),
                     "tcp": lambda: em.asnumpy(chain(em, big_remote, 100)),
                     "jit": lambda: em.asnumpy(jitted(big_remote))}, max(3, repeats // 3))
        report.add(Row("(e) 100 ops on 1e6 float32 + read, TCP", t["tcp"], "local", t["local"], "≤ 1.10x", stolen=t.stolen))
        report.add(Row("(e) the same under em.jit, TCP", t["jit"], "local", t["local"], "reported", stolen=t.stolen))

        size = (64 if quick else 256) * MIB
        big = np.random.default_rng(1).random(size // 4, dtype=np.float32)
        raw = RawPeer()
        try:
            remote_big = {}

            def up(name, d):
                remote_big[name] = em.asarray(big, device=d)
                em.sync(d)

            transfer_repeats = 3 if quick else 7
            t = medians({"raw": lambda: raw.upload(big), "tcp": lambda: up("tcp", tcp), "ws": lambda: up("ws", ws)},
                        transfer_repeats)
            for name, d in (("TCP", "tcp"), ("WebSocket", "ws")):
                report.add(Row(f"(b) upload {size // MIB} MiB, {name}", size / t[d], "raw", size / t["raw"], BULK_TARGET[name],
                               unit="B/s", higher_is_better=True, stolen=t.stolen))
            t = medians({"raw": lambda: raw.download(size), "tcp": lambda: em.asnumpy(remote_big["tcp"]),
                         "ws": lambda: em.asnumpy(remote_big["ws"])}, transfer_repeats)
            for name, d in (("TCP", "tcp"), ("WebSocket", "ws")):
                report.add(Row(f"(b) download {size // MIB} MiB, {name}", size / t[d], "raw", size / t["raw"], BULK_TARGET[name],
                               unit="B/s", higher_is_better=True, stolen=t.stolen))

            if tls is not None:  # a pair of its own: in (b)'s rotation, whatever follows WebSocket measured slower
                t = medians({"tcp": lambda: up("tcp", tcp), "tls": lambda: up("tls", tls)}, transfer_repeats)
                report.add(Row(f"(d) upload {size // MIB} MiB, TCP+TLS", size / t["tls"], "TCP", size / t["tcp"],
                               "reported", unit="B/s", higher_is_better=True, stolen=t.stolen))
                t = medians({"tcp": lambda: em.asnumpy(remote_big["tcp"]), "tls": lambda: em.asnumpy(remote_big["tls"])},
                            transfer_repeats)
                report.add(Row(f"(d) download {size // MIB} MiB, TCP+TLS", size / t["tls"], "TCP", size / t["tcp"],
                               "reported", unit="B/s", higher_is_better=True, stolen=t.stolen))
            remote_big.clear()

            raw.start_echo(64)
            one = {name: em.asarray(np.ones(4, np.float32), device=d) for name, d in (("tcp", tcp), ("ws", ws))}
            latency_repeats = 200 if quick else 1000
            op_and_read = {name: (lambda x=x: em.asnumpy(x + 1)) for name, x in one.items()}
            # each transport beside the echo alone: in a rotation of all three, the other session's thread, polling
            # for its next frame after each reply (EMBER_SPIN_US), shares the two CPUs with the one measured next;
            # that rotation is reported too
            for name, label, target in (("tcp", "TCP", "≤ 2.00x"), ("ws", "WebSocket", "")):
                t = medians({"raw": raw.echo, name: op_and_read[name]}, latency_repeats, warmup=20)
                report.add(Row(f"(c) one small op + read, {label}", t[name], "raw echo", t["raw"], target, stolen=t.stolen))
            t = medians({"raw": raw.echo, **op_and_read}, latency_repeats, warmup=20)
            report.add(Row("(c) one small op + read, TCP, turns with WS", t["tcp"], "raw echo", t["raw"], "reported",
                           stolen=t.stolen))
            for placement, t in _placed_latencies(peer.pid, raw, op_and_read["tcp"], latency_repeats):
                report.add(Row(f"(c) one small op + read, TCP, {placement}", t["tcp"], "raw echo", t["raw"], "reported",
                               stolen=t.stolen))
        finally:
            raw.close()
    return report
