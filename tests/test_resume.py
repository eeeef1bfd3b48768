"""Sessions that resume, without I/O: the client's outbox (wire/replay.py), the client protocol's
numbering, and the peer's Session, Host and Parking (remote/resume.py), fed each other's bytes.
A lost connection here is frames that never arrive; the process tests cut real sockets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember import dtypes as dt
from ember.errors import ProtocolError
from ember.ops.table import Meta
from ember.remote.host import Host, hosted_devices
from ember.remote.memory import BufferPool
from ember.wire import protocol as wire
from ember.wire.client import ClientProtocol, init_frame
from ember.wire.messages import Get
from ember.wire.replay import Outbox

TOKEN = "a-token-of-16-chars"
META = Meta((4,), dt.float64)


class Handle:
    def __init__(self, tid: int):
        self.id = tid


def frames_of(buffers_list: list) -> list[wire.Frame]:
    """What a peer reads of the frames a client wrote (each a list of buffers)."""
    reader = wire.FrameReader(wire.Limits())
    return [frame for buffers in buffers_list for frame in reader.feed(b"".join(bytes(b) for b in buffers))]


def frame_of(header: dict, segments=()) -> wire.Frame:
    """A reply as the client reads it: encoded, then decoded."""
    return frames_of([wire.encode_frame(header, list(segments))])[0]


class Pair:
    """A client protocol and its session on a Host, joined by frames the test delivers (or loses)."""

    def __init__(self, window: float = 300.0, bound: int = 1 << 20, authorize=None, token: str = TOKEN):
        self.host = Host(hosted_devices("numpy"), None if authorize else TOKEN, wire.Limits(), authorize=authorize,
                         resume_window=window)
        self.token = token
        init = frames_of([init_frame(0, token, None, resume=True)])[0]
        self.session, replies = self.host.open(init, BufferPool(), "127.0.0.1:5000")
        self.info = replies[0][0]
        self.client = ClientProtocol(frame_of(self.info).header, "ember://peer/0", Handle, resume_buffer=bound)

    def upload(self, values) -> Handle:
        return Handle(self.client.put(np.asarray(values, dtype=np.float64)))

    def add(self, x: Handle, y: Handle) -> Handle:
        (tid,) = self.client.op("add", (x, y), (META, META), {}, (META,))
        return Handle(tid)

    def deliver(self, frames: list, session=None) -> list[wire.Frame]:
        """Hand ``frames`` to the session: the replies the client reads."""
        replies = []
        for frame in frames_of(frames):
            replies += [frame_of(h, s) for h, s in (session or self.session).handle(frame)]
        return replies

    def read(self, x: Handle, lose: bool = False):
        """A read of ``x``: its value, or with ``lose`` None — the batch reached the peer, the reply was lost."""
        rid, frames = self.client.request(Get, x.id)
        replies = self.deliver(frames)
        if lose:
            return rid
        answers = [self.client.receive_frame(reply, rid) for reply in replies]
        reply, segments = next(a for a in answers if a is not None)
        return segments[reply.segment]

    def resume(self, address: str = "127.0.0.1:6000", **changed):
        """A new connection's resume frame through the Host: the session back and the frames it answers."""
        header = frames_of([self.client.resume_frame(0, self.token, None)])[0].header | changed
        frame = wire.Frame(header, [])
        session, refusal = self.host.resume(frame, address)
        return (session, refusal) if session is None else (session, self.host.resumed(session, frame, address))


def _batch_of(box: Outbox, padding: int) -> tuple:
    """A batch frame the outbox numbered and kept, of a message ``padding`` bytes long: its header and its bytes."""
    header = {"t": "batch", "m": (b"x" * padding,)}
    frame = box.frame(header, [])
    return header, len(frame[0])


