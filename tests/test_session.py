"""The compute peer's logic without I/O: ``Host.open`` (the handshake) and ``Session.handle``,
fed frames directly — hostile ones from hypothesis — with no socket in the way.

Whatever arrives, a session either answers with well-formed reply frames or refuses the frame
with a ProtocolError (the shell then closes the connection); it never raises anything else, and
a session that survived hostile messages still computes correctly.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember import dtypes as dt
from ember.errors import ProtocolError
from ember.remote.host import COUNTED, Host, hosted_devices
from ember.remote.memory import RUN_OP_BYTES, RUN_OVERHEAD, TENSOR_OVERHEAD, BufferPool
from ember.remote.session import Session
from ember.wire import messages
from ember.wire import protocol as wire
from ember.wire.protocol import Frame, Limits

from .test_memory import _registered
from .traffic import register_message

TOKEN = "s3cret"
PER_ID = TENSOR_OVERHEAD  # what each tensor id costs besides its data
HOSTS = "this peer hosts 1 device(s) (numpy)"


def _host(limits: Limits = Limits(max_tensor_bytes=1 << 16)) -> Host:
    return Host(hosted_devices("numpy"), TOKEN, limits)


def _open(host: Host):
    session, replies = host.open(Frame({"t": "init", "v": wire.VERSION, "device": 0, "token": TOKEN}, []), BufferPool())
    assert session is not None and replies[0][0]["t"] == "info"
    return session


def _batch(session, *messages, segments=()):
    return session.handle(Frame({"t": "batch", "m": tuple(messages)}, list(segments)))


def _replies(frames) -> list:
    return [m for header, _ in frames for m in header["m"]]


def _requota(session, quota: int) -> None:
    """Give ``session`` another quota (a peer's limits are fixed: the op path's ceiling is set again by hand)."""
    session.limits = replace(session.limits, max_session_bytes=quota)
    session.quota.room()


def test_a_put_naming_a_segment_from_the_end_is_refused_not_taken_from_the_end():
    session = _open(_host())
    with pytest.raises(ProtocolError, match=r"the 'put' message's segment must be a non-negative integer, got -1"):
        _batch(session, ("put", 1, -1), segments=[np.zeros(2), np.ones(2)])
    assert 1 not in session.table.tensors


def test_handshake_opens_a_session_or_refuses_with_a_reason():
    host = _host()
    session, (info,) = host.open(Frame({"t": "init", "v": wire.VERSION, "device": 0, "token": TOKEN}, []), BufferPool())
    assert session in host.registry.sessions and info[0]["device"] == "numpy" and info[0]["limits"]["max_tensor_bytes"] == 1 << 16
    for header, kind, reason in [
        ({"v": wire.VERSION, "device": 0, "token": "S3CRET"}, "AccessDenied", "bad or missing token"),
        ({"v": wire.VERSION, "device": 0}, "AccessDenied", "bad or missing token"),
        ({"v": wire.VERSION + 1, "device": 0, "token": TOKEN}, "ProtocolError", "is not supported"),
        ({"v": wire.VERSION, "device": 3, "token": TOKEN}, "DeviceError", "index 3 does not exist"),
    ]:
        refused, (reply,) = host.open(Frame({"t": "init", **header}, []), BufferPool())
        assert refused is None and reply[0]["t"] == "refuse" and reply[0]["kind"] == kind and reason in reply[0]["reason"]
        assert TOKEN not in reply[0]["reason"]
    with pytest.raises(ProtocolError, match=r"^the first frame must be an init$"):
        host.open(Frame({"t": "batch", "m": ()}, []), BufferPool())
    assert len(host.registry.sessions) == 1
    host.close(session)
    assert not host.registry.sessions and not session.table.tensors


def test_a_session_computes_reads_and_reports_deferred_errors():
    session = _open(_host())
    x = np.arange(6.0).reshape(2, 3)
    assert _batch(session, ("put", 1, 0), ("op", "matmul", (1, 1), (2,), {}), segments=[x]) == []  # no reply owed
    (reply, segments), = _batch(session, ("op", "multiply", (1, (2.0, "float64")), (3,), {}), ("get", 7, 3))
    assert reply == {"t": "reply", "m": [("data", 7, 0)]}
    np.testing.assert_array_equal(segments[0], x * 2)
    refusal = "matmul: shapes (2, 3) and (2, 3) are not aligned (3 (dim 1) != 2 (dim 0))"
    assert _replies(_batch(session, ("sync", 8))) == [("error", 8, "ShapeError", refusal)]  # reported once
    assert _replies(_batch(session, ("sync", 9))) == [("ok", 9)]
    assert _replies(_batch(session, ("get", 10, 2))) == [("error", 10, "ShapeError", refusal)]  # the output stays failed
    assert _replies(_batch(session, ("shape", 11, (3,)))) == [("shapes", 11, ((2, 3),))]


MESSAGE_NAMES = st.sampled_from(["op", "ops", "put", "get", "shape", "sync", "drop", "stats", "graph", "run", "forget", "bogus"])
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**63), st.floats(allow_nan=True), st.text(max_size=8),
                   st.binary(max_size=8), st.sampled_from(["float64", "add", "matmul", "sum", "int8"]))
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(st.tuples(inner, inner), st.tuples(inner, inner, inner),
                                                       st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=12)
MESSAGES = st.one_of(st.tuples(MESSAGE_NAMES, VALUES), st.tuples(MESSAGE_NAMES, VALUES, VALUES),
                     st.tuples(MESSAGE_NAMES, VALUES, VALUES, VALUES), st.tuples(MESSAGE_NAMES, VALUES, VALUES, VALUES, VALUES),
                     VALUES)


@given(messages=st.lists(MESSAGES, max_size=6), header_kind=st.sampled_from(["batch", "batch", "close", "init", None]))
def test_hostile_frames_are_answered_or_refused_and_the_session_still_computes(messages, header_kind):
    session = _open(_host())
    np.random.seed(0)
    kept = np.random.rand(3)
    _batch(session, ("put", 1000, 0), segments=[kept])
    frame = Frame({"t": header_kind, "m": tuple(messages)} if header_kind else {"m": tuple(messages)},
                  [np.zeros(2)])
    try:
        replies = session.handle(frame)
    except ProtocolError:
        return  # refused: the shell closes this connection; nothing else may escape
    for header, segments in replies:
        assert header["t"] == "reply" and isinstance(header["m"], list)
        assert all(isinstance(s, np.ndarray) for s in segments)
        assert all(type(messages.parse_reply(m)) is type(m) for m in header["m"])  # each a reply record, well formed
        wire.encode_frame(header, segments)  # every reply can be sent
    # whatever happened to ids 0..N, an untouched tensor and fresh work are fine
    if 1000 in session.table.tensors:
        (_, out), = _batch(session, ("op", "add", (1000, (1.0, "float64")), (5000,), {}), ("get", 1, 5000))
        np.testing.assert_array_equal(out[0], kept + 1)


def test_a_tensor_over_the_sessions_limit_is_refused_before_it_runs():
    session = _open(_host(Limits(max_tensor_bytes=1024)))
    _batch(session, ("put", 1, 0), segments=[np.ones(16)])
    _batch(session, ("op", "tile", (1,), (2,), {"repetitions": (100,)}))
    assert 2 not in session.table.tensors or not isinstance(session.table.tensors[2], np.ndarray)  # nothing was allocated
    assert _replies(_batch(session, ("get", 3, 2))) == [
        ("error", 3, "ResourceLimitError",
         "tile: an output of shape (1600,) float64 exceeds the peer's tensor limit of 1024 bytes")]
    assert _replies(_batch(session, ("shape", 4, (1,)))) == [("shapes", 4, ((16,),))]  # the session goes on


def test_the_info_reply_describes_the_host_and_each_session_is_new():
    host, pool = _host(), BufferPool()
    init = Frame({"t": "init", "v": wire.VERSION, "token": TOKEN}, [])  # no device index: device 0
    first, ((info, _),) = host.open(init, pool)
    second, ((again, _),) = host.open(init, BufferPool())
    assert set(info) == {"t", "v", "session", "peer", "backend", "device", "devices", "device_count", "dtypes", "limits"}
    assert (info["t"], info["v"], info["backend"], info["device"], info["devices"], info["device_count"]) == \
        ("info", wire.VERSION, "numpy", "numpy", ("numpy",), 1)
    assert info["dtypes"] == ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                              "float32", "float64", "complex64", "complex128")
    assert info["limits"] == {"max_header_bytes": 64 << 20, "max_tensor_bytes": 1 << 16, "max_frame_bytes": 8 << 30,
                              "max_session_bytes": 1 << 62, "max_session_tensors": 1 << 20, "max_session_graphs": 1 << 12,
                              "max_graph_ops": 1 << 16}
    assert len(info["session"]) == 32 and int(info["session"], 16) >= 0 and again["session"] != info["session"]
    assert info["session"] == first.id and again["peer"] == info["peer"] == host.identity != info["session"]  # one peer
    assert first.pool is pool and first.registry is host.registry
    assert _replies(_batch(first, ("stats", 1))) == [("stats", 1, {"session_tensors": 0, "session_bytes": 0,
                                                                   "session_used_bytes": 0, "session_ops": 0,
                                                                   "session_runs_replayed": 0, "session_graphs": 0, "sessions": 2,
                                                                   "live_tensors": 0})]


@pytest.mark.parametrize("header, kind, reason", [
    ({"v": wire.VERSION, "device": 0, "token": "s3cre"}, "AccessDenied",
     "bad or missing token: pass it in the device string (ember://TOKEN@host:port/0) or in EMBER_TOKEN"),
    ({"v": 0, "device": 0, "token": TOKEN}, "ProtocolError",
     f"protocol version 0 is not supported: this peer speaks version {wire.VERSION}"),
    ({"v": wire.VERSION, "device": 1, "token": TOKEN}, "DeviceError", f"{HOSTS}; index 1 does not exist"),
    ({"v": wire.VERSION, "device": -1, "token": TOKEN}, "DeviceError", f"{HOSTS}; index -1 does not exist"),
    ({"v": wire.VERSION, "device": "0", "token": TOKEN}, "DeviceError", f"{HOSTS}; index '0' does not exist"),
])
def test_each_refusal_says_exactly_why(header, kind, reason):
    session, replies = _host().open(Frame({"t": "init", **header}, []), BufferPool())
    assert session is None and replies == [({"t": "refuse", "kind": kind, "reason": reason}, [])]


@pytest.mark.parametrize("message, refusal", [
    ((), "malformed message ()"),
    ((1, 2), "malformed message (1, 2)"),
    (("bogus",), "unknown message type 'bogus'"),
    (("get", 1), "the 'get' message is [kind, rid, id], got 2 items"),
    (("op", "add", (1,)), "the 'op' message is [kind, name, inputs, outputs, attrs], got 3 items"),
    (("op", "negative", (1,), (-1,), {}), "tensor ids are non-negative integers, got -1"),
    (("op", "negative", (1,), (True,), {}), "tensor ids are non-negative integers, got True"),
    (("op", "no_such_op", (1,), (-1,), {}), "tensor ids are non-negative integers, got -1"),  # a failure's outputs too
    (("op", "no_such_op", (1,), (False,), {}), "tensor ids are non-negative integers, got False"),
    (("op", "negative", (1,), 2, {}), "the 'op' message's outputs must be a list, got 2"),
    (("op", "negative", 1, (2,), {}), "the 'op' message's inputs must be a list, got 1"),
    (("op", "negative", (1,), (2,), ()), "the 'op' message's attrs must be a map, got ()"),
    (("op", "add", (1, (1.0, "float99")), (2,), {}), "add: malformed literal input (1.0, 'float99')"),
    (("op", "add", (1, (1.0, {"float64": 1})), (2,), {}), "add: malformed literal input (1.0, {'float64': 1})"),
    (("op", "add", (1, (1.0,)), (2,), {}), "add: malformed literal input (1.0,)"),
    (("op", "add", (1, (1.0, "float64", 0)), (2,), {}), "add: malformed literal input (1.0, 'float64', 0)"),
    (("op", "add", (1, ("x", "float64")), (2,), {}), "add: malformed literal input ('x', 'float64')"),
    (("op", "add", (1, (None, "float64")), (2,), {}), "add: malformed literal input (None, 'float64')"),
])
def test_a_malformed_message_is_refused_naming_it(message, refusal):
    session = _open(_host())
    _batch(session, ("put", 1, 0), segments=[np.ones(3)])
    with pytest.raises(ProtocolError) as refused:
        _batch(session, message)
    assert str(refused.value) == refusal


# one well-formed message of each kind a client sends; each field the tests below spoil is checked by its record's type
WELL_FORMED = {messages.Op: ("op", "add", (1, 1), (2,), {}), messages.Ops: ("ops", 10, (1,), wire.pack(([], []))),
               messages.Put: ("put", 1, 0), messages.Get: ("get", 1, 1), messages.Shape: ("shape", 1, (1,)),
               messages.Sync: ("sync", 1), messages.Drop: ("drop", (1,)), messages.Stats: ("stats", 1),
               messages.Graph: ("graph", 7, (), (), (), ()), messages.RunGraph: ("run", 7, (), ()),
               messages.Forget: ("forget", 7), messages.Grant: ("grant", 1, b"k" * 32, "s"),
               messages.Fetch: ("fetch", 5, dt.float64, (2,), "ember", "peer.example", 7878, b"c" * 32, "other")}
ADMITS = {"Id": lambda v: type(v) is int and v >= 0, "int": lambda v: type(v) is int, "str": lambda v: type(v) is str,
          "bytes": lambda v: type(v) is bytes, "tuple": lambda v: type(v) is tuple, "dict": lambda v: type(v) is dict}


def _checked(record) -> list[tuple[int, str, str]]:
    """(index, name, annotation) of each field of ``record`` whose type its annotation names (its kind aside)."""
    declared = next(vars(k)["__annotations__"] for k in record.__mro__ if vars(k).get("__annotations__"))
    notes = [getattr(note, "__forward_arg__", note) for note in declared.values()]  # as written
    return [(index, name, note) for index, (name, note) in enumerate(zip(record._fields, notes)) if index and note in ADMITS]


def test_every_kind_a_client_sends_has_a_handler_and_a_well_formed_message_here():
    assert set(Session._HANDLERS) | {messages.Op} == set(messages.REQUESTS.values()) == set(WELL_FORMED)
    for record, message in WELL_FORMED.items():  # ops go straight to the op path, before parse: never to a handler
        assert type(messages.parse(message)) is record and all(ADMITS[n](message[i]) for i, _, n in _checked(record))
        assert messages.Op not in Session._HANDLERS and _checked(record), record


SPOILERS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.text(max_size=3),
                     st.binary(max_size=3), st.tuples(), st.tuples(st.integers(0, 3)), st.dictionaries(st.text(max_size=2),
                                                                                                     st.integers(), max_size=1),
                     st.just(dt.float64), st.just([1]))


@given(data=st.data(), record=st.sampled_from(sorted(WELL_FORMED, key=lambda r: r.KIND)))
def test_a_message_with_a_field_of_the_wrong_type_is_refused_naming_the_field(data, record):
    """Each field whose type the record declares, spoilt, closes the connection with a ProtocolError naming the
    message's kind, the field and the value: an ``op`` on its inline path as every other kind through parse."""
    index, field, note = data.draw(st.sampled_from(_checked(record)))
    value = data.draw(SPOILERS.filter(lambda v: not ADMITS[note](v)))
    message = (*WELL_FORMED[record][:index], value, *WELL_FORMED[record][index + 1:])
    session = _open(_host())
    with pytest.raises(ProtocolError) as refused:
        _batch(session, ("put", 1, 0), message, segments=[np.ones(3)])
    refusal = str(refused.value)
    assert refusal.startswith(f"the {record.KIND!r} message's {field} must be ") and refusal.endswith(f", got {value!r:.40}")
    assert refusal == str(pytest.raises(ProtocolError, messages.parse, message).value)  # the record's own words


