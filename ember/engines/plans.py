"""Compiled local plans: a graph's records turned, pass by pass, into kernel calls over a list of slots.

A record is ``(row, refs, output ids, attrs)``, its refs node ids or ``(value, dtype name)``
literals. :meth:`LocalEngine.compile <ember.engines.local.LocalEngine.compile>` runs the passes in
this order, each over the named results of those before it:

- :func:`look_up`: each record's kernel in the backend's table, and its ``into`` kernel
  (:meth:`Backend.into`) where the row is elementwise;
- :func:`liveness`: per step, the nodes let go right after it (read for the last time there, or
  made there and read by nothing), none of the caller's;
- :func:`plan_in_place`: per step, the dying input its result is written over, or None;
- :func:`assign_slots`: a :class:`Layout`, the slot of every node and literal (equal literals
  share one) and each step's argument slots;
- :func:`make_steps`: one :class:`Step` per record; :func:`shape_runs`: the in-place steps whose
  arrays share one shape, which a run may split into blocks;
- :func:`plan_refills`: the :class:`Refills`, the steps again with each output made afresh written
  into the last call's;
- :func:`fuse` (in :class:`Plan`): the steps as a replay runs them, runs of in-place steps as one
  list of ``(kernel, getter)`` pairs, or a :class:`Split` across threads.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import math
import operator
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from ..errors import EmberError, ExecutionError, IndexingError, NotSupportedError
from ..ops.records import LITERAL_METAS
from ..ops.table import fmt_shape


class Step(NamedTuple):
    """One kernel call of a plan: ``kernel(*fetch(values))`` runs it."""

    kernel: Callable
    fetch: Callable   # the values' tuple of its arguments (and of the slot it writes into, where ``store`` is None)
    store: Any        # the slot of its one output, a tuple of slots for a row with several, or None: written in place
    ended: tuple      # the slots let go after it
    row: Any          # its op row, and ``reads(values)`` its inputs: what an error names
    reads: Callable


class Layout(NamedTuple):
    """Where a plan keeps its values, one slot each: node id -> slot (``slots``), per step its
    arguments' slots (``args``, literals' included) and its outputs' (``stores``), the ``(slot,
    value)`` pairs set at each call before the inputs (``preset``: constants, literals), the
    inputs' slots and the number of slots."""

    slots: dict
    args: list
    stores: list
    preset: list
    inputs: list
    size: int


class Refills(NamedTuple):
    """A plan's outputs made afresh, written over its last call's (their ``slots``): the ``steps``
    writing into those, the ``spans`` of their in-place steps, and the outputs' bytes."""

    slots: tuple
    steps: list
    spans: dict
    nbytes: int


def look_up(records: list, table: dict, backend) -> tuple[list, list]:
    """Each record's kernel in the kernel ``table`` (the engine's: its backend's kernels), and its
    ``into`` kernel (None but for an elementwise row ``backend`` has one for); NotSupportedError
    names the first row without a kernel."""
    kernels = []
    for row, _, _, _ in records:
        kernel = table.get(row.name)
        if kernel is None:
            raise NotSupportedError(f"{row.name}: not supported on {backend.device_name}")
        kernels.append(kernel)
    return kernels, [backend.into(row.name) if row.elementwise else None for row, _, _, _ in records]


def liveness(records: list, kept: set) -> list[list]:
    """Per step, the nodes let go right after it, as eager execution lets an array go with its last
    name: those it reads for the last time (in the order it reads them), then those it makes that
    nothing reads. The ``kept`` nodes (the caller's inputs, constants and outputs) stay."""
    last = {}  # node -> the index of the last step that reads it
    for index, (_, refs, _, _) in enumerate(records):
        for ref in refs:
            if type(ref) is int:
                last[ref] = index
    dying = []
    for index, (_, refs, outs, _) in enumerate(records):
        ending = [r for r in dict.fromkeys(refs) if type(r) is int and last[r] == index and r not in kept]
        dying.append(ending + [o for o in outs if o not in last and o not in kept])
    return dying


