"""The local engine: executes each op immediately through a backend's kernel table."""

from __future__ import annotations

import collections
import os
import threading
import weakref

import numpy as np

from .. import dtypes as dt
from ..backends.base import Backend
from ..errors import EmberError, NotSupportedError
from ..ops.table import Meta
from .base import Engine
from .plans import Getters, Plan, assign_slots, liveness, look_up, make_steps, plan_in_place, plan_refills, shape_runs, translate

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
            raise translate(error, op.name, inputs) from error
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
            raise translate(error, op.name, inputs) from error
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
        were validated once, so a replay pays only for the kernels. The passes are in
        :mod:`ember.engines.plans`.

        Each value is let go right after its last reader (a value nothing reads, right after the
        step that makes it), as eager execution lets an array go when its last name does: a
        plan's peak memory is eager's. The inputs, constants and outputs are the caller's and stay.

        Given every node's meta (``metas``), an elementwise row whose backend kernel can write
        into a destination (:meth:`Backend.into`) writes its result over a dying input of its
        result's meta that the plan made with such a kernel and no view shares, and the literals
        of such rows are converted once (:meth:`Backend.literal`): a chain runs in one buffer.

        With ``refill``, where the backend can tell that nothing else holds an array
        (:meth:`Backend.unshared`), a call writes each output that an ``into`` kernel makes afresh
        into the same output of the call before, if the caller has let all of those go: a result
        read and dropped costs no fresh memory (a large one, none of the page faults of memory the
        allocator gave back to the system). Plans keep their last call's outputs for this, where
        they hold ``REFILL_MIN`` bytes or more, up to ``REFILL_BYTES`` in all (``KEPT``), as a
        caching allocator keeps freed blocks; a peer, whose memory is counted, compiles without.

        A backend with a compiler of its own compiles the plan (:meth:`Backend.compiled`) unless
        ``native`` is False: JAX hands it to ``jax.jit``, per input shapes and dtypes, so a graph
        runs as one XLA program."""
        backend = self.backend
        kernels, intos = look_up(ops, self._kernels, backend)
        dying = liveness(ops, {*input_ids, *constants, *output_ids})
        over = plan_in_place(ops, intos, dying, metas)
        layout = assign_slots(ops, input_ids, constants, over, intos, backend.literal)
        getters = Getters()
        steps = make_steps(ops, kernels, intos, over, dying, layout, getters)
        spans = shape_runs(ops, over, layout, metas)
        outputs = [layout.slots[o] for o in output_ids]
        refills = None
        if refill and type(backend).unshared is not Backend.unshared:
            refills = plan_refills(ops, steps, intos, over, layout, metas, outputs, spans, getters,
                                   REFILL_MIN, REFILL_BYTES)
        plan = Plan(backend, steps, layout, outputs, spans, refills, KEPT)
        return (native and backend.compiled(plan)) or plan

    def run_graph(self, graph, inputs: list) -> list:
        plan = self._plans.get(graph)
        if plan is None:
            ops = [(op.row, op.inputs, op.outputs, op.attrs) for op in graph.ops]
            plan = self._plans[graph] = self.compile(ops, [i for _, i, _ in graph.inputs], graph.constant_handles(self),
                                                     [i for _, i in graph.outputs], graph.metas, refill=True)
        outputs = plan.run(inputs)
        self.ops_executed += len(plan.steps)
        return outputs

    def stats(self) -> dict:
        return {"ops": self.ops_executed, "round_trips": 0, "bytes_up": 0, "bytes_down": 0}


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