@given(record=st.sampled_from(sorted(WELL_FORMED, key=lambda r: r.KIND)), cut=st.integers(-3, 2))
def test_a_message_of_the_wrong_length_is_refused_naming_its_fields(record, cut):
    well_formed = WELL_FORMED[record]
    message = well_formed[:len(well_formed) + cut] if cut < 0 else well_formed + (0,) * (cut + 1)
    if len(message) < 2:
        message = (well_formed[0],)
    session = _open(_host())
    with pytest.raises(ProtocolError) as refused:
        _batch(session, message)
    assert str(refused.value) == f"the {record.KIND!r} message is [{', '.join(record._fields)}], got {len(message)} items"


def test_frames_a_session_answers_without_replies_and_one_it_refuses():
    session = _open(_host())
    assert session.handle(Frame({"t": "close"}, [])) == [] and session.handle(Frame({"t": "batch"}, [])) == []
    with pytest.raises(ProtocolError, match=r"^unexpected frame type 'init' in a session$"):
        session.handle(Frame({"t": "init"}, []))
    with pytest.raises(ProtocolError, match=r"^a batch's 'm' must be a list of messages$"):
        session.handle(Frame({"t": "batch", "m": "op"}, []))
    _batch(session, ("put", 0, 0), segments=[np.ones(2)])  # id 0 is a valid id
    assert _replies(_batch(session, ("shape", 1, (0,)), ("get", 2, 99))) == [
        ("shapes", 1, ((2,),)), ("error", 2, "ExecutionError", "unknown tensor id 99 (dropped, or from another session)")]


def test_a_kernels_own_failure_is_an_execution_error_naming_the_op():
    session = _open(_host())
    _batch(session, ("put", 1, 0), segments=[np.ones(3)])
    _batch(session, ("op", "sum", (1,), (2,), {"dtype": "float64"}))  # a dtype name where a dtype belongs
    ((kind, rid, error, message),) = _replies(_batch(session, ("get", 3, 2)))
    assert (kind, rid, error) == ("error", 3, "ExecutionError") and message.startswith("sum: ")