def plan_in_place(records: list, intos: list, dying: list, metas: dict | None) -> list:
    """Per step, the input its result is written over, or None. Given every node's meta, a step
    with an ``into`` kernel and one output writes over the first input it reads last (``dying``)
    of its result's meta whose buffer is the plan's own — made by such a kernel — and shared by no
    view — read by no other kind, which may return a view of it. A chain then runs in one buffer."""
    over: list = [None] * len(records)
    if metas is None:
        return over
    shared = {ref for (_, refs, _, _), into in zip(records, intos) if into is None for ref in refs if type(ref) is int}
    owned = set()  # nodes made by an into kernel
    for index, ((_, refs, outs, _), into) in enumerate(zip(records, intos)):
        if into is None or len(outs) != 1:
            continue
        meta, ending = metas.get(outs[0]), dying[index]
        over[index] = next((r for r in dict.fromkeys(refs) if type(r) is int and r in ending and r in owned
                            and r not in shared and metas.get(r) == meta), None)
        owned.add(outs[0])
    return over


def assign_slots(records: list, input_ids: list, constants: dict, over: list, intos: list, literal) -> Layout:
    """A slot per node — the constants', the inputs', then each step's in order; a result written
    over an input takes that input's slot — and per literal value: a dict tells values apart, so
    zeros (0.0 == -0.0) take a slot each. A step with an ``into`` kernel takes its literals as
    ``literal(value, dtype)`` gives them (:meth:`Backend.literal`), converted once, here."""
    slots: dict = {}
    preset = [(slots.setdefault(node, len(slots)), value) for node, value in constants.items()]
    inputs = [slots.setdefault(node, len(slots)) for node in input_ids]
    literals: dict = {}  # (type, value, dtype name, converted) -> slot
    args, stores = [], []
    for index, (_, refs, outs, _) in enumerate(records):
        converted, places = intos[index] is not None, []
        for ref in refs:
            if type(ref) is int:
                places.append(slots.setdefault(ref, len(slots)))
                continue
            value = ref[0]
            key = (type(value), value, ref[1], converted) if value else None
            place = literals.get(key) if key is not None else None
            if place is None:
                place = len(slots)
                slots[("literal", place)] = place
                preset.append((place, literal(value, LITERAL_METAS[ref[1]].dtype) if converted else value))
                if key is not None:
                    literals[key] = place
            places.append(place)
        if over[index] is not None:
            slots[outs[0]] = slots[over[index]]
        stores.append(tuple(slots.setdefault(o, len(slots)) for o in outs))
        args.append(places)
    return Layout(slots, args, stores, preset, inputs, len(slots))


class Getters(dict):
    """One getter per tuple of slots (``getters[slots]``): a chain's thousand ``x * 1.0001`` read
    one array through one getter, so a replay touches few objects."""

    def __missing__(self, key: tuple):
        fetch = self[key] = getter(key)
        return fetch


def getter(indices) -> Callable:
    """A C-speed function returning the tuple of ``values[i]`` for the given indices."""
    if len(indices) == 1:
        index = indices[0]
        return lambda values: (values[index],)
    if not indices:
        return lambda values: ()
    return operator.itemgetter(*indices)


def make_steps(records: list, kernels: list, intos: list, over: list, dying: list, layout: Layout,
               getters: Getters) -> list[Step]:
    """A :class:`Step` per record: its ``into`` kernel writing over the input ``over`` names, or its
    kernel with the record's attributes bound storing its outputs; each lets its ``dying`` go."""
    steps = []
    for index, (row, refs, outs, attrs) in enumerate(records):
        args, stores, ending, target = layout.args[index], layout.stores[index], list(dying[index]), over[index]
        here = {ref: place for ref, place in zip(refs, args) if type(ref) is int}  # the slots as this step sees them
        here.update(zip(outs, stores))
        reads = getters[tuple(args)]
        if target is not None:
            ending.remove(target)
            kernel, fetch, store = intos[index], getters[(*args, stores[0])], None
        else:
            kernel, fetch, store = kernels[index], reads, stores if row.multiple or len(stores) != 1 else stores[0]
            if attrs:
                kernel = functools.partial(kernel, **attrs)
        steps.append(Step(kernel, fetch, store, tuple(here[node] for node in ending), row, reads))
    return steps


