"""A session's tensor table and its quota, without a session: ``TensorTable`` and ``Quota`` fed
writes, reads and hostile ids directly, their accounting checked after each step.

Whatever the sequence, the quota counts exactly the bytes the table holds, the budget exactly the
quota's bytes and credit, the fast path (``Quota.fits``) never passes where the full check would
refuse, and a bad id is a ProtocolError that leaves the table as it was counted.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember import dtypes as dt
from ember.errors import ProtocolError, ResourceLimitError
from ember.ops.table import Meta
from ember.remote.failures import Failure
from ember.remote.memory import CREDIT, TENSOR_OVERHEAD, Budget, BufferPool, Quota
from ember.remote.tensors import UNKEPT, TensorTable
from ember.wire.protocol import Limits

O = TENSOR_OVERHEAD  # noqa: E741  (what each tensor id costs besides its data)


def _table(quota: int = 1 << 20, tensors: int = 16, budget: int = 1 << 30) -> TensorTable:
    memory = Budget(budget)
    return TensorTable(Limits(max_session_bytes=quota, max_session_tensors=tensors), memory, BufferPool(budget=memory),
                       None, Failure)


def _vector(n: int) -> tuple[np.ndarray, Meta]:
    return np.zeros(n), Meta((n,), dt.float64)


def _balanced(table: TensorTable) -> bool:
    """The quota counts the table's tensors alone, the budget the quota's bytes and credit, and the
    ceiling leaves no room past the quota or the cap on tensors."""
    quota, limits = table.quota, table.quota.limits
    return (quota.used == table.live_bytes() and quota.budget.used == quota.used + quota.credit
            and quota.ceiling <= limits.max_session_bytes
            and quota.ceiling <= quota.used + O * (limits.max_session_tensors - len(table.sizes))
            and set(table.metas) <= set(table.tensors) <= set(table.sizes))


def test_a_stored_tensor_counts_its_bytes_and_its_id_and_a_drop_gives_them_back():
    table = _table()
    value, meta = _vector(4)
    table.store(1, value, meta, False)
    assert table.read(1) is value and table.sizes == {1: 32 + O} and table.quota.used == 32 + O and _balanced(table)
    table.store(1, *_vector(2), False)  # written again: the old one's bytes go back
    assert table.sizes == {1: 16 + O} and _balanced(table)
    table.drop((1, 7))  # an unknown id is no error
    assert not table.tensors and table.quota.used == 0 and _balanced(table)
    assert table.read(1).message == "unknown tensor id 1 (dropped, or from another session)"


def test_the_quota_takes_the_budget_in_credits_and_gives_back_all_but_one():
    quota = Quota(Limits(), Budget(1 << 30), {})
    assert quota.reserve(100) is None and (quota.used, quota.credit, quota.budget.used) == (100, CREDIT, 100 + CREDIT)
    assert quota.fits(CREDIT) and quota.credit == 0  # within the credit: no lock taken
    quota.give(CREDIT + 100)
    assert (quota.used, quota.credit, quota.budget.used) == (0, CREDIT + 100, CREDIT + 100)  # at most two credits: kept
    quota.reserve(2 * CREDIT)
    quota.give(2 * CREDIT)
    assert (quota.used, quota.credit, quota.budget.used) == (0, CREDIT, CREDIT)  # past two: one is kept
    quota.close()
    assert (quota.used, quota.credit, quota.budget.used) == (0, 0, 0)


def test_each_refusal_names_the_limit_it_meets():
    quota = Quota(Limits(max_session_bytes=1000, max_session_tensors=2), Budget(600), {1: O})
    assert quota.reserve(1001) == "1001 more bytes would exceed this session's quota of 1000 bytes (0 in use)"
    assert quota.reserve(600, 2) == ("2 more tensor(s) would exceed this session's limit of 2 tensors (1 held, failed "
                                     "ones included); drop some first")
    assert quota.reserve(601) == ("601 more bytes would exceed the peer's memory budget of 600 bytes (0 in use by all "
                                  "sessions)")
    assert quota.reserve(600, 1) is None and (quota.used, quota.credit) == (600, 0)  # no room for a credit: exactly
    table = _table(quota=100)
    with pytest.raises(ResourceLimitError, match=r"^get of tensor 3: 101 more bytes would exceed this session's quota"):
        table.take("get of tensor 3", 101)


def test_past_the_cap_a_value_holds_its_refusal_and_a_failure_is_remembered_apart():
    table = _table(tensors=2)
    table.store(1, *_vector(1), False)
    table.store(2, *_vector(1), False)
    table.store(3, *_vector(1), False)  # no id left: not kept, and its failure has no room either
    assert set(table.sizes) == {1, 2} and table.read(3).message.startswith("put of tensor 3: 1 more tensor(s) would ")
    assert table.unreported == [table.unkept[3]] and _balanced(table)
    table.poison((4,), "ShapeError", "add: shapes differ")
    assert 4 not in table.sizes and table.read(4).message == "add: shapes differ"  # reported first came first
    assert table.unreported[0].kind == "ResourceLimitError"
    table.drop((1,))
    table.store(3, *_vector(1), False)  # room again: the id is kept, and no longer remembered as failed
    assert 3 in table.sizes and 3 not in table.unkept and _balanced(table)


def test_failures_not_kept_are_remembered_by_the_last_unkept_and_an_old_one_says_so():
    table = _table(tensors=1)
    table.store(0, *_vector(1), False)
    for tid in range(1, UNKEPT + 2):
        table.poison((tid,), "ExecutionError", f"failure {tid}")
    assert len(table.unkept) <= UNKEPT and table.read(UNKEPT + 1).message == f"failure {UNKEPT + 1}"
    assert table.read(1).message == ("unknown tensor id 1 (dropped, from another session, or a failure this session "
                                     "had no room to keep)")


def test_an_op_path_write_adds_a_new_id_and_leaves_any_other_to_keep():
    table = _table()
    value, meta = _vector(4)
    assert not table.quota.fits(32 + O)  # no credit yet: the full check takes some from the budget
    assert table.quota.reserve(32 + O, 1) is None and table.add(5, value, meta, 32 + O)
    assert not table.add(5, value, meta, 32 + O) and not table.add(-1, value, meta, 32 + O)  # in use; no id
    table.sent[6] = 0  # a reply being built reads 6: keep() must see the write
    assert not table.add(6, value, meta, 32 + O) and _balanced(table)
    assert table.quota.reserve(2 * (16 + O) + 100, 2) is None  # two outputs and 100 bytes of scratch
    table.keep((5, 6), [np.zeros(2), np.zeros(2)], [Meta((2,), dt.float64)] * 2, 2 * (16 + O) + 100)
    assert table.sizes == {5: 16 + O, 6: 16 + O} and 6 not in table.sent and _balanced(table)  # 5's old bytes came back
    assert table.quota.reserve(16 + O) is None
    with pytest.raises(ProtocolError, match=r"^tensor ids are non-negative integers, got 'x'$"):
        table.keep(("x",), [np.zeros(2)], [Meta((2,), dt.float64)], 16 + O, False)
    assert _balanced(table)  # the reservation went back


IDS = st.one_of(st.integers(-2, 12), st.booleans(), st.text(max_size=2), st.none())
STEPS = st.lists(st.tuples(st.sampled_from(["store", "fail", "free", "op", "keep", "drop", "poison", "read"]),
                           st.lists(IDS, min_size=1, max_size=3), st.integers(0, 40)), max_size=25)


@given(steps=STEPS, quota=st.integers(0, 8 * O), tensors=st.integers(0, 6))
def test_any_sequence_of_writes_and_hostile_ids_keeps_the_table_counted(steps, quota, tensors):
    table = _table(quota=quota, tensors=tensors)
    for kind, ids, n in steps:
        value, meta = _vector(n)
        need = n * 8 + O
        try:
            if kind == "store":
                table.store(ids[0], value, meta, False)
            elif kind == "fail":
                table.store(ids[0], Failure("ExecutionError", "upstream"), None, False)
            elif kind == "free":
                table.store(ids[0], None, None, False)
            elif kind == "op" and table.quota.fits(need):  # the fast path vouches for the quota and the cap
                assert table.quota.refusal(0) is None and len(table.sizes) < tensors + (ids[0] in table.sizes)
                if not table.add(ids[0], value, meta, need):
                    table.keep(ids[:1], (value,), (meta,), need, False)
            elif kind == "keep" and table.quota.reserve(len(ids) * need, table.new_ids(ids)) is None:
                table.keep(tuple(ids), [value] * len(ids), [meta] * len(ids), len(ids) * need)
            elif kind == "drop":
                table.drop(tuple(ids))
            elif kind == "poison":
                table.poison(tuple(ids), "ExecutionError", "bad")
            elif kind == "read":
                read = table.read(ids[0])
                assert read is table.tensors.get(ids[0]) or type(read) is Failure
        except ProtocolError as error:
            assert str(error).startswith("tensor ids are non-negative integers")
        except TypeError:  # an unhashable id (none here) would be the session's ProtocolError
            raise
        assert _balanced(table) and len(table.sizes) <= tensors and len(table.unkept) <= UNKEPT
    table.close()
    assert table.quota.budget.used == 0 and not table.sizes
