"""The local engine: executes each op immediately through a backend's kernel table."""

from __future__ import annotations

import collections
import concurrent.futures
import contextvars
import functools
import math
import operator
import os
import threading
import weakref

import numpy as np

from .. import dtypes as dt
from ..backends.base import Backend
from ..errors import EmberError, ExecutionError, IndexingError, NotSupportedError
from ..ops.records import LITERAL_METAS
from ..ops.table import Meta, fmt_shape
from .base import Engine

LITERALS_KEPT = 1024  # the scalar literals an engine keeps converted (a loop's changing scalars stop there)
REFILL_BYTES = 64 << 20  # the most plans keep, all together, of their last calls' outputs to write the next into
# the least a plan's outputs made afresh hold for it to keep them: glibc maps blocks from 128 KiB afresh and gives them
# back when freed (page faults at each call); smaller ones malloc hands back warm, at no cost to keep
REFILL_MIN = 128 << 10


class LocalEngine(Engine):
    """Runs ops now, on one backend device; handles are native arrays."""

    def __init__(self, backend):
        self.backend = backend
        self._kernels = backend.kernels
        self._native_type = backend.native_type
        self._dtypes = frozenset(backend.dtypes)
        self._all_dtypes = len(self._dtypes) == len(dt.ALL)  # then results need no dtype check
        self._unchecked = self._kernels if self._all_dtypes else {}  # the kernels apply runs without a check first
        self.ops_executed = 0
        self._literals: dict = {}
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def execute(self, op, inputs, in_metas, attrs, metas):
        try:
            kernel = self._kernels[op.name]
        except KeyError:
            reason = self.backend.gaps.get(op.name, "no kernel")
            raise NotSupportedError(f"{op.name}: not supported on {self.backend.device_name} ({reason})") from None
        if not self._all_dtypes:
            self._check_dtypes(op, in_metas, metas)
        try:
            out = kernel(*inputs, **attrs)
        except EmberError:
            raise
        except Exception as error:
            raise _translate(error, op.name, inputs) from error
        self.ops_executed += 1
        native_type = self._native_type
        if op.multiple:
            outs = tuple(o if type(o) is native_type else self.backend.coerce(o) for o in out)
        else:
            outs = (out if type(out) is native_type else self.backend.coerce(out),)
        if op.data_dependent:
            metas = tuple(Meta(tuple(o.shape), m.dtype) for o, m in zip(outs, metas))
        return outs, metas

    def apply(self, op, inputs, in_metas, attrs, meta):
        kernel = self._unchecked.get(op.name)
        if kernel is None:  # refused, or dtypes to check: the full path says why
            return self.execute(op, inputs, in_metas, attrs, (meta,))[0][0]
        try:
            out = kernel(*inputs, **attrs) if attrs else kernel(*inputs)
        except EmberError:
            raise
        except Exception as error:
            raise _translate(error, op.name, inputs) from error
        self.ops_executed += 1
        return out if type(out) is self._native_type else self.backend.coerce(out)

    def literal(self, value, dtype):
        """The backend's form of a scalar literal (:meth:`Backend.literal`: NumPy's 0-d array of the
        dtype, which its kernels take without converting a Python float at every call), made once
        per value and dtype. Zeros (0.0 and -0.0 are one key), NaNs (equal to nothing) and values
        past the first LITERALS_KEPT stay Python scalars, converted by the kernel as before."""
        converted = self._literals.get((value, dtype))
        if converted is None:
            if not value or value != value or len(self._literals) >= LITERALS_KEPT:
                return value
            converted = self._literals[(value, dtype)] = self.backend.literal(value, dtype)
        return converted

    def _check_dtypes(self, op, in_metas, metas) -> None:
        if op.family == "data type":  # astype: the way into and out of a dtype the backend holds but computes nothing on
            return
        for meta in (*in_metas, *metas):
            if meta.dtype not in self._dtypes:
                raise NotSupportedError(f"{op.name}: {self.backend.device_name} computes nothing on {meta.dtype}; "
                                        f"convert it first with astype (e.g. to int64)")

    def upload(self, host: np.ndarray):
        return self.backend.from_host(host)

    def download(self, handle) -> np.ndarray:
        return self.backend.to_host(handle)

    def native(self, handle):
        return handle

    @property
    def computes_every_dtype(self) -> bool:
        """Whether the backend computes on every dtype (else ops check theirs before running)."""
        return self._all_dtypes

    def compile(self, ops, input_ids, constants: dict, output_ids, metas: dict | None = None, native: bool = True,
                refill: bool = False) -> Plan:
        """A plan running ``ops`` — ``(row, refs, output ids, attrs)`` records whose refs are node
        ids or ``(value, dtype name)`` literals — straight through the kernel table: the records
        were validated once, so a replay pays only for the kernels.

        Each value is let go right after its last reader (a value nothing reads, right after the
        step that makes it), as eager execution lets an array go when its last name does: a
        plan's peak memory is eager's, not the sum of every intermediate. The inputs, constants
        and outputs are the caller's and stay.

        Given every node's meta (``metas``), an elementwise row whose backend kernel can write
        into a destination (:meth:`Backend.into`) writes its result over an input of the
        result's shape and dtype that this step reads last — when that input is the plan's own
        buffer, made by such a kernel and read by no other kind, so no view of it lives on — and
        the literals of such rows are converted once (:meth:`Backend.literal`). A chain then
        runs in one buffer, with no fresh memory per op, under the kernel's casting rules.

        With ``refill``, where the backend can tell that nothing else holds an array
        (:meth:`Backend.unshared`), a call writes each output that an ``into`` kernel makes afresh
        into the same output of the call before, if the caller has let all of those go: a result
        read and dropped costs no fresh memory (a large one, none of the page faults of memory the
        allocator gave back to the system). Plans keep their last call's outputs for this, where
        they hold ``REFILL_MIN`` bytes or more, up to ``REFILL_BYTES`` in all
        (:class:`KeptOutputs`), as a caching allocator keeps freed blocks; a peer, whose memory is
        counted, compiles without.

        A backend with a compiler of its own compiles the plan (:meth:`Backend.compiled`) unless
        ``native`` is False: JAX hands it to ``jax.jit``, per input shapes and dtypes, so a graph
        runs as one XLA program."""
        slots: dict = {}

        def slot(key) -> int:
            return slots.setdefault(key, len(slots))

        preset = [(slot(i), v) for i, v in constants.items()]
        inputs = [slot(i) for i in input_ids]
        kept = {*input_ids, *constants, *output_ids}
        backend = self.backend
        intos = [backend.into(op.name) if op.elementwise else None for op, _, _, _ in ops]
        last = {}  # node id -> the index of the last step that reads it
        shared = set()  # nodes read by a kernel that may return a view of them
        for index, (_, refs, _, _) in enumerate(ops):
            for ref in refs:
                if type(ref) is int:
                    last[ref] = index
                    if intos[index] is None:
                        shared.add(ref)
        owned = set()  # nodes whose buffer the plan made and no view shares: one may be written over
        # a literal's slot by value, and one getter per list of slots: a chain's thousand `x * 1.0001` read one
        # array through one getter, so a replay touches little memory (what a cold cache makes it pay for)
        literals: dict = {}
        getters: dict = {}

        def getter(indices: list):
            key = tuple(indices)
            fetch = getters.get(key)
            if fetch is None:
                fetch = getters[key] = _getter(indices)
            return fetch

        def span(meta, arrays: list, target: int):
            """``(shape, slots)`` of a step writing into slot ``target`` whose arrays all have its result's
            shape: a run of such steps may split into blocks, each array sliced alike; else None."""
            if meta is not None and all(getattr(metas.get(r), "shape", None) == meta.shape for r in arrays):
                return meta.shape, frozenset([target, *(slots[r] for r in arrays)])
            return None

        steps = []
        fresh: dict = {}  # step index -> (into kernel, arg slots, output node, its arrays' refs): a result made afresh
        spans: dict = {}  # in-place step -> (its arrays' one shape, their slots): the steps a run may split into blocks
        for index, (op, refs, outs, attrs) in enumerate(ops):
            kernel, into = self._kernels.get(op.name), intos[index]
            if kernel is None:
                raise NotSupportedError(f"{op.name}: not supported on {backend.device_name}")
            args = []
            for ref in refs:
                if type(ref) is int:
                    args.append(slot(ref))
                else:  # a literal: a preset slot holding its value, one per value where a dict tells values apart
                    value = ref[0]
                    key = (type(value), value, ref[1], into is None) if value else None  # 0.0 == -0.0: not kept apart
                    literal_slot = literals.get(key) if key is not None else None
                    if literal_slot is None:
                        literal_slot = len(slots)
                        slots[("literal", literal_slot)] = literal_slot
                        preset.append((literal_slot, value if into is None else backend.literal(value, _dtype(ref[1]))))
                        if key is not None:
                            literals[key] = literal_slot
                    args.append(literal_slot)
            ending = [r for r in dict.fromkeys(refs) if type(r) is int and last[r] == index and r not in kept]
            over = None  # the input written over
            if into is not None and metas is not None and len(outs) == 1:
                meta = metas.get(outs[0])
                over = next((r for r in ending if r in owned and r not in shared and metas.get(r) == meta), None)
                owned.add(outs[0])
            if over is not None:
                slots[outs[0]] = slots[over]
                ending.remove(over)
                kernel, fetch, store = into, getter(args + [slots[over]]), None
                found = span(meta, [r for r in refs if type(r) is int], slots[over])
                if found is not None:
                    spans[len(steps)] = found
            else:
                store = tuple(slot(o) for o in outs)
                if len(store) == 1 and not op.multiple:
                    store = store[0]
                fetch = getter(args)
                if attrs:
                    kernel = functools.partial(kernel, **attrs)
                elif into is not None and metas is not None and type(store) is int:
                    fresh[len(steps)] = (into, args, outs[0], [r for r in refs if type(r) is int])
            ending += [o for o in outs if o not in last and o not in kept]
            steps.append((kernel, fetch, store, tuple(slots[n] for n in ending), (op, getter(args))))
        outputs = [slots[o] for o in output_ids]
        refills = None  # the steps again, each output made afresh written over the last call's (Plan says what)
        if refill and type(backend).unshared is not Backend.unshared:
            ends = set(outputs)
            refilled = [i for i, (_, _, out, _) in fresh.items()
                        if slots[out] in ends and getattr(metas.get(out), "size", None) is not None]
            nbytes = sum(metas[fresh[i][2]].nbytes for i in refilled)
            if refilled and REFILL_MIN <= nbytes <= REFILL_BYTES:
                again, again_spans = list(steps), dict(spans)
                for index in refilled:
                    into, args, out, arrays = fresh[index]
                    kernel, fetch, store, ended, info = steps[index]
                    again[index] = (into, getter(args + [store]), None, ended, info)
                    found = span(metas.get(out), arrays, store)
                    if found is not None:
                        again_spans[index] = found
                refills = (tuple(steps[i][2] for i in refilled), again, again_spans, nbytes)
        plan = Plan(self, steps, len(slots), preset, inputs, outputs, spans, refills)
        return (native and backend.compiled(plan)) or plan

    def run_graph(self, graph, inputs: list) -> list:
        plan = self._plans.get(graph)
        if plan is None:
            ops = [(op.row, op.inputs, op.outputs, op.attrs) for op in graph.ops]
            plan = self._plans[graph] = self.compile(ops, [i for _, i, _ in graph.inputs], graph.constant_handles(self),
                                                     [i for _, i in graph.outputs], graph.metas, refill=True)
        return plan.run(inputs)

    def stats(self) -> dict:
        return {"ops": self.ops_executed, "round_trips": 0, "bytes_up": 0, "bytes_down": 0}


