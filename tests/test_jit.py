"""``em.jit`` at its edges: what the jitted function says of itself, calls without arrays,
arguments on two devices, results on the arguments' device, keyword arguments, what a graph
names its inputs and outputs, and outputs the function did not compute; what a compiled plan
holds (each value let go after its last use, a chain run in one buffer, a result written over the
last call's only where nothing else holds it, never by two threads at once); long runs split across
threads (blocks, errors, errstate, forks, the thresholds); and, generated from the op table, every
elementwise row jitted against eager execution, whole and split, its last replay into the result
of the one before."""

from __future__ import annotations

import functools
import gc
import os
import threading
import weakref

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import ember as em
from ember import dtypes as dt
from ember.backends.base import cpu_threads
from ember.engines import local, plans
from ember.ops import OPS

from .conftest import torch_available
from .generators import Drawer
from .recipes import EXAMPLES


def scaled(x, y, *, scale):
    """x · scale + y."""
    return x * scale + y


def test_a_jitted_function_keeps_its_name_doc_and_function():
    jitted = em.jit(scaled)
    assert (jitted.__name__, jitted.__doc__, jitted.__wrapped__) == ("scaled", "x · scale + y.", scaled)
    assert repr(jitted) == "<jit scaled: 0 captured>"
    assert em.jit(functools.partial(scaled, scale=2)).__name__ == "function"  # a callable without a name
    assert em.jit(lambda x: x).__name__ == "<lambda>"


def test_keyword_arrays_are_traced_and_the_graph_names_arguments_and_outputs():
    jitted = em.jit(scaled)
    x, y = em.asarray([1.0, 2.0]), em.asarray([10.0, 20.0])
    np.testing.assert_array_equal(em.asnumpy(jitted(x, y, scale=em.asarray(3.0))), [13.0, 26.0])
    np.testing.assert_array_equal(em.asnumpy(jitted(y, x, scale=em.asarray(0.5))), [6.0, 12.0])  # replayed
    assert repr(jitted) == "<jit scaled: 1 captured>"
    ((graph, _),) = jitted.graphs.values()
    assert [name for name, _, _ in graph.inputs] == ["arg0", "arg1", "arg2"] and [n for n, _ in graph.outputs] == ["out0"]


def test_a_call_without_arrays_runs_the_function_itself():
    jitted = em.jit(scaled)
    assert jitted(2, 3, scale=10) == 23 and not jitted.graphs


def test_a_function_returning_no_array_is_captured_once_and_returns_its_value():
    calls = []

    def note(x):
        calls.append(x.shape)
        return {"rows": x.shape[0]}
    jitted = em.jit(note)
    assert jitted(em.ones((3, 2))) == {"rows": 3} and jitted(em.ones((3, 2))) == {"rows": 3}
    assert calls == [(3, 2)]  # captured once; the replay has nothing to run


@pytest.mark.skipif(not torch_available(), reason="torch is not installed")
def test_results_stay_on_the_arguments_device_and_two_devices_are_refused():
    jitted = em.jit(lambda a, b: a * b)
    torch = em.device("torch:cpu")
    a, b = em.asarray([1.0, 2.0], device=torch), em.asarray([3.0, 4.0], device=torch)
    out = jitted(a, b)
    assert out.device is torch and em.asnumpy(out).tolist() == [3.0, 8.0]
    with pytest.raises(em.EmberError) as refused:
        jitted(a, em.asarray([3.0, 4.0]))
    assert str(refused.value) == "jit(<lambda>): array arguments are on different devices: numpy, torch:cpu"


def test_an_output_from_outside_the_function_is_refused_and_an_argument_may_come_back():
    outside = em.ones(2)
    with pytest.raises(em.CaptureError) as refused:
        em.jit(lambda x: (x * 2, outside))(em.zeros(2))
    assert str(refused.value) == ("jit(<lambda>): output 1 is not computed in the function (return it from outside "
                                  "the jitted function)")
    np.testing.assert_array_equal(em.asnumpy(em.jit(lambda x: x)(em.arange(3.0))), [0.0, 1.0, 2.0])


