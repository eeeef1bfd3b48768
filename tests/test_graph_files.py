"""Graph files: ``load_graph`` refuses every damaged or tampered file with a GraphFormatError naming what is wrong.

Each case saves a real graph, changes one thing in its decoded header (or its bytes) and writes it back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ember as em
from ember.graphs import GraphFormatError
from ember.wire import protocol as wire

SAVED = {  # the graph below as save() writes it: node 0 the input, 1 the constant, 2–4 the ops' outputs
    "inputs": (("x", 0, em.float32, (2, 3)),),
    "outputs": (("y", 4),),
    "ops": (("multiply", (0, 1), (2,), {}),
            ("sum", (2,), (3,), {"axis": (1,), "dtype": em.float32, "keepdims": False}),
            ("add", (3, (1.5, "float32")), (4,), {})),
    "metas": ((0, em.float32, (2, 3)), (1, em.float32, (3,)), (2, em.float32, (2, 3)), (3, em.float32, (2,)),
              (4, em.float32, (2,))),
    "constants": (1,),
}


@pytest.fixture
def saved(tmp_path):
    """The path of a saved graph; its decoded header and segments."""
    with em.capture() as cap:
        x = cap.input((2, 3), em.float32, name="x")
        cap.output(em.sum(x * em.asarray(np.arange(3, dtype=np.float32), device=cap.device), axis=1) + 1.5, name="y")
    path = cap.graph.save(tmp_path / "g.ember")
    (frame,) = wire.FrameReader().feed(path.read_bytes())
    header = {k: v for k, v in frame.header.items() if k != "seg"}
    assert {k: header[k] for k in SAVED} == SAVED
    return path, header, frame.segments


def _write(path: Path, header: dict, segments) -> Path:
    path.write_bytes(b"".join(bytes(b) for b in wire.encode_frame(header, list(segments))))
    return path


def _op(k: int, **fields) -> tuple:
    """The saved ops with fields of op ``k`` replaced."""
    ops = [dict(zip(("name", "inputs", "outputs", "attrs"), op)) for op in SAVED["ops"]]
    ops[k].update(fields)
    return tuple(tuple(op.values()) for op in ops)


def _meta(node: int, dtype=None, shape=None) -> tuple:
    """The saved metas with node ``node``'s dtype or shape replaced."""
    return tuple((i, dtype or d, shape or s) if i == node else (i, d, s) for i, d, s in SAVED["metas"])


SUM_ATTRS = SAVED["ops"][1][3]
TAMPERED = {  # name -> (header entries replaced, what the error names)
    # validate(): the records against the op table
    "unknown op": ({"ops": _op(0, name="no_such_op")}, "unknown op 'no_such_op'"),
    "op name not a string": ({"ops": _op(0, name=5)}, "unknown op 5"),
    "unknown attribute": ({"ops": _op(1, attrs={**SUM_ATTRS, "bogus": 1})}, "sum: unknown attribute 'bogus'"),
    "required attribute missing": ({"ops": _op(1, name="reshape", attrs={})},
                                   "reshape: the required attribute 'shape' is missing"),
    "attribute the meta rule refuses": ({"ops": _op(1, attrs={**SUM_ATTRS, "axis": (5,)})},
                                        "is malformed: sum: axis 5 is out of bounds for an array of dimension 2"),
    "input shape the meta rule refuses": ({"inputs": (("x", 0, em.float32, (2, 4)),), "metas": _meta(0, shape=(2, 4))},
                                          "is malformed: multiply: shapes (2, 4) and (3,) cannot be broadcast together"),
    "node nothing produced": ({"ops": _op(1, inputs=(99,))}, "sum reads node 99, which nothing before it produced"),
    "ops out of order": ({"ops": SAVED["ops"][1:] + SAVED["ops"][:1]},
                         "sum reads node 2, which nothing before it produced"),
    "node written twice": ({"ops": _op(2, outputs=(2,))}, "add writes node 2, which is produced already"),
    "malformed literal": ({"ops": _op(2, inputs=(3, ("abc", "float32")))}, "add: malformed literal input ('abc', 'float32')"),
    "literal of no dtype": ({"ops": _op(2, inputs=(3, (1.5, "float128")))}, "add: malformed literal input (1.5, 'float128')"),
    "recorded shape disagrees": ({"metas": _meta(3, shape=(3,))}, "sum: the recorded output metas disagree with the op table"),
    "recorded dtype disagrees": ({"metas": _meta(3, dtype=em.float64)}, "sum: the recorded output metas disagree"),
    "one output too many": ({"ops": _op(1, outputs=(3, 5))}, "sum: 2 output ids for 1 outputs"),
    "input disagrees with its node": ({"inputs": (("x", 0, em.float32, (5, 3)),)},
                                      "input 'x' is (5, 3) float32, but its node 0 is recorded as (2, 3) float32"),
    "input of no dtype": ({"inputs": (("x", 0, "float32", (2, 3)),)}, "input 'x' has no valid shape and dtype"),
    "negative dimension": ({"metas": _meta(2, shape=(-2, 3))}, "node 2 has no valid shape and dtype: (-2, 3)"),
    "constant with no recorded meta": ({"metas": tuple(m for m in SAVED["metas"] if m[0] != 1)},
                                       "constant 1 holds (3,) float32, but is recorded as nothing"),
    "constant disagrees with its data": ({"metas": _meta(1, shape=(1, 3))},
                                         "constant 1 holds (3,) float32, but is recorded as (1, 3) float32"),
    "output nothing produces": ({"outputs": (("y", 99),)}, "output 'y' is not produced by the graph"),
    # load_graph(): the file's structure
    "constant without its data": ({"constants": ()}, "names 0 constants for 1 stored tensors"),
    "record of the wrong length": ({"ops": (SAVED["ops"][0][:3],) + SAVED["ops"][1:]}, "is malformed: not enough values"),
    "entry missing": ({"metas": None}, "is malformed: 'metas'"),
    "not a graph": ({"format": "ember.checkpoint"}, "is not an ember graph"),
    "newer version": ({"version": 2}, "has graph format version 2; this ember reads up to version 1 — upgrade ember"),
    "no version": ({"version": None}, "has no valid graph format version: None"),
    "version zero": ({"version": 0}, "has no valid graph format version: 0"),
}


