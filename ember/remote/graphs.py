"""A session's registered graphs, without I/O: registered once by number (``graph``), then run.

A ``graph`` message is validated whole when it arrives — its size, every constant, every row's
meta rule, every limit — and compiled into a local engine plan; a ``run`` checks its inputs'
metas and runs the plan on the session's tensors, keeping its outputs in the
:class:`~ember.remote.tensors.TensorTable`; ``forget`` gives the graph's bytes back. A refused
graph keeps its entry, so each run reports why; one refused for want of room for even that is
remembered apart (the last UNKEPT). What a graph holds is counted through the table's quota.
"""

from __future__ import annotations

from typing import NamedTuple

from .. import dtypes as dt
from ..errors import ProtocolError, ResourceLimitError
from ..ops.records import check_records
from ..ops.table import Meta
from .failures import Failure
from .memory import GRAPH_COMPILE_BYTES, GRAPH_NODE_BYTES, GRAPH_OVERHEAD, TENSOR_OVERHEAD
from .runs import endings, peak
from .tensors import TensorTable, error_kind, need_of
from .uploads import Uploads


class RegisteredGraph(NamedTuple):
    """A graph a session keeps by number (a ``graph`` message), for its ``run`` messages: what a
    run checks and runs, and the bytes the graph holds. A refused graph keeps its error alone."""

    inputs: tuple           # (node, Meta) of each input, in order: a run's tensors must have these metas
    outputs: tuple          # the nodes a run returns, in order
    plan: object            # the local engine's compiled plan (None for a refused graph)
    out_metas: dict         # node -> Meta, of each output
    error: Failure | None   # why it was refused: each run reports it
    held: int               # bytes counted for it until it is forgotten: its entry, its nodes and its constants
    need: int               # bytes a run reserves: the most its plan holds at once

    @classmethod
    def refused(cls, error: Failure, held: int = 0) -> RegisteredGraph:
        return cls((), (), None, {}, error, held, 0)


