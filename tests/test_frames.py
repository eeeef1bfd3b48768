"""The wire without I/O: the msgpack codec and the incremental FrameReader, byte by byte.

The peer tests send these frames over real sockets; here every edge of the format — limits at
their exact value, header-less frames, empty and non-contiguous tensors, frames split anywhere,
several frames in one read, segments declined or disagreeing with the payload — is checked
directly. The shells that carry frames over sockets: test_tcp.py and test_websocket.py.
"""

from __future__ import annotations

import re
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ember as em
from ember import errors
from ember.wire import protocol as wire
from ember.wire.protocol import MAGIC, PREFIX_SIZE, FrameReader, Limits

from .framing import frame_bytes as _bytes


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


# --- segments a reader declines, cannot account for or cannot allocate ---------------------------

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
