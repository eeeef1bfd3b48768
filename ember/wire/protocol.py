"""The ember wire protocol, without I/O: frames, the msgpack codec, and an incremental reader.

A frame is a 16-byte prefix, a msgpack header and raw tensor segments::

    b"EMBR" | header length: u32 LE | payload length: u64 LE | header | segment 0 | segment 1 | …

The header is a map; its ``"seg"`` entry lists each segment as ``[dtype name, shape]``, so a
receiver allocates every tensor before reading it and receives the bytes straight into it
(:class:`FrameReader`). Nothing is pickled: msgpack carries plain values, and two extension
types carry ember dtypes and complex numbers. An op's inputs are tensor ids (ints) or scalar
literals written as ``[value, dtype name]``. Every size is checked against
:class:`Limits` before anything is allocated. See docs/protocol.md.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import asdict, dataclass
from typing import NamedTuple

import msgpack
import numpy as np

from .. import dtypes as dt
from .. import errors
from ..errors import ProtocolError

VERSION = 3  # 2: runs of ops as ["ops", base, inputs, blob] messages (remote/runs.py); 3: runs name outputs let go
MAGIC = b"EMBR"
_PREFIX = struct.Struct("<4sIQ")
PREFIX_SIZE = _PREFIX.size  # 16
CAPABILITY_BYTES = 32  # the random bytes of a transfer's capability, in its grant and its fetch (256 bits, as Burn's)

_EXT_DTYPE, _EXT_COMPLEX = 1, 2
_NUMPY = {d.name: native for d, native in dt.NUMPY.items()}


@dataclass(frozen=True)
class Limits:
    """Sizes a peer accepts; the server announces its own at the handshake (a served peer's
    default header limit is smaller: ``ember.remote.server.PEER_LIMITS``)."""

    max_header_bytes: int = 64 << 20
    max_tensor_bytes: int = 4 << 30
    max_frame_bytes: int = 8 << 30
    max_session_bytes: int = 1 << 62  # one session's live bytes (a peer sets it: --max-session-bytes; unset, a share)
    max_session_tensors: int = 1 << 20  # tensor ids one session holds at once, failed ones included
    max_session_graphs: int = 1 << 12   # graphs one session keeps registered
    max_graph_ops: int = 1 << 16        # ops in one graph (and inputs, and outputs): refused before it is compiled

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Limits:
        return cls(**{k: int(v) for k, v in values.items() if k in cls.__dataclass_fields__})


#: what either side accepts until the handshake is done: nothing large before authentication
HANDSHAKE_LIMITS = Limits(max_header_bytes=64 << 10, max_tensor_bytes=64 << 10, max_frame_bytes=64 << 10)


class Frame(NamedTuple):
    """A decoded frame: its header map and its segments as NumPy arrays."""
    header: dict
    segments: list


_tuple_new = tuple.__new__  # a Frame without the Python call of its __new__ (the reader's hot path)


# --- codec ------------------------------------------------------------------------------------

def _default(value):
    if isinstance(value, dt.DType):
        return msgpack.ExtType(_EXT_DTYPE, value.name.encode())
    if isinstance(value, complex):
        return msgpack.ExtType(_EXT_COMPLEX, struct.pack("<dd", value.real, value.imag))
    if isinstance(value, np.generic):
        return value.item()
    raise ProtocolError(f"cannot encode {type(value).__name__} {value!r}: only plain values travel")


def _ext_hook(code: int, data: bytes):
    if code == _EXT_DTYPE:
        try:
            return dt.from_name(data.decode())
        except Exception:
            raise ProtocolError(f"unknown dtype {data[:32]!r}") from None
    if code == _EXT_COMPLEX and len(data) == 16:
        return complex(*struct.unpack("<dd", data))
    raise ProtocolError(f"unknown msgpack extension type {code}")


_packer = msgpack.Packer(default=_default, use_bin_type=True, strict_types=False)


def pack(value) -> bytes:
    """``value`` (plain data) as msgpack bytes."""
    try:
        return _packer.pack(value)
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as error:
        raise ProtocolError(f"cannot encode a message: {error}") from None


# every encoding of a timestamp msgpack decodes (it refuses one of other than 4, 8 or 12 bytes): fixext 4
# or 8 (0xd6, 0xd7), or ext 8, 16 or 32 (0xc7, 0xc8, 0xc9) with a length of 4, 8 or 12; then the type byte 0xff
_TIMESTAMP = re.compile(rb"(?:[\xd6\xd7]|(?:\xc7|\xc8\x00|\xc9\x00\x00\x00)[\x04\x08\x0c])\xff")
_EXT_HEADS = (b"\xc7", b"\xc8\x00", b"\xc9\x00\x00\x00")
_FEW = 16  # up to this many 0xff bytes are looked behind one by one; then the rest is searched whole


def maybe_timestamp(data, at: int | None = None) -> bool:
    """Whether ``data`` may encode a msgpack timestamp, which msgpack decodes itself without asking
    the ext hook. Most batches hold no 0xff byte or a few (a run's first input is -1, 0xff), so each
    is found with ``bytes.find`` and the bytes just before it are compared with a timestamp's: a
    regular expression costs more to call than this, and over every byte more than decoding the
    batch. Past a few (a hostile header of 0xff bytes), the rest is searched whole, in C. ``at``:
    where the first 0xff is, when the caller has found it."""
    data = bytes(data)
    if at is None:
        at = data.find(b"\xff")
    for _ in range(_FEW):
        if at < 0:
            return False
        before = data[at - 1] if at else None
        if before == 0xd6 or before == 0xd7:
            return True
        if (before == 4 or before == 8 or before == 12) and data[max(0, at - 5):at - 1].endswith(_EXT_HEADS):
            return True
        at = data.find(b"\xff", at + 1)
    return at >= 0 and _TIMESTAMP.search(data, max(0, at - 5)) is not None


def unpack(data):
    """Plain data from msgpack bytes; tuples for arrays; ProtocolError on anything malformed.

    msgpack bounds every string, array, map and extension by the size of ``data`` itself, so a
    few bytes announcing a billion elements are refused before anything is allocated; maps
    (headers, attributes) hold at most 1024 entries and extensions 64 bytes. Extension types
    other than ember's two — msgpack's timestamp (-1) included — are refused.
    """
    data = bytes(data)
    try:
        value = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=True, ext_hook=_ext_hook,
                                max_map_len=1 << 10, max_ext_len=64)
    except ProtocolError:
        raise
    except Exception as error:  # msgpack raises several types on malformed input
        raise ProtocolError(f"malformed header: {type(error).__name__}: {error}") from None
    # every timestamp has a 0xff byte (its type), which many headers lack: those need no search
    at = data.find(b"\xff")
    if at >= 0 and maybe_timestamp(data, at) and _holds_timestamp(value):  # the bytes also occur in other values
        raise ProtocolError("unknown msgpack extension type -1 (a timestamp)")
    return value


def _holds_timestamp(value) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is tuple:
            stack.extend(item)
        elif type(item) is dict:
            stack.extend(item.values())  # keys are strings
        elif type(item) is msgpack.Timestamp:
            return True
    return False


# --- frames -----------------------------------------------------------------------------------

_NAMES = {native: d.name for native, d in dt.FROM_NUMPY.items()}


def segment_descriptor(array: np.ndarray) -> tuple:
    return (_NAMES[array.dtype], array.shape)


def bytes_of(array: np.ndarray) -> memoryview:
    """An array's bytes in C order: a view of a C-contiguous array, else of a contiguous copy (a
    strided or broadcast 1-d view is not made contiguous by ``reshape(-1)``)."""
    try:
        return memoryview(array).cast("B")  # raises for a strided, broadcast or empty array
    except (TypeError, ValueError):
        return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


_SMALL = 4096  # tensors of a frame up to this many bytes in all are copied into its first buffer


def encode_frame(header: dict, segments: list[np.ndarray] = ()) -> list:
    """A frame as buffers for a scatter-gather send: prefix, header, then each segment's bytes
    (no copies of contiguous arrays); a small frame (a reply of a few values) as one buffer."""
    if not segments:
        body = pack(header)
        return [_PREFIX.pack(MAGIC, len(body), 0) + body]
    descriptors, buffers, payload = [], [None], 0
    for array in segments:
        descriptors.append(segment_descriptor(array))
        view = bytes_of(array)
        buffers.append(view)
        payload += view.nbytes
    body = pack({**header, "seg": descriptors})
    buffers[0] = _PREFIX.pack(MAGIC, len(body), payload) + body
    if payload <= _SMALL:
        return [b"".join(buffers)]
    return buffers


def _segment_layout(item, limits: Limits) -> tuple:
    """A segment descriptor's dtype, shape and size in bytes, checked against ``limits``."""
    try:
        name, shape = item
        dtype = _NUMPY[name]
        shape = tuple(map(int, shape))
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"bad segment descriptor {item!r:.80}") from None
    if len(shape) > 64 or (shape and min(shape) < 0):
        raise ProtocolError(f"bad segment shape {shape!r:.80}")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > limits.max_tensor_bytes:
        raise ProtocolError(f"a tensor of {nbytes} bytes exceeds the limit of {limits.max_tensor_bytes} bytes")
    # an empty shape's other extents are bounded too (NumPy refuses these); a nonempty one's are its size
    if not nbytes and math.prod(s for s in shape if s) * dtype.itemsize > limits.max_tensor_bytes:
        raise ProtocolError(f"bad segment shape {shape!r:.80}: empty, but its other extents exceed the tensor limit")
    return dtype, shape, nbytes


