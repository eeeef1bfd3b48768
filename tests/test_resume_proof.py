"""Proof that a resumed session loses nothing and runs nothing twice (issue 47, point 5): a 2,000-step
training run of the spirals MLP, and a 1,000-op chain, on a real ``ember serve`` behind a fault line
(benchmarks/faults.py) that fails at seeded random moments in every way it can — a reset, a FIN, the
peer's answer lost (reset, closed or black-holed), the link down a while, a black hole, a stall of
either direction — end with bits equal (``np.array_equal``) to the same run uncut on a direct
connection, and with the peer's count of the ops it ran equal to the client's count of those it sent.
Some faults are thrown from a timer thread while a step is in flight, so that they land with batches
sent and not yet acknowledged; each of those is counted, as is each answer lost after the peer ran
its batch. Also ``ember bench resume`` at its quick size (point 6): its rows and what they count."""

from __future__ import annotations

import collections
import json
import socket
import threading
import time

import numpy as np
import pytest
from ember.benchmarks import SUITES
from ember.benchmarks.faults import FaultLine

import ember as em
from ember.cli import main
from ember.spirals import Training

from .peers import Peer

SEED = 47
STEPS = 2000
CUTS = 50
POINTS_PER_CLASS = 50  # 100 points: a step is ~4 ms here, its ~120 ops in two or three batches
WINDOW = 1.0  # EMBER_KEEPALIVE: a black hole or a stall is noticed after a second of silence
# every way the line fails; "answer-…" set cut_on_answer: the peer runs the batch, its answer is lost
KINDS = ("rst", "fin", "answer-rst", "answer-fin", "answer-hole", "down", "hole", "stall-up", "stall-down")
HELD = {"answer-hole", "hole", "stall-up", "stall-down"}  # faults that hold bytes until the line heals


@pytest.fixture(scope="module")
def peer():
    with Peer("--resume-window", "60") as running:
        yield running
        assert running.tracebacks == 0, "".join(running.log)[-4000:]  # nothing the peer did not expect


@pytest.fixture
def resume(monkeypatch):
    monkeypatch.setenv("EMBER_RESUME", "30")  # the suite's 2 s is for peers that are gone
    monkeypatch.setenv("EMBER_KEEPALIVE", f"{WINDOW:g}")


@pytest.fixture
def line(peer):
    """A fault line in front of the peer: its own address, so its own device and session."""
    made = []

    def through_a_line():
        made.append(FaultLine(peer.address))
        return made[-1], em.device(made[-1].url())
    yield through_a_line
    for fault_line in made:
        em.device(fault_line.url()).engine.close()  # a later line on the same port must not find this session
        fault_line.close()


class Faults:
    """Applies the faults to a line and keeps the record of each: its kind, when it came, how many batches
    the client had sent and not yet seen acknowledged at that moment (sent, perhaps not run), and whether
    there was a connection to fail (one the client had made since the last fault)."""

    def __init__(self, line: FaultLine, engine):
        self.line, self.engine = line, engine
        self.records: list[dict] = []
        self._failed = None  # the client's connection the last fault failed
        self._answers: list[dict] = []  # answer faults set, not yet seen to fire
        self._held = False

    def apply(self, kind: str, when: str, seconds: float = 0.0, **extra) -> None:
        connection = self.engine.connection
        live = connection is not self._failed  # else the client has not noticed the last fault yet: nothing to fail
        record = {"kind": kind, "when": when, "unacked": len(self.engine.protocol.outbox.kept), "had_connection": live,
                  "live": live, **extra}
        self._failed = connection
        line = self.line
        if kind in ("rst", "fin"):
            line.cut(kind)
        elif kind.startswith("answer-"):
            line.cut_on_answer = kind.removeprefix("answer-")
            record["had_connection"] = False  # until it fires (settle), if on a connection of the session
            self._answers.append(record)
        elif kind == "down":
            line.down(seconds)
        elif kind == "hole":
            line.black_hole()
        else:
            line.stall(kind.removeprefix("stall-"))
        self._held = self._held or kind in HELD
        self.records.append(record)

    def settle(self) -> None:
        """After the wait that met the fault: note whether an answer fault fired (then the answer to a batch
        the peer ran was lost), and clear one that did not."""
        fired = self.line.cut_on_answer is None
        for record in self._answers:
            record["answer_lost"] = fired
            record["had_connection"] = fired and record["live"]  # else it fired on a dial that then failed
        self._answers.clear()
        self.line.cut_on_answer = None

    def heal(self) -> None:
        """Send on what a hole or stall held (to connections the client has left): it must change nothing."""
        if self._held:
            self.line.heal()
            self._held = False

    def summary(self) -> dict:
        by_kind = collections.Counter(r["kind"] for r in self.records)
        return {"by_kind": dict(sorted(by_kind.items())),
                "in_flight": sum(r["unacked"] > 0 for r in self.records),
                "answers_lost": sum(bool(r.get("answer_lost")) for r in self.records),
                "had_connection": sum(r["had_connection"] for r in self.records),
                "by_when": dict(collections.Counter(r["when"] for r in self.records))}