def _span(metas: dict, meta, nodes: list, places, target: int) -> tuple | None:
    """``(shape, slots)`` of a step writing into slot ``target`` whose arrays (``nodes``, in slots
    ``places``) all have its result's shape: a run of such steps may split into blocks; else None."""
    if meta is not None and all(getattr(metas.get(node), "shape", None) == meta.shape for node in nodes):
        return meta.shape, frozenset([target, *places])
    return None


def shape_runs(records: list, over: list, layout: Layout, metas: dict | None) -> dict:
    """In-place step index -> ``(shape, slots)``, where its arrays share its result's shape."""
    spans = {}
    for index, target in enumerate(over):
        if target is not None:
            _, refs, outs, _ = records[index]
            nodes = [ref for ref in refs if type(ref) is int]
            places = [place for ref, place in zip(refs, layout.args[index]) if type(ref) is int]
            found = _span(metas, metas.get(outs[0]), nodes, places, layout.stores[index][0])
            if found is not None:
                spans[index] = found
    return spans


def plan_refills(records: list, steps: list, intos: list, over: list, layout: Layout, metas: dict | None,
                 outputs: list, spans: dict, getters: Getters, least: int, most: int) -> Refills | None:
    """The steps again, where each output that an ``into`` kernel makes afresh (no attributes, one
    output of a known size) is written into the same output of the call before; None unless there
    are some, holding ``least`` to ``most`` bytes in all."""
    if metas is None:
        return None
    ends, refilled = set(outputs), []
    for index, ((_, _, outs, attrs), step) in enumerate(zip(records, steps)):
        if (intos[index] is not None and over[index] is None and not attrs and type(step.store) is int
                and layout.slots[outs[0]] in ends and getattr(metas.get(outs[0]), "size", None) is not None):
            refilled.append(index)
    nbytes = sum(metas[records[index][2][0]].nbytes for index in refilled)
    if not refilled or not least <= nbytes <= most:
        return None
    again, again_spans = list(steps), dict(spans)
    for index in refilled:
        step, (_, refs, outs, _) = steps[index], records[index]
        again[index] = step._replace(kernel=intos[index], fetch=getters[(*layout.args[index], step.store)], store=None)
        nodes = [ref for ref in refs if type(ref) is int]
        found = _span(metas, metas.get(outs[0]), nodes, [layout.slots[node] for node in nodes], step.store)
        if found is not None:
            again_spans[index] = found
    return Refills(tuple(steps[index].store for index in refilled), again, again_spans, nbytes)