# --- graphs: registered once, run by number ---------------------------------------------------------------

def _captured():
    """y = inv(a) + c, c a constant: a graph with an input, a constant and a kernel that can fail."""
    import ember as em
    with em.capture() as cap:
        a = cap.input((2, 2), em.float64, "a")
        cap.output(em.linalg.inv(a) + em.asarray(np.array([1.0, 2.0]), device=cap.device), "y")
    return cap.graph


def test_a_registered_graph_runs_with_its_constants_and_counts_its_ops():
    graph, session = _captured(), _open(_host())
    a = np.array([[2.0, 0.0], [0.0, 4.0]])
    register = register_message(7, graph)
    replies = _batch(session, register, ("put", 1, 1), ("run", 7, (1,), (2,)), ("get", 3, 2),
                     ("run", 7, (1,), (4,)), ("stats", 5), segments=[*graph.constants.values(), a])
    ((header, (y,)),) = replies
    np.testing.assert_array_equal(y, np.linalg.inv(a) + [1.0, 2.0])
    held = 3 * (32 + PER_ID) + _registered(register) + 16  # what its quota counts: three tensors and the graph
    assert header["m"][1] == ("stats", 5, {"session_tensors": 3, "session_bytes": 3 * (32 + PER_ID),
                                           "session_used_bytes": held, "session_ops": 4,
                                           "session_runs_replayed": 0, "session_graphs": 1, "sessions": 1,
                                           "live_tensors": 3})
    assert session.table.metas[4] == session.table.metas[2] and np.array_equal(session.table.tensors[4], y)
    # a kernel that fails inside a run poisons the run's outputs only, reported once
    assert _batch(session, ("put", 5, 0), ("run", 7, (5,), (6,)), segments=[np.zeros((2, 2))]) == []
    singular = ("ExecutionError", "inv: Singular matrix (inputs: (2, 2) float64)")
    assert _replies(_batch(session, ("get", 8, 6), ("sync", 9), ("sync", 10), ("get", 11, 4))) == [
        ("error", 8, *singular), ("error", 9, *singular), ("ok", 10), ("data", 11, 0)]
    _batch(session, ("forget", 7), ("forget", 12345))  # forgetting an unknown graph is no error
    assert _replies(_batch(session, ("run", 7, (1,), (13,)), ("get", 14, 13))) == [
        ("error", 14, "ExecutionError", "run: unknown graph 7")]
    session.close()
    assert not session.registered.graphs and not session.table.tensors and not session.table.metas


def test_a_registered_graph_is_compiled_as_a_local_jit_is():
    """Given its nodes' metas, the peer's plan runs an elementwise chain in one buffer (as em.jit does),
    and counts each registration."""
    import ember as em
    with em.capture() as cap:
        x = cap.input((1000,), em.float64, "x")
        cap.output(-((x * 2.0 + 1.0) * 3.0), "y")
    session = _open(_host())
    _batch(session, register_message(1, cap.graph), register_message(2, cap.graph))
    plan = session.registered.graphs[1].plan
    assert [step[2] is None for step in plan.steps] == [False, True, True, True]  # in place after the first step
    assert session.registered.graphs_registered == 2
    (_, (y,)), = _batch(session, ("put", 1, 0), ("run", 1, (1,), (2,)), ("get", 3, 2), segments=[np.ones(1000)])
    np.testing.assert_array_equal(y, np.full(1000, -9.0))


def test_a_registered_graph_reserves_the_op_paths_peak_not_every_intermediate():
    """An 80-op chain on 10,000 float64 (80 kB an array) holds at most two arrays at once on the op path (and its
    plan, one): a run reserves those 160 kB (and their ids), not the 6.4 MB of every intermediate. One byte less is
    refused."""
    import ember as em
    with em.capture() as cap:
        y = cap.input((10_000,), em.float64, "x")
        for _ in range(40):
            y = y * 1.5 - 1.0
        cap.output(y, "y")
    host = np.linspace(0, 1, 10_000)
    expected = host
    for _ in range(40):
        expected = expected * 1.5 - 1.0
    array = 80_000 + PER_ID  # an array and its id
    register = register_message(1, cap.graph)
    quota = _registered(register) + 3 * array  # the graph, the input, and the run's two arrays at once
    session = _open(_host(Limits(max_tensor_bytes=1 << 20, max_session_bytes=quota)))
    _batch(session, register, ("put", 1, 0), segments=[host])
    assert session.registered.graphs[1].need == 2 * array  # the need a run reserves
    (_, (y,)), = _batch(session, ("run", 1, (1,), (2,)), ("get", 3, 2))
    np.testing.assert_array_equal(y, expected)
    assert session.quota.used == session.table.live_bytes() + _registered(register) and session.table.live_bytes() == 2 * array
    _batch(session, ("drop", (2,)))
    _requota(session, quota - 1)
    (reply,) = _replies(_batch(session, ("run", 1, (1,), (4,)), ("get", 5, 4)))
    assert reply[2:] == ("ResourceLimitError", f"run of graph 1: {2 * array} more bytes would exceed this session's quota "
                                               f"of {quota - 1} bytes ({_registered(register) + array} in use)")
    assert session.quota.used == session.table.live_bytes() + _registered(register)
    assert session.table.live_bytes() == array + PER_ID


@pytest.mark.parametrize("run, kind, message", [
    ((7, (1, 1), (9,)), "ProtocolError", "run: graph 7 takes 1 inputs and gives 1 outputs; got 2 input ids and 1 output ids"),
    ((7, (), (9,)), "ProtocolError", "run: graph 7 takes 1 inputs and gives 1 outputs; got 0 input ids and 1 output ids"),
    ((7, (1,), (9, 10)), "ProtocolError", "run: graph 7 takes 1 inputs and gives 1 outputs; got 1 input ids and 2 output ids"),
    ((7, (3,), (9,)), "ShapeError", "run: input 0 expects (2, 2) float64, got (3, 3) float64"),
    ((7, (4,), (9,)), "ShapeError", "run: input 0 expects (2, 2) float64, got (2, 2) float32"),
    ((7, (99,), (9,)), "ExecutionError", "run: unknown tensor id 99 (dropped, or from another session)"),
    ((7, (5,), (9,)), "ExecutionError", "run: unknown tensor id 5 (dropped, or from another session)"),
    ((8, (1,), (9,)), "ExecutionError", "run: unknown graph 8"),
    ((7, (6,), (9,)), "ProtocolError", "unknown op 'no_such_op'"),  # a failed input: its own error travels on
])
def test_a_run_that_does_not_fit_its_graph_poisons_only_its_outputs(run, kind, message):
    graph, session = _captured(), _open(_host())
    tensors = {1: np.eye(2), 3: np.eye(3), 4: np.eye(2, dtype=np.float32), 5: np.eye(2)}
    _batch(session, register_message(7, graph), *(("put", i, k + 1) for k, i in enumerate(tensors)), ("drop", (5,)),
           ("op", "no_such_op", (1,), (6,), {}), ("sync", 0), segments=[*graph.constants.values(), *tensors.values()])
    # the run's own error is reported by the next sync; a failed input's was reported already (sync 0)
    synced = ("ok", 30) if run[1] == (6,) else ("error", 30, kind, message)
    assert _replies(_batch(session, ("run", *run), *(("get", 20 + k, o) for k, o in enumerate(run[2])),
                           ("sync", 30), ("sync", 31))) == [
        *(("error", 20 + k, kind, message) for k in range(len(run[2]))), synced, ("ok", 31)]
    assert _replies(_batch(session, ("run", 7, (1,), (40,)), ("get", 41, 40)))[0] == ("data", 41, 0)  # it serves on


INV, ADD = ("inv", (0,), (1,), {}), ("add", (1, 2), (3,), {})  # _captured()'s records