def _describe(inputs) -> str:
    parts = []
    for value in inputs:
        shape = getattr(value, "shape", None)
        parts.append(f"{fmt_shape(tuple(shape))} {str(value.dtype).replace('torch.', '')}" if shape is not None else repr(value))
    return ", ".join(parts)


def _translate(error: Exception, name: str, inputs) -> EmberError:
    """A backend's exception as a typed ember error naming the op and its inputs."""
    message = f"{name}: {error} (inputs: {_describe(inputs)})"
    if isinstance(error, IndexError):
        return IndexingError(message)
    return ExecutionError(message)


def _dtype(name: str) -> dt.DType:
    return LITERAL_METAS[name].dtype


def _getter(indices: list):
    """A C-speed function returning the tuple of ``values[i]`` for the given indices."""
    if len(indices) == 1:
        index = indices[0]
        return lambda values: (values[index],)
    if not indices:
        return lambda values: ()
    return operator.itemgetter(*indices)


class Plan:
    """A compiled graph for one local engine: kernels in order over a list of value slots.

    A step is ``(kernel, fetch, store, ended, (row, inputs))``: ``kernel(*fetch(values))`` runs
    it; ``store`` is the slot of its one output, a tuple of slots for a row with several, or None
    where the kernel writes into a slot that ``fetch`` hands it; ``ended`` lists the slots let go
    after it; ``inputs(values)`` are its inputs, for an error's message. ``refills``, where given,
    is ``(slots, steps, spans, nbytes)``: the slots of outputs made afresh, the steps writing them
    into the last call's instead (:meth:`LocalEngine.compile`), and those outputs' bytes."""

    def __init__(self, engine: LocalEngine, steps: list, n_slots: int, preset: list, inputs: list, outputs: list,
                 spans: dict, refills: tuple | None = None):
        self.engine, self.steps, self.n_slots = engine, steps, n_slots
        self._native_type, self._coerce = engine._native_type, engine.backend.coerce
        self.preset, self.inputs, self.outputs = preset, inputs, outputs
        threads = engine.backend.threads
        self._program = _program(steps, spans, threads)
        self._refills = None
        if refills is not None:
            slots, again, again_spans, nbytes = refills
            self._refills = (slots, _program(again, again_spans, threads), again, nbytes)
            self._unshared = engine.backend.unshared
            self._key = key = object()  # the plan's entry in KEPT, which holds no reference to the plan
            weakref.finalize(self, KEPT.take, key)  # a plan gone lets go of what it kept

    def run(self, inputs) -> list:
        refills = self._refills
        if refills is None:
            values = self._trace(inputs, self._program, self.steps, ())
        else:
            slots, program, steps, nbytes = refills
            spares = KEPT.take(self._key)  # taken: two threads running the plan never write into the same
            if spares is not None and self._unshared(spares):
                values = self._trace(inputs, program, steps, zip(slots, spares))
            else:
                values = self._trace(inputs, self._program, self.steps, ())
            KEPT.keep(self._key, tuple([values[index] for index in slots]), nbytes)
        self.engine.ops_executed += len(self.steps)
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
                kernel, fetch, store, ended, _ = item
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
            op, inputs_of = next(step[4] for step in steps if step[0] is kernel and step[1] is fetch)
            raise _translate(error, op.name, inputs_of(values)) from error
        return values


