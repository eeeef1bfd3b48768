"""Reading graph files: ``load_graph`` and ``validate``, which re-runs every record through the op
table (the checks the compute peer applies to a registered graph, ``ops.records.check_records``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import dtypes as dt
from ..errors import EmberError, GraphFormatError, ProtocolError
from ..ops.records import OpRecord, check_records
from ..ops.table import Meta, fmt_shape
from ..wire import protocol as wire
from .graph import GRAPH_FORMAT_VERSION, CapturedGraph


def load_graph(path) -> CapturedGraph:
    """Read a graph written by ``CapturedGraph.save``; GraphFormatError if it is malformed,
    truncated or newer than this ember reads."""
    data = Path(path).read_bytes()
    # nothing in a file can be larger than the file: a header claiming more is refused before anything is allocated
    size = len(data)
    reader = wire.FrameReader(wire.Limits(max_header_bytes=size, max_frame_bytes=size))  # a tensor is within its frame
    try:
        frames = reader.feed(data)
    except (ProtocolError, EmberError) as error:
        raise GraphFormatError(f"load_graph: {path} is not a valid ember graph: {error}") from None
    if len(frames) != 1 or reader.buffer().nbytes != wire.PREFIX_SIZE:
        raise GraphFormatError(f"load_graph: {path} is truncated or has trailing data")
    header, segments = frames[0]
    if header.get("format") != "ember.graph":
        raise GraphFormatError(f"load_graph: {path} is not an ember graph")
    version = header.get("version")
    if type(version) is not int or version < 1:
        raise GraphFormatError(f"load_graph: {path} has no valid graph format version: {version!r}")
    if version > GRAPH_FORMAT_VERSION:
        raise GraphFormatError(f"load_graph: {path} has graph format version {version!r}; this ember reads up to "
                               f"version {GRAPH_FORMAT_VERSION} — upgrade ember")
    try:
        if len(header["constants"]) != len(segments):
            raise GraphFormatError(f"load_graph: {path} names {len(header['constants'])} constants for "
                                   f"{len(segments)} stored tensors")
        metas = {i: Meta(tuple(shape), dtype) for i, dtype, shape in header["metas"]}
        graph = CapturedGraph(
            inputs=[(n, i, Meta(tuple(shape), dtype)) for n, i, dtype, shape in header["inputs"]],
            outputs=[(n, i) for n, i in header["outputs"]],
            ops=[OpRecord(name, tuple(inputs), tuple(outputs), dict(attrs)) for name, inputs, outputs, attrs in header["ops"]],
            constants={i: _read_only(segments[k]) for k, i in enumerate(header["constants"])},
            metas=metas,
        )
        validate(graph)
    except GraphFormatError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, EmberError) as error:
        raise GraphFormatError(f"load_graph: {path} is malformed: {error}") from None
    return graph


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _show(meta: Meta | None) -> str:
    return "nothing" if meta is None else f"{fmt_shape(meta.shape)} {meta.dtype}"


def validate(graph: CapturedGraph) -> None:
    """Re-run every op's meta rule from the inputs' metas; GraphFormatError if the graph's
    records disagree (a tampered or inconsistent file)."""
    for where, meta in [*((f"input {n!r}", m) for n, _, m in graph.inputs), *((f"node {i}", m) for i, m in graph.metas.items())]:
        if not isinstance(meta.dtype, dt.DType) or not all(type(s) is int and s >= 0 for s in meta.shape):
            raise GraphFormatError(f"{where} has no valid shape and dtype: {meta.shape!r:.60} {meta.dtype!r:.30}")
    known = {i: m for _, i, m in graph.inputs}
    for name, node, meta in graph.inputs:
        if graph.metas.get(node) != meta:
            raise GraphFormatError(f"input {name!r} is {_show(meta)}, but its node {node} is recorded as "
                                   f"{_show(graph.metas.get(node))}")
    for node, value in graph.constants.items():
        meta = Meta(value.shape, dt.FROM_NUMPY[value.dtype])
        if graph.metas.get(node) != meta:
            raise GraphFormatError(f"constant {node} holds {_show(meta)}, but is recorded as {_show(graph.metas.get(node))}")
        known[node] = meta
    try:
        checked = check_records(graph.ops, known)
    except ProtocolError as error:
        raise GraphFormatError(str(error)) from None
    for row, _, outputs, _, _, out_metas in checked:
        if any(graph.metas.get(i) != m for i, m in zip(outputs, out_metas)):
            raise GraphFormatError(f"{row.name}: the recorded output metas disagree with the op table")
    for name, node in graph.outputs:
        if node not in known:
            raise GraphFormatError(f"output {name!r} is not produced by the graph")
