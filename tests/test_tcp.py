"""The wire without I/O: the msgpack codec and the incremental FrameReader, byte by byte.

The peer tests send these frames over real sockets; here every edge of the format — limits at
their exact value, header-less frames, empty and non-contiguous tensors, frames split anywhere,
several frames in one read — is checked directly. The TCP shell's waits (deadlines, polling for
an expected frame) are checked last, over a loopback socket pair.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ember as em
from ember import errors
from ember.wire import protocol as wire
from ember.wire.protocol import MAGIC, PREFIX_SIZE, FrameReader, Limits
from ember.wire.tcp import TimedOut

from .conftest import too_large


def _bytes(header, segments=()) -> bytes:
    return b"".join(bytes(b) for b in wire.encode_frame(header, list(segments)))


def _prefix(header_len: int, payload: int) -> bytes:
    return struct.pack("<4sIQ", MAGIC, header_len, payload)


# --- the codec ---------------------------------------------------------------------------------------

def test_plain_values_round_trip_with_tuples_strings_dtypes_and_complex():
    value = {"t": "x", "n": [1, -2, 2**63 - 1], "f": 1.5, "c": 1 - 2j, "d": em.float32, "b": b"\x00\x01", "none": None,
             "nested": {"k": [(1, 2), True]}, "np": np.int16(7)}
    back = wire.unpack(wire.pack(value))
    assert back == {"t": "x", "n": (1, -2, 2**63 - 1), "f": 1.5, "c": 1 - 2j, "d": em.float32, "b": b"\x00\x01",
                    "none": None, "nested": {"k": ((1, 2), True)}, "np": 7}
    assert type(back["t"]) is str and type(back["n"]) is tuple and back["d"] is em.float32


def test_what_cannot_travel_is_refused_naming_it():
    with pytest.raises(errors.ProtocolError, match=r"^cannot encode object <object object at .*>: only plain values travel$"):
        wire.pack({"x": object()})
    with pytest.raises(errors.ProtocolError, match=r"^cannot encode int 1180591620717411303424: only plain values travel$"):
        wire.pack(2**70)
    with pytest.raises(errors.ProtocolError, match=r"^cannot encode a message: 'utf-8' codec can't encode"):
        wire.pack({"x": "\ud800"})  # a lone surrogate is not UTF-8


@pytest.mark.parametrize("data, message", [
    (wire.pack({1: "a"}), r"^malformed header: ValueError: .*"),  # map keys are strings
    (b"\xdd" + struct.pack(">I", 2**31), r"^malformed header: ValueError: 2147483648 exceeds max_array_len\(5\)$"),
    (b"\xdf" + struct.pack(">I", 2**30), r"^malformed header: ValueError: 1073741824 exceeds max_map_len"),
    (b"\xc7\x04\x01" + b"qu16", r"^unknown dtype b'qu16'$"),
    (b"\xc7\x28\x01" + b"x" * 40, r"^unknown dtype b'x{32}'$"),  # shown up to 32 bytes
    (b"\xc7\x08\x02" + b"\x00" * 8, r"^unknown msgpack extension type 2$"),  # a complex needs 16 bytes
    (b"\xc7\x10\x07" + b"\x00" * 16, r"^unknown msgpack extension type 7$"),
    (b"\xc1", r"^malformed header: "),
])
def test_malformed_or_oversized_msgpack_is_a_protocol_error(data, message):
    with pytest.raises(errors.ProtocolError, match=message):
        wire.unpack(data)


def test_error_replies_become_the_exception_they_name():
    assert type(wire.error_from_reply("ShapeError", "matmul: no")) is errors.ShapeError
    unknown = wire.error_from_reply("FromTheFuture", 42)
    assert type(unknown) is errors.ExecutionError and str(unknown) == "42"


# --- frames ------------------------------------------------------------------------------------------

SEGMENTS = [np.arange(12, dtype=np.float32).reshape(3, 4), np.zeros((0, 5), np.int64), np.array(2.5 + 1j),
            np.array([True, False])]


def _check(frame, header, segments):
    assert {k: v for k, v in frame.header.items() if k != "seg"} == header
    assert len(frame.segments) == len(segments)
    for got, sent in zip(frame.segments, segments):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        np.testing.assert_array_equal(got, sent)


@pytest.mark.parametrize("chunk", [1, 3, PREFIX_SIZE, 1000, None])
def test_frames_parse_the_same_however_the_bytes_are_split(chunk):
    """Several frames in one stream, fed in chunks (the incremental path) or whole (the fast path)."""
    header = {"t": "batch", "m": (("put", 1, 0),)}
    stream = _bytes(header, SEGMENTS) + _bytes({"t": "close"}) + _bytes(header, SEGMENTS[:1])
    reader, frames = FrameReader(), []
    for start in range(0, len(stream), chunk or len(stream)):
        frames += reader.feed(stream[start:start + (chunk or len(stream))])
    assert [f.header["t"] for f in frames] == ["batch", "close", "batch"]
    _check(frames[0], header, SEGMENTS)
    _check(frames[1], {"t": "close"}, [])
    _check(frames[2], header, SEGMENTS[:1])
    assert reader.buffer().nbytes == PREFIX_SIZE  # back at a frame boundary


def test_receiving_into_the_buffer_parses_like_feeding():
    stream = _bytes({"t": "a"}, SEGMENTS) + _bytes({"t": "b"})
    reader, frames, at = FrameReader(), [], 0
    while at < len(stream):
        target = reader.buffer()
        n = min(target.nbytes, 7, len(stream) - at)
        target[:n] = stream[at:at + n]
        at += n
        frames += reader.advance(n)
    assert [f.header["t"] for f in frames] == ["a", "b"]
    _check(frames[0], {"t": "a"}, SEGMENTS)


@pytest.mark.parametrize("tensor", [
    np.arange(20.0).reshape(4, 5)[:, ::2],                     # strided 2-d
    np.arange(10.0)[::3],                                       # strided 1-d: reshape(-1) keeps its strides
    np.broadcast_to(np.array(False), (5,)),                     # broadcast, stride 0, one byte per item
    np.broadcast_to(np.arange(3, dtype=np.int64), (2, 3)),     # broadcast rows
    np.asfortranarray(np.arange(6.0).reshape(2, 3)),           # column-major
], ids=["strided-2d", "strided-1d", "broadcast-bool", "broadcast-rows", "fortran"])
def test_a_non_contiguous_tensor_is_sent_by_value(tensor):
    buffers = wire.encode_frame({}, [tensor])
    assert all(memoryview(b).c_contiguous for b in buffers)  # what a scatter-gather send needs
    (frame,) = FrameReader().feed(_bytes({}, [tensor]))
    assert frame.segments[0].shape == tensor.shape and frame.segments[0].dtype == tensor.dtype
    np.testing.assert_array_equal(frame.segments[0], tensor)


def test_a_small_frame_is_one_buffer_and_a_large_tensor_is_sent_from_its_own_memory():
    small = np.arange(6, dtype=np.float32)
    (one,) = wire.encode_frame({"t": "reply"}, [small, small[::2]])  # one write: what a round trip's reply is
    (frame,) = FrameReader().feed(one)
    np.testing.assert_array_equal(frame.segments[1], small[::2])
    big = np.arange(wire._SMALL // 8 + 1, dtype=np.float64)  # one element past the copying size
    prefix, view = wire.encode_frame({"t": "reply"}, [big])
    assert np.shares_memory(np.frombuffer(view, np.float64), big)  # a view, no copy
    (frame,) = FrameReader().feed(bytes(prefix) + bytes(view))
    np.testing.assert_array_equal(frame.segments[0], big)


def test_a_finished_frames_tensors_are_held_by_the_frame_alone():
    """Was: the reader kept the last frame's arrays until the next frame's header, so a client's
    download buffers (reused only once nothing refers to them) were never free for the next read."""
    import weakref
    made = []

    def allocate(shape, dtype):
        array = np.empty(shape, dtype)
        made.append(weakref.ref(array))
        return array

    reader = FrameReader(allocate=allocate)
    data = _bytes({"t": "reply"}, [np.arange(1000.0)])
    frames = reader.feed(data[:10]) + reader.feed(data[10:])  # split: through the reader's stages
    assert len(frames) == 1 and made[0]() is not None
    np.testing.assert_array_equal(frames[0].segments[0], np.arange(1000.0))
    del frames
    assert made[0]() is None

@pytest.mark.parametrize("whole", [True, False])
def test_a_frame_without_a_header_is_an_empty_map(whole):
    reader = FrameReader()
    data = _prefix(0, 0)
    frames = reader.feed(data) if whole else reader.feed(data[:5]) + reader.feed(data[5:])
    assert frames == [wire.Frame({}, [])]


@pytest.mark.parametrize("whole", [True, False])
def test_received_tensors_go_where_allocate_says(whole):
    made = []

    def allocate(shape, dtype):
        made.append((shape, dtype))
        return np.empty(shape, dtype)

    data = _bytes({"t": "x"}, SEGMENTS[:2])
    reader = FrameReader(allocate=allocate)
    (frame,) = reader.feed(data) if whole else reader.feed(data[:PREFIX_SIZE]) + reader.feed(data[PREFIX_SIZE:])
    assert made == [((3, 4), np.dtype(np.float32)), ((0, 5), np.dtype(np.int64))]
    _check(frame, {"t": "x"}, SEGMENTS[:2])


@pytest.mark.parametrize("whole", [True, False])
def test_limits_hold_at_their_exact_values(whole):
    header = wire.pack({"t": "x", "seg": (("uint8", (16,)),)})
    data = _prefix(len(header), 16) + header + bytes(16)
    size = len(header)
    exact = Limits(max_header_bytes=size, max_tensor_bytes=16, max_frame_bytes=size + 16)

    def parse(limits):
        reader = FrameReader(limits)
        return reader.feed(data) if whole else reader.feed(data[:PREFIX_SIZE]) + reader.feed(data[PREFIX_SIZE:])

    (frame,) = parse(exact)
    assert frame.segments[0].nbytes == 16
    for limits, message in [
        (Limits(max_header_bytes=size - 1, max_tensor_bytes=16, max_frame_bytes=size + 16),
         f"a header of {size} bytes exceeds the limit of {size - 1}"),
        (Limits(max_header_bytes=size, max_tensor_bytes=15, max_frame_bytes=size + 16),
         "a tensor of 16 bytes exceeds the limit of 15 bytes"),
        (Limits(max_header_bytes=size, max_tensor_bytes=16, max_frame_bytes=size + 15),
         f"a frame of {size + 16} bytes exceeds the limit of {size + 15}"),
    ]:
        with pytest.raises(errors.ProtocolError, match=message):
            parse(limits)


@pytest.mark.parametrize("whole", [True, False])
def test_a_repeated_segment_descriptor_is_checked_against_the_limits_of_its_time(whole):
    """The reader keeps the last descriptor it checked, with its layout: the same one again after
    the limits changed (a handshake's end) meets the new limits; another is checked anew."""
    reader = FrameReader(Limits(max_tensor_bytes=16))

    def parse(array):
        data = _bytes({"t": "reply"}, [array])
        return reader.feed(data) if whole else reader.feed(data[:PREFIX_SIZE + 3]) + reader.feed(data[PREFIX_SIZE + 3:])

    for _ in range(2):
        (frame,) = parse(np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(frame.segments[0], np.arange(4, dtype=np.float32))
    (frame,) = parse(np.arange(2, dtype=np.float64))  # equal in size, another dtype
    assert frame.segments[0].dtype == np.float64
    with pytest.raises(errors.ProtocolError, match=r"^a tensor of 32 bytes exceeds the limit of 16 bytes$"):
        parse(np.arange(4, dtype=np.float64))
    reader = FrameReader(Limits(max_tensor_bytes=16))
    parse(np.arange(4, dtype=np.float32))
    reader.limits = Limits(max_tensor_bytes=15)
    with pytest.raises(errors.ProtocolError, match=r"^a tensor of 16 bytes exceeds the limit of 15 bytes$"):
        parse(np.arange(4, dtype=np.float32))


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("header, payload, message", [
    ([1, 2], 0, r"^a frame header must be a map$"),
    ({"seg": [["uint8", [2]]]}, 2, None),  # lists are fine: msgpack makes them tuples
    ({"seg": "uint8"}, 0, r"^'seg' must be a list of \[dtype, shape\]$"),
    ({"seg": (("float128", (2,)),)}, 32, r"^bad segment descriptor \('float128', \(2,\)\)$"),
    ({"seg": (("uint8",),)}, 0, r"^bad segment descriptor \('uint8',\)$"),
    ({"seg": (("uint8", (-1,)),)}, 0, r"^bad segment shape \(-1,\)$"),
    ({"seg": (("uint8", (1,) * 65),)}, 1, r"^bad segment shape"),
    ({"seg": (("uint8", (3,)),)}, 2, r"segments (of 3 bytes )?disagree with the payload length 2$"),
])
def test_bad_segment_descriptors_are_refused_naming_them(whole, header, payload, message):
    body = wire.pack(header)
    data = _prefix(len(body), payload) + body + bytes(payload)
    reader = FrameReader()
    parse = (lambda: reader.feed(data)) if whole else (lambda: reader.feed(data[:PREFIX_SIZE]) + reader.feed(data[PREFIX_SIZE:]))
    if message is None:
        (frame,) = parse()
        assert frame.segments[0].shape == (2,)
        return
    with pytest.raises(errors.ProtocolError, match=message):
        parse()


def test_the_most_dimensions_a_tensor_may_have_is_64():
    (frame,) = FrameReader().feed(_bytes({}, [np.zeros((1,) * 64, np.uint8)]))
    assert frame.segments[0].ndim == 64 and frame.segments[0].size == 1
    empty = np.zeros((0,) * 3, np.float64)
    (frame,) = FrameReader().feed(_bytes({}, [empty]))
    assert frame.segments[0].shape == (0, 0, 0)


def test_bad_magic_names_the_bytes():
    with pytest.raises(errors.ProtocolError, match=r"^bad frame magic b'HTTP': not an ember peer$"):
        FrameReader().feed(b"HTTP" + bytes(PREFIX_SIZE - 4))


# --- what a header may cost ------------------------------------------------------------------------

@pytest.mark.parametrize("data", [
    b"\xd6\xff" + bytes(4),                       # fixext 4: a 32-bit timestamp
    b"\xd7\xff" + bytes(8),                       # fixext 8
    b"\xc7\x0c\xff" + bytes(12),                  # ext 8, 96-bit
    b"\xc8\x00\x04\xff" + bytes(4),               # ext 16
    b"\xc9\x00\x00\x00\x08\xff" + bytes(8),       # ext 32
    wire.pack({"t": "batch", "m": (("op", "full", (), (1,), {"fill_value": "x"}),)})[:-2] + b"\xd6\xff" + bytes(4),
], ids=["fixext4", "fixext8", "ext8", "ext16", "ext32", "in-an-attribute"])
def test_msgpack_timestamps_are_an_unknown_extension(data):
    """msgpack decodes extension -1 itself, without the ext hook: it is refused all the same."""
    with pytest.raises(errors.ProtocolError, match=r"^unknown msgpack extension type -1 \(a timestamp\)$"):
        wire.unpack(data)


def test_bytes_that_look_like_a_timestamp_inside_other_values_are_fine():
    value = {"f": struct.unpack("<d", b"\x00\xd6\xff\x00\x00\x00\x00\x00")[0], "s": "\u05ff", "b": b"\xc7\x0c\xff"}
    data = wire.pack(value)
    assert wire.maybe_timestamp(data)  # the slow path: a look at every value
    assert wire.unpack(data) == value


# every encoding of a timestamp msgpack decodes: fixext 4 or 8, or ext 8, 16 or 32 with a length of 4,
# 8 or 12, then the type byte 0xff
_TIMESTAMP_ENCODINGS = re.compile(rb"[\xd6\xd7]\xff|\xc7[\x04\x08\x0c]\xff|\xc8\x00[\x04\x08\x0c]\xff|"
                                  rb"\xc9\x00\x00\x00[\x04\x08\x0c]\xff")


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([b"\xff", b"\xc7", b"\xc8", b"\xc9", b"\xd5", b"\xd6", b"\xd7", b"\xd8", b"\x00",
                                 b"\x04", b"\x05", b"\x08", b"\x0c"]), max_size=24).map(b"".join))