@pytest.mark.parametrize("ops, outputs, kind, message", [
    ((("no_such_op", (0,), (1,), {}), ADD), None, "ProtocolError", "unknown op 'no_such_op'"),
    ((INV, ("add", (1, 9), (3,), {})), None, "ProtocolError", "add reads node 9, which nothing before it produced"),
    ((INV, ("add", (1, 2), (0,), {})), (0,), "ProtocolError", "add writes node 0, which is produced already (or not an id)"),
    ((INV, ("add", (1, 2), ("3",), {})), None, "ProtocolError", "add writes node '3', which is produced already (or not an id)"),
    ((INV, ("add", (1, 2), (3, 4), {})), None, "ProtocolError", "add: 2 output ids for 1 outputs"),
    ((INV, ("add", (1, 2), (3,), {"axis": 0})), None, "ProtocolError", "add: unknown attribute 'axis'"),
    ((INV, ("tile", (1,), (3,), {})), None, "ProtocolError", "tile: the required attribute 'repetitions' is missing"),
    ((INV, ("add", (1, (1.0, "float99")), (3,), {})), None, "ProtocolError", "add: malformed literal input (1.0, 'float99')"),
    ((INV, ("add", (1, ((1.0,) * 3, "float64")), (3,), {})), None, "ProtocolError",  # a tuple is no scalar literal
     "add: malformed literal input ((1.0, 1.0, 1.0), 'float64')"),
    ((INV, ("add", (1, 2), (3,))), None, "ProtocolError",
     "a record is (name, inputs, outputs, attrs), got ('add', (1, 2), (3,))"),
    ((INV, ("add", [1, 2], (3,), {})), None, "ProtocolError", "add: a record is (name, inputs, outputs, attrs)"),
    ((INV, ("add", (1, 2), (3,), ())), None, "ProtocolError", "add: a record is (name, inputs, outputs, attrs)"),
    ((INV, ("add", (1, 2), 3, {})), None, "ProtocolError", "add: a record is (name, inputs, outputs, attrs)"),
    ((INV, ("reshape", (1,), (3,), {"shape": (3,)})), None, "ShapeError",
     "reshape: cannot reshape an array of shape (2, 2) (size 4) into shape (3,)"),
    ((INV, ("nonzero", (1,), (3, 4), {})), None, "ProtocolError", "nonzero: data-dependent shapes cannot be part of a graph"),
    ((INV, ("tile", (1,), (3,), {"repetitions": (100, 100)})), None, "ResourceLimitError",
     "tile: an output of shape (200, 200) float64 exceeds the peer's tensor limit of 65536 bytes"),
    ((INV, ADD), (3, 8), "ProtocolError", "graph output 8 is not produced by the graph"),
])
def test_a_graph_the_table_refuses_is_refused_at_every_run_and_the_session_serves_on(ops, outputs, kind, message):
    graph, session = _captured(), _open(_host())
    _batch(session, register_message(7, graph, ops, outputs), register_message(8, graph), ("put", 1, 1),
           segments=[*graph.constants.values(), np.eye(2)])
    assert 7 in session.registered.graphs  # refused graphs are kept with their error, so each run reports it
    for rid in (10, 20):
        replies = _replies(_batch(session, ("run", 7, (1,), (rid,) * len(outputs or (3,))), ("get", rid, rid),
                                  ("sync", rid + 1)))
        ((_, _, got_kind, got), synced) = replies
        assert got_kind == kind and got.startswith(f"graph: {message}") and synced == ("error", rid + 1, kind, got)
    assert _replies(_batch(session, ("run", 8, (1,), (30,)), ("get", 31, 30)))[0] == ("data", 31, 0)


def test_a_failed_op_poisons_what_depends_on_it_and_is_reported_once():
    session = _open(_host())
    _batch(session, ("put", 1, 0), ("op", "no_such_op", (1,), (2, 3), {}), ("op", "negative", (2,), (4,), {}),
           ("op", "negative", (1,), (5,), {}), ("op", "add", (5, 77), (6,), {}), segments=[np.arange(3.0)])
    unknown = ("ProtocolError", "unknown op 'no_such_op'")
    missing = ("ExecutionError", "add: unknown tensor id 77 (dropped, or from another session)")
    assert _replies(_batch(session, ("get", 10, 3), ("get", 11, 4), ("shape", 12, (5, 4)), ("get", 13, 6),
                           ("sync", 14), ("sync", 15), ("get", 16, 5))) == [
        ("error", 10, *unknown), ("error", 11, *unknown), ("error", 12, *unknown), ("error", 13, *missing),
        ("error", 14, *unknown), ("ok", 15), ("data", 16, 0)]
    assert session.ops == 4 and 4 not in session.table.metas  # a failed output has no meta: it counts its id alone


def test_an_op_of_several_outputs_that_gives_one_keeps_it_as_it_is():
    """A row with ``multiple`` outputs gives a tuple even when it holds one array (``unstack`` of a
    length-1 axis, ``nonzero`` of a 1-d array): the peer stores that array, not the tuple made into one."""
    session = _open(_host())
    x = np.array([7.0])
    _batch(session, ("put", 1, 0), ("op", "unstack", (1,), (2,), {"axis": 0}), ("op", "nonzero", (1,), (3,), {}),
           segments=[x])
    (header, (first, where)), = _batch(session, ("shape", 1, (2, 3)), ("get", 2, 2), ("get", 3, 3))
    assert header["m"] == [("shapes", 1, ((), (1,))), ("data", 2, 0), ("data", 3, 1)]
    assert first.shape == () and first == 7.0 and np.array_equal(where, [0])
    assert session.table.live_bytes() == 8 + 8 + 8 + 3 * PER_ID


def test_an_id_read_dropped_and_written_again_in_one_batch_is_read_anew():
    """A reply sends a tensor read twice once; an op that writes the id between the reads (after a
    drop freed it) makes the second read send the new value, not the first read's segment again."""
    session = _open(_host())
    (header, segments), = _batch(session, ("put", 1, 0), ("put", 2, 1), ("get", 1, 1), ("drop", (1,)),
                                 ("op", "negative", (2,), (1,), {}), ("get", 2, 1), ("get", 3, 1),
                                 segments=[np.ones(3), np.full(3, 5.0)])
    assert header["m"] == [("data", 1, 0), ("data", 2, 1), ("data", 3, 1)]
    assert segments[0].tolist() == [1.0] * 3 and segments[1].tolist() == [-5.0] * 3


def test_a_data_dependent_op_of_one_output_is_sized_when_it_has_run():
    session = _open(_host())
    x = np.array([3.0, 1.0, 3.0, 2.0])
    _batch(session, ("put", 1, 0), ("op", "unique_values", (1,), (2,), {}), segments=[x])
    (header, (values,)), = _batch(session, ("shape", 1, (2,)), ("get", 2, 2))
    assert header["m"] == [("shapes", 1, ((3,),)), ("data", 2, 0)]
    assert sorted(values) == [1.0, 2.0, 3.0] and session.table.live_bytes() == x.nbytes + 3 * 8 + 2 * PER_ID


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_peer_on_a_backend_that_holds_a_dtype_without_computing_on_it_refuses_each_op_by_name(dtype):
    """torch:cpu stores wide unsigned integers but computes nothing on them: a peer hosting it
    refuses an op on one before a kernel fails, as local execution does, and serves on."""
    pytest.importorskip("torch")
    host = Host(hosted_devices("torch:cpu"), TOKEN, Limits(max_tensor_bytes=1 << 16))
    session = _open(host)
    x = np.array([0, 7], dtype=dtype)
    _batch(session, ("put", 1, 0), ("op", "add", (1, 1), (2,), {}), ("op", "astype", (1,), (3,), {"dtype": dt.int64}),
           ("op", "sum", (3,), (4,), {"dtype": getattr(dt, dtype)}),  # a supported input, an output it lacks
           ("op", "unstack", (1,), (5, 6), {"axis": 0}), segments=[x])  # an op of several outputs
    (header, (cast,)), = _batch(session, ("get", 1, 2), ("get", 2, 3), ("get", 3, 4), ("get", 4, 5))
    refusal = "{}: torch:cpu computes nothing on " + dtype + "; convert it first with astype (e.g. to int64)"
    assert header["m"] == [("error", 1, "NotSupportedError", refusal.format("add")), ("data", 2, 0),
                           ("error", 3, "NotSupportedError", refusal.format("sum")),
                           ("error", 4, "NotSupportedError", refusal.format("unstack"))]
    assert cast.tolist() == [0, 7] and cast.dtype == np.int64
    for base in (10, 20, 30):  # as a run seen three times: never compiled past the op path's check
        _batch(session, _run(base, (1,), ("add", (-1, -1), (0,), {})))
        assert _replies(_batch(session, ("get", 5, base))) == [("error", 5, "NotSupportedError", refusal.format("add"))]
    assert session.runs_replayed == 0


def test_defaults_fill_missing_attributes_and_data_dependent_shapes_are_read_on_demand():
    session = _open(_host())
    x = np.array([[1.0, 0.0], [0.0, 3.0]])
    _batch(session, ("put", 1, 0), ("op", "sum", (1,), (2,), {}), ("op", "nonzero", (1,), (3, 4), {}),
           ("op", "mean", (1,), (5,), {"axis": (1,)}), segments=[x])
    (header, (total, mean)), = _batch(session, ("shape", 1, (2, 3, 4, 5)), ("get", 2, 2), ("get", 3, 5))
    assert header["m"] == [("shapes", 1, ((), (2,), (2,), (2,))), ("data", 2, 0), ("data", 3, 1)]
    assert total == 4.0 and np.array_equal(mean, [0.5, 1.5])
    assert session.table.live_bytes() == x.nbytes + 8 + 2 * 8 + 2 * 8 + 16 + 5 * PER_ID
    _batch(session, ("drop", (1, 3, 999)))  # an unknown id is no error
    assert sorted(session.table.tensors) == [2, 4, 5] and sorted(session.table.metas) == [2, 4, 5]
    assert session.table.live_bytes() == 8 + 16 + 16 + 3 * PER_ID


