"""Sessions that resume, across real sockets: a real ``ember serve`` behind a fault line
(tests/faults.py) that resets or closes the connection mid-stream, loses the peer's answer, or
takes the link down; the client resumes the same session — same arrays, each batch run once."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from ember.benchmarks.faults import FaultLine

import ember as em

from .peers import Peer

SCHEMES = ["ember", "ws"]


@pytest.fixture(scope="module")
def peer():
    with Peer("--resume-window", "30") as running:
        yield running


@pytest.fixture
def resume(monkeypatch):
    monkeypatch.setenv("EMBER_RESUME", "20")  # the suite's 2 s is for peers that are gone


def _session_ops(device) -> int:
    return device.engine.peer_stats()["session_ops"]


@pytest.mark.parametrize("how", ["rst", "fin"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_chain_cut_midway_resumes_with_the_same_arrays_and_runs_each_op_once(peer, resume, scheme, how):
    with FaultLine(peer.address) as line:
        device = em.device(line.url(scheme))  # a line of its own: a session of its own
        host = np.linspace(0, 1, 1000)
        x = em.asarray(host, device=device)
        kept = em.asarray(host * 2, device=device)
        for _ in range(300):
            x = x * 1.0001 + 0.5
            host = host * 1.0001 + 0.5
        device.engine.flush()
        line.cut(how)
        for _ in range(300):
            x = x * 1.0001 + 0.5
            host = host * 1.0001 + 0.5
        np.testing.assert_allclose(em.asnumpy(x), host, rtol=1e-12)
        np.testing.assert_array_equal(em.asnumpy(kept), np.linspace(0, 1, 1000) * 2)  # made before the cut
        stats = em.stats(device)
        assert stats["resumes"] == 1 and stats["resume_seconds"] < 5 and line.accepted == 2
        assert _session_ops(device) == stats["ops"]  # the peer ran what the client sent, once


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_read_whose_answer_is_lost_is_answered_from_the_peers_kept_reply(peer, resume, scheme):
    with FaultLine(peer.address) as line:
        device = em.device(line.url(scheme))
        x = em.asarray(np.arange(8.0), device=device)
        y = em.sin(x) * 3
        em.sync(device)
        ops = _session_ops(device)
        line.cut_on_answer = "rst"  # the next thing the peer sends is lost with the connection
        np.testing.assert_allclose(em.asnumpy(y + 1), np.sin(np.arange(8.0)) * 3 + 1)
        assert em.stats(device)["resumes"] == 1
        assert _session_ops(device) == ops + 1  # the add ran once, though its batch's answer was lost


def test_uploads_cut_midway_arrive_once_and_whole(peer, resume):
    with FaultLine(peer.address) as line:
        device = em.device(line.url())
        chunks = [np.random.default_rng(i).random(1 << 20) for i in range(5)]  # 8 MiB each
        arrays = []
        for i, chunk in enumerate(chunks):
            arrays.append(em.asarray(chunk, device=device))
            if i == 2:
                line.cut("rst")
        chunks[0][:] = 0  # the caller's array changes after its upload: the peer has what was uploaded
        for seed, array in enumerate(arrays):
            np.testing.assert_array_equal(em.asnumpy(array), np.random.default_rng(seed).random(1 << 20))
        assert em.stats(device)["resumes"] == 1 and device.engine.peer_stats()["session_tensors"] == 5


def test_a_link_down_for_a_while_resumes_once_it_is_back_and_the_profile_names_the_wait(peer, resume):
    with FaultLine(peer.address) as line:
        device = em.device(line.url())
        x = em.asarray(np.ones(4), device=device)
        line.down(1.5)
        with em.profile() as profile:
            np.testing.assert_array_equal(em.asnumpy(x + 1), 2 * np.ones(4))  # the line that waits
        stats = em.stats(device)
        assert stats["resumes"] == 1 and 1.0 < stats["resume_seconds"] < 6
        (row,) = [r for r in profile.rows() if "resume" in r.kinds]
        assert row.source.endswith("# the line that waits") and row.seconds >= 1.0


def test_past_the_peers_window_the_client_gets_one_error_saying_why(resume):
    with Peer("--resume-window", "1") as short, FaultLine(short.address) as line:
        device = em.device(line.url())
        x = em.asarray(np.ones(4), device=device)
        em.sync(device)
        line.down(4.5)  # the peer forgets the session after its 1 s window (checked every 2 s)
        with pytest.raises(em.ConnectionLost, match=r"the session cannot be resumed: .*connection was lost more than "
                                                    r"1 s ago \(the peer's --resume-window\), and its 1 array\(s\) on "
                                                    r"the peer \(\d+ B\) were freed; every array of the session is "
                                                    r"lost with it"):
            em.asnumpy(x + 1)


def test_uploads_past_the_resume_buffer_wait_for_the_peer_to_acknowledge_them(peer, resume, monkeypatch):
    bound, chunk = 20 << 20, 1 << 20  # 8 MiB uploads against a 20 MiB buffer
    monkeypatch.setenv("EMBER_RESUME_BUFFER", str(bound))
    with FaultLine(peer.address) as line:
        device = em.device(line.url())
        arrays = [em.asarray(np.full(chunk, float(i)), device=device) for i in range(6)]
        outbox = device.engine.protocol.outbox
        assert bound < outbox.peak < bound + 9 * chunk  # one upload past the bound at most, then a wait
        assert outbox.held < bound and em.stats(device)["round_trips"] >= 2  # two syncs: after the 3rd and 6th
        line.cut("rst")  # what is kept is what is sent again: nothing acknowledged is needed
        for i, array in enumerate(arrays):
            assert float(em.asnumpy(array)[-1]) == i
        assert em.stats(device)["resumes"] == 1


def test_a_move_between_peers_cut_midway_is_fetched_again_and_arrives_whole(resume):
    """The destination's fetch link to the source runs through the line too: cut while the tensor
    streams, the source grants it again (it was not confirmed), the destination asks again, and the
    client's own session with the source resumes."""
    values = np.random.default_rng(7).random(32 << 20)  # 256 MiB
    with Peer("--resume-window", "30") as source, Peer("--fetch-from", "127.0.0.1") as destination, \
            FaultLine(source.address) as line:
        a, b = em.device(line.url()), em.device(destination.url())
        x = em.asarray(values, device=a)
        em.sync(a)

        def cut_once_the_fetch_streams():
            deadline = time.monotonic() + 20
            while line.accepted < 2 and time.monotonic() < deadline:  # the destination's connection to the source
                time.sleep(0.0005)
            while line.carried(1)["down"] < 8 << 20 and time.monotonic() < deadline:
                time.sleep(0.0005)
            line.stall("down")  # 8 MiB of the tensor came: held from here, and cut, the cut lands mid-tensor
            line.cut("rst")

        cutter = threading.Thread(target=cut_once_the_fetch_streams)
        cutter.start()
        y = x.to_device(b)
        moved = em.asnumpy(y)
        cutter.join()
        np.testing.assert_array_equal(moved, values)
        assert line.accepted == 3 and any("asking again" in entry for entry in destination.log)  # fetched anew
        np.testing.assert_array_equal(em.asnumpy(x[:4]), values[:4])  # the client's session was cut too: it resumes
        assert em.stats(a)["resumes"] == 1 and line.accepted == 4