def test_the_timestamp_scan_finds_what_a_regular_expression_of_the_encodings_finds(data):
    """The byte scan is compared with the plain statement of the rule, as a regular expression,
    on strings built of the bytes that matter; behind 17 more 0xff bytes (which hold no timestamp,
    so they change no answer) the scan hands a header to its own expression instead of a Python loop."""
    expected = bool(_TIMESTAMP_ENCODINGS.search(data))
    assert wire.maybe_timestamp(data) is expected
    assert wire.maybe_timestamp(memoryview(data)) is expected
    assert wire.maybe_timestamp(b"\xff" * 17 + data) is expected
    assert wire.maybe_timestamp(b"\xff" * 16 + data) is expected  # data's first 0xff is the one the whole search starts at


_TIMESTAMPS = [marker + bytes(size) for size, markers in ((4, [b"\xd6\xff", b"\xc7\x04\xff", b"\xc8\x00\x04\xff"]),
                                                        (8, [b"\xd7\xff", b"\xc9\x00\x00\x00\x08\xff"]),
                                                        (12, [b"\xc7\x0c\xff", b"\xc8\x00\x0c\xff"]))
               for marker in markers]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(_TIMESTAMPS), st.integers(-2**63, 2**64 - 1).map(msgpack.packb),
                          st.binary(max_size=8).map(msgpack.packb), st.floats().map(msgpack.packb)), max_size=8))