def test_the_untampered_file_round_trips(saved, tmp_path):
    _, header, segments = saved
    graph = em.load_graph(_write(tmp_path / "same.ember", header, segments))
    np.testing.assert_array_equal(em.asnumpy(graph(np.ones((2, 3), np.float32))), [4.5, 4.5])
    assert not graph.constants[1].flags.writeable  # a loaded graph's constants cannot be changed under it


@pytest.mark.parametrize("case", TAMPERED)
def test_a_tampered_graph_is_refused(saved, tmp_path, case):
    _, header, segments = saved
    changes, message = TAMPERED[case]
    header = {k: v for k, v in {**header, **changes}.items() if v is not None}
    with pytest.raises(GraphFormatError) as refused:
        em.load_graph(_write(tmp_path / "tampered.ember", header, segments))
    assert message in str(refused.value)


def _frame(header: dict, payload: int) -> bytes:
    """A frame prefix and ``header``, announcing ``payload`` bytes of tensors that do not follow."""
    body = wire.pack(header)
    return wire.MAGIC + len(body).to_bytes(4, "little") + payload.to_bytes(8, "little") + body


def _header_end(data: bytes) -> int:
    return wire.PREFIX_SIZE + int.from_bytes(data[4:8], "little")


DAMAGED = {  # name -> (the saved file's bytes -> the damaged bytes, what the error names)
    "empty": (lambda data: b"", "is truncated or has trailing data"),
    "cut in the prefix": (lambda data: data[:10], "is truncated or has trailing data"),
    "cut in the header": (lambda data: data[:wire.PREFIX_SIZE + 5],  # its header cannot fit in what is left
                          "is not a valid ember graph: a header of"),
    "cut in the tensors": (lambda data: data[:-1], "is truncated or has trailing data"),
    "a trailing byte": (lambda data: data + b"\0", "is truncated or has trailing data"),
    "a second frame": (lambda data: data + data, "is truncated or has trailing data"),
    "bad magic": (lambda data: b"EMBX" + data[4:], "is not a valid ember graph: bad frame magic b'EMBX'"),
    "malformed header": (lambda data: data[:wire.PREFIX_SIZE] + b"\xc1" * (_header_end(data) - wire.PREFIX_SIZE)
                         + data[_header_end(data):], "is not a valid ember graph: malformed header"),
    "header not a map": (lambda data: _frame([], 0), "is not a valid ember graph: a frame header must be a map"),
    "tensors larger than the file": (lambda data: _frame({"seg": (("uint8", (100_000,)),)}, 100_000),
                                     "is not a valid ember graph: a frame of 100019 bytes exceeds the limit of 35"),
    "header larger than the file": (lambda data: wire.MAGIC + (1 << 20).to_bytes(4, "little") + bytes(8) + b"\x80",
                                    "is not a valid ember graph: a header of 1048576 bytes exceeds the limit of 17"),
    "tensors disagree with the payload": (lambda data: _frame({"seg": (("uint8", (4,)),)}, 3) + b"abc",
                                          "is not a valid ember graph: segments disagree with the payload length 3"),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_file_is_refused(saved, tmp_path, case):
    path, _, _ = saved
    damage, message = DAMAGED[case]
    (tmp_path / "damaged.ember").write_bytes(damage(path.read_bytes()))
    with pytest.raises(GraphFormatError) as refused:
        em.load_graph(tmp_path / "damaged.ember")
    assert message in str(refused.value)
