"""The client's protocol without I/O (ember/wire/client.py): ops, uploads, graphs and requests go in,
the frames' bytes come out and are compared with the frames expected, replies are fed back in. No
peer process, no socket, no sleeping: the batch's clock is a value the test sets."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from ember import dtypes as dt
from ember.errors import AccessDenied, ExecutionError, PeerBusy, ProtocolError, ShapeError, TLSError
from ember.ops.table import Meta
from ember.wire import client, messages
from ember.wire import protocol as wire
from ember.wire.client import ClientProtocol, init_frame, refusal
from ember.wire.messages import Drop, Forget, Get, Op, Put, RunGraph, Stats, Sync
from ember.wire.runs import Run

META = Meta((3,), dt.float64)
INFO = {"t": "info", "v": wire.VERSION, "session": "s1", "dtypes": ("float32", "float64"),
        "limits": {"max_tensor_bytes": 1 << 24}}


class Handle:
    """A tensor id, as the shell's handles are to the protocol."""

    def __init__(self, tid: int):
        self.id = tid


class Clock:
    """The batch's clock: it reads ``now``, which the test moves."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def protocol(clock):
    return ClientProtocol(INFO, "ember://127.0.0.1:7878/0", Handle, clock)


def logged(protocol: ClientProtocol, name: str, *inputs, attrs=None, tid=None) -> Handle:
    """Log an op as the shell's ``apply`` does: take an id (or use ``tid``, one taken earlier), append
    to the log, note when the log began, and ask the batch's rules at every eighth op."""
    tid = next(protocol.ids) if tid is None else tid
    log = protocol.log
    log.append((name, inputs, (META,) * len(inputs), attrs or {}, tid))
    if len(log) & 7 == 0:
        if protocol.due():
            protocol.flush()
    elif len(log) == 1:
        protocol.began = protocol.clock()
    return Handle(tid)


def sent(protocol: ClientProtocol) -> list[bytes]:
    """The frames the protocol has to send, each as the bytes on the wire."""
    return [b"".join(map(bytes, buffers)) for buffers in protocol.data_to_send()]


def asked(protocol: ClientProtocol, record: type, *fields) -> list[bytes]:
    """The frames a request hands back (those the batch sent before it first), as the bytes on the wire."""
    return [b"".join(map(bytes, buffers)) for buffers in protocol.request(record, *fields)[1]]


def unstack(protocol: ClientProtocol, x: Handle, meta: Meta = META) -> tuple:
    """An op of two outputs of ``meta``, sent as a message of its own: its output ids."""
    return protocol.op("unstack", (x,), (META,), {}, (meta, meta))


def decoded(frames: list[bytes]) -> list[wire.Frame]:
    reader = wire.FrameReader(wire.Limits())
    return [frame for data in frames for frame in reader.feed(data)]


def batch(*messages_, segments=()) -> bytes:
    """The bytes of the batch frame holding ``messages_``: the expected fixture."""
    return b"".join(map(bytes, wire.encode_frame({"t": "batch", "m": tuple(messages_)}, list(segments))))


def reply(*replies, segments=()) -> wire.Frame:
    return wire.Frame({"t": "reply", "m": tuple(replies)}, list(segments))


# -- the batch's boundaries --

@pytest.mark.parametrize("kind", ["logged", "message", "both"])
def test_a_batch_goes_once_it_holds_batch_ops_ops_or_is_batch_seconds_old(protocol, clock, kind):
    """Ops wait in the batch until BATCH_OPS of them are there, or until one added at a count of
    eight finds the batch older than BATCH_SECONDS (the clock is read every eighth op, and starts at
    the batch's first op): not before. Alike for ops only logged (one output, its meta known), for
    ops sent as messages of their own (more outputs) and for both in one batch (runs of three logged
    ops between messages), where each op of a run counts."""
    x = Handle(next(protocol.ids))

    def batches_after(ops: int, pause: float = 0.0, pause_before: int | None = None) -> int:
        for k in range(ops):
            if k == (ops - 1 if pause_before is None else pause_before):
                clock.now += pause
            if kind == "message" or (kind == "both" and k % 4 == 3):
                unstack(protocol, x)
            else:
                logged(protocol, "add", x, 1.0)
        frames = sent(protocol)
        protocol.request(Sync)  # the batch's end: the next starts afresh
        return len(frames)

    assert batches_after(client.BATCH_OPS - 1) == 0
    assert batches_after(client.BATCH_OPS) == 1
    assert batches_after(8, pause=2 * client.BATCH_SECONDS, pause_before=-1) == 0  # young: the clock starts at the first op
    assert batches_after(7, pause=2 * client.BATCH_SECONDS) == 0  # old, but the clock is read at the eighth op
    assert batches_after(8, pause=2 * client.BATCH_SECONDS) == 1  # the eighth op finds the batch old
    assert batches_after(8, pause=2 * client.BATCH_SECONDS, pause_before=1) == 1  # its clock started at the first op