def test_whatever_msgpack_decodes_as_a_timestamp_the_scan_finds(items):
    """The rule itself, against msgpack: of arrays of values, timestamps among them (every encoding
    msgpack decodes), each one msgpack decodes into a timestamp is one the scan cannot pass over,
    and unpack refuses."""
    data = msgpack.packb([None] * len(items))[:-len(items) or None] + b"".join(items)
    value = msgpack.unpackb(data, use_list=False)
    assert len(value) == len(items)
    if wire._holds_timestamp(value):
        assert wire.maybe_timestamp(data)
        with pytest.raises(errors.ProtocolError, match=r"\(a timestamp\)"):
            wire.unpack(data)
    else:
        assert not any(item in _TIMESTAMPS for item in items)


def test_maps_and_extensions_are_small():
    wire.unpack(wire.pack({f"k{i}": i for i in range(1024)}))
    with pytest.raises(errors.ProtocolError, match=r"^malformed header: ValueError: 1025 exceeds max_map_len\(1024\)$"):
        wire.unpack(wire.pack({f"k{i}": i for i in range(1025)}))
    with pytest.raises(errors.ProtocolError, match=r"^malformed header: ValueError: \d+ exceeds max_ext_len\(64\)$"):
        wire.unpack(b"\xc7\x41\x01" + b"x" * 65)


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("shape", [(0, 2**62), (0, 2**32, 2**32), (2**40, 0)])
def test_an_empty_segment_of_an_impossible_shape_is_refused(whole, shape):
    """NumPy refuses to make these (ValueError): the reader refuses them first, as a protocol error."""
    body = wire.pack({"seg": (("uint8", shape),)})
    data = _prefix(len(body), 0) + body
    reader = FrameReader()
    with pytest.raises(errors.ProtocolError, match=r"^bad segment shape .*: empty, but its other extents exceed"):
        reader.feed(data) if whole else reader.feed(data[:PREFIX_SIZE]) + reader.feed(data[PREFIX_SIZE:])


def test_before_the_handshake_every_frame_is_small():
    limits = wire.HANDSHAKE_LIMITS
    assert limits.max_header_bytes == limits.max_tensor_bytes == limits.max_frame_bytes == 64 << 10
    reader = FrameReader(limits)
    with pytest.raises(errors.ProtocolError, match=f"^a header of {64 << 20} bytes exceeds the limit of {64 << 10}$"):
        reader.feed(_prefix(64 << 20, 0))  # refused at the prefix: nothing of that size is allocated
    body = wire.pack({"seg": (("uint8", (64 << 10,)),)})
    with pytest.raises(errors.ProtocolError, match=f"^a frame of {len(body) + (64 << 10)} bytes exceeds the limit"):
        FrameReader(limits).feed(_prefix(len(body), 64 << 10) + body)
    (init,) = FrameReader(limits).feed(_bytes({"t": "init", "v": 1, "token": "x" * 1000}))
    assert init.header["t"] == "init"


def test_waits_never_pass_a_deadline():
    from ember.wire.tcp import TimedOut, wait_limit
    assert wait_limit(None, None) is None and wait_limit(5.0, None) == 5.0
    soon = time.monotonic() + 2
    assert 1 < wait_limit(None, soon) <= 2 and wait_limit(0.5, soon) == 0.5 and 1 < wait_limit(30, soon) <= 2
    assert 0 < wait_limit(30, time.monotonic() + 0.5) <= 0.5  # however little is left, until none is
    with pytest.raises(TimedOut, match="^the deadline passed$"):
        wait_limit(30, time.monotonic() - 0.001)
    assert issubclass(TimedOut, errors.ConnectionLost)


@pytest.fixture(params=[("tcp", True), ("tcp", False), ("websocket", True), ("websocket", False)],
                ids=["tcp, kernel timeouts", "tcp, python timeouts", "websocket, kernel timeouts",
                     "websocket, python timeouts"])
