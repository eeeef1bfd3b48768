"""A session's registered graphs without a session: ``Graphs`` over a tensor table and the numpy
engine, fed ``graph``, ``run`` and ``forget`` fields directly — hostile ones from hypothesis.

A graph is kept (or its refusal, which each run reports), runs on the table's tensors, and gives
its bytes back when forgotten; whatever the fields, the quota counts exactly the table's tensors
and the graphs' entries.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ember import dtypes as dt
from ember.engines.local import LocalEngine
from ember.errors import ProtocolError
from ember.ops.table import Meta
from ember.remote.failures import Failure
from ember.remote.graphs import Graphs
from ember.remote.host import hosted_devices
from ember.remote.memory import GRAPH_NODE_BYTES, GRAPH_OVERHEAD, TENSOR_OVERHEAD, Budget, BufferPool
from ember.remote.tensors import TensorTable
from ember.remote.uploads import Uploads
from ember.wire.protocol import Limits

O = TENSOR_OVERHEAD  # noqa: E741  (what each tensor id costs besides its data)
INPUTS = ((0, dt.float64, (3,)),)
OPS = (("multiply", (0, (2.0, "float64")), (1,), {}), ("add", (1, (1.0, "float64")), (2,), {}))  # 2x + 1


def _graphs(**limits) -> tuple[Graphs, TensorTable, Uploads]:
    budget = Budget(1 << 30)
    pool = BufferPool(budget=budget)
    engine = LocalEngine(hosted_devices("numpy")[0].engine.backend)
    table = TensorTable(Limits(**limits), budget, pool, engine, Failure)
    return Graphs(table, engine), table, Uploads(table.quota, pool)


def _balanced(graphs: Graphs, table: TensorTable) -> bool:
    return table.quota.used == table.live_bytes() + sum(graph.held for graph in graphs.graphs.values())


def test_a_graph_is_registered_once_run_on_the_tables_tensors_and_forgotten():
    graphs, table, uploads = _graphs()
    graphs.register(4, INPUTS, (2,), OPS, (), [], uploads)
    assert graphs.graphs[4].held == GRAPH_OVERHEAD + GRAPH_NODE_BYTES * 4 and _balanced(graphs, table)
    table.store(10, np.arange(3.0), Meta((3,), dt.float64), False)
    assert graphs.run(4, (10,), (11,)) == 2 and graphs.graph_runs == 1
    np.testing.assert_array_equal(table.read(11), np.arange(3.0) * 2 + 1)
    assert table.sizes[11] == 24 + O and _balanced(graphs, table)
    graphs.forget(4)
    assert not graphs.graphs and table.quota.used == table.live_bytes()
    assert graphs.run(4, (10,), (12,)) == 0 and table.read(12).message == "run: unknown graph 4"


def test_a_refused_graph_keeps_its_entry_and_each_run_reports_why():
    graphs, table, uploads = _graphs()
    graphs.register(1, INPUTS, (5,), OPS, (), [], uploads)
    refusal = "graph: graph output 5 is not produced by the graph"
    assert graphs.graphs[1].error.message == refusal and table.quota.used == GRAPH_OVERHEAD
    table.store(10, np.arange(3.0), Meta((3,), dt.float64), False)
    graphs.run(1, (10,), (11,))
    assert table.read(11).message == refusal and table.unreported[0].message == refusal
    table.store(20, np.arange(4.0), Meta((4,), dt.float64), False)
    graphs.register(2, INPUTS, (2,), OPS, (), [], uploads)
    graphs.run(2, (20,), (21,))
    assert table.read(21).message == "run: input 0 expects (3,) float64, got (4,) float64"
    graphs.run(2, (10, 20), (22,))
    assert table.read(22).message.startswith("run: graph 2 takes 1 inputs and gives 1 outputs; got 2 input ids")


def test_a_graph_with_no_room_for_its_entry_is_remembered_apart_and_its_runs_say_so():
    graphs, table, uploads = _graphs(max_session_graphs=1)
    graphs.register(1, INPUTS, (2,), OPS, (), [], uploads)
    graphs.register(2, INPUTS, (2,), OPS, (), [], uploads)
    assert list(graphs.graphs) == [1] and 2 in graphs.unkept
    graphs.run(2, (10,), (11,))
    assert table.read(11).message == ("graph: graph 2 is not kept: this session keeps 1 graphs, the peer's limit; "
                                      "forget some first")


def test_a_declined_constant_is_named_by_its_reason():
    graphs, table, uploads = _graphs()
    uploads.declined.append("no room")
    uploads.begin([None])
    graphs.register(3, INPUTS, (2,), OPS, ((7, 0),), [None], uploads)
    assert graphs.graphs[3].error.message == "graph: constant 7: no room" and _balanced(graphs, table)


FIELDS = st.recursive(st.one_of(st.none(), st.integers(-2, 4), st.text(max_size=3), st.sampled_from(["add", "float64"])),
                      lambda inner: st.tuples(inner, inner, inner) | st.tuples(inner, inner), max_leaves=8)


@given(gid=st.integers(0, 3), fields=st.lists(FIELDS, min_size=4, max_size=4), run=st.tuples(FIELDS, FIELDS))
def test_hostile_graph_fields_are_refused_and_leave_the_quota_counted(gid, fields, run):
    """Whatever the lists hold (a graph id's type is the message's parse's to check: test_session), a graph is
    kept or refused with its bytes counted."""
    graphs, table, uploads = _graphs()
    table.store(0, np.arange(3.0), Meta((3,), dt.float64), False)
    graphs.register(gid, *fields, [], uploads)
    assert _balanced(graphs, table)
    try:
        graphs.run(gid, *run)
    except (ProtocolError, TypeError, ValueError, IndexError):  # the session's ProtocolError
        pass
    assert _balanced(graphs, table)
    graphs.register(1, INPUTS, (2,), OPS, (), [], uploads)  # and a good graph still runs
    table.store(100, np.arange(3.0), Meta((3,), dt.float64), False)
    assert graphs.run(1, (100,), (101,)) == 2 and table.read(101).tolist() == [1.0, 3.0, 5.0]