@pytest.mark.parametrize("fault", ["cut after the run was sent", "the run's answer lost"])
def test_a_graph_run_cut_midway_completes_and_runs_once(peer, resume, fault):
    """A compiled graph's run in flight across a drop: sent, then the connection reset before the
    peer answered, or the peer's answer lost with the connection. The run's result arrives, the
    session resumed once, and the peer ran the graph once more, not twice."""
    with FaultLine(peer.address) as line:
        device = em.device(line.url())
        step = em.jit(lambda a, b: em.sin(a) * b + 1)
        host = np.linspace(0, 1, 64)
        x, w = em.asarray(host, device=device), em.asarray(host * 3, device=device)
        expected = np.sin(host) * host * 3 + 1
        np.testing.assert_allclose(em.asnumpy(step(x, w)), expected)  # registered, and run once
        runs, ops = em.stats(device)["graph_runs"], _session_ops(device)
        assert runs == 1 and ops == 3  # the graph's three ops; the client counts runs, not their ops
        if fault == "cut after the run was sent":
            y = step(x, w)
            device.engine.flush()
            line.cut("rst")
        else:
            line.cut_on_answer = "rst"
            y = step(x, w)
        np.testing.assert_allclose(em.asnumpy(y), expected)
        stats = em.stats(device)
        assert stats["resumes"] == 1 and stats["graph_runs"] == 2
        assert _session_ops(device) == 6  # the peer ran the graph twice, not three times
