"""A session's tensors, without I/O: their values, metas and counted sizes, and those being fetched.

A :class:`TensorTable` keeps by id each tensor a session holds — a native array, or the
:class:`Failure` that took its place — with its meta (a failure has none) and the bytes counted
for it, its id's overhead included, and the tensors being fetched from another peer (their bytes
counted, their value not there yet). Every change goes through :meth:`~TensorTable.store`,
:meth:`~TensorTable.keep`, :meth:`~TensorTable.add`, :meth:`~TensorTable.drop` and
:meth:`~TensorTable.poison`, which count what the table holds through the session's one
:class:`Quota`; reads go through :meth:`~TensorTable.read` and :meth:`~TensorTable.lookup`. The
op path reads :attr:`~TensorTable.tensors` and :attr:`~TensorTable.metas` itself, its cheapest
lookups. A failure with no room to be kept is remembered apart (the last :data:`UNKEPT`), so a
read still names it.
"""

from __future__ import annotations

import math
from collections import deque

from ..errors import EmberError, ProtocolError, ResourceLimitError
from ..ops.table import Meta
from .failures import Failure
from .memory import TENSOR_OVERHEAD, Quota

UNKEPT = 1024  # failures a session remembers that had no room to be kept (at most; about 100 KB)


def check_id(tid) -> None:
    """ProtocolError unless ``tid`` is a tensor id: a non-negative integer (bool is no id)."""
    if type(tid) is not int or tid < 0:  # the spelling the op path uses inline
        raise ProtocolError(f"tensor ids are non-negative integers, got {tid!r}")


def error_kind(error: Exception) -> str:
    """The kind a failure caused by ``error`` carries: an ember exception's name, else ExecutionError."""
    return type(error).__name__ if isinstance(error, EmberError) else "ExecutionError"


def check_size(name, out_metas, limit: int) -> None:
    """ResourceLimitError naming ``name`` if an output whose shape is known exceeds ``limit`` bytes."""
    for meta in out_metas:
        if None not in meta.shape and meta.nbytes > limit:
            raise ResourceLimitError(f"{name}: an output of shape {meta.shape} {meta.dtype} exceeds the peer's "
                                     f"tensor limit of {limit} bytes")


def need_of(op, in_metas: tuple, attrs: dict, out_metas: tuple, limit: int) -> int:
    """The bytes an op may hold while it runs: its outputs — a data-dependent one at its largest,
    as many elements as the largest input — with their ids' overhead, and its kernels' scratch
    (the row's ``scratch`` rule). An output or a scratch past the tensor ``limit`` is refused:
    the limit bounds every allocation a client causes, not only the tensors it names."""
    need = TENSOR_OVERHEAD * len(out_metas)
    for meta in out_metas:
        if None in meta.shape:  # its size is checked against the tensor limit once it is known
            need += max(math.prod(m.shape) for m in in_metas) * meta.dtype.itemsize  # such ops have inputs
            continue
        nbytes = meta.nbytes
        if nbytes > limit:
            check_size(op.name, (meta,), limit)
        need += nbytes
    if op.scratch is not None:
        scratch = op.scratch(in_metas, out_metas, attrs)
        if scratch > limit:
            raise ResourceLimitError(f"{op.name}: its kernels need {scratch} bytes of scratch, more than the peer's "
                                     f"tensor limit of {limit} bytes")
        need += scratch
    return need


