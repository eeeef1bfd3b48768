"""The compute peer's logic without I/O: ``Host.open`` (the handshake) and ``Session.handle``,
fed frames directly — hostile ones from hypothesis — with no socket in the way.

Whatever arrives, a session either answers with well-formed reply frames or refuses the frame
with a ProtocolError (the shell then closes the connection); it never raises anything else, and
a session that survived hostile messages still computes correctly.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.errors import ProtocolError
from ember.remote.session import BufferPool, Host, hosted_devices
from ember.wire import protocol as wire
from ember.wire.protocol import Frame, Limits

TOKEN = "s3cret"
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
    with pytest.raises(ProtocolError, match="the first frame must be an init"):
        host.open(Frame({"t": "batch", "m": ()}, []), BufferPool())
    assert len(host.registry.sessions) == 1
    host.close(session)
    assert not host.registry.sessions and not session.tensors


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


MESSAGE_NAMES = st.sampled_from(["op", "put", "get", "shape", "sync", "drop", "stats", "graph", "run", "forget", "bogus"])
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
        wire.encode_frame(header, segments)  # every reply can be sent
    # whatever happened to ids 0..N, an untouched tensor and fresh work are fine
    if 1000 in session.tensors:
        (_, out), = _batch(session, ("op", "add", (1000, (1.0, "float64")), (5000,), {}), ("get", 1, 5000))
        np.testing.assert_array_equal(out[0], kept + 1)


def test_a_tensor_over_the_sessions_limit_is_refused_before_it_runs():
    session = _open(_host(Limits(max_tensor_bytes=1024)))
    _batch(session, ("put", 1, 0), segments=[np.ones(16)])
    _batch(session, ("op", "tile", (1,), (2,), {"repetitions": (100,)}))
    assert 2 not in session.tensors or not isinstance(session.tensors[2], np.ndarray)  # nothing was allocated
    assert _replies(_batch(session, ("get", 3, 2))) == [
        ("error", 3, "ProtocolError", "tile: an output of shape (1600,) float64 exceeds the peer's tensor limit of 1024 bytes")]
    assert _replies(_batch(session, ("shape", 4, (1,)))) == [("shapes", 4, ((16,),))]  # the session goes on


def test_the_info_reply_describes_the_host_and_each_session_is_new():
    host, pool = _host(), BufferPool()
    init = Frame({"t": "init", "v": wire.VERSION, "token": TOKEN}, [])  # no device index: device 0
    first, ((info, _),) = host.open(init, pool)
    second, ((again, _),) = host.open(init, BufferPool())
    assert set(info) == {"t", "v", "session", "backend", "device", "devices", "device_count", "dtypes", "limits"}
    assert (info["t"], info["v"], info["backend"], info["device"], info["devices"], info["device_count"]) == \
        ("info", wire.VERSION, "numpy", "numpy", ("numpy",), 1)
    assert info["dtypes"] == ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                              "float32", "float64", "complex64", "complex128")
    assert info["limits"] == {"max_header_bytes": 64 << 20, "max_tensor_bytes": 1 << 16, "max_frame_bytes": 8 << 30}
    assert len(info["session"]) == 32 and int(info["session"], 16) >= 0 and again["session"] != info["session"]
    assert first.pool is pool and first.registry is host.registry
    assert _replies(_batch(first, ("stats", 1))) == [("stats", 1, {"session_tensors": 0, "session_bytes": 0, "session_ops": 0,
                                                                   "sessions": 2, "live_tensors": 0})]


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
    (("get", 1), "malformed 'get' message: not enough values to unpack (expected 2, got 1)"),
    (("op", "add", (1,)), "malformed 'op' message: not enough values to unpack (expected 5, got 3)"),
    (("op", "negative", (1,), (-1,), {}), "tensor ids are non-negative integers, got -1"),
    (("op", "negative", (1,), (True,), {}), "tensor ids are non-negative integers, got True"),
])
def test_a_malformed_message_is_refused_naming_it(message, refusal):
    session = _open(_host())
    _batch(session, ("put", 1, 0), segments=[np.ones(3)])
    with pytest.raises(ProtocolError) as refused:
        _batch(session, message)
    assert str(refused.value) == refusal


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
