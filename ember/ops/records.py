"""Op records: one op instance as plain data, and the checks every reader of records shares.

A record is ``(row name, inputs, outputs, attrs)``: inputs are node (or tensor) ids, ints, or
scalar *literals* ``(value, dtype name)``; outputs are node ids; attrs the canonical attributes.
Capture extracts graphs of them, graph files and the wire carry them, compiled plans run them,
and the compute peer and ``load_graph`` validate them with the same :func:`check_records`.
"""

from __future__ import annotations

from typing import NamedTuple

from .. import dtypes as dt
from ..errors import ProtocolError
from .table import OPS, REQUIRED, Meta, Op


class OpRecord(NamedTuple):
    """One op of a graph or a batch: row name, inputs (ids or literals), output ids, attributes."""

    name: str
    inputs: tuple
    outputs: tuple
    attrs: dict


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


def check_records(records, known: dict) -> list[tuple[Op, tuple, tuple, dict, tuple]]:
    """Validate ``records`` in order against the op table, re-running each meta rule from the metas
    of what it reads; ``known`` (node id → Meta: the inputs and constants) gains every output.

    Refused with ProtocolError: an unknown row, a malformed literal, an unknown or missing
    attribute, a read of a node nothing before produced, a node written twice, an output count
    the row does not give; the meta rule's own errors (shapes, dtypes, axes) propagate. Returns
    ``(row, inputs, outputs, canonical attrs, output metas)`` per record.
    """
    checked = []
    for name, refs, outs, attrs in records:
        row = OPS.get(name) if type(name) is str else None
        if row is None:
            raise ProtocolError(f"unknown op {name!r} in the graph")
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
        attrs, out_metas = row.infer(tuple(in_metas), full_attrs(row, attrs))
        if len(out_metas) != len(outs):
            raise ProtocolError(f"{name}: {len(outs)} output ids for {len(out_metas)} outputs")
        known.update(zip(outs, out_metas))
        checked.append((row, refs, outs, attrs, out_metas))
    return checked