class TensorTable:
    """The tensors of one session by id, and what they cost. ``fail(kind, message)`` makes a new
    :class:`Failure` (the session counts it for the peer's status); ``engine`` takes in a fetched
    tensor's value; ``pool`` is offered the buffers of dropped tensors."""

    def __init__(self, limits, budget, pool, engine, fail):
        self.tensors: dict[int, object] = {}  # id -> native array or Failure
        self.metas: dict[int, Meta] = {}      # id -> its Meta, for each live tensor
        self.sizes: dict[int, int] = {}       # id -> the bytes counted for it: every id held, failed or being fetched
        self.quota = Quota(limits, budget, self.sizes)  # the cap on tensors counts the ids in sizes
        self.pool, self.engine, self.fail = pool, engine, fail
        self.incoming: dict = {}     # id -> its Fetch: its bytes are in sizes, its value not yet in tensors
        self.cancelled: list = []    # fetches of tensors gone whose worker may still run: their bytes in granted
        self.granted = 0             # bytes of grants not yet ended and of cancelled fetches still running
        self.ended: deque[int] = deque()  # bytes of those ended on other threads, given back at the next frame
        self.unreported: list[Failure] = []  # the first failure since the last sync
        self.unkept: dict[int, Failure] = {}  # failures that had no room to be kept, by id: the last UNKEPT
        self.forgot_unkept = False   # whether some were forgotten past UNKEPT
        self.sent: dict[int, int] = {}  # id -> its segment in the reply being built: written again, it is read again

    def live_bytes(self) -> int:
        """The bytes counted for the tensors held (data and ids' overhead)."""
        return sum(self.sizes.values())

    def take(self, what: str, nbytes: int, ids: int = 0) -> None:
        """Count ``nbytes`` more (for ``ids`` new tensor ids) through the quota, or ResourceLimitError naming ``what``."""
        reason = self.quota.reserve(nbytes, ids)
        if reason is not None:
            raise ResourceLimitError(f"{what}: {reason}")

    def new_ids(self, outputs) -> int:
        """How many of ``outputs`` are ids the table does not hold yet."""
        sizes = self.sizes
        return sum(type(o) is int and o not in sizes for o in outputs)

    # -- writes --
    def store(self, tid, value, meta: Meta | None, counted: bool) -> None:
        """Keep ``value`` as tensor ``tid`` (a Failure has no meta; None frees the id), counting its
        bytes and its id's overhead unless ``counted`` (a received segment's reservation has them).
        A value with no room is kept as its refusal; a failure with no room is not kept (its error is
        still reported, and the last UNKEPT such failures are remembered apart, so a read names it)."""
        check_id(tid)
        if self.incoming and tid in self.incoming:
            self._cancel_fetch(tid)
        if self.unkept:
            self.unkept.pop(tid, None)
        quota, sizes = self.quota, self.sizes
        old = sizes.pop(tid, None)
        self.metas.pop(tid, None)
        if old is not None:
            quota.give(old)
        if self.sent:
            self.sent.pop(tid, None)
        if value is None:
            self.tensors.pop(tid, None)
            return
        nbytes = TENSOR_OVERHEAD if meta is None else meta.nbytes + TENSOR_OVERHEAD
        limits = quota.limits
        if meta is None and (len(sizes) >= limits.max_session_tensors or
                             quota.used + nbytes > limits.max_session_bytes):  # the common refusal, without its message
            self.tensors.pop(tid, None)
            self.remember(self.unkept, tid, value)
            return
        if not counted:
            reason = quota.reserve(nbytes, 1)
        elif len(sizes) >= limits.max_session_tensors:  # its bytes were reserved as it arrived; its id was not
            quota.give(nbytes)
            reason = quota.refusal(0, 1)
        else:
            reason = None
        if reason is not None:
            self.tensors.pop(tid, None)
            if meta is None:  # a failure with no room: the id stays free, its failure is remembered (UNKEPT)
                self.remember(self.unkept, tid, value)
                return
            poison = self.fail("ResourceLimitError", f"put of tensor {tid}: {reason}")
            self.report(poison)
            self.store(tid, poison, None, False)
            return
        if meta is not None:
            self.metas[tid] = meta
        sizes[tid] = nbytes
        self.tensors[tid] = value
        quota.room()  # its reservation may predate the last time the ceiling was set

    def add(self, tid, value, meta: Meta, nbytes: int) -> bool:
        """Keep ``value`` as tensor ``tid`` if that is a new id, its ``nbytes`` reserved already (the op
        path's common case); False, keeping nothing, where :meth:`keep` must do it."""
        sizes = self.sizes
        if type(tid) is int and tid >= 0 and tid not in sizes and not self.sent:
            self.tensors[tid] = value
            self.metas[tid] = meta
            sizes[tid] = nbytes
            return True
        return False

    def keep(self, outputs, values, out_metas, reserved: int, partly: bool = True, sizes=None) -> None:
        """Store an op's or a run's outputs; of the bytes ``reserved`` for it, they keep theirs — data
        and id overhead, or ``sizes`` where the caller knows them (a compiled run) — (all of them
        unless ``partly``: the outputs' sizes were all the reservation)."""
        quota = self.quota
        for tid in outputs:
            if type(tid) is not int or tid < 0:
                quota.give(reserved)
                check_id(tid)
        if self.incoming:
            for tid in outputs:
                if tid in self.incoming:
                    self._cancel_fetch(tid)
        freed = written = 0
        if len(outputs) == 1 and not partly:
            kept = (reserved,)
        else:
            kept = sizes or [m.nbytes + TENSOR_OVERHEAD for m in out_metas]
            if partly:
                freed = reserved - sum(kept)
        tensors, metas, held = self.tensors, self.metas, self.sizes
        for tid, value, meta, nbytes in zip(outputs, values, out_metas, kept):
            old = held.get(tid)
            if old is not None:  # a tensor written again: the old one's bytes go back
                written += old
            tensors[tid] = value
            metas[tid] = meta
            held[tid] = nbytes
        if freed or written:  # after the ids are in: the ceiling counts them (Quota.room)
            quota.give(freed + written)
        if self.sent:
            for tid in outputs:
                self.sent.pop(tid, None)

    def drop(self, ids) -> None:
        """Let tensors ``ids`` go (a fetch of one is cancelled), their bytes and their buffers with them."""
        tensors, metas, sizes = self.tensors, self.metas, self.sizes
        dropped: list = []  # the only references to the values dropped, for the pool to judge
        freed, unkept = 0, self.unkept
        try:
            for tid in ids:
                if self.incoming and tid in self.incoming:
                    self._cancel_fetch(tid)
                dropped.append(tensors.pop(tid, None))
                metas.pop(tid, None)
                freed += sizes.pop(tid, 0)
                if unkept:
                    unkept.pop(tid, None)
        finally:  # a malformed id ends the frame; what was dropped before it is given back
            self.pool.release(dropped)
            if freed:
                self.quota.give(freed)

    # -- failures --
    def poison(self, outputs, kind: str, message: str) -> None:
        """A new failure in each of ``outputs``, reported at the next sync."""
        poison = self.fail(kind, message)
        for tid in outputs:
            self.store(tid, poison, None, False)
        self.report(poison)

    def report(self, failure: Failure) -> None:
        """Report ``failure`` at the next sync, unless one is reported there already: a sync
        reports the first, so only the first is kept (a client that never syncs holds no list)."""
        if not self.unreported:
            self.unreported.append(failure)

    def remember(self, unkept: dict, key: int, failure: Failure) -> None:
        """Remember ``failure`` as that of ``key`` (a tensor or graph id) that had no room to be kept."""
        if len(unkept) >= UNKEPT:  # the older half goes at once: a constant cost per failure, however many come
            newer = list(unkept.items())[UNKEPT // 2:]
            unkept.clear()
            unkept.update(newer)
            self.forgot_unkept = True
        unkept[key] = failure

    def unknown(self, tid) -> str:
        """Why tensor ``tid`` is unknown to this session."""
        if self.forgot_unkept:
            return f"unknown tensor id {tid!r} (dropped, from another session, or a failure this session had no room to keep)"
        return f"unknown tensor id {tid!r} (dropped, or from another session)"

    # -- reads --
    def lookup(self, tid):
        """Tensor ``tid``'s value, its Failure (one not kept included), or None if it is unknown;
        a tensor being fetched is waited for first."""
        value = self.tensors.get(tid)
        if value is None and type(tid) is int:
            if self.incoming and tid in self.incoming:
                self.settle(tid)
                value = self.tensors.get(tid)
            if value is None and self.unkept:
                value = self.unkept.get(tid)
        return value

    def read(self, tid):
        """Tensor ``tid``'s live value, else the Failure a read of it meets (a new one if it is unknown)."""
        value = self.tensors.get(tid) if isinstance(tid, int) else None
        if value is not None and type(value) is not Failure:  # the common case: a live tensor
            return value
        value = self.lookup(tid) if isinstance(tid, int) else None
        return self.fail("ExecutionError", self.unknown(tid)) if value is None else value

    # -- fetches from other peers (transfers.py) --
    def expect(self, tid: int, job, nbytes: int) -> None:
        """Tensor ``tid`` is what ``job`` fetches, ``nbytes`` counted for it (reserved with its id):
        whatever the id held goes, and :meth:`settle` takes the outcome when the tensor is first used."""
        self.store(tid, None, None, False)
        self.sizes[tid] = nbytes
        self.quota.room()
        self.incoming[tid] = job

    def settle(self, tid) -> None:
        """Wait for the fetch of tensor ``tid`` and keep its value, or the failure naming it."""
        job = self.incoming.pop(tid)
        outcome = job.wait()
        if type(outcome) is not Failure:
            try:
                value = self.engine.backend.adopt(outcome) if job.local else self.engine.upload(outcome)
            except Exception as error:
                outcome = Failure(error_kind(error), f"transfer from {job.source}: {error}")
        if type(outcome) is Failure:
            self.poison((tid,), outcome.kind, outcome.message)
            return
        self.tensors[tid] = value
        self.metas[tid] = job.meta

    def settle_all(self) -> None:
        """Wait for every fetch (a sync: each transfer is done, and its failure reported, by then)."""
        for tid in list(self.incoming):
            self.settle(tid)

    def give_ended(self) -> None:
        """Give back the bytes of grants and fetches that ended on other threads since the last frame."""
        ended = self.ended
        while ended:
            nbytes = ended.popleft()
            self.granted -= nbytes
            self.quota.give(nbytes)

    def _cancel_fetch(self, tid) -> None:
        """Tensor ``tid``, being fetched, goes (dropped, written again): its fetch is cancelled. While
        a worker still performs it, its bytes stay counted (moved to ``granted``): the buffer it
        receives into exists until the worker ends, and hands them back then (``ended``)."""
        job = self.incoming.pop(tid)
        if job.cancel(self.ended.append):  # the worker hands back the tensor's bytes; its id's overhead goes now
            self.quota.give(self.sizes.pop(tid) - job.meta.nbytes)
            self.granted += job.meta.nbytes
            self.cancelled.append(job)
        if len(self.cancelled) > 64:  # those over are let go now and then, not at each drop
            self.cancelled = [f for f in self.cancelled if not f.over]

    def close(self) -> None:
        """Let everything go and give the quota's bytes back to the budget, but those of fetches still
        running (their workers give them back when they end)."""
        quota = self.quota
        held = sum(job.meta.nbytes for job in (*self.incoming.values(), *self.cancelled) if job.cancel(quota.budget.give))
        for table in (self.incoming, self.tensors, self.metas, self.sizes, self.unkept):
            table.clear()
        self.cancelled.clear()
        self.ended.clear()
        self.granted = 0
        quota.close(held)