def test_the_registry_counts_every_open_session_and_forgets_closed_ones():
    host = _host()
    first, second = _open(host), _open(host)
    _batch(first, ("put", 1, 0), ("put", 2, 1), segments=[np.ones(2), np.ones(3)])
    _batch(second, ("put", 1, 0), segments=[np.ones(2)])
    assert host.registry.stats() == {"sessions": 2, "live_tensors": 3}
    host.close(first)
    assert host.registry.stats() == {"sessions": 1, "live_tensors": 1} and not first.table.tensors
    assert _replies(_batch(second, ("get", 5, 1)))[0] == ("data", 5, 0)


def test_a_session_counts_by_name_what_the_peer_sums_and_keeps_once_it_closed():
    host = _host()
    session = _open(host)
    _batch(session, ("put", 1, 0), ("op", "negative", (1,), (2,), {}), ("get", 5, 2), segments=[np.ones(2)])
    counted = session.counted()
    assert tuple(counted) == COUNTED  # the status page's rows show them in this order
    assert counted == {"ops": 1, "round_trips": 1, "bytes_in": 16, "bytes_out": 16, "graphs_registered": 0, "graph_runs": 0}
    assert host.totals() == counted
    host.close(session)
    assert host.totals() == counted  # a closed session's counts stay in the peer's totals


@pytest.mark.parametrize("token", ["s3cret", None])
def test_a_host_without_a_token_opens_any_session_and_one_with_a_token_only_the_exact_one(token):
    host = Host(hosted_devices("numpy"), token, Limits())
    for presented in ["s3cret", "S3CRET", "s3cre", "s3crett", "", None, 5, b"s3cret"]:
        header = {"t": "init", "v": wire.VERSION} | ({} if presented is None else {"token": presented})
        session, ((reply, _),) = host.open(Frame(header, []), BufferPool())
        opened = token is None or presented == token
        assert (session is not None) is opened and reply["t"] == ("info" if opened else "refuse")


@pytest.mark.parametrize("device, hosted", [("numpy", ["numpy"]), ("torch:cpu", ["torch:cpu"])])
def test_a_peer_hosts_the_backend_it_is_given_without_autodiff(device, hosted):
    pytest.importorskip("torch") if device.startswith("torch") else None
    import ember as em
    assert [str(d) for d in hosted_devices(device)] == hosted
    assert [str(d) for d in hosted_devices(em.autodiff(device))] == hosted


@pytest.mark.parametrize("device, refusal", [
    ("capture", "cannot host a remote server on a capture device — capture records operations without executing them; "
                "host the underlying backend instead (e.g. `numpy`)"),
    ("ember://127.0.0.1:1/0", "cannot host a remote server on a remote device — run `ember serve` on the machine "
                              "that owns the hardware"),
])
def test_devices_that_cannot_be_hosted_are_refused_saying_why(device, refusal):
    from ember.errors import HostDeviceError
    with pytest.raises(HostDeviceError) as refused:
        hosted_devices(device)
    assert str(refused.value) == refusal


def test_a_backend_that_is_not_installed_cannot_be_hosted(monkeypatch):
    import ember.backends
    from ember.errors import HostDeviceError

    def missing(name):
        raise ImportError(f"No module named {name!r}")
    monkeypatch.setattr(ember.backends, "backend_module", missing)
    with pytest.raises(HostDeviceError) as refused:
        hosted_devices("numpy")
    assert str(refused.value) == "cannot host numpy: numpy is not installed (No module named 'numpy')"


@pytest.mark.parametrize("name, hosted", [
    ("numpy", ["numpy"]),
    ("torch:cpu", ["torch:cpu"]),
    ("torch:cuda:1", ["torch:cuda:0", "torch:cuda:1", "torch:cuda:10"]),  # one peer hosts every GPU
    ("torch:cuda:0", ["torch:cuda:0", "torch:cuda:1", "torch:cuda:10"]),
    ("torch:cuda:7", ["torch:cuda:0", "torch:cuda:1", "torch:cuda:10"]),  # what it asked for need not be listed
    ("torch:mps", ["torch:mps"]),                                          # nothing of its kind listed: itself
    ("jax:gpu:1", ["jax:gpu:0", "jax:gpu:1"]),                             # JAX's GPUs likewise
    ("jax:cpu", ["jax:cpu"]),
])
def test_a_peer_hosts_every_device_of_the_kind_it_serves(name, hosted):
    from ember.remote.host import same_kind
    assert same_kind(name, ["torch:cpu", "torch:cuda:0", "torch:cuda:1", "torch:cuda:10", "torch:cudax", "numpy",
                            "jax:cpu", "jax:gpu:0", "jax:gpu:1"]) == hosted


def test_a_refusal_lists_every_hosted_device():
    devices = hosted_devices("numpy") * 2
    session, ((reply, _),) = Host(devices, None, Limits()).open(Frame({"t": "init", "v": wire.VERSION, "device": 2}, []),
                                                                BufferPool())
    assert session is None and reply["reason"] == "this peer hosts 2 device(s) (numpy, numpy); index 2 does not exist"


def test_an_op_name_that_is_not_a_string_is_an_unknown_op():
    session = _open(_host())
    _batch(session, ("put", 1, 0), ("op", {"add": 1}, (1,), (2,), {}), ("op", 7, (1,), (3,), {}), segments=[np.ones(2)])
    assert _replies(_batch(session, ("get", 4, 2), ("get", 5, 3))) == [
        ("error", 4, "ProtocolError", "unknown op {'add': 1}"), ("error", 5, "ProtocolError", "unknown op 7")]


def test_single_ops_take_literals_anywhere_unknown_references_fail_and_id_0_is_an_output():
    session = _open(_host())
    _batch(session, ("put", 1, 0), ("op", "subtract", ((10.0, "float64"), 1), (0,), {}),
           ("op", "negative", ({"not": "an id"},), (2,), {}), ("op", "negative", ("1",), (3,), {}), segments=[np.arange(3.0)])
    assert _replies(_batch(session, ("get", 4, 2), ("get", 5, 3))) == [
        ("error", 4, "ExecutionError", "negative: unknown tensor id {'not': 'an id'} (dropped, or from another session)"),
        ("error", 5, "ExecutionError", "negative: unknown tensor id '1' (dropped, or from another session)")]
    (_, (out,)), = _batch(session, ("get", 6, 0))
    np.testing.assert_array_equal(out, [10.0, 9.0, 8.0])
    assert _replies(_batch(session, ("shape", 8, ((1,),)))) == [  # an id in a list names no tensor: an error reply
        ("error", 8, "ExecutionError", "unknown tensor id (1,) (dropped, or from another session)")]
    with pytest.raises(ProtocolError, match=r"^the 'get' message's id must be a non-negative integer, got \{'not': 'an id'\}$"):
        _batch(session, ("get", 7, {"not": "an id"}))  # the message's own field: a malformed message


def test_a_peer_keeps_literals_converted_and_tells_zeros_and_dtypes_apart():
    session = _open(_host())
    host = np.array([1.5, -2.0, 0.0])
    literals = ((2.5, "float64"), (2.5, "float64"), (-0.0, "float64"), (0.0, "float64"), (3, "int64"), (True, "bool"))
    _batch(session, ("put", 1, 0), *(("op", "multiply", (1, ref), (10 + i,), {}) for i, ref in enumerate(literals)),
           segments=[host])
    for i, (value, _) in enumerate(literals):
        (_, (out,)), = _batch(session, ("get", 20 + i, 10 + i))
        expected = host * value
        assert out.dtype == expected.dtype and np.array_equal(np.signbit(out), np.signbit(expected)), value
        np.testing.assert_array_equal(out, expected)
    # each kept once, as 0-d arrays of their dtypes; zeros never (0.0 and -0.0 are one key)
    assert set(session.engine._literals) == {(2.5, dt.float64), (3, dt.int64), (True, dt.bool_)}


def _blob(records, let_go=()) -> bytes:
    """A run's records and the outputs its client let go, as the client packs them (remote/runs.py)."""
    return wire.pack((list(records), list(let_go)))


def _run(base: int, inputs: tuple, *records, let_go=()) -> tuple:
    """An ``ops`` message as the client builds it (remote/runs.py)."""
    return ("ops", base, inputs, _blob(records, let_go))


def _learnt(records, let_go=()) -> int:
    """What a session counts for a run it has compiled: its blob, its entry and each record of its plan."""
    return len(_blob(records, let_go)) + RUN_OVERHEAD + RUN_OP_BYTES * len(records)


# a run as a loop sends it: ids relative to its first output, the array made before it its input -1
CHAIN = [("multiply", (-1, (1.5, "float64")), (0,), {}), ("sin", (0,), (1,), {}),
         ("add", (1, -1), (2,), {}), ("sum", (2,), (3,), {"axis": None, "keepdims": False, "dtype": None})]


def _chain(x):
    y = np.sin(x * 1.5) + x
    return [x * 1.5, np.sin(x * 1.5), y, y.sum()]


