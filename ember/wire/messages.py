"""The messages of a session, one typed record each (docs/protocol.md, "Session frames").

A batch frame's ``"m"`` holds the client's messages, a reply frame's the peer's answers; each is a
msgpack array whose first item names its kind: ``["get", rid, id]``. Here each kind is a
NamedTuple whose first field is that kind, so a record packs to exactly the array it stands for
(msgpack packs a tuple subclass as an array) and ``Get(rid, id)`` is built without naming it
again. :func:`parse` turns a decoded message into its record, checking its length and the type of
each field — not the items inside a field's list, which the session checks as it uses them — and
raises ProtocolError naming the kind and the field that is wrong; :func:`check` only checks, and
names the record (the peer's session unpacks the checked tuple by the record's fields). Literals
in an op's inputs are ``(value, dtype name)``; the run format inside ``ops`` is ``wire/runs.py``'s.
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import ProtocolError

Id = int  # a tensor, graph or request id: a non-negative integer (bool is none)

_CHECKS = {  # annotation -> (what a value must be, its type, its least value or None)
    "Id": ("a non-negative integer", int, 0),  # type(True) is bool: no id
    "int": ("an integer", int, None),
    "str": ("a string", str, None),
    "bytes": ("bytes", bytes, None),
    "tuple": ("a list", tuple, None),
    "dict": ("a map", dict, None),
}

REQUESTS: dict[str, type] = {}  # kind -> record, of the messages a client sends
REPLIES: dict[str, type] = {}   # kind -> record, of the peer's answers
_tuple_new = tuple.__new__


def _kind(kind: str, table: dict):
    """Declare a NamedTuple (its first field ``kind``) as the record of messages of ``kind``: it is
    built from the other fields, and :func:`parse` checks each field by its annotation."""
    def declare(fields: type) -> type:
        def __new__(cls, *values):
            return _tuple_new(cls, (kind, *values))
        notes = [getattr(note, "__forward_arg__", note) for note in fields.__annotations__.values()]  # names, as written
        checks = tuple((index, name, *_CHECKS[note]) for index, (name, note) in enumerate(zip(fields._fields, notes))
                       if index and note in _CHECKS)  # (index, field, what, type, least), kind aside
        record = type(fields.__name__, (fields,), {"__slots__": (), "__new__": __new__, "__doc__": fields.__doc__,
                                                   "KIND": kind, "CHECKS": checks, "__module__": __name__})
        table[kind] = record
        return record
    return declare


# -- what a client sends --

@_kind("op", REQUESTS)
class Op(NamedTuple):
    """Apply op-table row ``name`` to ``inputs`` (tensor ids and literals), making ``outputs``."""
    kind: str
    name: object  # an unknown or malformed name poisons the outputs, as any refused op does
    inputs: tuple
    outputs: tuple
    attrs: dict


@_kind("ops", REQUESTS)
class Ops(NamedTuple):
    """A run of one-output ops, its ids relative to ``base`` and ``inputs`` (wire/runs.py)."""
    kind: str
    base: int
    inputs: tuple
    blob: bytes


@_kind("put", REQUESTS)
class Put(NamedTuple):
    """Tensor ``id`` is segment ``segment`` of this frame."""
    kind: str
    id: Id
    segment: Id  # an index: a negative one would pick a segment from the end


@_kind("get", REQUESTS)
class Get(NamedTuple):
    """Read tensor ``id``: answered :class:`Data`."""
    kind: str
    rid: Id
    id: Id


@_kind("shape", REQUESTS)
class Shape(NamedTuple):
    """The shapes of data-dependent outputs ``ids``: answered :class:`Shapes`."""
    kind: str
    rid: Id
    ids: tuple


@_kind("sync", REQUESTS)
class Sync(NamedTuple):
    """Answered :class:`Ok`, or the first failure since the last sync."""
    kind: str
    rid: Id


@_kind("drop", REQUESTS)
class Drop(NamedTuple):
    """Free these tensors."""
    kind: str
    ids: tuple


@_kind("stats", REQUESTS)
class Stats(NamedTuple):
    """The peer's counters: answered :class:`PeerStats`."""
    kind: str
    rid: Id


