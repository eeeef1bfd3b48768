"""Fuzzing the peer's session with mutated real traffic.

The frames a real client sent a real peer (over TCP, for a small job: uploads, ops, reads, a
jitted function registered and run) are recorded once; hypothesis then mutates them byte by
byte — flips, truncations, repeats, insertions — and feeds them through the frame reader into
the sans-I/O session. Whatever arrives, the session answers with well-formed replies or refuses
the frame with a ProtocolError (the shell then closes that connection); nothing else escapes,
its memory accounting still balances, and it still computes correctly afterwards.
tools/fuzz.py runs the same mutations for longer against a real ``ember serve``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.errors import ProtocolError
from ember.remote.host import Host, hosted_devices
from ember.remote.memory import Budget
from ember.wire import protocol as wire
from ember.wire.protocol import Frame, FrameReader, Limits

from .traffic import mutate, record_traffic

MiB = 1 << 20


@pytest.fixture(scope="module")
def traffic() -> list[bytes]:
    return record_traffic()


def _session(host):
    session, _ = host.open(Frame({"t": "init", "v": wire.VERSION}, []))
    return session


MUTATIONS = st.one_of(
    st.tuples(st.just("message"), st.integers(0, 1 << 20), st.integers(0, 1 << 10)),
    st.tuples(st.just("message"), st.integers(0, 1 << 20), st.integers(0, 1 << 10)),
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20), st.just(0)),
    st.tuples(st.just("repeat"), st.integers(0, 1 << 20), st.integers(1, 64)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.integers(0, 255)),
)


FUZZ_EXAMPLES = int(os.environ.get("EMBER_FUZZ_EXAMPLES", "300"))  # 20,000 run in ~25 s


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pick=st.integers(0, 10_000), mutations=st.lists(MUTATIONS, min_size=1, max_size=4))
def test_mutated_traffic_is_answered_or_refused_and_the_session_still_computes(traffic, pick, mutations):
    host = Host(hosted_devices("numpy"), None, Limits(max_tensor_bytes=4 * MiB, max_session_bytes=16 * MiB), Budget(32 * MiB))
    session = _session(host)
    target = pick % len(traffic)
    reader = FrameReader(session.limits, session.allocate)
    refused = False
    for k, data in enumerate(traffic[:target + 1]):
        try:
            for frame in reader.feed(mutate(data, mutations) if k == target else data):
                for header, segments in session.handle(frame):
                    assert header["t"] == "reply" and isinstance(header["m"], list)
                    wire.encode_frame(header, segments)  # every reply can be sent
        except ProtocolError:
            refused = True  # the shell closes this connection; nothing else may escape
            break
    assert host.budget.used == session.quota.used + session.quota.credit + host.pool.total
    graphs = sum(g.held for g in session.registered.graphs.values())
    assert session.quota.used == session.table.live_bytes() + session.replying + graphs + \
        sum(session.uploads.reserved.values()) + session.runs_bytes
    if not refused:  # what it kept still works beside new work
        x, fresh = np.arange(5.0), 10**9
        work = (("put", fresh, 0), ("op", "multiply", (fresh, (2.0, "float64")), (fresh + 1,), {}), ("get", 1, fresh + 1))
        (reply, (out,)), = session.handle(Frame({"t": "batch", "m": work}, [x]))
        np.testing.assert_array_equal(out, x * 2)
    host.close(session)
    assert host.budget.used == host.pool.total


def test_the_recorded_traffic_is_a_real_job(traffic):
    kinds = set()
    for data in traffic:
        for frame in FrameReader().feed(data):
            kinds |= {m[0] for m in frame.header.get("m", ())}
    assert {"put", "op", "get", "graph", "run", "drop"} <= kinds and len(traffic) >= 5
