"""The resume benchmark (``ember bench resume``): a loopback peer (``ember serve`` in a child process)
behind a fault line (faults.py) that takes the link down, and what a resumable session costs.

(a) the time from the link's return to the first answered op after it was down 0.5 s (the client
    redials at once, then after jittered waits doubling from 50 ms: ``backoff()`` in
    ember/engines/dialing.py), against the plain round trip of one small op and its read through the
    same line measured in the same run: the target is one round trip and the one backoff step the
    client was sleeping in when the link came back (the dial that got through, and the wait before
    it, are recorded for each repeat);
(b) the memory a session holds for batches not yet acknowledged (the client's ``Outbox``,
    ember/wire/replay.py): its bytes and frames at the peak of a burst of uploads and of a burst of
    ops, against what the burst sent, and after the acknowledgement that lets them go;
(c) the round trip of one small op and its read, and core's 1000-op chain and its read, with resume
    on (the default) against EMBER_RESUME=0: two sessions with the same peer timed in turn (target
    ≤ 1.03×, the issue's 3 %).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

import ember as em
from ember.devices import RemoteDevice
from ember.engines import dialing
from ember.remote.spawn import PeerProcess

from .core import chain
from .faults import FaultLine
from .timing import Report, Row, cpu_ticks, medians, stolen_share

MIB = 1 << 20
DOWN = 0.5  # seconds the link is down in (a)


@dataclass
class ResumeRow(Row):
    """A row with what it counted beside its times: (a) its repeats, the resumes they made and the
    median wait of the backoff step that applied; (b) the outbox's frames at the peak and its bytes once
    acknowledged (the row's unit)."""
    repeats: int = 0
    resumes: int = 0
    step_seconds: float = 0.0
    frames: int = 0
    after_ack: float = 0.0


class _DialTimes:
    """The times of the client's dials while it is entered (``dialing.dial`` wrapped, then put back):
    which attempt of a reconnection got through, and after what wait."""

    def __init__(self):
        self.times: list[float] = []

    def __enter__(self):
        self._dial = dial = dialing.dial

        def timed(*args, **kwargs):
            self.times.append(time.monotonic())
            return dial(*args, **kwargs)
        dialing.dial = timed
        return self

    def __exit__(self, *exc):
        dialing.dial = self._dial


@contextlib.contextmanager
def _quiet():
    """The resumes' WARNING lines held back while (a) makes them: the table is the report."""
    logger = logging.getLogger("ember.remote")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _session(address: str, resume: bool) -> RemoteDevice:
    """A device of its own for the peer at ``address`` (devices are shared by their string): a session
    opened with EMBER_RESUME as given."""
    host, port = address.rsplit(":", 1)
    device = RemoteDevice("ember", host, int(port), 0, None)
    before = os.environ.get("EMBER_RESUME")
    os.environ["EMBER_RESUME"] = "60" if resume else "0"
    try:
        device.engine  # noqa: B018 — the handshake reads EMBER_RESUME
    finally:
        if before is None:
            del os.environ["EMBER_RESUME"]
        else:
            os.environ["EMBER_RESUME"] = before
    return device


def _link_back(report: Report, line: FaultLine, repeats: int) -> None:
    """(a): the link down DOWN s, then one small op read at once; timed from the link's return."""
    device = _session(line.address, resume=True)
    x = em.asarray(np.ones(4), device=device)
    rtt = medians({"op": lambda: em.asnumpy(x + 1)}, 200 if repeats < 10 else 1000, warmup=20)["op"]
    back, dial_to_answer, residual, steps, bounds, attempts = [], [], [], [], [], []
    resumes = em.stats(device)["resumes"]
    before = cpu_ticks()
    with _quiet():
        for _ in range(repeats):
            em.asnumpy(x + 1)  # the connection in use, nothing pending
            with _DialTimes() as dials:
                line.down(DOWN)
                returned = line.down_until
                em.asnumpy(x + 1)
                answered = time.monotonic()
            through = dials.times[-1]  # the last dial is the one that got through
            wait = through - dials.times[-2] if len(dials.times) > 1 else 0.0  # its backoff step, and the dial refused
            back.append(answered - returned)
            dial_to_answer.append(answered - through)
            residual.append(through - returned)
            steps.append(wait)
            bounds.append(rtt + wait)
            attempts.append(len(dials.times) - 1)
    stolen = stolen_share(before, cpu_ticks())
    resumed = em.stats(device)["resumes"] - resumes
    median = statistics.median
    common = {"repeats": repeats, "resumes": resumed, "step_seconds": median(steps), "stolen": stolen}
    report.add(ResumeRow(f"(a) link back → answer, {DOWN:g} s down", median(back), "1 RTT + step",
                         median(bounds), "≤ 1.00x", **common))
    report.add(ResumeRow("(a) link back → answer vs one round trip", median(back), "1 RTT", rtt, "reported",
                         **common))
    report.add(ResumeRow("(a) the dial that got through → answer", median(dial_to_answer), "1 RTT", rtt,
                         "reported", **common))
    seen = sorted(set(attempts))
    report.notes.append(
        f"(a) the dial that got through was redial {'/'.join(map(str, seen))} (0: the first, at once), after a "
        f"backoff step of {min(steps) * 1e3:.0f}–{max(steps) * 1e3:.0f} ms (median {median(steps) * 1e3:.0f}): "
        f"backoff(k) = min(2 s, 50 ms·2^(k−1)) jittered down by up to half, so {DOWN:g} s down ends in step 4 "
        f"(200–400 ms) or 5 (400–800 ms); the link came back a median {median(residual) * 1e3:.0f} ms "
        f"before that dial; {resumed} resumes in {repeats} repeats; through the fault line (a Python proxy)")
    device.engine.close()


def _outbox_rows(report: Report, line: FaultLine, quick: bool) -> None:
    """(b): the outbox after each burst is sent (nothing acknowledged yet: a burst reads nothing), and once
    a sync's reply has acknowledged it."""
    device = _session(line.address, resume=True)
    engine = device.engine
    outbox = engine.protocol.outbox
    kept = []
    for label, size, count in (("uploads", 256 << 10, 16 if quick else 64), ("large uploads", 4 * MIB, 2 if quick else 8)):
        em.sync(device)
        hosts = [np.random.default_rng(i).random(size // 8) for i in range(count)]
        kept += [em.asarray(h, device=device) for h in hosts]
        engine.flush()
        held, frames = outbox.held, len(outbox.kept)
        em.sync(device)
        each = f"{size // MIB} MiB" if size >= MIB else f"{size >> 10} KiB"
        report.add(ResumeRow(f"(b) outbox at a burst's peak, {label}", held / MIB, f"{count}×{each}", size * count / MIB,
                             "reported", unit="MiB",
                             frames=frames, after_ack=outbox.held / MIB))
    x = em.asarray(np.ones(1000), device=device)
    em.sync(device)
    sent = em.stats(device)["bytes_up"]
    for k in range(1000):
        x = x * 1.0001 if k % 2 else x + 0.5
    engine.flush()
    held, frames = outbox.held, len(outbox.kept)
    sent = em.stats(device)["bytes_up"] - sent
    em.sync(device)
    report.add(ResumeRow("(b) outbox at a burst's peak, 1000 ops", held / 1024, "bytes sent", sent / 1024, "reported",
                         unit="KiB", frames=frames, after_ack=outbox.held / 1024))
    report.notes.append(f"(b) the outbox keeps every batch frame sent until a reply acknowledges it (at most "
                        f"EMBER_RESUME_BUFFER, {outbox.bound // MIB} MiB; past half of it a batch asks); a 1000-op chain "
                        f"of 1000 float64 (x + 0.5, x·1.0001 in turn) sends its runs of ops; each burst is read after "
                        f"engine.flush(), before the sync that acknowledges it; peak held this session: "
                        f"{outbox.peak / MIB:.1f} MiB")
    del kept
    engine.close()


def run(quick: bool = False) -> Report:
    """Measure (a), (b) and (c) against a fresh peer."""
    report = Report("resume")
    with PeerProcess("--resume-window", "60") as peer, FaultLine(peer.address) as line:
        _link_back(report, line, 3 if quick else 15)
        _outbox_rows(report, line, quick)
        on, off = _session(peer.address, resume=True), _session(peer.address, resume=False)
        try:
            xs = {"on": em.asarray(np.ones(4), device=on), "off": em.asarray(np.ones(4), device=off)}
            t = medians({name: (lambda x=x: em.asnumpy(x + 1)) for name, x in xs.items()}, 300 if quick else 3000,
                        warmup=50)
            report.add(Row("(c) small op + read, resume on vs off", t["on"], "EMBER_RESUME=0", t["off"],
                           "≤ 1.03x", stolen=t.stolen))
            start = np.linspace(0, 1, 1000, dtype=np.float32)
            chains = {name: em.asarray(start, device=d) for name, d in (("on", on), ("off", off))}
            t = medians({name: (lambda x=x: em.asnumpy(chain(em, x, 1000))) for name, x in chains.items()}, 10 if quick else 200,
                        warmup=3)
            report.add(Row("(c) 1000-op chain + read, resume on vs off", t["on"], "EMBER_RESUME=0", t["off"],
                           "≤ 1.03x", stolen=t.stolen))
            report.notes.append("(c) two sessions with the peer, directly (no fault line), timed in turn: the cost of "
                                "numbering each batch and keeping it until its reply acknowledges it")
        finally:
            on.engine.close()
            off.engine.close()
    return report