def test_the_outbox_keeps_frames_until_acknowledged_and_refuses_an_ack_beyond_the_last():
    box = Outbox(bound=1000)  # less than half held: no batch asks, so the three are of one size
    sizes = [_batch_of(box, 70)[1] for _ in range(3)]
    size = sizes[0]
    assert sizes == [size] * 3 and 70 < size < 120 and box.last == 3
    assert box.held == 3 * size and box.full(1000 - 3 * size + 1) and not box.full(1000 - 3 * size)
    assert [wire.FrameReader().feed(b"".join(f))[0].header["n"] for f in box.frames()] == [1, 2, 3]
    box.acknowledge(2)
    assert box.held == size and box.acked == 2 and len(box.frames()) == 1
    box.acknowledge(1)  # an older ack changes nothing
    assert box.held == size
    with pytest.raises(ProtocolError, match="acknowledged batch 4, but the last one sent is 3"):
        box.acknowledge(4)
    box.acknowledge(3)
    assert not box.frames() and box.held == 0 and not box.full(1000)  # an empty outbox takes any one frame
    assert box.peak == 3 * size


@given(st.lists(st.integers(1, 60), min_size=1, max_size=30))
def test_the_outbox_asks_once_past_half_its_bound_until_acknowledged(paddings):
    box, asks, sizes = Outbox(bound=400), [], []
    for padding in paddings:
        header, size = _batch_of(box, padding)
        asks.append(header.get("ask", False))
        sizes.append(size)
    half = [i for i in range(len(sizes)) if sum(sizes[:i]) * 2 > 400]
    assert asks.count(True) == (1 if half else 0) and (not half or asks.index(True) == half[0])
    box.acknowledge(box.last)
    assert box.held == 0 and not box.asking()  # nothing held


def test_a_resumable_sessions_batches_are_numbered_and_every_reply_acknowledges():
    pair = Pair()
    assert len(pair.info["secret"]) == 32 and pair.info["window"] == 300.0
    x = pair.upload([1.0, 2, 3, 4])
    y = pair.add(x, x)
    np.testing.assert_array_equal(pair.read(y), [2.0, 4, 6, 8])
    assert pair.session.resumable.done == 1 and pair.client.outbox.acked == 1 and not pair.client.outbox.frames()
    z = pair.add(y, x)
    np.testing.assert_array_equal(pair.read(z), [3.0, 6, 9, 12])
    assert pair.session.resumable.done == pair.client.outbox.acked == 2


def test_a_session_that_did_not_ask_is_not_resumable_and_its_batches_carry_no_number():
    host = Host(hosted_devices("numpy"), TOKEN, wire.Limits())
    session, replies = host.open(frames_of([init_frame(0, TOKEN, None)])[0], BufferPool(), "127.0.0.1:5000")
    client = ClientProtocol(replies[0][0], "peer", Handle)
    assert "secret" not in replies[0][0] and session.resumable is None and client.outbox is None
    client.put(np.ones(4))
    client.flush()
    (frame,) = frames_of(client.data_to_send())
    assert "n" not in frame.header


def test_batches_lost_with_the_connection_are_sent_again_and_run_once():
    pair = Pair()
    x = pair.upload([1.0, 2, 3, 4])
    y = pair.add(x, x)
    pair.client.flush()
    pair.deliver(pair.client.data_to_send())  # batch 1 arrives; its acknowledgement would ride on a reply
    z = pair.add(y, y)
    pair.client.flush()
    pair.client.data_to_send()  # batch 2 is lost with the connection
    session, answer = pair.resume()
    assert session is pair.session and answer[0][0] == {"t": "resumed", "v": wire.VERSION, "session": session.id,
                                                         "ack": 1}
    again = pair.client.resumed(frame_of(answer[0][0]).header)
    assert len(again) == 1 and pair.client.counters["resumes"] == 0  # counted once the frames are sent
    pair.client.count_resume(len(again), 0.25)
    counters = pair.client.counters
    assert (counters["resumes"], counters["batches_replayed"], counters["resume_seconds"]) == (1, 1, 0.25)
    pair.deliver(again)
    ops = pair.session.ops
    np.testing.assert_array_equal(pair.read(z), [4.0, 8, 12, 16])
    assert pair.session.ops == ops  # the read added no op: each ran once