class Graphs:
    """The graphs of one session by number, over its :class:`TensorTable` and ``engine``. Each
    method takes the fields of a message's record (``wire/messages.py``), whose types ``parse``
    checked: a graph id is a non-negative integer (a string id would cost its size), a node list a
    tuple; what the lists hold is checked here."""

    def __init__(self, table: TensorTable, engine):
        self.table, self.engine = table, engine
        self.graphs: dict[int, RegisteredGraph] = {}
        self.unkept: dict[int, Failure] = {}  # graphs refused with no room for their entry: their failures
        # as the peer's status names them: graph messages handled, runs of a registered graph (cache hits)
        self.graphs_registered = self.graph_runs = 0

    def register(self, gid, inputs, outputs, ops, constants, segments: list, uploads: Uploads) -> None:
        """Keep graph ``gid`` (a number registered again is a new graph), or its refusal. Its constants
        are ``segments`` of the frame, counted by ``uploads`` as they arrived (or declined)."""
        self.forget(gid)
        self.graphs_registered += 1
        table = self.table
        limits = table.quota.limits
        # its entry, kept even if the graph is refused (its runs report why): unless there is no room for one
        reason = f"this session keeps {limits.max_session_graphs} graphs, the peer's limit; forget some first" \
            if len(self.graphs) >= limits.max_session_graphs else table.quota.reserve(GRAPH_OVERHEAD)
        if reason is not None:
            failure = table.fail("ResourceLimitError", f"graph: graph {gid} is not kept: {reason}")
            table.report(failure)
            table.remember(self.unkept, gid, failure)  # its runs report it
            return
        known, values, held, transient, need = {}, {}, GRAPH_OVERHEAD, 0, 0
        records, needs, error, plan = [], [], None, None
        try:  # validate the whole graph once: its size, every constant, every row's meta rule, every limit
            for what, nodes in (("ops", ops), ("inputs", inputs), ("outputs", outputs), ("constants", constants)):
                if len(nodes) > limits.max_graph_ops:  # refused before anything is built from it
                    raise ResourceLimitError(f"{len(nodes)} {what} in graph {gid}, more than the peer's limit of "
                                             f"{limits.max_graph_ops} per graph")
            nodes = GRAPH_NODE_BYTES * (len(ops) + len(inputs) + len(outputs))
            table.take(f"registering graph {gid}", nodes)  # what the registered graph keeps of each node
            held += nodes
            table.take(f"registering graph {gid}", GRAPH_COMPILE_BYTES * len(ops))  # while it is checked and compiled
            transient = GRAPH_COMPILE_BYTES * len(ops)
            known = {tid: Meta(tuple(shape), dtype) for tid, dtype, shape in inputs}
            for tid, index in constants:
                host = segments[index]
                if host is None:
                    raise ResourceLimitError(f"constant {tid}: {uploads.reason(index)}")
                meta = Meta(tuple(host.shape), dt.FROM_NUMPY[host.dtype])
                nbytes = uploads.claim(host)  # reserved as it arrived
                if nbytes is None:
                    nbytes = host.nbytes + TENSOR_OVERHEAD
                    table.take(f"constant {tid}", nbytes)
                held += nbytes  # the graph keeps its constants until it is forgotten
                values[tid], known[tid] = self.engine.upload(host), meta
            for row, refs, outs, attrs, in_metas, out_metas in check_records(ops, known):
                if any(None in m.shape for m in out_metas):
                    raise ProtocolError(f"{row.name}: data-dependent shapes cannot be part of a graph")
                needs.append(need_of(row, in_metas, attrs, out_metas, limits.max_tensor_bytes))
                records.append((row, refs, outs, attrs))
            missing = [o for o in outputs if o not in known]
            if missing:
                raise ProtocolError(f"graph output {missing[0]} is not produced by the graph")
            # a run holds what the op path would: each intermediate until its last use (the plan lets it go then),
            # and at least every output it returns (one returned twice is kept twice)
            returned = set(outputs)
            intermediates = tuple(o for _, _, outs, _ in records for o in outs if o not in returned)
            need = max(peak(records, needs, endings(records, intermediates), known, TENSOR_OVERHEAD),
                       sum(known[o].nbytes + TENSOR_OVERHEAD for o in outputs))
            plan = self.engine.compile(records, [tid for tid, _, _ in inputs], values, outputs, known)
        except Exception as failure:
            error = table.fail(error_kind(failure), f"graph: {failure}")
            table.quota.give(held - GRAPH_OVERHEAD)  # a refused graph keeps its entry alone
            held = GRAPH_OVERHEAD
        finally:
            table.quota.give(transient)
        if error is not None:
            self.graphs[gid] = RegisteredGraph.refused(error, held)
            return
        input_metas = tuple((tid, known[tid]) for tid, _, _ in inputs)
        self.graphs[gid] = RegisteredGraph(input_metas, tuple(outputs), plan, {o: known[o] for o in outputs}, None,
                                           held, need)

    def run(self, gid, input_ids, output_ids) -> int:
        """Run graph ``gid`` on tensors ``input_ids`` into ``output_ids``, or poison them saying why;
        returns the ops it ran."""
        table = self.table
        graph = self.graphs.get(gid)
        if graph is None and self.unkept and gid in self.unkept:
            graph = RegisteredGraph.refused(self.unkept[gid])  # refused with no room for its entry
        if graph is None:
            table.poison(output_ids, "ExecutionError", f"run: unknown graph {gid!r}")
            return 0
        inputs, outputs, error = graph.inputs, graph.outputs, graph.error
        self.graph_runs += 1  # a run of a registered graph: the registration is reused (a cache hit)
        if error is not None:
            for tid in output_ids:
                table.store(tid, error, None, False)
            table.report(error)
            return 0
        if len(input_ids) != len(inputs) or len(output_ids) != len(outputs):
            table.poison(output_ids, "ProtocolError", f"run: graph {gid!r} takes {len(inputs)} inputs and gives "
                                                      f"{len(outputs)} outputs; got {len(input_ids)} input ids and "
                                                      f"{len(output_ids)} output ids")
            return 0
        values = []
        for (node, meta), tid in zip(inputs, input_ids):
            value = table.lookup(tid)
            if value is None:
                table.poison(output_ids, "ExecutionError", f"run: {table.unknown(tid)}")
                return 0
            if type(value) is Failure:  # the failure travels on, reported once
                for out in output_ids:
                    table.store(out, value, None, False)
                return 0
            held = table.metas[tid]
            if held != meta:
                table.poison(output_ids, "ShapeError", f"run: input {node} expects {meta.shape} {meta.dtype}, "
                                                        f"got {held.shape} {held.dtype}")
                return 0
            values.append(value)
        plan, need = graph.plan, graph.need
        try:
            table.take(f"run of graph {gid}", need, table.new_ids(output_ids))
            try:
                results = plan.run(values)
            except BaseException:
                table.quota.give(need)
                raise
        except Exception as failure:
            table.poison(output_ids, error_kind(failure), str(failure))
            return 0
        table.keep(output_ids, results, tuple(graph.out_metas[node] for node in outputs), need)
        return len(plan.steps)

    def forget(self, gid) -> None:
        """Let graph ``gid`` go, and the bytes it held (its entry, nodes and constants)."""
        graph = self.graphs.pop(gid, None)
        if graph is not None:
            self.table.quota.give(graph.held)
        if self.unkept:
            self.unkept.pop(gid, None)

    def clear(self) -> None:
        self.graphs.clear()
        self.unkept.clear()