def test_a_peers_compiled_run_keeps_none_of_its_outputs_to_write_over(monkeypatch):
    """A session counts the memory it holds, so a peer's plans never keep their last results to write the next
    over (em.jit's local plans do, from ``REFILL_MIN`` bytes): nothing kept, whatever the results' size."""
    from ember.engines import local
    monkeypatch.setattr(local, "REFILL_MIN", 0)
    monkeypatch.setattr(local, "KEPT", local.KeptOutputs())
    session = _open(_host())
    _batch(session, ("put", 1, 0), segments=[np.arange(4.0)])
    for base in (10, 20, 30):
        _batch(session, _run(base, (1,), *CHAIN))
    assert session.runs_replayed == 1 and session.runs[_blob(CHAIN)].plan._refills is None
    assert local.KEPT.nbytes == 0


def test_a_jax_peer_replays_runs_through_its_own_plan_not_xla():
    """A run is short and seen with few shapes: a peer on jax replays it through the local engine's plan, never
    handing it to XLA to compile (em.jit's graphs are; registered graphs on peers too)."""
    pytest.importorskip("jax")
    from ember.engines import local
    session = _open(Host(hosted_devices("jax:cpu"), TOKEN, Limits(max_tensor_bytes=1 << 16)))
    x = np.arange(4.0)
    _batch(session, ("put", 1, 0), segments=[x])
    for base in (10, 20, 30):
        _batch(session, _run(base, (1,), *CHAIN))
        (_, (out,)), = _batch(session, ("get", 1, base + 3))
        np.testing.assert_allclose(out, _chain(x)[3], rtol=1e-12)
    assert session.runs_replayed == 1 and type(session.runs[_blob(CHAIN)].plan) is local.Plan


def test_a_replay_reads_later_tensors_it_did_not_make_and_steps_aside_for_any_output_in_use():
    """The edges of a compiled run: a record may read a tensor at or past the run's base that the run did not make
    (another thread's, logged between), by its base at every sighting; an output of exactly the tensor limit is
    compiled; base 0 replays; a replay whose output past the first is in use runs op by op, giving that tensor's
    bytes back; an empty run is accepted at every sighting; and a peer's chain of outputs let go runs in place."""
    from ember.engines import local
    host = _host(Limits(max_tensor_bytes=32))  # each output below holds exactly 32 bytes
    session = _open(host)
    x, later = np.arange(4.0), np.arange(4.0) + 10
    records = [("multiply", (-1, (1.5, "float64")), (0,), {}), ("add", (0, 3), (1,), {}), ("sin", (1,), (2,), {})]

    def expected(x, later):
        return [x * 1.5, x * 1.5 + later, np.sin(x * 1.5 + later)]
    _batch(session, ("put", 9, 0), segments=[x])
    for sighting, base in enumerate((10, 20, 0)):
        _batch(session, ("put", base + 3, 0), segments=[later + sighting])  # what the records read as 3
        _batch(session, _run(base, (9,), *records))
        assert session.runs_replayed == max(0, sighting - 1)
        for k, want in enumerate(expected(x, later + sighting)):
            (_, (out,)), = _batch(session, ("get", 1, base + k))
            np.testing.assert_array_equal(out, want)
    assert type(session.runs[_blob(records)]).__name__ == "RunPlan"
    _batch(session, ("put", 42, 0), segments=[x + 100])  # the run at 40 would make 40, 41 and 42: 42 is in use
    _batch(session, ("put", 43, 0), segments=[later])
    _batch(session, _run(40, (9,), *records))
    assert session.runs_replayed == 1 and session.quota.used == session.table.live_bytes() + session.runs_bytes  # op by op
    (_, (out,)), = _batch(session, ("get", 1, 42))
    np.testing.assert_array_equal(out, expected(x, later)[2])
    for _ in range(3):
        assert _replies(_batch(session, _run(50, (9,)), ("sync", 1))) == [("ok", 1)]

    chained = [("multiply", (-1, (2.0, "float64")), (0,), {}), ("add", (0, (1.0, "float64")), (1,), {}),
               ("sin", (1,), (2,), {})]
    for base in (60, 70, 80):
        _batch(session, _run(base, (9,), *chained, let_go=(0, 1)))
    (_, (out,)), = _batch(session, ("get", 1, 82))
    np.testing.assert_array_equal(out, np.sin(x * 2.0 + 1.0))
    plan = session.runs[_blob(chained, (0, 1))].plan
    assert any(type(item) is list for item in plan._program) and isinstance(plan, local.Plan)  # in place
    assert session.runs_replayed == 3 and host.budget.used == session.quota.used + session.quota.credit + host.pool.total
    with pytest.raises(ProtocolError, match=r"^the 'ops' message's blob must be bytes, got 'not bytes'$"):
        _batch(session, ("ops", 90, (9,), "not bytes"))


def test_a_run_seen_twice_is_compiled_then_replayed_with_the_op_paths_results():
    session = _open(_host())
    x = np.arange(4.0)
    _batch(session, ("put", 1, 0), segments=[x])
    for sighting, base in enumerate((10, 20, 30, 40)):
        _batch(session, _run(base, (1,), *CHAIN))
        assert type(session.runs[_blob(CHAIN)]).__name__ == ("int" if sighting == 0 else "RunPlan")
        assert session.runs_replayed == max(0, sighting - 1)
        for k, expected in enumerate(_chain(x)):
            (_, (out,)), = _batch(session, ("get", 100 + k, base + k))
            np.testing.assert_array_equal(out, expected)
            metas, sizes = session.table.metas, session.table.sizes
            assert metas[base + k] == metas[10 + k] and sizes[base + k] == out.nbytes + PER_ID
    assert session.ops == 16 and _replies(_batch(session, ("sync", 1))) == [("ok", 1)]
    # another input of the same shape and dtype: the plan; of another shape: op by op, the same results
    _batch(session, ("put", 2, 0), ("put", 3, 1), segments=[x + 1, np.arange(6.0)])
    for base, tid, host in ((50, 2, x + 1), (60, 3, np.arange(6.0))):
        _batch(session, _run(base, (tid,), *CHAIN))
        for k, expected in enumerate(_chain(host)):
            (_, (out,)), = _batch(session, ("get", 200 + k, base + k))
            np.testing.assert_array_equal(out, expected)
            assert session.table.metas[base + k].shape == out.shape and session.table.sizes[base + k] == out.nbytes + PER_ID
    assert session.runs_replayed == 3
    # outputs over tensors in use: op by op, each old tensor's bytes given back
    _batch(session, _run(40, (1,), *CHAIN))
    assert session.runs_replayed == 3 and session.quota.used == session.table.live_bytes() + session.runs_bytes
    # an output below 0: refused at every sighting, as the op path refuses it
    below = [("negative", (-1,), (-2,), {})]
    for base in (100, 110):
        _batch(session, _run(base, (1,), *below))
    with pytest.raises(ProtocolError, match="tensor ids are non-negative integers, got -1"):
        _batch(session, _run(1, (1,), *below))
    # a tensor read, dropped and written again by a replay in one frame: the second read is the new value
    _batch(session, ("op", "negative", (1,), (300,), {}))
    (_, (first, again)), = _batch(session, ("get", 1, 300), ("drop", (300,)), _run(300, (2,), *CHAIN), ("get", 2, 300))
    np.testing.assert_array_equal(first, -x)
    np.testing.assert_array_equal(again, (x + 1) * 1.5)
    assert session.runs_replayed == 3  # op by op: the frame had sent tensor 300 already
    _batch(session, _run(400, (2,), *CHAIN))
    assert session.runs_replayed == 4
    with pytest.raises(ProtocolError, match="tensor ids are non-negative integers, got -5"):  # as op by op
        _batch(session, _run(-5, (1,), *CHAIN))


# a loop's run as its client sends it after the loop moved on: every output but the last let go; the first is read last
LINKS = [("multiply", (-1, (1.5, "float64")), (0,), {}), *(("sin", (k,), (k + 1,), {}) for k in range(6)),
         ("add", (6, 0), (7,), {})]