@_kind("graph", REQUESTS)
class Graph(NamedTuple):
    """Register graph ``gid``: ``inputs`` as ``(node, dtype, shape)``, ``outputs`` node ids, ``ops``
    records over nodes, ``constants`` ``(node, segment)`` pairs."""
    kind: str
    gid: Id
    inputs: tuple
    outputs: tuple
    ops: tuple
    constants: tuple


@_kind("run", REQUESTS)
class RunGraph(NamedTuple):
    """Run registered graph ``gid`` on tensors ``inputs``, making ``outputs``."""
    kind: str
    gid: Id
    inputs: tuple
    outputs: tuple


@_kind("forget", REQUESTS)
class Forget(NamedTuple):
    """Free registered graph ``gid``."""
    kind: str
    gid: Id


@_kind("grant", REQUESTS)
class Grant(NamedTuple):
    """Tensor ``id`` may be read once by ``session`` (of any peer) with ``capability``."""
    kind: str
    id: Id
    capability: bytes
    session: str


@_kind("fetch", REQUESTS)
class Fetch(NamedTuple):
    """Tensor ``id`` is the one granted with ``capability`` at ``scheme://host:port`` (identity
    ``peer``); this peer fetches it."""
    kind: str
    id: Id
    dtype: object  # an ember dtype (a msgpack extension)
    shape: tuple
    scheme: str
    host: str
    port: int
    capability: bytes
    peer: str


# -- what the peer answers --

@_kind("data", REPLIES)
class Data(NamedTuple):
    """Request ``rid``'s tensor is segment ``segment`` of the reply frame."""
    kind: str
    rid: Id
    segment: Id


@_kind("shapes", REPLIES)
class Shapes(NamedTuple):
    """Request ``rid``'s shapes, one per id asked."""
    kind: str
    rid: Id
    shapes: tuple


@_kind("ok", REPLIES)
class Ok(NamedTuple):
    """Request ``rid`` succeeded."""
    kind: str
    rid: Id


@_kind("stats", REPLIES)
class PeerStats(NamedTuple):
    """Request ``rid``'s counters."""
    kind: str
    rid: Id
    stats: dict


@_kind("error", REPLIES)
class Error(NamedTuple):
    """Request ``rid`` failed with the ember exception named ``error``."""
    kind: str
    rid: Id
    error: str
    message: str


def check(message, table: dict = REQUESTS) -> type:
    """The record ``message`` (a decoded batch item; a reply with ``table`` REPLIES) is valid as: its
    fields are that record's, in order, so a hot path can unpack the tuple itself without the
    ~0.1 µs of building the record. ProtocolError naming its kind and the field that is wrong
    unless it has its kind's length and each field its type."""
    if type(message) is not tuple or not message or type(message[0]) is not str:
        raise ProtocolError(f"malformed message {message!r:.80}")
    record = table.get(message[0])
    if record is None:
        raise ProtocolError(f"unknown {'reply' if table is REPLIES else 'message'} type {message[0]!r:.40}")
    if len(message) != len(record._fields):
        raise ProtocolError(f"the {record.KIND!r} message is [{', '.join(record._fields)}], got {len(message)} items")
    for index, field, what, kind, least in record.CHECKS:  # no call per field: a reply is parsed per round trip
        value = message[index]
        if type(value) is not kind or (least is not None and value < least):
            raise ProtocolError(f"the {record.KIND!r} message's {field} must be {what}, got {value!r:.40}")
    return record


def parse(message, table: dict = REQUESTS):
    """The record of a message, checked by :func:`check`."""
    return _tuple_new(check(message, table), message)


def parse_reply(reply):
    """The record of a reply the peer sent; ProtocolError as :func:`parse`."""
    return parse(reply, REPLIES)