def _training(device, steps: int, before_step=None, after_step=None) -> tuple[list, list]:
    """The spirals MLP trained ``steps`` Adam steps on ``device`` (each step reads its loss): the losses
    and the final weights, as host arrays."""
    training = Training(device, n_per_class=POINTS_PER_CLASS)
    losses = []
    for i in range(steps):
        if before_step is not None:
            before_step(i)
        losses.append(training.step())
        if after_step is not None:
            after_step(i)
    return losses, [em.asnumpy(p) for p in training.params]


def _check_counts(device, faults: Faults, label: str, started: float) -> dict:
    """The peer ran each op the client sent once; every fault that had a connection to fail was resumed
    from. Prints the faults by kind and the counters."""
    stats = em.stats(device)
    peer_ops = device.engine.peer_stats()["session_ops"]
    summary = faults.summary()
    print(f"\n{label}: {len(faults.records)} faults {summary['by_kind']}, by when {summary['by_when']}; "
          f"{summary['in_flight']} with batches sent and unacknowledged, {summary['answers_lost']} answers lost after "
          f"the peer ran their batch; {summary['had_connection']} had a connection to fail; resumes {stats['resumes']}, "
          f"batches sent again {stats['batches_replayed']}, {stats['resume_seconds']:.1f} s resuming; ops: client "
          f"{stats['ops']}, peer {peer_ops}; {time.perf_counter() - started:.1f} s")
    assert peer_ops == stats["ops"]  # nothing lost, nothing run twice
    assert stats["resumes"] >= summary["had_connection"]
    return {**summary, **stats}


def test_two_thousand_training_steps_through_fifty_random_faults_end_bit_identical(peer, resume, line):
    started = time.perf_counter()
    reference_losses, reference = _training(em.device(peer.url()), STEPS)  # uncut, on a direct connection

    rng = np.random.default_rng(SEED)
    kinds = [KINDS[i % len(KINDS)] for i in range(CUTS)]
    rng.shuffle(kinds)
    at = dict(zip(sorted(rng.choice(np.arange(10, STEPS - 10, 4), CUTS, replace=False).tolist()), kinds))  # 4 apart
    healing = set()
    fault_line, device = line()
    faults = None
    timer = None

    def before_step(i):
        nonlocal faults, timer
        if faults is None:
            faults = Faults(fault_line, device.engine)
        if i in healing:  # two steps after a hole or stall: the client has left the connections it held
            faults.heal()
        kind = at.get(i)
        if kind is None:
            return
        seconds = float(rng.uniform(0.05, 0.3))
        if kind in HELD:
            healing.add(i + 2)
        if kind.startswith("answer-") or rng.random() < 0.5:
            faults.apply(kind, "on the answer" if kind.startswith("answer-") else "between steps", seconds, step=i)
        else:  # from another thread while the step is in flight (its ops' batches sent, its read awaited)
            delay = float(rng.uniform(0.0, 0.004))
            timer = threading.Timer(delay, faults.apply, (kind, "in flight", seconds), {"step": i})
            timer.start()

    def after_step(i):
        nonlocal timer
        if timer is not None:
            timer.join()
            timer = None
        if i in at:
            faults.settle()

    losses, weights = _training(device, STEPS, before_step, after_step)
    faults.heal()
    counts = _check_counts(device, faults, f"{STEPS} training steps", started)
    assert len(faults.records) == CUTS and set(counts["by_kind"]) == set(KINDS)
    assert losses == reference_losses  # every step's loss, to the bit
    for got, want in zip(weights, reference):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    # not by luck: faults met batches the peer had run or had not yet seen, and batches were sent again
    assert counts["in_flight"] >= 5 and counts["answers_lost"] >= 5 and counts["batches_replayed"] >= 1
    assert counts["had_connection"] >= CUTS - 5