def test_a_new_sessions_first_batch_goes_at_batch_ops_too(protocol):
    """The first batch of a session just opened counts its ops from zero, as every later one does:
    an op logged (a creation) and BATCH_OPS - 2 ops sent as messages of their own wait; the next
    one sends the batch."""
    rows = logged(protocol, "zeros", attrs={"shape": (2, 3)})
    for _ in range(client.BATCH_OPS - 2):
        unstack(protocol, rows)
    assert sent(protocol) == []
    unstack(protocol, rows)
    (frame,) = decoded(sent(protocol))
    messages_ = frame.header["m"]
    assert len(messages_) == client.BATCH_OPS and messages_[0][0] == "ops" and messages_[-1][0] == "op"


def test_uploads_are_copied_into_the_batch_up_to_inline_bytes_and_larger_ones_go_at_once(protocol):
    small, large = np.arange(3.0), np.zeros(client.INLINE_BYTES // 8 + 1)
    a = protocol.put(small)
    small[0] = 7.0  # the batch holds a copy
    assert sent(protocol) == []
    b = protocol.put(large)
    assert sent(protocol) == [batch(Put(a, 0), segments=[np.arange(3.0)]), batch(Put(b, 0), segments=[large])]
    with pytest.raises(Exception, match="does not support complex64"):
        protocol.put(np.zeros(2, np.complex64))


# -- runs of ops --

def chain_and_read(protocol: ClientProtocol, x: Handle, ops: int) -> tuple[Handle, list[bytes]]:
    """``ops`` adds of ``x``, each output let go once the next is made (as ``y = y + x`` does), then a
    read: the last output, and the frames the read hands back."""
    y = x
    for _ in range(ops):
        previous, y = y, logged(protocol, "add", y, x)
        if previous is not x:
            protocol.drops.append(previous.id)  # a handle's __del__
    return y, asked(protocol, Get, y.id)


def test_a_loop_sends_the_same_run_bytes_each_time_at_other_ids(protocol):
    x = Handle(protocol.put(np.ones(3)))
    protocol.flush()
    protocol.data_to_send()
    records = [("add", [k - 1 if k else -1, -1], (k,), {}) for k in range(10)]
    blob = wire.pack((records, list(range(9))))  # all but the last let go in the run: never stored
    for rid in (1, 2):
        y, frames = chain_and_read(protocol, x, 10)
        assert frames == [batch(("ops", y.id - 9, (x.id,), blob), ("get", rid, y.id))]
    assert len(protocol._blobs) == 1  # the second time, the first's bytes were sent again


def test_runs_that_differ_only_in_the_sign_of_a_zero_are_packed_each_as_it_is(protocol):
    x = Handle(protocol.put(np.ones(3)))
    blobs = []
    for zero in (0.0, -0.0, 0.0):
        logged(protocol, "multiply", x, zero)
        protocol.flush()
        (frame,) = decoded(sent(protocol))
        blobs.append(frame.header["m"][-1][3])
    assert blobs[0] == blobs[2] != blobs[1]  # -0.0 == 0.0: reusing the bytes would send the wrong sign
    assert np.signbit(wire.unpack(blobs[1])[0][0][1][1][0])


def test_equal_runs_reuse_their_bytes_only_when_they_let_the_same_outputs_go(protocol):
    x = Handle(protocol.put(np.ones(3)))
    protocol.flush()
    protocol.data_to_send()
    blobs = []
    for let_go in (True, False, True):
        y = logged(protocol, "multiply", x, 2.0)
        logged(protocol, "add", y, 1.0)
        if let_go:
            protocol.drops.append(y.id)
        protocol.flush()
        (frame,) = decoded(sent(protocol))
        blobs.append(frame.header["m"][0][3])
    assert blobs[0] == blobs[2] != blobs[1]
    assert wire.unpack(blobs[0])[1] == (0,) and wire.unpack(blobs[1])[1] == ()


def test_ops_logged_out_of_their_ids_order_by_threads_make_runs_that_name_them_right(protocol):
    """Ops are logged without a lock: between one thread's taking an id and logging its op, another
    thread may log an op of a later id (or take an id for an upload)."""
    x = Handle(protocol.put(np.ones(3)))
    a = logged(protocol, "add", x, 1.0)
    b_id = next(protocol.ids)
    other = logged(protocol, "multiply", x, 3.0)  # another thread's op, logged between b's id and b's op
    b = logged(protocol, "multiply", a, 2.0, tid=b_id)
    logged(protocol, "subtract", b, x)
    protocol._take_log()
    (run,) = [m for m in protocol._batch if type(m) is Run]
    assert run.base == a.id and [record[2][0] for record in run.records] == [0, 2, 1, 3] and not run.in_order
    assert run.release([b.id, other.id, x.id]) == [x.id] and run.let_go == [1, 2]  # found one by one
    protocol.flush()
    protocol.data_to_send()

    d_id = next(protocol.ids)
    five = logged(protocol, "multiply", x, 5.0)  # logged first: d's op starts a run of its own
    d = logged(protocol, "subtract", x, 1.0, tid=d_id)
    logged(protocol, "add", d, five)
    protocol._take_log()
    assert [m.base for m in protocol._batch if type(m) is Run] == [d_id + 1, d_id]

    protocol.flush()
    protocol.data_to_send()
    f = logged(protocol, "add", x, 1.0)
    upload = next(protocol.ids)  # an id another thread took for an upload, between two outputs of a run
    logged(protocol, "multiply", f, 2.0)
    protocol._take_log()
    (run,) = [m for m in protocol._batch if type(m) is Run]
    assert run.in_order is False and run.release([upload, f.id]) == [upload] and run.let_go == [0]


# -- drops --

def test_a_dropped_output_of_the_last_run_is_let_go_in_it_and_an_earlier_array_dropped_ahead(protocol):
    x = Handle(protocol.put(np.ones(3)))
    protocol.flush()
    protocol.data_to_send()
    parts = Op("unstack", (x.id,), unstack(protocol, x), {})
    protocol.drops.append(parts.outputs[0])
    y = logged(protocol, "add", x, 1.0)
    logged(protocol, "add", y, 1.0)
    protocol.drops.append(y.id)
    records = [("add", [-1, (1.0, "float64")], (0,), {}), ("add", [0, (1.0, "float64")], (1,), {})]
    assert asked(protocol, Stats) == [batch(parts, Drop((parts.outputs[0],)), ("ops", y.id, (x.id,), wire.pack((records, [0]))),
                                    Stats(1))]


def test_an_array_dropped_before_ops_were_logged_goes_ahead_of_them(protocol):
    """No logged op reads it (the log holds its inputs' handles), and the bytes it frees count for
    those ops: the peer frees them before it runs the ops."""
    old = Handle(protocol.put(np.ones(3)))
    x = Handle(protocol.put(np.ones(3)))
    protocol.drops.append(old.id)
    y = logged(protocol, "add", x, 1.0)
    (frame,) = decoded(asked(protocol, Sync))
    assert [m[0] for m in frame.header["m"]] == ["put", "put", "drop", "ops", "sync"]
    assert frame.header["m"][2] == ("drop", (old.id,)) and frame.header["m"][3][1] == y.id


def test_drops_go_ahead_of_the_next_message_once_the_ops_made_drop_bytes(protocol):
    """Ops sent as messages of their own count the bytes they make: once those since the last drops
    reach DROP_BYTES, or one message makes as many, the drops go ahead of the next one."""
    x = Handle(protocol.put(np.ones(3)))
    quarter = Meta((client.DROP_BYTES // 32,), dt.float64)  # two of them make half of DROP_BYTES
    for k in range(6):
        unstack(protocol, x, quarter)
        protocol.drops.append(100 + k)
    unstack(protocol, x, Meta((client.DROP_BYTES // 16,), dt.float64))  # two of them: DROP_BYTES
    protocol.flush()
    (frame,) = decoded(sent(protocol))
    kinds = [m[0] if m[0] != "drop" else m[1] for m in frame.header["m"]]
    # the third message finds 2 × half made: the drops before it go; the fifth too; the seventh makes as many itself
    assert kinds == ["put", "op", "op", (100, 101), "op", "op", (102, 103), "op", "op", (104, 105), "op"]


def test_very_many_drops_go_in_frames_of_their_own(protocol, monkeypatch):
    monkeypatch.setattr(client, "DROP_IDS", 1000)
    protocol.drops.extend(range(1, 2501))
    frames = decoded(asked(protocol, Stats))
    assert [[len(m[1]) if m[0] == "drop" else m[0] for m in f.header["m"]] for f in frames] == \
        [[1000], [1000], [500, "stats"]]


# -- graphs --

class Graph:
    """What the protocol reads of a captured graph."""

    def __init__(self, constants: dict):
        self.inputs = [("x", 0, META)]
        self.constants = constants
        self.ops = [("multiply", (0, 1), (3,), {}, "more the wire does not carry"), ("add", (3, 2), (4,), {}, None)]
        self.outputs = [("y", 4)]
        self.metas = {4: META}


def test_a_graphs_constants_registered_behind_an_upload_name_their_own_segments(protocol):
    """A graph's constants travel as segments of the frame that registers it, after any the batch holds
    already (a small upload's); then each call sends its number and tensor ids."""
    ones, tens = np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0])
    graph = Graph({1: ones, 2: tens})
    x = protocol.put(np.array([5.0, 6.0, 7.0]))
    (y,) = protocol.run_graph(graph, (x,))
    (z,) = protocol.run_graph(graph, (y,))
    protocol.flush()
    registration = messages.Graph(1, ((0, dt.float64, (3,)),), (4,), (("multiply", (0, 1), (3,), {}), ("add", (3, 2), (4,), {})),
                                  ((1, 1), (2, 2)))
    assert sent(protocol) == [batch(Put(x, 0), registration, RunGraph(1, (x,), (y,)), RunGraph(1, (y,), (z,)),
                                    segments=[np.array([5.0, 6.0, 7.0]), ones, tens])]
    assert protocol.counters["graphs_registered"] == 1 and protocol.counters["graph_runs"] == 2
    del graph
    gc.collect()
    assert asked(protocol, Sync) == [batch(Forget(1), Sync(1))]  # once the program lets it go, the peer forgets it


# -- requests and replies --

def test_a_reply_answers_its_request_by_id_and_an_error_reply_raises_its_kind(protocol):
    get = protocol.request(Get, 5)[0]
    value = np.arange(3.0)
    frame = reply(("data", 99, 1), ("data", get, 0), segments=[value, value])  # 99: a request nobody waits for
    assert protocol.receive_frame(frame, 99 + get) is None  # not the one asked for
    answer, segments = protocol.receive_frame(frame, get)
    assert answer == messages.Data(get, 0) and type(answer) is messages.Data and segments[answer.segment] is value
    assert protocol.counters["bytes_down"] == 2 * (wire.PREFIX_SIZE + 2 * value.nbytes)
    stats = protocol.request(Stats)[0]
    assert protocol.receive_frame(reply(("stats", stats, {"sessions": 1})), stats)[0].stats == {"sessions": 1}
    sync = protocol.request(Sync)[0]
    with pytest.raises(ShapeError, match=r"^add: shapes"):
        protocol.receive_frame(reply(("error", sync, "ShapeError", "add: shapes (2,) and (3,)")), sync)
    unknown = protocol.request(Sync)[0]
    with pytest.raises(ExecutionError, match="from a newer peer"):
        protocol.receive_frame(reply(("error", unknown, "SomeNewError", "from a newer peer")), unknown)
    malformed = protocol.request(Get, 5)[0]
    with pytest.raises(ProtocolError, match=r"the 'data' message is \[kind, rid, segment\], got 2 items"):
        protocol.receive_frame(reply(("data", malformed)), malformed)
    read, synced = protocol.request(Get, 6)[0], protocol.request(Sync)[0]  # the shell's wait: the one asked for comes back
    answer, segments = protocol.receive_frame(reply(("ok", synced), ("data", read, 0), segments=[value]), read)
    assert answer == messages.Data(read, 0) and segments == [value]


def test_alive_frames_only_count_and_an_error_frame_ends_the_session(protocol):
    protocol.receive_frame(wire.Frame({"t": "alive"}, []))
    assert protocol.counters["keepalives"] == 1 and protocol.ended is None
    protocol.receive_frame(wire.Frame({"t": "error", "kind": "ConnectionLost", "reason": "idle for 900 s"}, []))
    assert protocol.ended == "the peer ended the session: idle for 900 s"


def test_close_sends_the_batch_then_a_close_frame(protocol):
    x = Handle(protocol.put(np.ones(3)))
    protocol.close()
    assert sent(protocol) == [batch(Put(x.id, 0), segments=[np.ones(3)]),
                              b"".join(wire.encode_frame({"t": "close"}))]


def test_grants_and_fetches_carry_their_fields_in_order(protocol):
    class Where:
        scheme, host, port = "ember", "10.0.0.7", 7878
    x = Handle(protocol.put(np.ones(3)))
    y = logged(protocol, "add", x, 1.0)
    protocol.grant(y.id, b"c" * 32, "s2")
    z = protocol.fetch(META, b"d" * 32, Where, "peer-a")
    protocol.flush()
    (frame,) = decoded(sent(protocol))
    assert [m[0] for m in frame.header["m"]] == ["put", "ops", "grant", "fetch"]  # the grant after the op it reads
    assert frame.header["m"][2:] == (("grant", y.id, b"c" * 32, "s2"),
                                     ("fetch", z, dt.float64, (3,), "ember", "10.0.0.7", 7878, b"d" * 32, "peer-a"))


# -- the handshake --

def test_the_init_frame_asks_for_the_device_and_keepalives():
    assert b"".join(init_frame(2, "tok", 30.0)) == b"".join(wire.encode_frame(
        {"t": "init", "v": wire.VERSION, "device": 2, "token": "tok", "keepalive": 30.0}))
    assert b"".join(init_frame(0, None, None)) == b"".join(wire.encode_frame(
        {"t": "init", "v": wire.VERSION, "device": 0, "token": None}))


@pytest.mark.parametrize("header, error, message", [
    ({"t": "refuse", "kind": "AccessDenied", "reason": "bad or missing token"}, AccessDenied, "bad or missing token"),
    ({"t": "refuse", "kind": "TLSError", "reason": "this peer requires TLS"}, TLSError, "requires TLS"),
    ({"t": "refuse", "kind": "PeerBusy", "reason": "this peer is busy"}, PeerBusy, "busy"),
    ({"t": "refuse", "kind": "NoSuchKind", "reason": "odd"}, ProtocolError, "odd"),
    ({"t": "reply", "m": ()}, ProtocolError, "unexpected reply 'reply'"),
])
def test_an_init_answered_with_anything_but_info_raises_what_the_refusal_names(header, error, message):
    refused = refusal(header, "ember://127.0.0.1:7878/0")
    assert type(refused) is error and str(refused).startswith("ember://127.0.0.1:7878/0 refused the session: ")
    assert message in str(refused)


def test_the_peer_s_info_sets_the_limits_and_dtypes(protocol):
    assert protocol.limits.max_tensor_bytes == 1 << 24 and protocol.dtypes == ("float32", "float64")
    with pytest.raises(Exception, match=r"upload: a tensor of 16777224 bytes exceeds .*7878/0's limit of 16777216"):
        protocol.put(np.zeros((1 << 21) + 1))
