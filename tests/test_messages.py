"""The session's message records (ember/wire/messages.py): each packs to the array it stands for, and
parse names the kind and the field of a malformed message."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember import dtypes as dt
from ember.errors import ProtocolError
from ember.wire import messages, protocol

ids = st.integers(0, 1 << 40)
id_lists = st.lists(ids, max_size=4).map(tuple)
literals = st.tuples(st.floats(allow_nan=False), st.just("float32"))
FIELDS = {  # annotation -> values of it that a peer sends
    "Id": ids, "int": st.integers(-(1 << 40), 1 << 40), "str": st.text(max_size=8), "bytes": st.binary(max_size=40),
    "tuple": st.lists(st.one_of(ids, literals), max_size=4).map(tuple),
    "dict": st.dictionaries(st.text(max_size=4), st.integers(-9, 9), max_size=2), "object": st.sampled_from(["add", dt.float32]),
}
RECORDS = [*messages.REQUESTS.values(), *messages.REPLIES.values()]


def _notes(record) -> list[str]:
    return [getattr(note, "__forward_arg__", note) for note in record.__mro__[1].__annotations__.values()][1:]


def _records(record):
    return st.tuples(*(FIELDS[note] for note in _notes(record))).map(lambda values: record(*values))


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"{r.KIND}-{r.__name__}")
@given(data=st.data())
def test_a_record_packs_to_the_array_it_stands_for_and_parses_back(record, data):
    message = data.draw(_records(record))
    plain = tuple(message)
    assert plain[0] == record.KIND and protocol.pack(message) == protocol.pack(plain)
    table = messages.REQUESTS if record in messages.REQUESTS.values() else messages.REPLIES
    parse = messages.parse if table is messages.REQUESTS else messages.parse_reply
    parsed = parse(protocol.unpack(protocol.pack(message)))
    assert type(parsed) is record and parsed == plain
    assert messages.check(plain, table) is record  # what the session's handlers unpack by


def test_records_build_today_s_arrays():
    assert messages.Op("add", (1, (2.0, "float32")), (3,), {}) == ("op", "add", (1, (2.0, "float32")), (3,), {})
    assert messages.Get(7, 3) == ("get", 7, 3) and messages.Drop((1, 2)) == ("drop", (1, 2))
    assert messages.RunGraph(1, (2,), (3,)) == ("run", 1, (2,), (3,))
    fetch = messages.Fetch(5, dt.float32, (2, 3), "ember", "127.0.0.1", 7878, b"c" * 32, "peer")
    assert fetch.port == 7878 and protocol.pack(fetch) == protocol.pack(tuple(fetch))
    assert messages.parse(("stats", 4)) == messages.Stats(4)
    assert messages.parse_reply(("stats", 4, {"sessions": 1})).stats == {"sessions": 1}


@pytest.mark.parametrize("record", [r for r in RECORDS if r.CHECKS], ids=lambda r: f"{r.KIND}-{r.__name__}")
@given(data=st.data())
def test_a_field_of_the_wrong_type_is_named(record, data):
    message = list(data.draw(_records(record)))
    index, field, what, _, _ = data.draw(st.sampled_from(record.CHECKS))
    kind, least = [c[3:] for c in record.CHECKS if c[0] == index][0]
    message[index] = data.draw(st.sampled_from([None, -1, 1.5, "x", b"x", (1,), {"a": 1}, True]).filter(
        lambda bad: type(bad) is not kind or (least is not None and bad < least)))
    parse = messages.parse if messages.REQUESTS.get(record.KIND) is record else messages.parse_reply
    table = messages.REQUESTS if parse is messages.parse else messages.REPLIES
    for refuse in (parse, lambda m: messages.check(m, table)):
        with pytest.raises(ProtocolError, match=f"the '{record.KIND}' message's {field} must be {what}"):
            refuse(tuple(message))


@pytest.mark.parametrize("message, named", [
    (("get", 1), r"the 'get' message is \[kind, rid, id\], got 2 items"),
    (("op", "add", (1,), (2,), {}, None), r"the 'op' message is \[kind, name, inputs, outputs, attrs\]"),
    (("teleport", 1), "unknown message type 'teleport'"),
    ((), "malformed message"), ([1], "malformed message"), ((3, 1), "malformed message"),
])
def test_a_message_of_the_wrong_shape_or_kind_is_refused_by_name(message, named):
    with pytest.raises(ProtocolError, match=named):
        messages.parse(message)
    with pytest.raises(ProtocolError):
        messages.parse_reply(("data", 1))