def _chain(x, start: int, stop: int):
    """Ops ``start`` to ``stop`` of the chain: multiply, add, sine, subtract, in turn."""
    for k in range(start, stop):
        step = k % 4
        x = x * 1.0001 if step == 0 else x + 0.5 if step == 1 else em.sin(x) if step == 2 else x - 0.25
    return x


def test_a_thousand_op_chain_through_random_faults_ends_bit_identical(peer, resume, line):
    started = time.perf_counter()
    host = np.random.default_rng(SEED).random(1000)
    direct = em.device(peer.url())
    reference = em.asnumpy(_chain(em.asarray(host, device=direct), 0, 1000))

    rng = np.random.default_rng(SEED + 1)
    kinds = [str(k) for k in (*KINDS, *rng.choice(KINDS, 3))]
    rng.shuffle(kinds)
    at = sorted(rng.choice(np.arange(40, 960, 20), len(kinds), replace=False).tolist())
    fault_line, device = line()
    x = em.asarray(host, device=device)
    kept = em.asarray(host * 2, device=device)
    faults = Faults(fault_line, device.engine)
    done = 0
    for op, kind in zip(at, kinds):
        x = _chain(x, done, op)
        done = op
        if rng.random() < 0.5:
            device.engine.flush()  # the batches so far sent: unacknowledged, since a chain reads nothing
        faults.apply(kind, "mid-chain", float(rng.uniform(0.05, 0.3)), op=op)
        if kind in HELD or kind.startswith("answer-"):
            em.sync(device)  # a wait: the silence (or the lost answer) is met now, and resumed from
            faults.settle()
            faults.heal()
    x = _chain(x, done, 1000)
    got = em.asnumpy(x)
    counts = _check_counts(device, faults, "a 1,000-op chain", started)
    assert np.array_equal(got, reference)
    assert np.array_equal(em.asnumpy(kept), host * 2)  # made before the first fault
    assert counts["ops"] == 1000  # the chain (kept and x are uploads)
    assert counts["in_flight"] >= len(kinds) // 2 and counts["had_connection"] >= len(kinds) // 2


def test_the_resume_suite_is_registered_and_reports_its_rows_at_quick_size(tmp_path):
    assert "resume" in SUITES
    path = tmp_path / "resume.json"
    assert main(["bench", "resume", "--quick", "--json", str(path)]) == 0
    (report,) = json.loads(path.read_text())
    assert report["suite"] == "resume"
    rows = {row["name"]: row for row in report["rows"]}
    for row in rows.values():
        assert row["ember"] >= 0 and row["baseline"] > 0, row
    back = rows["(a) link back → answer, 0.5 s down"]
    assert back["resumes"] == back["repeats"] and back["step_seconds"] > 0  # each repeat resumed once
    uploads = rows["(b) outbox at a burst's peak, uploads"]
    assert uploads["unit"] == "MiB" and uploads["ember"] >= uploads["baseline"]  # it holds every byte uploaded
    assert uploads["frames"] >= 1 and uploads["after_ack"] == 0
    ops = rows["(b) outbox at a burst's peak, 1000 ops"]
    assert ops["frames"] >= 2 and ops["after_ack"] == 0 and ops["ember"] == ops["baseline"]  # every batch sent, kept
    cost = rows["(c) small op + read, resume on vs off"]
    assert cost["unit"] == "s" and cost["baseline_name"] == "EMBER_RESUME=0"


def test_the_fault_line_forwards_each_frame_at_once(peer):
    with FaultLine(peer.address) as fault_line:
        device = em.device(fault_line.url())
        try:
            em.sync(device)  # a connection through the line, both its sockets made
            (pair,) = fault_line.pairs
            assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in pair.sockets)
        finally:
            device.engine.close()