def test_outputs_a_run_let_go_are_never_stored_and_a_replay_reserves_only_the_op_paths_peak():
    x = np.arange(4.0)  # 32 bytes, as each output
    expected = x * 1.5
    for _ in range(6):
        expected = np.sin(expected)
    expected = expected + x * 1.5
    # the op path holds at most three outputs at once (the first, the last and the one before): 96 bytes, not 256
    # (and their ids), beside the input and what the session learnt of the run
    array, learnt = 32 + PER_ID, _learnt(LINKS, range(7))
    quota = array + 3 * array + learnt
    session = _open(_host(Limits(max_tensor_bytes=1 << 16, max_session_bytes=quota)))
    _batch(session, ("put", 1, 0), segments=[x])
    for sighting, base in enumerate((10, 20, 30, 40)):
        _batch(session, _run(base, (1,), *LINKS, let_go=range(7)))
        assert set(session.table.tensors) == set(session.table.metas) == set(session.table.sizes) == {1, base + 7}
        assert session.runs_replayed == max(0, sighting - 1) and session.table.live_bytes() == 2 * array
        assert session.quota.used == session.table.live_bytes() + session.runs_bytes and session.runs_bytes == (
            learnt if sighting else learnt - RUN_OP_BYTES * len(LINKS))
        (_, (out,)), = _batch(session, ("get", 1, base + 7), ("drop", (base + 7,)))
        np.testing.assert_allclose(out, expected, rtol=1e-12)
    assert session.ops == 32 and _replies(_batch(session, ("sync", 1))) == [("ok", 1)]
    # one byte less: the op path refuses the op that does not fit, and so does the plan (it runs op by op)
    _requota(session, quota - 1)
    _batch(session, _run(50, (1,), *LINKS, let_go=range(7)))
    assert session.runs_replayed == 2 and set(session.table.tensors) == {1, 57}  # 57: its failure
    assert set(session.table.metas) == {1}
    assert session.quota.used == session.table.live_bytes() + learnt and session.table.live_bytes() == array + PER_ID
    (reply,) = _replies(_batch(session, ("get", 1, 57)))
    assert reply[2:] == ("ResourceLimitError", f"sin: {array} more bytes would exceed this session's quota of {quota - 1} "
                                               f"bytes ({3 * array + learnt} in use)")
    # an output let go that no record reads is freed right after the record that makes it
    _requota(session, 1 << 20)
    for base in (60, 70, 80):
        _batch(session, _run(base, (1,), ("negative", (-1,), (0,), {}), ("sin", (-1,), (1,), {}), let_go=[0]))
        assert set(session.table.metas) == {1, base + 1} and session.table.live_bytes() == 2 * array + PER_ID  # and 57's failure
        assert session.quota.used == session.table.live_bytes() + session.runs_bytes
        _batch(session, ("drop", (base + 1,)))
    assert session.runs_replayed == 3


@pytest.mark.parametrize("spoil, kind, message", [
    # the input failed: every output carries its failure, as ops reading it would
    (lambda s: _batch(s, ("op", "divide", (1, 1), (1,), {"bogus": 1})), "ProtocolError", "divide: unknown attribute 'bogus'"),
    # dropped: unknown
    (lambda s: _batch(s, ("drop", (1,))), "ExecutionError", "multiply: unknown tensor id 1 (dropped, or from another session)"),
    # no room for the outputs: the op that does not fit is refused
    (lambda s: _requota(s, s.quota.used + 40 + 2 * PER_ID), "ResourceLimitError",
     f"sin: {32 + PER_ID} more bytes would exceed this session's quota"),
])
def test_a_run_whose_plan_does_not_fit_runs_op_by_op_with_its_errors(spoil, kind, message):
    session = _open(_host(Limits(max_tensor_bytes=1 << 16, max_session_bytes=1 << 20)))
    _batch(session, ("put", 1, 0), segments=[np.arange(4.0)])
    for base in (10, 20):
        _batch(session, _run(base, (1,), *CHAIN))
    spoil(session)
    _batch(session, _run(30, (1,), *CHAIN))
    assert session.runs_replayed == 0
    (reply,) = _replies(_batch(session, ("get", 7, 33)))
    assert reply[:3] == ("error", 7, kind) and reply[3].startswith(message), reply
    assert session.table.live_bytes() == sum(session.table.sizes.values()) and session.quota.used >= session.table.live_bytes()


def test_a_kernel_failing_inside_a_plan_leaves_nothing_and_the_op_path_reports_it():
    session = _open(_host())
    inverse = [("inv", (-1,), (0,), {}), ("add", (0, (1.0, "float64")), (1,), {})]
    _batch(session, ("put", 1, 0), ("put", 2, 1), segments=[np.eye(2) * 2, np.zeros((2, 2))])
    for base in (10, 20):
        _batch(session, _run(base, (1,), *inverse))
    used = session.quota.used
    _batch(session, _run(30, (2,), *inverse))  # singular: the plan raises, the ops then run one by one
    assert session.runs_replayed == 0 and 30 in session.table.tensors and 31 in session.table.tensors
    assert _replies(_batch(session, ("sync", 1)))[0][2:] == ("ExecutionError", "inv: Singular matrix (inputs: (2, 2) float64)")
    assert session.quota.used == used + 2 * PER_ID  # the outputs failed: their ids alone are counted
    _batch(session, _run(40, (1,), *inverse))
    (_, (out,)), = _batch(session, ("get", 2, 41))
    np.testing.assert_array_equal(out, np.linalg.inv(np.eye(2) * 2) + 1)
    assert session.runs_replayed == 1


def test_runs_the_plan_cannot_take_are_never_compiled_and_sightings_are_bounded(monkeypatch):
    from ember.remote import runs
    session = _open(_host())
    _batch(session, ("put", 1, 0), segments=[np.arange(4.0)])
    several = [("unique_counts", (-1,), (0, 1), {})]   # two outputs, data-dependent sizes
    for base in (10, 20, 30):
        _batch(session, _run(base, (1,), *several))
    assert session.runs[_blob(several)] is runs.NOT_COMPILED and session.runs_replayed == 0
    (_, (values, counts)), = _batch(session, ("get", 1, 30), ("get", 2, 31))
    np.testing.assert_array_equal(values, np.arange(4.0))
    for records, inputs, segments in (
            ([("unique_values", (-1,), (0,), {})], (1,), []),  # a data-dependent size
            ([("conv2d", (-1, -2), (0,), {})], (2, 3), [np.ones((1, 1, 4, 4)), np.ones((1, 1, 3, 3))]),  # scratch
            ([("matmul", (-1, -2), (0,), {})], (4, 5), [np.ones((100, 1)), np.ones((1, 100))])):  # over the tensor limit
        _batch(session, *(("put", tid, k) for k, tid in enumerate(inputs[:len(segments)])), segments=segments)
        for base in (40, 50, 60):
            _batch(session, _run(base, inputs, *records))
        assert session.runs[_blob(records)] is runs.NOT_COMPILED and session.runs_replayed == 0
    (reply,) = _replies(_batch(session, ("get", 3, 60)))
    assert reply[2:] == ("ResourceLimitError", "matmul: an output of shape (100, 100) float64 exceeds the peer's "
                                               "tensor limit of 65536 bytes")
    monkeypatch.setattr(runs, "KEPT_RUNS", 3)
    monkeypatch.setattr("ember.remote.session.KEPT_RUNS", 3)
    for k in range(5):
        _batch(session, _run(100 + 10 * k, (1,), ("multiply", (-1, (float(k + 2), "float64")), (0,), {})))
        assert 1 <= len(session.runs) <= 3


@pytest.mark.parametrize("message, refusal", [
    (("ops", "10", (1,), _blob([])), "the 'ops' message's base must be an integer, got '10'"),
    (("ops", 10, [1], _blob([])), "the 'ops' message's inputs must be a list, got [1]"),
    (("ops", 10, (1,), "not bytes"), "the 'ops' message's blob must be bytes, got 'not bytes'"),
    (("ops", 10, (1,), b"\xc1"), "malformed header"),
    (("ops", 10, (1,), wire.pack([])), "a run's blob is (records, outputs let go), got ()"),
    (("ops", 10, (1,), wire.pack([[], [], []])), "a run's blob is (records, outputs let go)"),
    (("ops", 10, (1,), _blob([("sin", (0,), (1,))])), "a run's records are (name, inputs, outputs, attrs)"),
    (("ops", 10, (1,), wire.pack(([], 3))), "a run's outputs let go are a list of its outputs, got 3"),
    (("ops", 10, (1,), _blob([("sin", (-1,), (0,), {})], [1])), "a run's output let go, 1, is not one of its records' outputs"),
    (("ops", 10, (1,), _blob([("sin", (-1,), (0,), {})], [-1])), "a run's output let go, -1, is not one of its records'"),
    (("ops", 10, (1,), _blob([("sin", (-1,), (0,), {})], [True])), "a run's output let go, True, is not one of its records'"),
    (("ops", 10, (1,), _blob([("sin", (-2,), (0,), {})])), "a run's input -2 is beyond its 1 inputs"),
    (("ops", 10), "the 'ops' message is [kind, base, inputs, blob], got 2 items"),
])
def test_a_malformed_run_is_refused_naming_what_is_wrong(message, refusal):
    session = _open(_host())
    _batch(session, ("put", 1, 0), segments=[np.arange(4.0)])
    with pytest.raises(ProtocolError, match=re.escape(refusal)):
        _batch(session, message)


REFS = st.one_of(st.integers(-3, 5), st.just((1.5, "float64")), VALUES)
RECORDS = st.tuples(st.sampled_from(["add", "sin", "multiply", "sum", "inv", "unique_counts", "bogus", 3]),
                    st.one_of(st.lists(REFS, max_size=3).map(tuple), VALUES),
                    st.one_of(st.lists(st.integers(-2, 5), max_size=2).map(tuple), VALUES),
                    st.one_of(st.just({}), VALUES))


@given(records=st.lists(st.one_of(RECORDS, VALUES), max_size=4), base=st.one_of(st.integers(-5, 2000), VALUES),
       inputs=st.one_of(st.lists(st.sampled_from([1000, 1001, 7]), max_size=3).map(tuple), VALUES),
       let_go=st.one_of(st.lists(st.integers(-2, 5), max_size=3), VALUES))
