"""The passes that compile a local plan (ember/engines/plans.py), each on records written by hand, and a
plan built from a backend alone. tests/test_jit.py judges the plans em.jit makes end to end."""

from __future__ import annotations

import numpy as np
import pytest

import ember as em
from ember import dtypes as dt
from ember.engines import plans
from ember.ops import OPS
from ember.ops.table import Meta

F64 = "float64"


def _records():
    """``-((x * 2.0 + 1.0) * 3.0)`` over input node 0: nodes 1 to 4, 4 the output."""
    return [(OPS["multiply"], (0, (2.0, F64)), (1,), {}), (OPS["add"], (1, (1.0, F64)), (2,), {}),
            (OPS["multiply"], (2, (3.0, F64)), (3,), {}), (OPS["negative"], (3,), (4,), {})]


def _backend():
    return em.device("numpy").engine.backend


def _compile(records, input_ids, output_ids, metas, refill_bytes=None):
    """The passes in LocalEngine.compile's order; (plan, layout, over)."""
    backend = _backend()
    kernels, intos = plans.look_up(records, backend.kernels, backend)
    dying = plans.liveness(records, {*input_ids, *output_ids})
    over = plans.plan_in_place(records, intos, dying, metas)
    layout = plans.assign_slots(records, input_ids, {}, over, intos, backend.literal)
    getters = plans.Getters()
    steps = plans.make_steps(records, kernels, intos, over, dying, layout, getters)
    spans = plans.shape_runs(records, over, layout, metas)
    outputs = [layout.slots[o] for o in output_ids]
    refills = None
    if refill_bytes is not None:
        refills = plans.plan_refills(records, steps, intos, over, layout, metas, outputs, spans, getters, *refill_bytes)
    return plans.Plan(backend, steps, layout, outputs, spans, refills, KeptForTest()), layout, over


class KeptForTest:
    """What a plan keeps of its last call, without a bound (local.KeptOutputs has one)."""

    def __init__(self):
        self.entries = {}

    def take(self, key):
        return self.entries.pop(key, None)

    def keep(self, key, arrays, nbytes):
        self.entries[key] = arrays


def test_liveness_lets_each_node_go_after_its_last_reader_and_keeps_the_callers():
    """A node read twice by one step is let go once; an output nothing reads goes right after its step; the
    inputs and outputs stay."""
    records = [(OPS["multiply"], (0, 0), (1,), {}), (OPS["add"], (1, 1), (2,), {}),
               (OPS["sin"], (0,), (3,), {}), (OPS["negative"], (2,), (4,), {})]
    assert plans.liveness(records, {0, 4}) == [[], [1], [3], [2]]


def test_a_chain_writes_in_place_over_its_own_buffers_and_shares_nothing_a_view_reads():
    """The chain runs in the buffer its first step makes: each later step writes over the input it reads last.
    A node a view-making row reads (reshape) is never written over."""
    meta = Meta((4,), dt.float64)
    records = _records()
    metas = dict.fromkeys(range(5), meta)
    plan, layout, over = _compile(records, [0], [4], metas)
    assert over == [None, 1, 2, 3]
    assert [step.store for step in plan.steps] == [layout.slots[1], None, None, None]
    assert len({layout.slots[node] for node in (1, 2, 3, 4)}) == 1
    x = np.arange(4.0)
    np.testing.assert_array_equal(plan.run([x])[0], -((x * 2.0 + 1.0) * 3.0))
    np.testing.assert_array_equal(x, np.arange(4.0))  # the caller's input is never written over

    viewed = records[:2] + [(OPS["reshape"], (2,), (5,), {"shape": (2, 2)})] + [(OPS["negative"], (2,), (4,), {})]
    metas[5] = Meta((2, 2), dt.float64)
    _, _, over = _compile(viewed, [0], [4, 5], metas)
    assert over == [None, 1, None, None]  # node 2 is read by reshape: its buffer may be a view's


def test_without_metas_nothing_is_written_in_place():
    backend = _backend()
    records = _records()
    _, intos = plans.look_up(records, backend.kernels, backend)
    assert plans.plan_in_place(records, intos, plans.liveness(records, {0, 4}), None) == [None] * 4


def test_equal_literals_share_a_slot_but_zeros_take_one_each():
    """A dict tells literal values apart, but 0.0 == -0.0: each zero takes its own slot. An ``into`` step's
    literals are converted once (NumPy's 0-d arrays); another step's stay Python scalars."""
    records = [(OPS["multiply"], (0, (2.0, F64)), (1,), {}), (OPS["multiply"], (1, (2.0, F64)), (2,), {}),
               (OPS["add"], (2, (0.0, F64)), (3,), {}), (OPS["add"], (3, (-0.0, F64)), (4,), {}),
               (OPS["pow"], (4, (2.0, F64)), (5,), {})]
    backend = _backend()
    _, intos = plans.look_up(records, backend.kernels, backend)
    intos[4] = None  # as a row without an into kernel
    layout = plans.assign_slots(records, [0], {}, [None] * 5, intos, backend.literal)
    assert layout.args[0][1] == layout.args[1][1] != layout.args[4][1]
    assert layout.args[2][1] != layout.args[3][1]
    preset = dict(layout.preset)
    assert type(preset[layout.args[0][1]]) is np.ndarray and preset[layout.args[4][1]] == 2.0
    assert type(preset[layout.args[4][1]]) is float


def test_a_missing_kernel_is_refused_by_name():
    backend = _backend()
    with pytest.raises(em.NotSupportedError, match=r"^negative: not supported on numpy$"):
        plans.look_up(_records(), {"multiply": np.multiply, "add": np.add}, backend)


def test_refills_write_an_output_made_afresh_into_the_last_calls():
    """An output an into kernel makes afresh is written, on the next call, into the array the last call
    returned when nothing else holds it; below ``least`` bytes, or above ``most``, nothing is refilled."""
    meta = Meta((4,), dt.float64)
    records = [(OPS["multiply"], (0, (2.0, F64)), (1,), {})]
    metas = {0: meta, 1: meta}
    assert _compile(records, [0], [1], metas, (33, 64))[0]._refills is None
    assert _compile(records, [0], [1], metas, (0, 31))[0]._refills is None
    plan, _, _ = _compile(records, [0], [1], metas, (32, 32))
    first = plan.run([np.arange(4.0)])[0]
    address = first.ctypes.data
    del first
    again = plan.run([np.ones(4)])[0]
    assert again.ctypes.data == address
    np.testing.assert_array_equal(again, np.full(4, 2.0))


def test_fuse_makes_one_loop_of_in_place_steps_and_keeps_the_others_whole():
    """Steps that store nothing and let nothing go are one list of (kernel, getter) pairs, equal pairs one
    object; any other step is a (kernel, fetch, store, ended) tuple."""
    plan, _, _ = _compile(_records(), [0], [4], dict.fromkeys(range(5), Meta((4,), dt.float64)))
    first, loop = plan._program
    assert type(first) is tuple and len(first) == 4
    assert type(loop) is list and [kernel for kernel, _ in loop] == [np.add, np.multiply, np.negative]