def shell_pairs(request, monkeypatch):
    """Makes pairs of a shell (a TcpConnection, or a WebSocketConnection as a server's) and the
    far end of its loopback connection, with plain TCP's kernel timeouts (where this system has
    them), then with Python's, and closes every one after the test. The far end sends frame bytes
    as the transport carries them (:class:`_WebSocketFar`: one binary message a ``sendall``)."""
    from ember.wire import tcp
    transport, kernel = request.param
    monkeypatch.setattr(tcp, "_KERNEL_TIMEOUTS", kernel and tcp._KERNEL_TIMEOUTS)
    made = []

    def make():
        made.append(_shell_pair(transport))
        return made[-1]
    yield make
    for connection, far in made:
        connection.close()
        far.close()


class _WebSocketFar:
    """A WebSocket client's end written by hand: each ``sendall`` one masked binary message."""

    def __init__(self, sock, protocol):
        self.sock, self.protocol = sock, protocol

    def sendall(self, data: bytes) -> None:
        self.protocol.send_binary(data)
        self.sock.sendall(b"".join(self.protocol.data_to_send()))

    def close(self) -> None:
        self.sock.close()


def _loopback_pair() -> tuple[socket.socket, socket.socket]:
    """The two ends of a loopback TCP connection: the accepted one, and the one that connected."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        far = socket.create_connection(listener.getsockname())
        near, _ = listener.accept()
    return near, far


def _upgrade_request():
    """A hand-driven WebSocket client's protocol, and the bytes of its upgrade request."""
    from websockets.client import ClientProtocol
    from websockets.uri import parse_uri
    client = ClientProtocol(parse_uri("ws://127.0.0.1/"))
    client.send_request(client.connect())
    return client, b"".join(client.data_to_send())


def _shell_pair(transport: str):
    """A shell over one end of a loopback TCP connection (its timeout 10 s) and the other end."""
    from websockets.http11 import Response

    from ember.wire import websocket
    from ember.wire.tcp import TcpConnection
    near, far = _loopback_pair()
    if transport == "tcp":
        return TcpConnection(near, timeout=10), far
    client, request = _upgrade_request()
    far.sendall(request)  # the upgrade request, before the server reads it
    near.settimeout(10)
    connection = websocket.accept(near)
    while not any(isinstance(event, Response) for event in client.events_received()):
        client.receive_data(far.recv(4096))
    return connection, _WebSocketFar(far, client)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel timeouts", "python timeouts"])
def test_a_frame_with_empty_tensors_between_and_after_large_ones_arrives_whole(kernel, monkeypatch):
    """A large frame goes scatter-gather, a buffer a segment: an empty tensor's buffer is empty, and
    one between, after or in place of large ones neither stops the send nor is sent twice. The send
    returns the frame's bytes and leaves the socket's timeouts as it found them."""
    from ember.wire import tcp
    monkeypatch.setattr(tcp, "_KERNEL_TIMEOUTS", kernel and tcp._KERNEL_TIMEOUTS)
    near, far = _shell_pair("tcp")
    far = tcp.TcpConnection(far, timeout=10)
    try:
        rng = np.random.default_rng(5)
        for layout in ([3000, 0], [0, 3000, 0, 0], [3000, 0, 5000, 0], [200_000, 0]):  # float64: 24 kB and more
            segments = [rng.random(n) for n in layout]
            buffers = wire.encode_frame({"t": "batch"}, segments)
            assert near.send(buffers) == sum(memoryview(b).nbytes for b in buffers)  # what the counters count
            # a large frame may be sent with Python's timeouts: the socket's own are as they were after it
            assert near.sock.gettimeout() == (None if near._kernel else near.timeout)
            frame = far.receive()
            assert frame.header == {"t": "batch", "seg": tuple(("float64", (n,)) for n in layout)}
            for sent, received in zip(segments, frame.segments, strict=True):
                np.testing.assert_array_equal(received, sent)
    finally:
        near.close()
        far.close()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel timeouts", "python timeouts"])
def test_frames_of_one_buffer_sent_faster_than_the_far_end_reads_arrive_whole(kernel, monkeypatch):
    """A frame of one buffer (a header of many ops, with small tensors or none) goes in one write,
    which a full socket buffer may cut short: the rest follows, and the count returned is the
    frame's. Fifty such frames of 200 kB, sent through small socket buffers while the far end starts
    reading late, all arrive whole and in order."""
    from ember.wire import tcp
    monkeypatch.setattr(tcp, "_KERNEL_TIMEOUTS", kernel and tcp._KERNEL_TIMEOUTS)
    near, far = _shell_pair("tcp")
    near.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # smaller than a frame: writes cut short
    far.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    far = tcp.TcpConnection(far, timeout=10)
    frames = [wire.encode_frame({"t": "batch", "k": k, "ops": bytes([k]) * 200_000}, [np.full(3, k, np.float32)])
              for k in range(50)]
    assert all(len(buffers) == 1 for buffers in frames)
    counts = []
    sender = threading.Thread(target=lambda: counts.extend(near.send(buffers) for buffers in frames))
    try:
        sender.start()
        time.sleep(0.2)  # the buffers fill
        for k in range(50):
            frame = far.receive()
            assert frame.header["ops"] == bytes([k]) * 200_000 and (frame.segments[0] == k).all()
        sender.join(10)
        assert counts == [len(buffers[0]) for buffers in frames]
    finally:
        near.close()
        far.close()
        sender.join(10)


def test_a_kernel_timeout_is_whole_microseconds_rounded_up_and_none_is_zero():
    """The kernel reads a socket timeout as a struct timeval, where zero means none: no timeout is
    zero, and a timeout of any length (zero included: do not wait) is at least a microsecond,
    rounded up, never down to none."""
    from ember.wire.tcp import _TIMEVAL, _timeval
    for seconds, expected in ((None, (0, 0)), (0.0, (0, 1)), (1e-9, (0, 1)), (1e-6, (0, 1)), (2.5e-6, (0, 3)),
                              (1.5, (1, 500_000)), (2.0000001, (2, 1)), (600.0, (600, 0))):
        assert _TIMEVAL.unpack(_timeval(seconds)) == expected, seconds


@pytest.mark.parametrize("transport", ["tcp", "websocket"])
def test_a_connection_made_keeps_the_timeout_limits_and_allocator_it_was_given(transport):
    """``connect`` of either shell hands its connection what it was given: tensors arrive in the
    allocator's arrays, a wait for bytes ends after the timeout, and a frame over the limits is
    refused naming them. A port nobody listens on is named in the error."""
    from ember.wire import tcp, websocket
    module = tcp if transport == "tcp" else websocket
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        far = []

        def serve():
            sock, _ = listener.accept()
            sock.settimeout(10)
            far.append(tcp.TcpConnection(sock, timeout=10) if transport == "tcp" else websocket.accept(sock))
        server = threading.Thread(target=serve)
        server.start()
        made = []

        def allocate(shape, dtype):
            made.append(np.empty(shape, dtype))
            return made[-1]
        near = module.connect("127.0.0.1", port, Limits(max_tensor_bytes=64), timeout=0.5, allocate=allocate)
        server.join(10)
        watchdog = threading.Timer(10, far[0].close)  # a wait without its timeout ends, and the test fails
        watchdog.start()
        try:
            far[0].send(wire.encode_frame({"t": "batch"}, [np.arange(4.0)]))
            frame = near.receive()
            assert frame.segments[0] is made[0] and frame.segments[0].tolist() == [0.0, 1.0, 2.0, 3.0]
            start = time.monotonic()
            with pytest.raises(TimedOut):
                near.receive()  # nothing more comes
            assert time.monotonic() - start < 5
            far[0].send(wire.encode_frame({"t": "batch"}, [np.arange(9.0)]))
            with pytest.raises(errors.ProtocolError, match="a tensor of 72 bytes exceeds the limit of 64 bytes"):
                near.receive()
        finally:
            watchdog.cancel()
            near.close()
            far[0].close()
    with pytest.raises(errors.ConnectionLost, match=rf"^cannot connect to 127\.0\.0\.1:{port}: "):
        module.connect("127.0.0.1", port, timeout=5)