def chain(x, n_ops: int):
    """The benchmarks' elementwise chain (benchmarks/core.py): multiply, add, sin, subtract."""
    for _ in range(n_ops // 4):
        x = em.sin(x * 1.0001 + 0.5) - 0.25
    return x


def peak_bytes(function):
    """The most memory ``function()`` holds at once beyond what was held before (tracemalloc sees NumPy's
    buffers), and its result."""
    import tracemalloc
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = function()
        return tracemalloc.get_traced_memory()[1] - base, result
    finally:
        tracemalloc.stop()


def test_a_jitted_chain_on_a_large_array_peaks_no_higher_than_eager_execution():
    """A plan lets each intermediate go after its last use, as eager execution does: the 100-op chain on
    1,000,000 float32 holds what eager holds at its peak (a few 4 MB arrays), not a hundred of them."""
    x = em.asarray(np.random.default_rng(0).random(1_000_000, dtype=np.float32))
    jitted = em.jit(lambda x: chain(x, 100))
    jitted(x)  # captured and compiled before the measurement
    eager_peak, eager = peak_bytes(lambda: chain(x, 100))
    jit_peak, result = peak_bytes(lambda: jitted(x))
    assert jit_peak <= eager_peak + (64 << 10), f"jit held {jit_peak} bytes at its peak; eager {eager_peak}"
    assert jit_peak <= 4_000_000 + (64 << 10)  # on numpy, the chain runs in its one result buffer
    assert eager_peak < 4 * 4_000_000  # the bound is eager's few arrays, not a measurement artefact
    np.testing.assert_allclose(em.asnumpy(result), em.asnumpy(eager), rtol=2e-6)


@pytest.fixture
def split_small(monkeypatch):
    """Plans split every run of in-place steps with a known shape, two elements a block, on two threads."""
    monkeypatch.setattr(plans, "SPLIT_MIN", 1)
    monkeypatch.setattr(plans, "SPLIT_WORK", 1)
    monkeypatch.setattr(plans, "SPLIT_BLOCK", 2)
    monkeypatch.setattr(plans, "SPLIT_ALIGN", 1)
    monkeypatch.setattr(em.device("numpy").engine.backend, "threads", 2)


@pytest.fixture
def refill_small(monkeypatch):
    """Plans keep outputs of any size to write the next call's into (the generated tests' arrays are small)."""
    monkeypatch.setattr(local, "REFILL_MIN", 0)


def plan_of(jitted):
    """The local plan of a function jitted once."""
    (graph, _), = jitted.graphs.values()
    return em.device("numpy").engine._plans[graph]


def splits(jitted) -> list:
    """The runs of the plans of ``jitted`` that split across threads."""
    engine = em.device("numpy").engine
    return [item for graph, _ in jitted.graphs.values() for item in engine._plans[graph]._program
            if type(item) is plans.Split]


def test_a_long_run_on_a_large_array_splits_across_threads_and_gives_eager_values_exactly(monkeypatch):
    """The 100-op chain on 1M float32 and a two-input float64 chain on a 2-d array run block by block on two
    threads (NumPy's kernels let the GIL go), bit for bit what eager execution gives; a chain on 1,000
    elements, too short to pay for a thread, runs as one loop."""
    monkeypatch.setattr(em.device("numpy").engine.backend, "threads", 2)
    x = em.asarray(np.random.default_rng(0).random(1_000_000, dtype=np.float32))
    jitted = em.jit(lambda x: chain(x, 100))
    np.testing.assert_array_equal(em.asnumpy(jitted(x)), em.asnumpy(chain(x, 100)))
    np.testing.assert_array_equal(em.asnumpy(jitted(x)), em.asnumpy(chain(x, 100)))  # replayed
    (split,) = splits(jitted)
    assert (split.size, len(split.pairs), split.threads) == (1_000_000, 99, 2)  # the first op makes the buffer
    assert any(thread.name.startswith("ember-split") for thread in threading.enumerate())

    rng = np.random.default_rng(1)
    a, b = (em.asarray(rng.standard_normal((600, 500))) for _ in range(2))

    def two(a, b):
        y = a * b
        for _ in range(10):
            y = em.exp(-em.abs(y)) * b + a
        return y
    jitted_two = em.jit(two)
    np.testing.assert_array_equal(em.asnumpy(jitted_two(a, b)), em.asnumpy(two(a, b)))
    (split,) = splits(jitted_two)
    assert split.size == 300_000 and len(split.slots) == 3  # a, b and the plan's buffer, each taken by blocks

    small = em.jit(lambda x: chain(x, 1000))
    small(em.asarray(np.ones(1000, dtype=np.float32)))
    short = em.jit(lambda x: (x * 2.0 + 1.0) * 3.0)  # two in-place steps on 300K elements: under SPLIT_WORK
    short(a)
    assert not splits(small) and not splits(short)

    monkeypatch.setattr(em.device("numpy").engine.backend, "threads", 1)  # EMBER_NUM_THREADS=1: one loop, as before
    one = em.jit(lambda x: chain(x, 100))
    np.testing.assert_array_equal(em.asnumpy(one(x)), em.asnumpy(chain(x, 100)))
    assert not splits(one)


def _address(array) -> int:
    return em.asnumpy(array).__array_interface__["data"][0]


def test_a_call_writes_its_result_over_the_last_calls_result_where_nothing_else_holds_it(monkeypatch):
    """A result read and let go is the next call's buffer (no fresh memory, no page faults); a result
    that anything still sees — an Array, its NumPy array, a view of it, a memoryview, a weak
    reference — is never written over, and each call gives its own inputs' values. All plans keep
    ``REFILL_BYTES`` at most, the ones that ran last; a plan gone lets go of what it kept; outputs under
    ``REFILL_MIN`` are not kept."""
    rng = np.random.default_rng(0)
    x, other = (em.asarray(rng.random(1_000_000, dtype=np.float32)) for _ in range(2))

    def function(x):  # one fresh buffer, then in place (not the chain: it converges, so inputs would not tell apart)
        return em.exp(x * 0.5) * 2.0 + x
    jitted = em.jit(function)
    expected, expected_other = em.asnumpy(function(x)), em.asnumpy(function(other))
    assert not (expected == expected_other).any()
    first = _address(jitted(x))  # the Array and its NumPy array are let go at once
    again = jitted(x)
    assert _address(again) == first
    np.testing.assert_array_equal(em.asnumpy(again), expected)
    del again

    def kept(hold):  # what `hold` keeps of a result must survive a call on other inputs
        result = jitted(x)
        held = hold(result)
        del result
        np.testing.assert_array_equal(em.asnumpy(jitted(other)), expected_other)
        return held
    assert (em.asnumpy(kept(lambda y: y)) == expected).all()
    assert (kept(em.asnumpy) == expected).all()
    assert (kept(lambda y: em.asnumpy(y)[::2]) == expected[::2]).all()
    assert (np.frombuffer(kept(lambda y: memoryview(em.asnumpy(y))), np.float32) == expected).all()
    reference = kept(lambda y: weakref.ref(em.asnumpy(y)))
    assert reference() is None or (reference() == expected).all()

    backend, owner = x.device.engine.backend, np.zeros(4)
    assert backend.unshared((np.zeros(4),))  # held by the tuple alone
    assert not backend.unshared((owner,)) and not backend.unshared((owner[1:],))  # a view's memory is its owner's

    (graph, _), = jitted.graphs.values()
    (refilled,) = [item for item in x.device.engine._plans[graph]._refills[1] if type(item) is not list or item]
    assert type(refilled) is (plans.Split if x.device.engine.backend.threads > 1 else list)  # all four steps in place

    monkeypatch.setattr(local, "REFILL_BYTES", 6_000_000)  # room for one 4 MB result of all plans, not two
    another = em.jit(lambda x: em.exp(x * 0.25) * 3.0 - x)
    jitted(x), another(x)  # the second result pushes the first out
    assert plan_of(another)._key in local.KEPT and plan_of(jitted)._key not in local.KEPT
    assert local.KEPT.nbytes <= 6_000_000
    key = plan_of(another)._key
    del another
    gc.collect()
    assert key not in local.KEPT  # a plan gone, what it kept goes with it

    monkeypatch.setattr(local, "REFILL_BYTES", 4_000_000 - 1)  # one byte less than the result
    over = em.jit(function)
    np.testing.assert_array_equal(em.asnumpy(over(x)), expected)
    assert plan_of(over)._refills is None
    small = em.jit(function)  # 128 KiB less 4 bytes: malloc hands such blocks back warm, nothing to keep
    small(em.asarray(np.ones((128 << 10) // 4 - 1, dtype=np.float32)))
    assert plan_of(small)._refills is None


def test_two_threads_calling_one_plan_never_write_into_one_buffer():
    """The last call's result is taken out of what plans keep, under its lock: a thread that runs the plan while
    another has just found that result free (and not yet written over it) makes a buffer of its own, so each
    thread gets its own inputs' values."""
    jitted = em.jit(lambda x: em.sin(x * 2.0) + 1.0)
    inputs = [em.asarray(np.full(40_000, float(i))) for i in range(2)]  # 320 KB results: kept (REFILL_MIN)
    expected = [em.asnumpy(em.sin(x * 2.0) + 1.0) for x in inputs]
    jitted(inputs[0])  # compiled; its result let go
    (graph, _), = jitted.graphs.values()
    plan = inputs[0].device.engine._plans[graph]
    checked, resumed, caller = threading.Event(), threading.Event(), threading.current_thread()
    unshared = plan._unshared

    def paused(arrays):  # the helper stops right after its check, where a switch of threads could stop it
        answer = unshared(arrays)
        if threading.current_thread() is not caller:
            checked.set()
            resumed.wait(10)
        return answer
    plan._unshared = paused
    results = {}
    helper = threading.Thread(target=lambda: results.setdefault(0, em.asnumpy(jitted(inputs[0]))))
    helper.start()
    assert checked.wait(10)
    results[1] = em.asnumpy(jitted(inputs[1]))  # runs while the helper holds the last result, unwritten
    resumed.set()
    helper.join()
    np.testing.assert_array_equal(results[0], expected[0])
    np.testing.assert_array_equal(results[1], expected[1])


def _adding(slot: int, value: float) -> tuple:
    """A plan's step adding ``value`` to slot ``slot`` in place."""
    def fetch(values):
        return values[slot], value, values[slot]
    return plans.Step(np.add, fetch, None, (), None, fetch)


def test_in_place_steps_over_two_shapes_in_turn_split_apart(split_small):
    """Consecutive in-place steps over arrays of two shapes (steps a plan could order so) make one split each:
    a block of one shape's arrays is never taken of the other's."""
    steps = [_adding(0, 1.0), _adding(1, 10.0), _adding(0, 2.0), _adding(1, 20.0)]
    spans = {0: ((6,), {0}), 1: ((4,), {1}), 2: ((6,), {0}), 3: ((4,), {1})}
    program = plans.fuse(steps, spans, 2)
    assert [type(item) for item in program] == [plans.Split] * 4 and [item.size for item in program] == [6, 4, 6, 4]
    values = [np.zeros(6), np.zeros(4)]
    for split in program:
        assert split.run(values) is None
    np.testing.assert_array_equal(values[0], np.full(6, 3.0))
    np.testing.assert_array_equal(values[1], np.full(4, 30.0))


def test_a_split_run_over_arrays_not_in_c_order_runs_whole(split_small):
    """A Fortran-ordered argument makes a Fortran-ordered result, and a strided view has no flat blocks: a run over
    either goes the plain way (a flat block of such an array would be a copy, and a write into it lost)."""
    host, strided = np.arange(20.0).reshape(4, 5), np.arange(40.0).reshape(4, 10)[:, ::2]
    x = em.asarray(np.asfortranarray(host))  # x * 2.0, the buffer the run writes over, is in Fortran order too
    y = em.asarray(strided)
    function = em.jit(lambda x, y: (x * 2.0 + y) * y)
    expected = (host * 2.0 + strided) * strided
    np.testing.assert_array_equal(em.asnumpy(function(x, y)), expected)
    np.testing.assert_array_equal(em.asnumpy(function(x, y)), expected)
    assert splits(function)


def test_a_split_run_raises_a_failing_step_with_its_inputs_and_runs_again(split_small):
    """A kernel failing in some block is named with the whole arrays it read, and the plan runs again after."""
    jitted = em.jit(lambda x, y: (x * 2.0) / y + 1.0)
    x = em.asarray(np.arange(1.0, 9.0))
    with np.errstate(divide="raise"), pytest.raises(em.ExecutionError, match=r"^divide: divide by zero .*"
                                                   r"\(inputs: \(8,\) float64, \(8,\) float64\)"):
        jitted(x, em.zeros(8))
    assert splits(jitted)
    np.testing.assert_array_equal(em.asnumpy(jitted(x, em.full(8, 2.0))), np.arange(1.0, 9.0) + 1.0)


def test_every_thread_of_a_split_run_works_under_the_callers_errstate(split_small):
    """Each thread takes one block (a barrier holds the first until the second has taken its own) and sees the
    caller's ``np.errstate``: a worker runs in a copy of the caller's context."""
    barrier, seen = threading.Barrier(2, timeout=30), {}

    def kernel(x, out):
        seen[threading.get_ident()] = np.geterr()["divide"]
        barrier.wait()
        np.divide(x, 0.0, out=out)

    values = [np.ones(4)]
    split = plans.Split([(kernel, lambda values: (values[0], values[0]))], [0], 4, 2)
    with np.errstate(divide="ignore"):
        assert split.run(values) is None
    assert len(seen) == 2 and set(seen.values()) == {"ignore"}
    assert np.isinf(values[0]).all()


def _split_in_child(queue):
    x = em.asarray(np.random.default_rng(0).random(1_000_000, dtype=np.float32))
    queue.put(bool(np.array_equal(em.asnumpy(em.jit(lambda x: chain(x, 100))(x)), em.asnumpy(chain(x, 100)))))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_splits_with_threads_of_its_own(monkeypatch):
    """The parent's pool has threads the child lacks: the child makes a pool of its own, where reusing the parent's
    would leave its blocks unworked and the run waiting for ever. The lock of the outputs plans keep, held
    while forking (as another thread of the parent may hold it), is a fresh one in the child."""
    import multiprocessing
    monkeypatch.setattr(em.device("numpy").engine.backend, "threads", 2)
    x = em.asarray(np.random.default_rng(0).random(1_000_000, dtype=np.float32))
    em.jit(lambda x: chain(x, 100))(x)
    assert plans._POOL  # the parent's pool is made
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_split_in_child, args=(queue,))
    with local.KEPT._lock:
        child.start()
    try:
        assert queue.get(timeout=60) is True
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_a_step_failing_in_a_helper_thread_is_the_runs_failure(split_small):
    """Only the helper's block raises (a barrier makes each thread take one block): the run reports it."""
    barrier, caller = threading.Barrier(2, timeout=30), threading.get_ident()

    def kernel(x, out):
        barrier.wait()
        if threading.get_ident() != caller:
            raise ValueError("in the helper's block")
        np.negative(x, out=out)

    def fetch(values):
        return values[0], values[0]
    split = plans.Split([(kernel, fetch)], [0], 4, 2)
    failed_kernel, failed_fetch, error = split.run([np.ones(4)])
    assert (failed_kernel, failed_fetch, str(error)) == (kernel, fetch, "in the helper's block")


def test_the_split_threads_come_from_the_cpus_or_ember_num_threads(monkeypatch):
    monkeypatch.setenv("EMBER_NUM_THREADS", "3")
    assert cpu_threads() == 3
    monkeypatch.setenv("EMBER_NUM_THREADS", "0")
    assert cpu_threads() == 1
    monkeypatch.setenv("EMBER_NUM_THREADS", "many")
    with pytest.raises(em.ArgumentError, match="^EMBER_NUM_THREADS: expected a whole number of threads, got 'many'$"):
        cpu_threads()
    monkeypatch.delenv("EMBER_NUM_THREADS")
    assert cpu_threads() == (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())


def test_a_plan_keeps_what_the_caller_holds_while_letting_intermediates_go():
    """An argument returned as is, an intermediate both returned and read later, a value read twice by one op and
    an output nothing reads (qr's Q) all come back right, call after call."""
    def function(x):
        doubled = x * 2.0
        square = doubled * doubled
        r = em.linalg.qr(x).R
        return x, square + doubled, doubled, em.abs(r[0, 0]) + doubled
    jitted = em.jit(function)
    host = np.array([[3.0, 1.0], [4.0, 2.0]])
    for _ in range(2):
        x, out, doubled, after = jitted(em.asarray(host))
        np.testing.assert_array_equal(em.asnumpy(x), host)
        np.testing.assert_array_equal(em.asnumpy(out), (2 * host) ** 2 + 2 * host)
        np.testing.assert_array_equal(em.asnumpy(doubled), 2 * host)
        np.testing.assert_allclose(em.asnumpy(after), 5.0 + 2 * host)


def test_a_plan_shares_its_literals_and_getters_and_names_a_failing_step_inside_a_run():
    """A replay touches little memory: one slot per literal value (but each use of ±0.0 its own), one getter
    per list of slots. A kernel failing inside a run of in-place steps is named with its inputs."""
    def function(x, y):
        z = x * 2.0
        for _ in range(3):
            z = (z + 1.0) * 2.0
        z = z / y                                  # in place, over z's buffer
        return ((z - 0.0) * -0.0) + float("nan")  # −0.0 and NaN kept apart from 0.0
    jitted = em.jit(function)
    x, y = em.asarray([1.0, -2.0, 3.0]), em.asarray([2.0, 4.0, 8.0])
    expected = function(x, y)
    np.testing.assert_array_equal(em.asnumpy(jitted(x, y)), em.asnumpy(expected))
    (graph, _), = jitted.graphs.values()
    plan = x.device.engine._plans[graph]
    literals = [value for _, value in plan.preset]
    assert sorted(float(v) for v in literals if v == v) == [-0.0, 0.0, 1.0, 2.0]
    assert [np.signbit(v) for v in literals if v == 0] in ([False, True], [True, False])
    runs = [item for item in plan._program if type(item) is list]
    assert runs and len({id(pair) for run in runs for pair in run}) < sum(map(len, runs))  # pairs shared
    assert len({id(step[1]) for step in plan.steps}) < len(plan.steps)  # getters shared
    with np.errstate(divide="raise"), pytest.raises(em.ExecutionError, match=r"^divide: divide by zero .*"
                                                   r"\(inputs: \(3,\) float64, \(3,\) float64\)"):
        jitted(x, em.asarray([2.0, 0.0, 8.0]))
    np.testing.assert_array_equal(em.asnumpy(jitted(x, y)), em.asnumpy(expected))  # the plan still runs


def test_no_step_writes_over_a_buffer_a_view_shares():
    """A step writes its result over an input only where no view can share the input's buffer: not over an
    array a view-making row read (``reshape`` returns a view of it), nor over such a row's result (itself
    a view of its input). Both would change a view the caller gets back."""
    def over_the_base(x):
        doubled = x * 2.0
        return em.reshape(doubled, (2, 3)), doubled + 1.0  # the add is doubled's last reader

    def over_the_view(x):
        doubled = x * 2.0
        return doubled, em.reshape(doubled, (6,)) + 1.0  # the add is the view's last reader
    host = np.arange(6.0)
    for function, x in ((over_the_base, em.asarray(host)), (over_the_view, em.asarray(host.reshape(2, 3)))):
        jitted = em.jit(function)
        for _ in range(2):
            for got, want in zip(jitted(x), function(x)):
                np.testing.assert_array_equal(em.asnumpy(got), em.asnumpy(want), err_msg=function.__name__)


def test_a_jitted_chain_of_ops_making_fresh_arrays_peaks_no_higher_than_eager_execution():
    """Rows that write nothing in place (matmul) let their inputs go after their last use too: twenty
    products of a 1 MB array hold what eager execution holds at once, not twenty arrays."""
    rng = np.random.default_rng(0)
    x, w = em.asarray(rng.standard_normal((2048, 64))), em.asarray(rng.standard_normal((64, 64)) / 8)

    def products(x, w):
        for _ in range(20):
            x = em.matmul(x, w)
        return x
    jitted = em.jit(products)
    jitted(x, w)
    eager_peak, eager = peak_bytes(lambda: products(x, w))
    jit_peak, result = peak_bytes(lambda: jitted(x, w))
    assert jit_peak <= eager_peak + (64 << 10), f"jit held {jit_peak} bytes at its peak; eager {eager_peak}"
    assert eager_peak < 4 * (1 << 20)
    np.testing.assert_allclose(em.asnumpy(result), em.asnumpy(eager), rtol=1e-12)


def test_short_in_place_runs_over_two_shapes_in_a_row_run_as_one_loop():
    """With threads to split over, in-place steps over arrays of two shapes in turn are runs of their own shapes;
    too short to split, they are one loop again, in their order."""
    steps = [_adding(0, 1.0), _adding(1, 10.0), _adding(0, 2.0)]
    spans = {0: ((6,), {0}), 1: ((4,), {1}), 2: ((6,), {0})}
    (loop,) = plans.fuse(steps, spans, 2)
    assert [fetch for _, fetch in loop] == [step[1] for step in steps]
    values = [np.zeros(6), np.zeros(4)]
    for kernel, fetch in loop:
        kernel(*fetch(values))
    np.testing.assert_array_equal(values[0], np.full(6, 3.0))
    np.testing.assert_array_equal(values[1], np.full(4, 10.0))


def test_a_run_splits_from_exactly_split_min_elements_and_split_work_element_ops(monkeypatch):
    """The thresholds are inclusive: a run over ``SPLIT_MIN`` elements doing ``SPLIT_WORK`` element-ops splits;
    an element fewer, or a step fewer, does not."""
    monkeypatch.setattr(em.device("numpy").engine.backend, "threads", 2)
    monkeypatch.setattr(plans, "SPLIT_MIN", 8)
    monkeypatch.setattr(plans, "SPLIT_WORK", 16)

    def function(x):
        return (x * 2.0 + 1.0) - 3.0  # one fresh step, then two in place
    for n, steps, splits_expected in ((8, function, True), (7, function, False),
                                      (8, lambda x: x * 2.0 + 1.0, False)):
        jitted = em.jit(steps)
        x = em.asarray(np.arange(float(n)))
        np.testing.assert_array_equal(em.asnumpy(jitted(x)), em.asnumpy(steps(x)))
        assert bool(splits(jitted)) is splits_expected, (n, splits_expected)


def test_what_plans_keep_counts_each_result_once_up_to_its_bound_inclusive(monkeypatch):
    """Keeping a key again replaces what it kept, counted once; results adding up to exactly ``REFILL_BYTES``
    are all kept, and past it the oldest go first. A result of exactly ``REFILL_MIN`` bytes, and a plan whose
    results fill ``REFILL_BYTES`` exactly, are written over the next call."""
    kept = local.KeptOutputs()
    monkeypatch.setattr(local, "REFILL_BYTES", 100)
    kept.keep("a", ("first",), 30)
    kept.keep("a", ("again",), 40)
    kept.keep("b", ("b",), 60)
    assert kept.nbytes == 100 and "a" in kept and "b" in kept
    kept.keep("c", ("c",), 1)
    assert kept.nbytes == 61 and "a" not in kept and kept.take("b") == ("b",) and kept.nbytes == 1

    monkeypatch.setattr(local, "KEPT", local.KeptOutputs())
    monkeypatch.setattr(local, "REFILL_BYTES", 4_000_000)
    x = em.asarray(np.random.default_rng(0).random(1_000_000, dtype=np.float32))
    whole = em.jit(lambda x: em.exp(x * 0.5) + x)
    for _ in range(3):
        result = whole(x)
        address = _address(result)
        del result
    assert plan_of(whole)._refills is not None and plan_of(whole)._key in local.KEPT
    assert local.KEPT.nbytes == 4_000_000 and _address(whole(x)) == address
    least = em.jit(lambda x: em.exp(x * 0.5) + x)
    least(em.asarray(np.ones(local.REFILL_MIN // 4, dtype=np.float32)))
    assert plan_of(least)._refills is not None


def test_a_plan_keeps_only_results_it_made_afresh_to_write_over(monkeypatch):
    """Of its last call a plan keeps the results its steps made afresh, to write the next call's into — not an
    intermediate it made afresh and let go (nothing to write into: the call would make fresh buffers)."""
    monkeypatch.setattr(local, "REFILL_MIN", 0)
    monkeypatch.setattr(local, "KEPT", local.KeptOutputs())

    def function(x, y):
        return x * 2.0 + y * 3.0  # x * 2.0 made afresh and written over with the sum; y * 3.0 made afresh, let go
    jitted = em.jit(function)
    x, y = em.asarray(np.arange(4.0)), em.asarray(np.arange(4.0, 8.0))
    for _ in range(3):
        np.testing.assert_array_equal(em.asnumpy(jitted(x, y)), em.asnumpy(function(x, y)))
    plan = plan_of(jitted)
    (spare,) = local.KEPT.take(plan._key)
    assert len(plan._refills[0]) == 1 and type(spare) is np.ndarray and spare.shape == (4,)


def test_the_steps_after_a_split_run_run_too(split_small):
    """A split run is one item of its plan: the steps after it (a reduction, a product) run after it."""
    def function(x):
        y = (x * 2.0 + 1.0) * 3.0
        return em.sum(y), em.matmul(y, y)
    jitted = em.jit(function)
    x = em.asarray(np.arange(8.0))
    for _ in range(2):
        for got, want in zip(jitted(x), function(x)):
            np.testing.assert_array_equal(em.asnumpy(got), em.asnumpy(want))
    assert splits(jitted)


def test_a_failing_step_is_named_with_its_own_inputs_whatever_the_plan_ran(monkeypatch, split_small):
    """The step named is the one that failed, not another running the same kernel; so in a plan writing over
    its last result (held by the caller, or let go), and in a split run over arrays not in C order."""
    monkeypatch.setattr(local, "REFILL_MIN", 0)
    x, u, good, zero = (em.asarray(a) for a in (np.arange(3.0), np.ones((2, 2)), np.ones((2, 2)), np.zeros((2, 2))))
    jitted = em.jit(lambda x, u, v: (x / 2.0, u / v))
    message = r"^divide: divide by zero .*\(inputs: \(2, 2\) float64, \(2, 2\) float64\)$"
    with np.errstate(divide="raise"):
        held = jitted(x, u, good)  # held: the next call makes its own buffers
        with pytest.raises(em.ExecutionError, match=message):
            jitted(x, u, zero)
        del held
        jitted(x, u, good)  # let go: the next call writes over it
        with pytest.raises(em.ExecutionError, match=message):
            jitted(x, u, zero)
        fortran = em.asarray(np.asfortranarray(np.arange(1.0, 7.0).reshape(2, 3)))
        strided = em.jit(lambda x, y: (x * 2.0) / y + 1.0)
        with pytest.raises(em.ExecutionError, match=r"^divide: divide by zero .*\(inputs: \(2, 3\) float64, \(2, 3\) float64\)$"):
            strided(fortran, em.zeros((2, 3)))
    assert splits(strided)


def test_a_jitted_function_may_make_arrays_of_its_own():
    """Arrays the function makes from values on its argument's device (constants of its graph) are uploaded
    once for the device and read by every call."""
    def function(x):
        return x * em.asarray([1.0, 2.0, 3.0], device=x.device) + 1.0
    jitted = em.jit(function)
    x = em.asarray([1.0, 1.0, 2.0])
    for _ in range(2):
        np.testing.assert_array_equal(em.asnumpy(jitted(x)), em.asnumpy(function(x)))


def test_the_split_pool_grows_with_the_threads_asked(monkeypatch, split_small):
    """The worker pool is made for the threads a split run asks, and made again, larger, when a run asks more."""
    backend = em.device("numpy").engine.backend
    x = em.asarray(np.arange(16.0))
    for threads in (2, 3):
        monkeypatch.setattr(backend, "threads", threads)
        jitted = em.jit(lambda x: (x * 2.0 + 1.0) * 3.0)
        np.testing.assert_array_equal(em.asnumpy(jitted(x)), (np.arange(16.0) * 2.0 + 1.0) * 3.0)
        assert plans._POOL[0]._max_workers >= threads - 1


def test_the_numpy_device_counts_the_ops_it_runs_eager_or_jitted():
    """``em.stats`` counts each op the device ran: an op of a known result, one sized as it runs, and each step
    of a jitted plan at every call."""
    x = em.asarray(np.array([3.0, 1.0, 3.0]))
    jitted = em.jit(lambda x: (x * 2.0 + 1.0) - 3.0)
    jitted(x)
    start = em.stats("numpy")["ops"]
    em.asnumpy(x * 2.0 + 1.0)
    assert em.stats("numpy")["ops"] == start + 2
    em.asnumpy(em.unique_values(x))
    assert em.stats("numpy")["ops"] == start + 3
    jitted(x), jitted(x)
    assert em.stats("numpy") == {"ops": start + 3 + 2 * 3, "round_trips": 0, "bytes_up": 0, "bytes_down": 0}


ELEMENTWISE = sorted(name for name, op in OPS.items() if op.elementwise)


def _tolerance(dtype):
    if dtype in (dt.float32, dt.complex64):
        return {"rtol": 2e-6, "atol": 0}
    if dtype in (dt.float64, dt.complex128):
        return {"rtol": 1e-12, "atol": 0}
    return {"rtol": 0, "atol": 0}


def test_every_row_made_by_the_elementwise_factories_is_elementwise():
    assert {name for name, op in OPS.items() if op.family.startswith("elementwise")} == set(ELEMENTWISE)
    assert len(ELEMENTWISE) > 60 and "add" in ELEMENTWISE and "where" not in ELEMENTWISE


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("name", ELEMENTWISE)
@given(data=st.data())
def test_a_jitted_elementwise_row_equals_eager_execution(name, split, data, request):
    """Each elementwise row applied three times — where the result has the first input's shape and dtype, the
    second and third write over the first's buffer — and, for a binary row, twice with a Python scalar (a
    literal the plan converts once): jitted and eager give the same dtype, shape and values (NaN where NaN);
    ``split``: with the in-place runs split into blocks of two elements on two threads."""
    request.getfixturevalue("refill_small")
    if split:
        request.getfixturevalue("split_small")
    device = em.device("numpy")
    arrays, _ = EXAMPLES[name](Drawer(data, em.__array_namespace_info__().dtypes(device=device).values()))
    function = getattr(em, name)

    def thrice(*xs):
        y = function(*xs)
        for _ in range(2):
            if (y.shape, y.dtype) == (xs[0].shape, xs[0].dtype):
                y = function(y, *xs[1:])
        return y
    cases = [(thrice, [em.asarray(a) for a in arrays])]
    if len(arrays) == 2 and arrays[1].size:
        scalar = arrays[1].flat[0].item()
        cases.append((lambda x: function(function(x, scalar), scalar), [em.asarray(arrays[0])]))
    for function_of, xs in cases:
        try:
            expected = em.asnumpy(function_of(*xs))
        except em.EmberError:  # a scalar the namespace refuses beside this dtype (a float beside integers)
            assume(False)
        jitted = em.jit(function_of)
        tolerance = _tolerance(dt.FROM_NUMPY[expected.dtype])
        held = em.asnumpy(jitted(*xs))  # captured; held through the replays, so never written over
        for _ in range(2):  # replayed, the second time into the first replay's result, let go
            actual = em.asnumpy(jitted(*xs))
            assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape)
            np.testing.assert_allclose(actual, expected, equal_nan=True, **tolerance, err_msg=name)
            del actual
        np.testing.assert_allclose(held, expected, equal_nan=True, **tolerance, err_msg=name)