class Plan:
    """A compiled graph over one backend's kernels: steps in order over a list of value slots.

    ``steps`` are the :class:`Step` of each record; a replay runs them as :func:`fuse` groups
    them. With ``refills``, a call writes those outputs into its last call's, when ``kept`` (a
    :class:`~ember.engines.local.KeptOutputs`) still holds them and nothing else does
    (:meth:`Backend.unshared`), and leaves its own there for the next."""

    def __init__(self, backend, steps: list, layout: Layout, outputs: list, spans: dict,
                 refills: Refills | None = None, kept=None):
        self.steps, self.n_slots = steps, layout.size
        self.preset, self.inputs, self.outputs = layout.preset, layout.inputs, outputs
        self._native_type, self._coerce = backend.native_type, backend.coerce
        threads = backend.threads
        self._program = fuse(steps, spans, threads)
        self._refills = None  # (slots, program, steps, bytes), for a replay to unpack at once
        if refills is not None:
            self._refills = (refills.slots, fuse(refills.steps, refills.spans, threads), refills.steps, refills.nbytes)
            self._unshared, self._kept = backend.unshared, kept
            self._key = key = object()  # the plan's entry in kept, which holds no reference to the plan
            weakref.finalize(self, kept.take, key)  # a plan gone lets go of what it kept

    def run(self, inputs) -> list:
        refills = self._refills
        if refills is None:
            values = self._trace(inputs, self._program, self.steps, ())
        else:
            slots, program, steps, nbytes = refills
            spares = self._kept.take(self._key)  # taken: two threads running the plan never write into the same
            if spares is not None and self._unshared(spares):
                values = self._trace(inputs, program, steps, zip(slots, spares))
            else:
                values = self._trace(inputs, self._program, self.steps, ())
            self._kept.keep(self._key, tuple([values[index] for index in slots]), nbytes)
        outputs = []
        for index in self.outputs:  # a loop: a comprehension's own frame costs more for the few outputs a plan has
            outputs.append(values[index])
        return outputs

    def trace(self, inputs) -> list:
        """Every value slot after running the steps on ``inputs`` (a compiler traces this with its own
        arrays: JAX's jit)."""
        return self._trace(inputs, self._program, self.steps, ())

    def _trace(self, inputs, program: list, steps: list, spares) -> list:
        values = [None] * self.n_slots
        for index, value in self.preset:
            values[index] = value
        for index, value in zip(self.inputs, inputs):
            values[index] = value
        for index, value in spares:  # arrays the refill steps write over
            values[index] = value
        native_type, coerce = self._native_type, self._coerce
        kernel = fetch = None
        try:
            for item in program:
                if type(item) is list:  # steps that write in place: nothing to store, nothing let go
                    for kernel, fetch in item:
                        kernel(*fetch(values))
                    continue
                if type(item) is Split:
                    failed = item.run(values)
                    if failed is not None:
                        kernel, fetch, error = failed
                        raise error
                    continue
                kernel, fetch, store, ended = item
                out = kernel(*fetch(values))
                if store is not None:
                    if type(store) is int:
                        values[store] = out if type(out) is native_type else coerce(out)
                    else:
                        for index, o in zip(store, out):
                            values[index] = o if type(o) is native_type else coerce(o)
                if ended:
                    for index in ended:
                        values[index] = None
        except EmberError:
            raise
        except Exception as error:
            # the failing step is one with the kernel and the getter the loop holds: steps that share both run one
            # kernel on the same slots, and name the same op and inputs
            step = next(step for step in steps if step.kernel is kernel and step.fetch is fetch)
            raise translate(error, step.row.name, step.reads(values)) from error
        return values


def translate(error: Exception, name: str, inputs) -> EmberError:
    """A backend's exception as a typed ember error naming the op and its inputs."""
    parts = []
    for value in inputs:
        shape = getattr(value, "shape", None)
        parts.append(f"{fmt_shape(tuple(shape))} {str(value.dtype).replace('torch.', '')}" if shape is not None else repr(value))
    message = f"{name}: {error} (inputs: {', '.join(parts)})"
    return IndexingError(message) if isinstance(error, IndexError) else ExecutionError(message)


def fuse(steps: list, spans: dict, threads: int) -> list:
    """The steps as :meth:`Plan.trace` runs them: each run of consecutive steps that write in place
    and let nothing go becomes one list of ``(kernel, fetch)`` pairs, for a loop with nothing else
    to check (a chain of elementwise ops is one such list) — or, given several ``threads`` and a run
    whose arrays share one shape (``spans``: step index -> (shape, array slots)) with work enough to
    pay for them, a :class:`Split` of it. Any other step is a ``(kernel, fetch, store, ended)`` tuple."""
    program: list = []
    pairs: dict = {}  # one tuple per (kernel, getter): a long run is a list of a few objects
    run = None  # the run being built
    for index, step in enumerate(steps):
        if step.store is not None or step.ended:
            program.append((step.kernel, step.fetch, step.store, step.ended))
            run = None
            continue
        pair = pairs.setdefault((step.kernel, step.fetch), (step.kernel, step.fetch))
        shape, arrays = spans.get(index, (None, ())) if threads > 1 else (None, ())
        if run is None or run.shape != shape:
            run = _Run(shape)
            program.append(run)
        run.pairs.append(pair)
        run.slots.update(arrays)
    merged: list = []
    for item in program:
        if type(item) is not _Run:
            merged.append(item)
            continue
        size = math.prod(item.shape) if item.shape is not None else 0
        if size >= SPLIT_MIN and size * len(item.pairs) >= SPLIT_WORK:
            merged.append(Split(item.pairs, sorted(item.slots), size, threads))
        elif merged and type(merged[-1]) is list:  # runs too small to split are one loop again
            merged[-1].extend(item.pairs)
        else:
            merged.append(item.pairs)
    return merged


