"""Op records: one op instance as plain data, and the checks every reader of records shares.

A record is ``(row name, inputs, outputs, attrs, metas)``. An input is a reference to a tensor or
a scalar *literal* ``(value, dtype name)``; attrs are the canonical attributes. What references a
tensor depends on where the record lives:

- graphs, graph files, the wire and compiled plans: integer node (tensor) ids, outputs too, and
  no ``metas`` (they are re-derived by :func:`check_records`, so nothing a file or a client
  claims about shapes is trusted); the wire's single-op message is ``("op", *record[:4])``;
- a capture: the input ``Node``s; outputs are empty, because each output node points back at
  its record and index, and ``metas`` are the outputs' (a graph extracted from a capture numbers
  them);
- the autodiff tape: the input ``Var``s; outputs are the inner engine's handles the gradient
  rules read, and ``metas`` their metas.

The compute peer, ``load_graph`` and a single op on the peer validate records with the same
:func:`infer_record`.
"""

from __future__ import annotations

from typing import NamedTuple

from .. import dtypes as dt
from ..errors import ProtocolError
from .table import OPS, REQUIRED, Meta, Op


class OpRecord(NamedTuple):
    """One op instance: row name, inputs (references or literals), outputs, attributes, and the
    outputs' metas where the record keeps them (see the module docstring)."""

    name: str
    inputs: tuple
    outputs: tuple
    attrs: dict
    metas: tuple = ()

    @property
    def row(self) -> Op:
        return OPS[self.name]


LITERAL_METAS = {d.name: Meta((), d) for d in dt.ALL}  # a literal's meta, by its dtype name


def literal_meta(what: str, ref) -> Meta:
    """The meta of literal ``ref``; ProtocolError naming ``what`` if it is not one."""
    if type(ref) is tuple and len(ref) == 2 and dt.is_python_scalar(ref[0]):
        meta = LITERAL_METAS.get(ref[1]) if type(ref[1]) is str else None
        if meta is not None:
            return meta
    raise ProtocolError(f"{what}: malformed literal input {ref!r:.60}")


def full_attrs(row: Op, attrs: dict) -> dict:
    """The row's attributes in its order, defaults filled in; unknown or missing ones refused."""
    unknown = attrs.keys() - row.attrs.keys()
    if unknown:
        raise ProtocolError(f"{row.name}: unknown attribute {sorted(unknown)[0]!r}")
    full = {k: attrs.get(k, default) for k, default in row.attrs.items()}
    missing = [k for k, v in full.items() if v is REQUIRED]
    if missing:
        raise ProtocolError(f"{row.name}: the required attribute {missing[0]!r} is missing")
    return full


def infer_record(name, in_metas: tuple, outputs: tuple, attrs: dict) -> tuple[Op, dict, tuple]:
    """The row, canonical attributes and output metas of one record whose inputs have ``in_metas``.

    Refused with ProtocolError: an unknown row, an unknown or missing attribute, an output count
    the row does not give; the meta rule's own errors (shapes, dtypes, axes) propagate.
    """
    row = OPS.get(name) if type(name) is str else None
    if row is None:
        raise ProtocolError(f"unknown op {name!r}")
    if attrs or row.attrs:
        attrs = full_attrs(row, attrs)
    attrs, out_metas = row.infer(in_metas, attrs)
    if len(out_metas) != len(outputs):
        raise ProtocolError(f"{name}: {len(outputs)} output ids for {len(out_metas)} outputs")
    return row, attrs, out_metas


def check_records(records, known: dict) -> list[tuple[Op, tuple, tuple, dict, tuple, tuple]]:
    """Validate ``records`` in order against the op table, re-running each meta rule from the metas
    of what it reads; ``known`` (node id → Meta: the inputs and constants) gains every output.

    Refused with ProtocolError: what :func:`infer_record` refuses, a malformed record or literal,
    a read of a node nothing before produced, a node written twice. Returns
    ``(row, inputs, outputs, canonical attrs, input metas, output metas)`` per record.
    """
    checked = []
    for record in records:
        if type(record) is not OpRecord and (type(record) is not tuple or len(record) != 4):
            raise ProtocolError(f"a record is (name, inputs, outputs, attrs), got {record!r:.60}")
        name, refs, outs, attrs = record[:4]
        if type(refs) is not tuple or type(outs) is not tuple or type(attrs) is not dict:
            raise ProtocolError(f"{name}: a record is (name, inputs, outputs, attrs)")
        in_metas = []
        for ref in refs:
            if type(ref) is int:
                meta = known.get(ref)
                if meta is None:
                    raise ProtocolError(f"{name} reads node {ref}, which nothing before it produced")
                in_metas.append(meta)
            else:
                in_metas.append(literal_meta(name, ref))
        rewritten = [o for o in outs if type(o) is not int or o in known]
        if rewritten:
            raise ProtocolError(f"{name} writes node {rewritten[0]!r}, which is produced already (or not an id)")
        in_metas = tuple(in_metas)
        row, attrs, out_metas = infer_record(name, in_metas, outs, attrs)
        known.update(zip(outs, out_metas))
        checked.append((row, refs, outs, attrs, in_metas, out_metas))
    return checked