@pytest.mark.parametrize("transport", ["tcp", "websocket"])
def test_a_connection_sends_at_once_and_notices_a_vanished_host(transport):
    """Both shells' sockets send small frames at once (no Nagle delay) and keep the connection alive
    where the system lets them tune it: a host that vanishes is noticed after 10 s of silence and
    3 probes 5 s apart, even while nothing is sent."""
    from ember.wire import tcp, websocket
    with socket.create_server(("127.0.0.1", 0)) as listener:
        accepted = []
        server = threading.Thread(target=lambda: accepted.append(listener.accept()[0]))
        server.start()
        if transport == "tcp":
            connection = tcp.connect("127.0.0.1", listener.getsockname()[1], timeout=10)
        else:
            def upgrade():
                server.join(10)
                accepted[0].settimeout(10)
                accepted.append(websocket.accept(accepted[0]))
            upgrading = threading.Thread(target=upgrade)
            upgrading.start()
            connection = websocket.connect("127.0.0.1", listener.getsockname()[1], timeout=10)
            upgrading.join(10)
        server.join(10)
        try:
            sock = connection.sock
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
                if hasattr(socket, option):
                    assert sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, option)) == value, option
        finally:
            connection.close()
            for far in accepted:
                far.close()


@pytest.mark.parametrize("poll", [True, False], ids=["poll", "select"])
def test_a_look_for_a_frame_never_waits_and_works_without_poll_too(monkeypatch, poll):
    """A look asks ``poll`` where the system has it, and ``select`` where not (Windows): not readable
    before bytes come, readable once a frame has, and at the stream's end; and it never waits (a
    thousand looks at a quiet connection take a few milliseconds, where a look that waited even a
    millisecond would take a second)."""
    import select
    if not poll:
        monkeypatch.delattr(select, "poll")
    from ember.wire import tcp
    monkeypatch.setattr(tcp, "_KERNEL_TIMEOUTS", False)  # with the kernel's timeouts a look reads instead
    near, far = _shell_pair("tcp")
    watchdog = threading.Timer(10, far.close)  # a look that waits ends, and the test fails
    watchdog.start()
    try:
        start = time.monotonic()
        assert not any(near.readable() for _ in range(1000))
        assert time.monotonic() - start < 0.5
        far.sendall(_bytes({"t": "batch"}))
        assert tcp.spin_wait(near, 5.0) and near.receive().header == {"t": "batch"}
        assert not near.readable()
        far.close()
        assert tcp.spin_wait(near, 5.0)
        with pytest.raises(errors.ConnectionLost, match="the peer closed the connection"):
            near.receive()
    finally:
        watchdog.cancel()
        near.close()