_DISCARD = 1 << 20  # a declined segment is read through a scratch buffer of at most this size


def _discarded(nbytes: int) -> list[memoryview]:
    scratch = memoryview(bytearray(min(nbytes, _DISCARD)))
    return [scratch[:min(_DISCARD, nbytes - start)] for start in range(0, nbytes, _DISCARD)]


class FrameReader:
    """Incremental frame parser for a byte stream, without I/O.

    The shell asks :meth:`buffer` where the next bytes go, receives into it, and reports how
    many arrived with :meth:`advance`, which returns the frames completed. Tensor bytes land
    directly in the arrays the frame returns: no intermediate copies.
    """

    def __init__(self, limits: Limits = Limits(), allocate=np.empty):
        self.limits = limits
        self.allocate = allocate  # (shape, dtype) -> array: where received tensors are put
        self._known_segment: tuple | None = None  # (descriptor, limits, layout) last checked (_segment_arrays)
        self._reset()

    def _reset(self):  # the header stage sets the frame's header, arrays, views and payload length
        self._stage = "prefix"
        self._target = memoryview(bytearray(PREFIX_SIZE))
        self._filled = 0
        # a finished frame's header and arrays are its own: held here, they would keep its tensors'
        # buffers from a pool that reuses only what nothing else refers to
        self._header = self._arrays = None

    def buffer(self) -> memoryview:
        """The writable region where the next bytes of the stream belong."""
        return self._target[self._filled:]

    def awaiting(self) -> int:
        """How many bytes :meth:`buffer` has room for (asked without making the view)."""
        return len(self._target) - self._filled

    def advance(self, n: int) -> list[Frame]:
        """Record ``n`` bytes written into :meth:`buffer`; return the frames now complete."""
        self._filled += n
        frames = []
        while self._filled == len(self._target):
            frame = self._next_stage()
            if frame is not None:  # the reader is back at an empty prefix: the loop ends
                frames.append(frame)
        return frames

    def feed(self, data) -> list[Frame]:
        """Copy ``data`` into the stream (for message transports such as WebSocket)."""
        if type(data) is not memoryview or data.format != "B" or data.ndim != 1:  # a connection's scratch view is one
            data = memoryview(data).cast("B")
        frames = []
        if self._stage == "prefix" and not self._filled:  # the common case: small frames that arrive whole
            size, at = data.nbytes, 0
            while size - at >= PREFIX_SIZE:
                frame, end = self._whole_frame(data, at)
                if frame is None:
                    break
                frames.append(frame)
                at = end
            if at == size:
                return frames
            data = data[at:]
        while data.nbytes:
            target = self.buffer()
            n = min(target.nbytes, data.nbytes)
            target[:n] = data[:n]
            data = data[n:]
            frames += self.advance(n)
        return frames

    def _check_prefix(self, magic, header_len: int, payload: int) -> None:
        limits = self.limits
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {bytes(magic)!r}: not an ember peer")
        if header_len > limits.max_header_bytes:
            raise ProtocolError(f"a header of {header_len} bytes exceeds the limit of {limits.max_header_bytes}")
        if payload + header_len > limits.max_frame_bytes:
            raise ProtocolError(f"a frame of {payload + header_len} bytes exceeds the limit of {limits.max_frame_bytes}")

    def _whole_frame(self, data: memoryview, at: int) -> tuple[Frame | None, int]:
        """Parse a frame that lies entirely in ``data`` from byte ``at``: (frame, where it ends), or
        (None, ``at``) when it does not."""
        magic, header_len, payload = _PREFIX.unpack_from(data, at)
        limits = self.limits
        if magic != MAGIC or header_len > limits.max_header_bytes or payload + header_len > limits.max_frame_bytes:
            self._check_prefix(magic, header_len, payload)  # raises, naming what is wrong
        offset = at + PREFIX_SIZE + header_len  # where the header ends and the tensors begin
        end = offset + payload
        if data.nbytes < end:
            return None, at
        header = unpack(data[offset - header_len:offset]) if header_len else {}
        if type(header) is not dict:
            raise ProtocolError("a frame header must be a map")
        descriptors = header.get("seg")
        if descriptors is None:  # most frames a peer receives: no tensors
            if payload:
                raise ProtocolError(f"segments disagree with the payload length {payload}")
            return _tuple_new(Frame, (header, [])), end
        arrays, sizes = self._segment_arrays(descriptors)
        if sum(sizes) != payload:
            raise ProtocolError(f"segments disagree with the payload length {payload}")
        for a, nbytes in zip(arrays, sizes):
            if nbytes and a is not None:
                bytes_of(a)[:] = data[offset:offset + nbytes]  # allocate's arrays are C-contiguous
            offset += nbytes
        return _tuple_new(Frame, (header, arrays)), end

    def _segment_arrays(self, descriptors) -> tuple[list, list[int]]:
        """The arrays a frame's segments are received into, and their sizes in bytes. ``allocate``
        may return None to decline a segment (a peer over its memory budget): its bytes are then
        read and dropped, and the frame carries None in its place. The last descriptor checked is
        kept with its layout and the limits it met: a connection's reads most often repeat one
        (equal descriptors have equal layouts, ``int`` of each extent being the extent)."""
        if not isinstance(descriptors, tuple):
            raise ProtocolError("'seg' must be a list of [dtype, shape]")
        limits, allocate, known = self.limits, self.allocate, self._known_segment
        arrays, sizes = [], []
        for item in descriptors:
            if known is not None and item == known[0] and limits is known[1]:
                layout = known[2]
            else:
                layout = _segment_layout(item, limits)
                self._known_segment = known = (item, limits, layout)
            dtype, shape, nbytes = layout
            try:
                arrays.append(allocate(shape, dtype))
            except (ValueError, MemoryError) as error:
                raise ProtocolError(f"cannot allocate a tensor of shape {shape!r:.80}: {error}") from None
            sizes.append(nbytes)
        return arrays, sizes

    def _next_stage(self) -> Frame | None:
        if self._stage == "prefix":
            magic, header_len, payload = _PREFIX.unpack(self._target)
            self._check_prefix(magic, header_len, payload)
            self._payload = payload
            self._stage, self._target, self._filled = "header", memoryview(bytearray(header_len)), 0
            return None  # an empty header is complete at once: advance's loop moves on
        if self._stage == "header":
            header = unpack(self._target) if len(self._target) else {}
            if not isinstance(header, dict):
                raise ProtocolError("a frame header must be a map")
            self._header = header
            self._arrays, sizes = self._segment_arrays(header.get("seg", ()))
            total = sum(sizes)
            if total != self._payload:
                raise ProtocolError(f"segments of {total} bytes disagree with the payload length {self._payload}")
            self._views = []
            for a, nbytes in zip(self._arrays, sizes):
                if nbytes:
                    self._views.extend([memoryview(a.reshape(-1).view(np.uint8))] if a is not None else _discarded(nbytes))
            return self._next_segment()
        return self._next_segment()

    def _next_segment(self) -> Frame | None:
        if self._views:
            self._stage, self._target, self._filled = "segment", self._views.pop(0), 0
            return None
        frame = Frame(self._header, self._arrays)
        self._reset()
        return frame


#: error kinds a peer may name in a reply, mapped to the exception the client raises
ERROR_KINDS = {name: value for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, errors.EmberError)}


def error_from_reply(kind, message) -> errors.EmberError:
    """The typed exception for an error reply (ExecutionError for kinds this client lacks)."""
    return ERROR_KINDS.get(kind, errors.ExecutionError)(str(message))