def test_hostile_runs_are_run_or_refused_at_each_sighting_and_the_session_still_computes(records, base, inputs, let_go):
    session = _open(_host())
    kept = np.arange(3.0)
    _batch(session, ("put", 1000, 0), ("put", 1001, 1), segments=[kept, np.eye(3)])
    try:
        blob = wire.pack((records, let_go))
    except ProtocolError:
        return
    for _ in range(3):  # seen, compiled, replayed: each may be refused, none may raise anything else
        try:
            for header, segments in _batch(session, ("ops", base, inputs, blob), ("sync", 1)):
                assert header["t"] == "reply"
                wire.encode_frame(header, segments)
        except ProtocolError:
            pass
        assert session.quota.used >= session.table.live_bytes() >= 0
    value = session.table.tensors.get(1000)
    if type(value) is np.ndarray:  # whatever the runs wrote over, fresh work on a live tensor is right
        (_, out), = _batch(session, ("op", "add", (1000, (1.0, "float64")), (5000,), {}), ("get", 1, 5000))
        np.testing.assert_array_equal(out[0], value + 1)


def test_a_failure_written_over_a_tensor_takes_its_place_and_its_bytes():
    session = _open(_host())
    _batch(session, ("put", 1, 0), ("op", "negative", (1,), (2,), {}), segments=[np.ones(4)])
    assert session.table.live_bytes() == 64 + 2 * PER_ID
    _batch(session, ("op", "no_such_op", (1,), (2,), {}))
    assert session.table.live_bytes() == 32 + 2 * PER_ID and 2 not in session.table.metas
    assert _replies(_batch(session, ("get", 3, 2)))[0] == ("error", 3, "ProtocolError", "unknown op 'no_such_op'")


def test_an_output_exactly_at_the_tensor_limit_is_allowed_one_element_more_is_not():
    session = _open(_host(Limits(max_tensor_bytes=1024)))
    _batch(session, ("op", "full", (), (1,), {"shape": (128,), "fill_value": 1.0}),
           ("op", "full", (), (2,), {"shape": (129,), "fill_value": 1.0}))
    assert _replies(_batch(session, ("shape", 3, (1,)), ("get", 4, 2))) == [
        ("shapes", 3, ((128,),)),
        ("error", 4, "ResourceLimitError",
         "full: an output of shape (129,) float64 exceeds the peer's tensor limit of 1024 bytes")]


def test_a_graph_whose_kernel_raises_an_ember_error_keeps_its_kind():
    import ember as em
    with em.capture() as cap:
        x, i = cap.input((3,), em.float64, "x"), cap.input((2,), em.int64, "i")
        cap.output(em.take(x, i), "y")
    graph, session = cap.graph, _open(_host())
    _batch(session, register_message(7, graph), ("put", 1, 0), ("put", 2, 1), ("run", 7, (1, 2), (3,)),
           segments=[np.arange(3.0), np.array([0, 5])])
    ((kind, rid, error, message),) = _replies(_batch(session, ("get", 4, 3)))
    assert (kind, rid, error) == ("error", 4, "IndexingError") and message.startswith("take: ")


# --- the buffer pool: reference counts, so these cannot run under mutmut's trampolines (tools/mutation.py) ---

def _address(array) -> int:
    return array.__array_interface__["data"][0]


def test_buffer_pool_reuses_only_unshared_buffers():
    pool = BufferPool(minimum=1024)
    offered = [pool.allocate((64, 64), np.dtype(np.float32))]  # the list holds the only reference, as a drop's does
    address = _address(offered[0])
    view = offered[0].reshape(-1)
    pool.release(offered)                # a view still shares the memory: kept out of the pool
    assert pool.total == 0
    del view
    alias = offered[0]
    pool.release(offered)                # so does another reference to the same array (another tensor id's, a name)
    assert pool.total == 0
    root = alias.base
    del alias
    pool.release(offered)                # and to its buffer
    assert pool.total == 0
    del root
    pool.release([offered[0], offered[0]])  # one array offered twice (two ids of one tensor): the second still uses it
    assert pool.total == 0
    pool.release(offered)
    assert pool.total == 64 * 64 * 4 and pool.free == {64 * 64 * 4: [offered[0].base]}
    del offered
    b = pool.allocate((32, 128), np.dtype(np.float32))   # same size: the buffer comes back
    assert _address(b) == address and pool.total == 0 and pool.free == {64 * 64 * 4: []}
    c = pool.allocate((32, 128), np.dtype(np.float32))   # the pool is empty again: a fresh buffer
    assert _address(c) != address and c.base.dtype == np.uint8


def test_buffer_pool_keeps_buffers_from_its_minimum_up_to_its_capacity():
    pool = BufferPool(capacity=3072, minimum=1024)
    small = pool.allocate((1023,), np.dtype(np.uint8))
    assert small.base is None  # below the minimum: a plain array, never pooled
    pool.release([small])
    pool.release([pool.allocate((128,), np.dtype(np.float64))])
    assert pool.total == 1024
    pool.release([pool.allocate((256,), np.dtype(np.float64))])
    assert pool.total == 3072 and sorted(pool.free) == [1024, 2048]  # exactly at capacity
    over = [pool.allocate((128,), np.dtype(np.float64))]
    assert pool.total == 2048  # the kept 1 KiB buffer came back
    pool.release(over)
    pool.release([pool.allocate((129,), np.dtype(np.float64))])
    assert pool.total == 3072 and sorted(pool.free) == [1024, 2048]  # a buffer past the capacity is let go


def test_buffer_pool_keeps_only_views_of_one_dimensional_byte_buffers():
    pool = BufferPool(minimum=1024)
    # each offered alone in its list, so only its shape decides (not another reference)
    pool.release([np.ones(4096, np.uint8)])                 # owns its memory: not from a frame
    pool.release([np.ones(1024)[:]])                        # a view of a float64 buffer
    pool.release([np.ones((64, 64), np.uint8)[:, :32]])     # a view of a 2-d buffer
    pool.release([np.zeros((32, 64), np.uint8).view(np.int16)[:]])
    pool.release([np.ones(2048, np.uint8)[:1024].view(np.float64)])  # a 1-d byte buffer: kept
    assert pool.total == 2048 and list(pool.free) == [2048]


def test_a_dropped_tensor_gives_its_buffer_back_once_nothing_shares_it():
    session = _open(_host(Limits(max_tensor_bytes=1 << 20)))
    pool = session.pool
    received = pool.allocate((1 << 17,), np.dtype(np.float64))  # as the frame reader receives a 1 MiB tensor
    address = _address(received)
    _batch(session, ("put", 1, 0), ("op", "reshape", (1,), (2,), {"shape": (256, 512)}), segments=[received])
    del received
    _batch(session, ("drop", (1,)))
    assert pool.total == 0  # the reshaped view still uses the memory
    _batch(session, ("drop", (2,)))
    assert pool.total == 1 << 20
    again = pool.allocate((1 << 18,), np.dtype(np.float32))
    assert _address(again) == address


def test_a_host_serves_at_most_its_sessions_and_says_so():
    host = Host(hosted_devices("numpy"), None, Limits(), max_sessions=2)
    opened = [host.open(Frame({"t": "init", "v": wire.VERSION}, []))[0] for _ in range(2)]
    refused, ((reply, _),) = host.open(Frame({"t": "init", "v": wire.VERSION}, []))
    assert all(opened) and refused is None and reply == {
        "t": "refuse", "kind": "PeerBusy", "reason": "this peer is full: it serves at most 2 session(s) at once; try again later"}
    host.close(opened[0])
    assert host.open(Frame({"t": "init", "v": wire.VERSION}, []))[0] is not None and opened[0] not in host.registry.sessions


@pytest.mark.parametrize("window, interval", [(4.0, 1.0), (0.1, 0.05), (999_999, 249_999.75), (0, None), (1e6, None),
                                              (-1, None), ("4", None)])
def test_a_client_asking_for_keepalives_gets_an_interval_a_quarter_of_its_window(window, interval):
    session, ((info, _),) = _host().open(Frame({"t": "init", "v": wire.VERSION, "token": TOKEN, "keepalive": window}, []),
                                         BufferPool())
    assert info.get("keepalive") == interval


def test_a_failing_authorizer_is_logged_with_the_address_and_never_the_token(caplog):
    def broken(address, token, device):
        raise KeyError(f"no entry for {token}")
    host = Host(hosted_devices("numpy"), None, Limits(), authorize=broken)
    session, _ = host.open(Frame({"t": "init", "v": wire.VERSION, "token": "abcd"}, []), BufferPool(), "10.0.0.7:5000")
    assert session is None
    (record,) = [r for r in caplog.records if "authorizer failed" in r.getMessage()]
    assert record.getMessage().startswith("10.0.0.7:5000: refused: the authorizer failed: Traceback (most recent call "
                                          "last):\n  File ")
    assert record.getMessage().endswith("KeyError: 'no entry for <token>'") and "abcd" not in caplog.text