def test_receives_and_sends_time_out_each_by_its_own_limit(shell_pairs):
    """Plain TCP on 64-bit Linux keeps a blocking socket with the kernel's timeouts (one system call a
    receive); TLS, and other systems, keep Python's. Either way: a receive's timeout is its own,
    the connection's is the default, and a send to a peer that reads nothing times out too."""
    from ember.wire import tcp
    connection, far = shell_pairs()
    assert connection._kernel is tcp._KERNEL_TIMEOUTS
    connection.set_timeout(1.0)
    for timeout, least, most in ((0.2, 0.15, 0.8), (None, 0.9, 5)):  # its own, then the connection's
        started = time.monotonic()
        with pytest.raises(tcp.TimedOut, match="timed out waiting for the peer"):
            connection.receive(timeout)
        assert least < time.monotonic() - started < most
    connection.set_timeout(0.3)
    far.sendall(_bytes({"t": "reply", "n": 1}))
    assert connection.receive(30).header == {"t": "reply", "n": 1}  # a long limit returns at once
    big = np.arange(1 << 16, dtype=np.float32)  # 256 KiB: received straight into its array, as with Python's timeouts
    assert big.nbytes > tcp._DIRECT
    far.sendall(_bytes({"t": "reply", "n": 2}, [big]))
    frame = connection.receive(30)
    assert frame.header["n"] == 2 and np.array_equal(frame.segments[0], big)
    data = _bytes({"t": "reply", "n": 3}, [big])
    far.sendall(data[:len(data) // 2])  # half a large frame, then nothing
    started = time.monotonic()
    with pytest.raises(tcp.TimedOut, match="timed out waiting for the peer"):
        connection.receive(0.2)
    assert 0.15 < time.monotonic() - started < 5
    assert connection.sock.gettimeout() == (None if connection._kernel else 0.3)  # as it was before the receive
    started = time.monotonic()
    with pytest.raises(errors.ConnectionLost, match="connection lost while sending"):
        connection.send(wire.encode_frame({"t": "batch"}, [np.zeros(64 << 20, np.uint8)]))  # far reads nothing
    assert 0.25 < time.monotonic() - started < 10  # the connection's 0.3 s, not the last receive's 30 s


def test_a_connection_without_a_timeout_waits_as_long_as_it_takes(shell_pairs):
    connection, far = shell_pairs()
    connection.set_timeout(None)  # a peer's --idle-timeout 0
    later = threading.Timer(1.2, lambda: far.sendall(_bytes({"t": "reply", "n": 1})))
    later.start()
    assert connection.receive().header == {"t": "reply", "n": 1}
    later.join()


def test_a_receive_never_waits_past_the_connections_deadline(shell_pairs):
    """While a connection has a deadline (a server's handshake), a receive ends there, however long
    its timeout, and a frame that came before it is still received."""
    connection, far = shell_pairs()
    connection.deadline = time.monotonic() + 0.5
    far.sendall(_bytes({"t": "init"}))
    assert connection.receive().header == {"t": "init"}
    watchdog = threading.Timer(10, far.close)  # a receive that waits on ends, and the test fails
    watchdog.start()
    try:
        start = time.monotonic()
        with pytest.raises(TimedOut):
            connection.receive(30.0)
        assert time.monotonic() - start < 5
    finally:
        watchdog.cancel()


def test_small_sends_time_out_once_the_far_end_reads_nothing(shell_pairs):
    """Small frames go in one send each (one buffer): once the far end's buffers are full, a send
    waits the connection's timeout and no longer."""
    connection, far = shell_pairs()
    connection.set_timeout(0.3)
    small = wire.encode_frame({"t": "batch"}, [np.zeros(2000, np.uint8)])
    assert len(small) == 1
    started = time.monotonic()
    with pytest.raises(errors.ConnectionLost, match="connection lost while sending"):
        for _ in range(1_000_000):  # far reads nothing: its buffers fill within a few MB
            connection.send(small)
    assert time.monotonic() - started < 30


def test_a_spin_wait_sees_a_frame_arrive_and_leaves_it_for_the_receive(shell_pairs):
    from ember.wire.tcp import spin_wait
    connection, far = shell_pairs()
    data = _bytes({"t": "reply", "n": 0})
    far.sendall(data[:7])  # part of a frame: with the kernel's timeouts polling reads it, and finds no frame
    time.sleep(0.05)
    assert spin_wait(connection, 0.002) is not connection._kernel  # with Python's, bytes wait: a receive's turn
    far.sendall(data[7:])
    assert spin_wait(connection, 5)
    assert connection.receive().header == {"t": "reply", "n": 0}
    started = time.monotonic()
    assert not spin_wait(connection, 0) and not spin_wait(connection, 0.002)  # nothing came …
    assert time.monotonic() - started < 5  # … and the window ended the polling
    far.sendall(_bytes({"t": "reply", "n": 1}))
    time.sleep(0.05)
    assert not spin_wait(connection, 0)  # a window of 0 (EMBER_SPIN_US=0) never polls
    assert spin_wait(connection, 5)
    assert connection.receive().header == {"t": "reply", "n": 1}  # the frame polling saw, whole
    later = threading.Timer(0.05, lambda: far.sendall(_bytes({"t": "reply", "n": 2})))
    started = time.monotonic()
    later.start()
    assert spin_wait(connection, 30)  # it arrived while polling: no need to wait out the window
    assert time.monotonic() - started < 15
    assert connection.receive().header == {"t": "reply", "n": 2}
    connection.close()  # as a stopping server closes a session's socket under its thread
    assert spin_wait(connection, 5)  # readable, for the receive to report the loss
    with pytest.raises(errors.ConnectionLost):
        connection.receive()
    connection, far = shell_pairs()
    far.sendall(_bytes({"t": "reply", "n": 4}) + b"EMBX" + bytes(12))  # a frame, then a malformed one
    time.sleep(0.05)
    assert spin_wait(connection, 5)
    with pytest.raises(errors.ProtocolError, match="bad frame magic b'EMBX'"):
        connection.receive()  # the receive reports it, as if it had read the bytes itself
    connection, far = shell_pairs()
    far.sendall(_bytes({"t": "error", "reason": "bye"}))
    far.close()  # the peer's last frame, then the end of the stream
    time.sleep(0.05)
    assert spin_wait(connection, 5)
    assert connection.receive().header == {"t": "error", "reason": "bye"}  # what came before the end first
    assert spin_wait(connection, 5)
    with pytest.raises(errors.ConnectionLost, match="the peer closed the connection"):
        connection.receive()


def test_a_look_finds_what_has_come_at_once_and_keeps_finding_it_until_received(shell_pairs):
    """``readable()`` answers at the first look once a frame has come, or frames wait already received
    (two came in one read), or the stream has ended, or malformed bytes came: each keeps it readable
    until a receive takes the frame or raises the loss. A spin wait then costs no extra poll."""
    connection, far = shell_pairs()
    far.sendall(_bytes({"t": "reply", "n": 0}) + _bytes({"t": "reply", "n": 1}))
    time.sleep(0.05)
    assert connection.readable() and connection.readable()
    assert connection.receive().header == {"t": "reply", "n": 0}
    assert connection.readable()  # the second frame came with the first
    assert connection.receive().header == {"t": "reply", "n": 1}
    assert not connection.readable()
    far.sendall(b"EMBX" + bytes(12))
    time.sleep(0.05)
    assert connection.readable() and connection.readable()  # malformed: the receive will say so
    with pytest.raises(errors.ProtocolError, match="bad frame magic b'EMBX'"):
        connection.receive()
    connection, far = shell_pairs()
    far.close()
    time.sleep(0.05)
    assert connection.readable() and connection.readable()  # the end of the stream
    with pytest.raises(errors.ConnectionLost, match="the peer closed"):
        connection.receive()


def test_a_close_ends_a_receive_blocked_in_another_thread_and_closing_again_does_nothing(shell_pairs):
    """A stopping server closes its sessions' connections under their threads: the receive each
    thread is blocked in reports the loss at once; a connection closed twice stays closed quietly."""
    connection, far = shell_pairs()
    lost = []

    def receive():
        try:
            connection.receive()
        except errors.ConnectionLost as error:
            lost.append(error)
    waiting = threading.Thread(target=receive)
    waiting.start()
    time.sleep(0.05)
    started = time.monotonic()
    connection.close()
    waiting.join(5)
    assert not waiting.is_alive() and len(lost) == 1 and time.monotonic() - started < 5  # not its 10 s timeout
    connection.close()
    with pytest.raises(errors.ConnectionLost):
        connection.receive()


def test_the_spin_window_comes_from_the_environment(monkeypatch):
    from ember.wire.tcp import spin_window
    monkeypatch.delenv("EMBER_SPIN_US", raising=False)
    assert spin_window() == pytest.approx(200e-6)
    for text, seconds in (("0", 0.0), ("50", 50e-6), (" ", 200e-6), ("1e6", 1.0)):
        monkeypatch.setenv("EMBER_SPIN_US", text)
        assert spin_window() == pytest.approx(seconds)
    for text in ("soon", "-1", "inf", "nan", "1000001"):
        monkeypatch.setenv("EMBER_SPIN_US", text)
        with pytest.raises(em.ArgumentError, match="EMBER_SPIN_US must be microseconds from 0 to 1000000"):
            spin_window()


@pytest.mark.parametrize("whole", [True, False])
def test_a_declined_segment_is_read_and_dropped_and_the_next_frame_follows(whole):
    big = np.arange(300_000, dtype=np.float64)  # 2.4 MB: read through the scratch buffer in 1 MiB pieces
    kept = np.arange(5, dtype=np.int16)
    data = _bytes({"t": "x"}, [big, kept]) + _bytes({"t": "y"}, [kept])

    def allocate(shape, dtype):  # declines the large one, as a peer over its budget does
        return None if shape == big.shape else np.empty(shape, dtype)

    reader = FrameReader(allocate=allocate)
    frames = reader.feed(data) if whole else [f for k in range(0, len(data), 4096) for f in reader.feed(data[k:k + 4096])]
    (first, second) = frames
    assert first.header == {"t": "x", "seg": (("float64", (300_000,)), ("int16", (5,)))} and first.segments[0] is None
    np.testing.assert_array_equal(first.segments[1], kept)
    assert second.header["t"] == "y" and np.array_equal(second.segments[0], kept)
    assert reader.buffer().nbytes == PREFIX_SIZE  # nothing left over


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("header, payload", [({"t": "batch"}, 8), ({"t": "batch", "seg": (("float32", (2,)),)}, 12)],
                         ids=["no tensors", "one tensor"])
def test_a_payload_its_segments_do_not_account_for_is_refused(whole, header, payload):
    body = wire.pack(header)
    data = _prefix(len(body), payload) + body + bytes(payload)
    reader = FrameReader()
    with pytest.raises(errors.ProtocolError, match=f"segments .*disagree with the payload length {payload}$"):
        reader.feed(data) if whole else reader.feed(data[:PREFIX_SIZE]) + reader.feed(data[PREFIX_SIZE:])


def test_an_empty_segment_whose_other_extents_exceed_the_tensor_limit_is_refused():
    body = wire.pack({"seg": (("float64", (0, 2**30)),)})  # 0 bytes, yet 8 GiB per row: NumPy would refuse it later
    with pytest.raises(errors.ProtocolError, match=r"^bad segment shape \(0, 1073741824\): empty, but its other extents "
                                                   r"exceed the tensor limit$"):
        FrameReader().feed(_prefix(len(body), 0) + body)


def test_an_allocation_that_fails_is_a_protocol_error_naming_the_shape():
    def allocate(shape, dtype):
        raise MemoryError("out of memory")
    with pytest.raises(errors.ProtocolError, match=r"^cannot allocate a tensor of shape \(4,\): out of memory$"):
        FrameReader(allocate=allocate).feed(_bytes({}, [np.zeros(4)]))


# --- the WebSocket shell: what ends a connection, and how large messages go -------------------------

@pytest.fixture(params=[True, False], ids=["kernel timeouts", "python timeouts"])
def websocket_pairs(request, monkeypatch):
    """Pairs of a server's WebSocketConnection and a hand-driven client end (:class:`_WebSocketFar`),
    with plain TCP's kernel timeouts, then Python's; all closed after the test."""
    from ember.wire import tcp
    monkeypatch.setattr(tcp, "_KERNEL_TIMEOUTS", request.param and tcp._KERNEL_TIMEOUTS)
    made = []

    def make():
        made.append(_shell_pair("websocket"))
        return made[-1]
    yield make
    for connection, far in made:
        connection.close()
        far.close()


def _far_writes(far: _WebSocketFar, *writes) -> None:
    """Have the far end's protocol write each of ``writes`` (a method name and its arguments), then
    send all of it in one ``sendall``."""
    for name, *args in writes:
        getattr(far.protocol, name)(*args)
    far.sock.sendall(b"".join(far.protocol.data_to_send()))


def test_a_websocket_says_what_ended_it(websocket_pairs):
    """Each way a WebSocket connection ends or is refused raises the error that says so: a text
    message (not ember's), the far end's close frame (also found by every look until a receive,
    and a send after it), the stream's end without one, a reset, a receive's own timeout, and a message
    past the connection's limits, refused at its WebSocket header, before its bytes come."""
    from ember.wire import websocket
    connection, far = websocket_pairs()
    _far_writes(far, ("send_text", b"hello"))
    with pytest.raises(errors.ProtocolError, match="^text WebSocket messages are not part of the ember protocol$"):
        connection.receive()

    connection, far = websocket_pairs()
    _far_writes(far, ("send_close",))
    time.sleep(0.05)
    assert connection.readable() and connection.readable()  # the close, until a receive reports it
    with pytest.raises(errors.ConnectionLost, match="^the peer closed the WebSocket$"):
        connection.receive()
    with pytest.raises(errors.ConnectionLost, match="^the WebSocket is (closing|closed)$"):
        connection.send(wire.encode_frame({"t": "reply"}))

    connection, far = websocket_pairs()
    far.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(errors.ConnectionLost, match="^the peer closed the connection$"):
        connection.receive()

    connection, far = websocket_pairs()
    far.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    far.sock.close()  # a reset, not an end
    with pytest.raises(errors.ConnectionLost, match="^connection lost: .*[Rr]eset"):
        connection.receive()

    connection, far = websocket_pairs()
    with pytest.raises(TimedOut, match="^timed out waiting for the peer$"):
        connection.receive(timeout=0.05)

    connection, far = websocket_pairs()
    connection.set_limits(Limits(max_frame_bytes=1 << 16))
    far.sock.sendall(b"\x82\xff" + (1 << 20).to_bytes(8, "big") + b"mask")  # a 1 MiB binary message's header alone
    with pytest.raises(errors.ConnectionLost) as lost:
        connection.receive(timeout=2)
    assert not isinstance(lost.value, TimedOut)  # refused at the header, not waited for
    assert re.fullmatch("the WebSocket closed: " + too_large(1 << 20, websocket._max_size(Limits(max_frame_bytes=1 << 16))),
                        str(lost.value))


def test_pings_are_answered_and_the_connection_works_on(websocket_pairs):
    """Pings (a browser's or a proxy's) are answered with pongs, two in one read as well, and the
    ember frame that came with them is received."""
    from websockets.frames import Opcode
    connection, far = websocket_pairs()
    _far_writes(far, ("send_ping", b"one"), ("send_ping", b"two"), ("send_binary", _bytes({"t": "reply", "n": 7})))
    assert connection.receive().header == {"t": "reply", "n": 7}
    far.sock.settimeout(5)
    pongs = []
    while len(pongs) < 2:
        far.protocol.receive_data(far.sock.recv(4096))
        assert far.protocol.parser_exc is None
        pongs += [event.data for event in far.protocol.events_received() if event.opcode is Opcode.PONG]
    assert pongs == [b"one", b"two"]


def test_a_large_frame_goes_in_fragments_that_end_at_the_first_buffer_past_4_mib():
    """A frame of many buffers is sent as one message in fragments: buffers are joined until a
    fragment holds 4 MiB or more (no join of the whole frame), a buffer of 4 MiB or more is cut at
    4 MiB; the far end receives the frame whole."""
    from ember.wire import websocket
    mib = 1 << 20
    port, server, accepted = _one_connection()
    client = websocket.connect("127.0.0.1", port, timeout=10)
    server.join(10)
    near, = accepted
    sent = []
    for name in ("send_binary", "send_continuation"):
        original = getattr(client.protocol, name)
        setattr(client.protocol, name, lambda data, fin=True, original=original: (sent.append(len(data)),
                                                                                    original(data, fin=fin))[1])
    try:
        for sizes, fragments in (([4 * mib, 3 * mib], [4 * mib, 3 * mib]),
                                 ([mib] * 9, [4 * mib, 4 * mib, mib]),
                                 ([9 * mib], [4 * mib, 4 * mib, mib])):
            sent.clear()
            chunks = [np.full(n, k, np.uint8) for k, n in enumerate(sizes)]
            arrived = []

            def read_message():  # fragment by fragment, below the ember frame reader, as the client sends
                ended = False
                while not ended:
                    for event in near._pump():
                        arrived.append(event.data)
                        ended = event.fin
            reader = threading.Thread(target=read_message)
            reader.start()
            assert client.send(chunks) == sum(sizes)
            reader.join(10)
            assert sent == fragments
            assert b"".join(arrived) == b"".join(chunk.tobytes() for chunk in chunks)
        sent.clear()  # an ember frame of two large tensors behind its header: several fragments, received whole
        frames = []
        reader = threading.Thread(target=lambda: frames.append(near.receive()))
        reader.start()
        assert client.send(wire.encode_frame({"t": "batch"}, [np.arange(mib, dtype=np.float64), np.ones(3 * mib, np.uint8)]))
        reader.join(10)
        assert max(sent) < 2 * websocket._FRAGMENT and len(sent) > 1
        frame, = frames
        np.testing.assert_array_equal(frame.segments[0], np.arange(mib, dtype=np.float64))
        np.testing.assert_array_equal(frame.segments[1], np.ones(3 * mib, np.uint8))
    finally:
        client.close()
        near.close()


def _one_connection(family=socket.AF_INET, host="127.0.0.1"):
    """A listener on loopback and a thread that accepts one connection as a WebSocket server's
    (``websocket.accept``, default limits): (port, thread, [the connection once accepted])."""
    from ember.wire import websocket
    listener = socket.create_server((host, 0), family=family)
    accepted = []

    def serve():
        with listener:
            sock, _ = listener.accept()
        sock.settimeout(10)
        accepted.append(websocket.accept(sock))
    thread = threading.Thread(target=serve)
    thread.start()
    return listener.getsockname()[1], thread, accepted


def test_a_websocket_client_reaches_ipv6_loopback_and_takes_messages_to_its_limits_from_the_start():
    """``websocket.connect`` writes an IPv6 host in brackets (ws://[::1]:port); a connection made
    with the default limits takes a 2 MiB message at once (not the library's 1 MiB default), and one
    made with the handshake's limits refuses a larger message at its WebSocket header, before its
    bytes come."""
    from ember.wire import websocket
    port, thread, accepted = _one_connection(socket.AF_INET6, "::1")
    client = websocket.connect("::1", port, timeout=10)
    thread.join(10)
    server, = accepted
    try:
        big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB
        client.send(wire.encode_frame({"t": "batch"}, [big]))
        np.testing.assert_array_equal(server.receive().segments[0], big)
        server.send(wire.encode_frame({"t": "reply"}, [big]))
        np.testing.assert_array_equal(client.receive().segments[0], big)
    finally:
        client.close()
        server.close()
    port, thread, accepted = _one_connection()
    client = websocket.connect("127.0.0.1", port, wire.HANDSHAKE_LIMITS, timeout=10)
    thread.join(10)
    server, = accepted
    try:
        server.sock.sendall(b"\x82\x7f" + (1 << 20).to_bytes(8, "big"))  # a server's 1 MiB binary message, its header alone
        with pytest.raises(errors.ConnectionLost) as lost:
            client.receive(timeout=2)
        assert not isinstance(lost.value, TimedOut)  # refused at the header, not waited for
        limit = websocket._max_size(wire.HANDSHAKE_LIMITS)
        assert re.search(too_large(1 << 20, limit), str(lost.value))
    finally:
        client.close()
        server.close()


def test_a_refused_websocket_upgrade_is_named_as_refused_not_as_a_timeout():
    """A server answering the upgrade with an HTTP error: ``connect`` raises ConnectionLost naming
    the address and the refusal (with a timeout given too: not a TimedOut) and closes its socket."""
    from ember.wire import websocket
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def refuse():
            sock, _ = listener.accept()
            with sock:
                sock.settimeout(10)
                request = b""
                while b"\r\n\r\n" not in request:
                    request += sock.recv(4096)
                sock.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                closed.append(sock.recv(1) == b"")  # the client closes its end
        closed = []
        thread = threading.Thread(target=refuse)
        thread.start()
        with pytest.raises(errors.ConnectionLost) as lost:
            websocket.connect("127.0.0.1", port, timeout=5)
        thread.join(10)
    assert not isinstance(lost.value, TimedOut)
    assert str(lost.value).startswith(f"WebSocket handshake with 127.0.0.1:{port} failed: ") and "403" in str(lost.value)
    assert closed == [True]


def test_a_websocket_server_keeps_what_it_was_given_and_names_a_failed_upgrade():
    """``websocket.accept`` hands its connection the allocator (tensors arrive in its arrays) and
    the socket's timeout (a wait after the handshake ends by it), waits for the upgrade no longer
    than its deadline, and refuses a request that is no WebSocket upgrade, naming the handshake."""
    from websockets.http11 import Response

    from ember.wire import websocket
    near, far = _loopback_pair()
    client, request = _upgrade_request()
    far.sendall(request)
    near.settimeout(0.3)
    made = []

    def allocate(shape, dtype):
        made.append(np.empty(shape, dtype))
        return made[-1]
    connection = websocket.accept(near, allocate=allocate)
    watchdog = threading.Timer(5, connection.close)  # a wait without its timeout ends, and the test fails
    watchdog.start()
    try:
        while not any(isinstance(event, Response) for event in client.events_received()):
            client.receive_data(far.recv(4096))
        client.send_binary(_bytes({"t": "batch"}, [np.arange(3.0)]))
        far.sendall(b"".join(client.data_to_send()))
        frame = connection.receive()
        assert frame.segments[0] is made[0] and frame.segments[0].tolist() == [0.0, 1.0, 2.0]
        started = time.monotonic()
        with pytest.raises(TimedOut):
            connection.receive()
        assert time.monotonic() - started < 4  # the socket's 0.3 s, well before the watchdog's 5
    finally:
        watchdog.cancel()
        connection.close()
        far.close()

    near, far = _loopback_pair()
    near.settimeout(10)
    started = time.monotonic()
    try:
        with pytest.raises(TimedOut):
            websocket.accept(near, deadline=time.monotonic() + 0.3)  # the client says nothing
        assert time.monotonic() - started < 5  # the deadline's 0.3 s, not the socket's 10
    finally:
        near.close()
        far.close()

    near, far = _loopback_pair()
    near.settimeout(10)
    try:
        far.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # no upgrade asked
        with pytest.raises(errors.ProtocolError, match="^WebSocket handshake failed: "):
            websocket.accept(near)
    finally:
        near.close()
        far.close()


def test_frames_sent_right_behind_the_websocket_upgrade_are_received():
    """A server may send its first frame right behind its upgrade response, and a hasty client its
    first behind its request (RFC 6455 asks it to wait): each arrives in the same read as the
    handshake and is received, not dropped. A text message there is refused as it would be later,
    and ``connect`` closes its socket."""
    from websockets.frames import Frame as WebSocketFrame
    from websockets.frames import Opcode
    from websockets.server import ServerProtocol

    from ember.wire import websocket
    first = _bytes({"t": "init", "n": 1})
    near, far = _loopback_pair()
    try:
        far.sendall(_upgrade_request()[1] + WebSocketFrame(Opcode.BINARY, first).serialize(mask=True, extensions=[]))
        near.settimeout(10)
        connection = websocket.accept(near)
        assert connection.receive().header == {"t": "init", "n": 1}
    finally:
        near.close()
        far.close()

    def connect_behind(frame: bytes):
        """``connect`` to a server that sends ``frame`` in the same write as its response:
        (the connection or the error connect raised, whether the server saw the client close)."""
        with socket.create_server(("127.0.0.1", 0)) as listener:
            def answer():
                sock, _ = listener.accept()
                with sock:
                    sock.settimeout(10)
                    server = ServerProtocol()
                    while not (events := server.events_received()):
                        server.receive_data(sock.recv(4096))
                    server.send_response(server.accept(events[0]))
                    sock.sendall(b"".join(server.data_to_send()) + frame)
                    while sock.recv(4096):  # a close frame, perhaps, then the client's end of the stream
                        pass
                    closed.append(True)
            closed = []
            thread = threading.Thread(target=answer)
            thread.start()
            try:
                made = websocket.connect("127.0.0.1", listener.getsockname()[1], timeout=10)
            except errors.EmberError as error:
                made = error
            if not isinstance(made, errors.EmberError):
                try:
                    assert made.receive(timeout=5).header == {"t": "init", "n": 1}
                finally:
                    made.close()
            thread.join(10)
        return made, closed

    made, _ = connect_behind(WebSocketFrame(Opcode.BINARY, first).serialize(mask=False, extensions=[]))
    assert not isinstance(made, errors.EmberError)
    # a text message behind the response: refused, and the client's socket closed
    made, closed = connect_behind(WebSocketFrame(Opcode.TEXT, b"hello").serialize(mask=False, extensions=[]))
    assert isinstance(made, errors.ProtocolError) and "text WebSocket messages" in str(made) and closed == [True]