class _Run:
    """In-place steps in a row, while :func:`fuse` builds: their arrays' one shape (None where
    they have none), their pairs and the slots of their arrays."""

    __slots__ = ("shape", "pairs", "slots")

    def __init__(self, shape):
        self.shape, self.pairs, self.slots = shape, [], set()


# A run of in-place elementwise steps splits across threads where its arrays hold SPLIT_MIN elements and the run
# SPLIT_WORK element-ops: a thread's start costs tens of µs (the 100-op chain on 64K float32 split ran at 0.84-1.05x
# raw NumPy against 0.90-0.96x on one thread, on 128K at 0.63-0.68x against 0.76-0.82x). A thread takes SPLIT_BLOCK
# elements at a time: 512 KB of float32 stays in a core's L2 through the run, and each kernel call is long enough
# that the two threads seldom wait for the GIL (blocks of 16K elements made the 100-op chain on 1M float32 slower
# than one thread). Blocks start at multiples of SPLIT_ALIGN elements, so SIMD loops see whole vectors, as in eager
# execution. Towards the end a block is a share of what is left, down to SPLIT_TAIL elements, so no thread waits
# long for the last block of another (guided scheduling: 0.44x raw NumPy on the 100-op chain on 1M float32 where
# equal blocks took 0.51x).
SPLIT_MIN, SPLIT_WORK, SPLIT_BLOCK, SPLIT_TAIL, SPLIT_ALIGN = 1 << 17, 1 << 21, 1 << 17, 1 << 14, 256


class Split:
    """A run of in-place elementwise steps whose arrays share one shape, run on several threads a
    block of elements at a time: each thread takes the next block and runs every step on it, so a
    block stays in the core's cache through the run and a busy CPU takes fewer blocks (smaller ones
    towards the end, so the threads end together). Element ``i`` of each result reads element ``i``
    of each operand only, so blocks give eager execution's values. NumPy lets the GIL go inside each
    kernel; a worker runs in a copy of the caller's context, so ``np.errstate`` holds there too."""

    __slots__ = ("pairs", "slots", "size", "threads")

    def __init__(self, pairs: list, slots: list, size: int, threads: int):
        self.pairs, self.slots, self.size, self.threads = pairs, slots, size, threads

    def run(self, values: list):
        """Runs the steps over ``values``; None, or ``(kernel, fetch, error)`` of a step that raised."""
        pairs, failures = self.pairs, []

        def steps(chunk):  # every step over one chunk of the values; a failure is kept with its step
            kernel = fetch = None
            try:
                for kernel, fetch in pairs:
                    kernel(*fetch(chunk))
            except Exception as error:
                failures.append((kernel, fetch, error))

        arrays = [values[i] for i in self.slots]
        if not all(a.flags.c_contiguous for a in arrays):  # a caller's strided view: no flat blocks of it
            steps(values)
            return failures[0] if failures else None
        flats = [(i, a.reshape(-1)) for i, a in zip(self.slots, arrays)]
        size, share = self.size, 2 * self.threads
        lock, taken = threading.Lock(), [0]

        def work():
            chunk = values.copy()  # the values, with each array replaced by its current block
            while not failures:
                with lock:  # the next block: SPLIT_BLOCK, less towards the end, so the threads end together
                    start = taken[0]
                    if start >= size:
                        return
                    block = min(SPLIT_BLOCK, max(SPLIT_TAIL, -(-(size - start) // share)))
                    end = taken[0] = start + -(-block // SPLIT_ALIGN) * SPLIT_ALIGN
                for index, flat in flats:
                    chunk[index] = flat[start:end]
                steps(chunk)

        pool = _pool(self.threads - 1)
        helpers = [pool.submit(contextvars.copy_context().run, work) for _ in range(self.threads - 1)]
        work()
        for helper in helpers:
            helper.result()
        return failures[0] if failures else None


_POOL: list = []  # the one worker pool of this process, made at the first split


def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    if not _POOL or _POOL[0]._max_workers < workers:
        if _POOL:
            _POOL[0].shutdown(wait=False)
        _POOL[:] = [concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ember-split")]
    return _POOL[0]


os.register_at_fork(after_in_child=_POOL.clear)  # a forked child has none of its parent's threads