class KeptOutputs:
    """The outputs that plans keep of their last call, to write the next call's into: those of the
    plans that ran last, ``REFILL_BYTES`` in all, so that many jitted functions and shapes never
    hold more. Each entry is ``key -> (arrays, bytes)``; the only reference to those arrays."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        """Keep nothing (and a fresh lock: a forked child's copy may be held by a thread it lacks)."""
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0

    def take(self, key) -> tuple | None:
        """The arrays kept for ``key``, no longer kept (None where there are none)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return None
            self.nbytes -= entry[1]
            return entry[0]

    def keep(self, key, arrays: tuple, nbytes: int) -> None:
        """Keep ``arrays`` for ``key``, letting go of those kept longest beyond ``REFILL_BYTES``."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self._entries[key] = (arrays, nbytes)
            self.nbytes += nbytes
            while self.nbytes > REFILL_BYTES:
                self.nbytes -= self._entries.popitem(last=False)[1][1]

    def __contains__(self, key) -> bool:
        return key in self._entries


KEPT = KeptOutputs()
os.register_at_fork(after_in_child=KEPT.clear)


def _program(steps: list, spans: dict, threads: int) -> list:
    """The steps as :meth:`Plan.trace` runs them: each run of consecutive steps that write in place
    and let nothing go becomes one list of ``(kernel, fetch)`` pairs, for a loop with nothing else
    to check (a chain of elementwise ops is one such list) — or, given several ``threads`` and a run
    whose arrays share one shape (``spans``: step index -> (shape, array slots)) with work enough to
    pay for them, a :class:`Split` of it."""
    program: list = []
    pairs: dict = {}  # one tuple per (kernel, getter): a long run is a list of a few objects
    run = None  # the run being built
    for index, step in enumerate(steps):
        kernel, fetch, store, ended, _ = step
        if store is not None or ended:
            program.append(step)
            run = None
            continue
        pair = pairs.setdefault((kernel, fetch), (kernel, fetch))
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
    """In-place steps in a row, while :func:`_program` builds: their arrays' one shape (None where
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