def test_a_read_whose_reply_was_lost_is_answered_from_the_kept_reply_not_run_again():
    pair = Pair()
    x = pair.upload([1.0, 2, 3, 4])
    y = pair.add(x, x)
    rid = pair.read(y, lose=True)  # the batch ran; its reply never reached the client
    ops = pair.session.ops
    session, answer = pair.resume()
    assert answer[0][0]["ack"] == 1 and len(answer) == 2  # resumed, then the reply the client missed
    assert pair.client.resumed(frame_of(answer[0][0]).header) == []  # nothing to send again
    reply, segments = pair.client.receive_frame(frame_of(*answer[1]), rid)
    np.testing.assert_array_equal(segments[reply.segment], [2.0, 4, 6, 8])
    # had the client sent the batch again anyway, the peer answers it from what it kept
    repeat = pair.session.resumable.repeat(1)
    assert repeat and pair.session.ops == ops


def test_a_gap_in_the_numbers_is_a_protocol_error():
    pair = Pair()
    pair.upload([1.0, 2, 3, 4])
    pair.client.flush()
    pair.client.data_to_send()  # batch 1, lost
    pair.upload([5.0, 6, 7, 8])
    pair.client.flush()
    with pytest.raises(ProtocolError, match="batch 2 came after batch 0"):
        pair.deliver(pair.client.data_to_send())


def test_a_stream_that_only_writes_asks_for_acknowledgements_past_half_its_buffer():
    pair = Pair(bound=64 << 10)
    x = pair.upload(np.zeros(4))
    for _ in range(40):  # each batch ~1.6 KB of op messages
        for _ in range(64):
            x = pair.add(x, x)
        answers = pair.deliver(pair.client.data_to_send())
        for answer in answers:
            pair.client.receive_frame(answer)
    assert pair.client.outbox.peak <= 40 << 10 and pair.client.outbox.acked > 0


def test_a_resume_must_prove_the_secret_and_the_same_client():
    pair = Pair()
    assert pair.resume(secret=b"\0" * 32)[0] is None
    session, answer = pair.resume(secret=b"\0" * 32)
    assert session is None and answer[0][0]["gone"] and "cannot be resumed" in answer[0][0]["reason"]
    assert pair.resume(peer="another peer")[1][0][0]["reason"] == ("the session cannot be resumed: the peer restarted "
                                                                   "since the session began")
    assert pair.resume(session="no such session")[0] is None
    assert pair.resume()[0] is pair.session  # the right secret from a new address


def test_a_named_client_cannot_resume_another_clients_session():
    names = {"token-of-alice-000": "alice", "token-of-bob-00000": "bob"}

    def authorize(address, token, device):
        return names.get(token, False)
    pair = Pair(authorize=authorize, token="token-of-alice-000")
    assert pair.session.client == "alice"
    session, answer = pair.resume(token="token-of-bob-00000")
    assert session is None and answer[0][0]["reason"] == "this token is not the session's client's"
    assert pair.resume(token="token-of-alice-000")[0] is pair.session


def test_a_parked_session_keeps_its_tensors_until_its_window_passes_then_says_why_it_is_gone():
    pair = Pair(window=30)
    x = pair.upload([1.0, 2, 3, 4])
    pair.read(x)
    used = pair.host.budget.used
    pair.host.park(pair.session, now=1000.0)
    assert pair.host.expire(1020.0) == 0 and pair.host.budget.used == used and pair.session in pair.host.registry.sessions
    assert pair.host.expire(1031.0) == 1 and pair.session not in pair.host.registry.sessions
    session, answer = pair.resume()
    assert session is None and answer[0][0]["gone"]
    assert "connection was lost more than 30 s ago (the peer's --resume-window)" in answer[0][0]["reason"]
