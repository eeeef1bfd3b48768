"""A compute peer's logic without I/O: the handshake, sessions, their tensors and graphs.

Like the ``websockets`` library's protocol objects, nothing here touches a socket: a
:class:`Host` turns an ``init`` frame into a :class:`Session` (or a refusal), and a session turns
each frame into the reply frames to send. ``server.py`` is the shell that moves frames between
these objects and sockets. Ops run through the same :class:`LocalEngine` as local execution,
after the op row's meta rule has validated them, so a peer executes nothing the table would
refuse locally.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
import uuid
from collections import Counter, deque
from typing import NamedTuple

import numpy as np

from .. import dtypes as dt
from ..devices import LocalDevice
from ..devices import device as as_device
from ..engines.local import LocalEngine
from ..errors import AccessDenied, EmberError, HostDeviceError, ProtocolError, ResourceLimitError
from ..ops.records import check_records, infer_record, literal_meta
from ..ops.table import Meta
from ..wire import protocol as wire
from ..wire.protocol import CAPABILITY_BYTES, Frame, Limits
from .access import NotPermitted, Throttle, Throttled, Viewer, is_guess, single_token
from .failures import Failure
from .memory import (
    CREDIT,
    GRAPH_COMPILE_BYTES,
    GRAPH_NODE_BYTES,
    GRAPH_OVERHEAD,
    RUN_OP_BYTES,
    RUN_OVERHEAD,
    TENSOR_OVERHEAD,
    Budget,
    BufferPool,
)
from .runs import KEPT_BLOB_BYTES, KEPT_RUNS, NOT_COMPILED, RunPlan, absolute, endings, peak, records_of
from .transfers import FETCHES_PER_SESSION, SCHEMES, Fetch, Grant, Transfers, is_host

log = logging.getLogger("ember.serve")

Reply = tuple  # (header, segments): one frame to send
MIN_KEEPALIVE = 0.05  # seconds: the shortest interval between "alive" frames a client may ask for

#: what each kind of device means for hosting: None (it executes) or why it cannot be hosted
HOSTING_REFUSALS = {
    "local": None,
    "capture": "cannot host a remote server on a capture device — capture records operations without "
               "executing them; host the underlying backend instead (e.g. `numpy`)",
    "remote": "cannot host a remote server on a remote device — run `ember serve` on the machine that owns "
              "the hardware",
}


def hosted_devices(device) -> list[LocalDevice]:
    """The devices a peer serving ``device`` hosts, by hardware index; HostDeviceError if none.

    Autodiff is stripped (gradients are the client's concern); a backend hosts all its devices
    of that kind: ``torch:cuda:1`` hosts every CUDA device (``jax:gpu:1`` every JAX GPU).
    """
    target = as_device(device).inner()
    refusal = HOSTING_REFUSALS[target.kind]
    if refusal:
        raise HostDeviceError(refusal)
    from ..backends import backend_module
    try:
        names = backend_module(target.backend_name).devices()
    except ImportError as error:
        raise HostDeviceError(f"cannot host {target}: {target.backend_name} is not installed ({error})") from None
    return [as_device(n) for n in same_kind(str(target), names)]


def same_kind(name: str, names: list[str]) -> list[str]:
    """The devices among ``names`` that a peer serving device ``name`` hosts: every CUDA device
    for one of them, else ``name`` alone."""
    family = name.rsplit(":", 1)[0] if name.startswith(("torch:cuda", "jax:gpu")) else name
    return [n for n in names if n == family or n.startswith(family + ":")] or [name]


RECENT_ERRORS = 20  # the failures a session (and a host) remembers for the status page
UNKEPT = 1024       # failures a session remembers that had no room to be kept (at most; about 100 KB)
KEPT_CHARACTERS = 1000  # of a remembered failure's message (the status shows 300 characters)
HISTORY = 150       # throughput samples a host keeps (five minutes, one every two seconds)
#: a session's counters that only grow, and that the peer's totals sum over its sessions
COUNTED = ("ops", "round_trips", "bytes_in", "bytes_out", "graphs_registered", "graph_runs")


def _check_id(tid) -> None:
    if type(tid) is not int or tid < 0:  # the spelling the op path uses inline (bool is no id)
        raise ProtocolError(f"tensor ids are non-negative integers, got {tid!r}")


def _check_graph_id(gid) -> None:
    if type(gid) is not int or gid < 0:  # as tensor ids: a client numbers its graphs (a string id would cost its size)
        raise ProtocolError(f"graph ids are non-negative integers, got {gid!r:.40}")


def _error_kind(error: Exception) -> str:
    return type(error).__name__ if isinstance(error, EmberError) else "ExecutionError"


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


class Session:
    """One client's session, without I/O: :meth:`handle` takes a frame and returns the reply
    frames to send (header, segments).

    Every byte the session makes the peer hold is counted against its quota
    (``limits.max_session_bytes``) and the peer's :class:`Budget` before it is allocated: a
    received tensor (:meth:`allocate`, the frame reader's hook), an op's outputs — at their
    largest where the data decides their size — and its kernels' scratch, a graph's constants
    and intermediates, and the copies a reply needs. A refusal is a ResourceLimitError naming
    the op, the size and the limit; the session and its other tensors live on.
    """

    def __init__(self, engine: LocalEngine, limits: Limits, registry: Registry, pool: BufferPool, budget: Budget,
                 transfers: Transfers, peer: str):
        self.engine = engine
        self.id = uuid.uuid4().hex  # the session's name: grants bind a transfer to it
        self.transfers = transfers  # the peer's table of grants, shared by its sessions
        self.peer = peer            # the hosting peer's identity: a fetch from it needs no network
        self.runner = None          # the shell's: runner(fetch) starts a Fetch at once; None keeps them in fetches
        self.fetches: list[Fetch] = []
        self.incoming: dict[int, Fetch] = {}  # tensors being fetched: their bytes are in sizes, not yet in tensors
        self.cancelled: list[Fetch] = []  # fetches of tensors gone whose worker may still run: their bytes in granted
        self.granted = 0            # bytes counted for its grants not yet ended, and its cancelled fetches still running
        self.ended: deque[int] = deque()  # bytes of those ended on other threads, given back at the next frame
        self.budget = budget
        self.pool = pool
        self.limits = limits
        self.registry = registry
        self.tensors: dict[int, object] = {}   # id -> native array or Failure
        self.metas: dict[int, Meta] = {}
        self.sizes: dict[int, int] = {}         # id -> the bytes counted for it
        self.unreported: list[Failure] = []     # failures since the last sync
        self.graphs: dict[int, RegisteredGraph] = {}  # by number
        self.ops = 0
        self.runs: dict[bytes, object] = {}  # a run's blob -> sightings, its RunPlan, or NOT_COMPILED (runs.py)
        self.runs_replayed = 0
        # what the peer's status page and /metrics show (ember/remote/status.py reads them, from another thread)
        self.client = self.address = self.device = ""
        self.opened = time.time()
        self.round_trips = self.bytes_in = self.bytes_out = self.graphs_registered = self.graph_runs = 0
        self.errors: Counter[str] = Counter()  # failures this session met, by kind
        self.recent: deque[tuple] = deque(maxlen=RECENT_ERRORS)  # (time, kind, message) of the last ones
        self.watch_lock = threading.Lock()  # errors and recent change on the session's thread, are read on another
        self.used = 0       # bytes counted against the quota: tensors and their ids, graphs, runs, frames in flight, replies
        self.credit = 0     # bytes taken from the budget and not yet used
        self.replying = 0   # bytes of copies made for the last replies (sent by the time the next frame comes)
        self.runs_bytes = 0  # of used: the runs remembered in self.runs (their blobs, and their plans once compiled)
        # failures that had no room to be kept, by tensor id and by graph id: the last UNKEPT of each, so a read
        # or a run still names the failure (and older ones say they were not kept)
        self.unkept: dict[int, Failure] = {}
        self.unkept_graphs: dict[int, Failure] = {}
        self.forgot_unkept = False  # whether failures not kept were forgotten past UNKEPT
        self.ceiling = 0    # how far the op path may raise used without the checks of _reserve (see _room)
        self._room()
        self._received: dict[int, int] = {}  # id of a buffer allocate() gave -> its bytes, until a message keeps it
        self._sent: dict[int, int] = {}      # tensor id -> its segment in the reply being built
        self._outgoing = 0  # bytes of the segments of the reply being built (a reply is one frame)
        self._declined: deque[str] = deque()  # why allocate() declined segments not yet handled, in order
        self._reasons: dict[int, str] = {}    # … those of the frame being handled, by segment

    # -- bookkeeping --
    def live_bytes(self) -> int:
        return sum(self.sizes.values())

    def close(self) -> None:
        # a fetch still running keeps its bytes taken from the budget: its worker gives them back when it ends
        held = sum(job.meta.nbytes for job in (*self.incoming.values(), *self.cancelled) if job.cancel(self.budget.give))
        self.incoming.clear()
        self.cancelled.clear()
        self.tensors.clear()
        self.metas.clear()
        self.sizes.clear()
        self.graphs.clear()
        self.runs.clear()
        self.budget.give(self.used + self.credit - held)
        self.used = self.credit = self.replying = self.granted = 0
        self.runs_bytes = self._outgoing = 0
        self.unkept.clear()
        self.unkept_graphs.clear()
        self.ended.clear()

    def _take(self, what: str, nbytes: int, ids: int = 0) -> None:
        """Count ``nbytes`` more (for ``ids`` new tensor ids) against the quota, the tensor cap and the
        budget, or refuse naming ``what``."""
        reason = self._reserve(nbytes, ids)
        if reason is not None:
            raise ResourceLimitError(f"{what}: {reason}")

    def _reserve(self, nbytes: int, ids: int = 0) -> str | None:
        """Count ``nbytes`` more, for ``ids`` tensor ids about to be added, if the quota, the cap on
        tensors (``limits.max_session_tensors``) and the budget have room; else why not."""
        limits = self.limits
        quota = limits.max_session_bytes
        if self.used + nbytes > quota:
            return f"{nbytes} more bytes would exceed this session's quota of {quota} bytes ({self.used} in use)"
        if ids and len(self.sizes) + ids > limits.max_session_tensors:
            return (f"{ids} more tensor(s) would exceed this session's limit of {limits.max_session_tensors} tensors "
                    f"({len(self.sizes)} held, failed ones included); drop some first")
        if nbytes > self.credit:
            wanted = nbytes - self.credit
            if self.budget.take(wanted + CREDIT):
                self.credit += wanted + CREDIT
            elif self.budget.take(wanted):
                self.credit += wanted
            else:
                return (f"{nbytes} more bytes would exceed the peer's memory budget of {self.budget.limit} bytes "
                        f"({self.budget.used} in use by all sessions)")
        self.credit -= nbytes
        self.used += nbytes
        if ids:  # (more bytes alone only lower the room the ceiling leaves: it stays right)
            self._room(ids)
        return None

    def _give(self, nbytes: int) -> None:
        self.used -= nbytes  # _give_back, inline: every drop comes here
        self.credit += nbytes
        if self.credit > 2 * CREDIT:
            self.budget.give(self.credit - CREDIT)
            self.credit = CREDIT
        self._room()

    def _give_back(self, nbytes: int) -> None:
        """:meth:`_give` without setting the ceiling again: only where the ids just added raised
        ``used`` by their overhead at least, net (a replay giving back what its outputs let go held)."""
        self.used -= nbytes
        self.credit += nbytes
        if self.credit > 2 * CREDIT:
            self.budget.give(self.credit - CREDIT)
            self.credit = CREDIT

    def _room(self, pending: int = 0) -> None:
        """Set :attr:`ceiling`, what the op path checks instead of the quota and the cap on tensors:
        the quota, lowered so that the ids still allowed (less ``pending``, ids just reserved for)
        fit in it at TENSOR_OVERHEAD each. Every id the op path adds raises ``used`` by at least
        that, so it cannot pass the cap without coming here (through ``_reserve``) first; whatever
        lowers ``used`` or adds ids otherwise calls this after."""
        limits = self.limits
        self.ceiling = min(limits.max_session_bytes,
                           self.used + TENSOR_OVERHEAD * (limits.max_session_tensors - len(self.sizes) - pending))

    def allocate(self, shape: tuple, dtype) -> np.ndarray | None:
        """Where a received tensor goes (the frame reader's hook, once the session is open): a
        buffer counted against the quota and the budget, or None to read its bytes and drop them.
        The tensor id it becomes is counted too (TENSOR_OVERHEAD): a frame of empty tensors costs."""
        reason = self._reserve(math.prod(shape) * dtype.itemsize + TENSOR_OVERHEAD)
        if reason is not None:  # why, for the message that meets this segment (frames come in order)
            self._declined.append(reason)
            return None
        array = self.pool.allocate(shape, dtype)
        self._received[id(array)] = array.nbytes + TENSOR_OVERHEAD
        return array

    def _store(self, tid, value, meta: Meta | None, counted: bool) -> None:
        """Keep ``value`` as tensor ``tid`` (a Failure has no meta; None frees the id), counting its
        bytes and its id's overhead unless ``counted`` (a received segment's reservation has them).
        A value with no room is kept as its refusal; a failure with no room is not kept (its error is
        still reported, and the last UNKEPT such failures are remembered apart, so a read names it)."""
        _check_id(tid)
        if self.incoming and tid in self.incoming:
            self._forget_fetch(tid)
        if self.unkept:
            self.unkept.pop(tid, None)
        old = self.sizes.pop(tid, None)
        self.metas.pop(tid, None)
        if old is not None:
            self._give(old)
        if self._sent:
            self._sent.pop(tid, None)
        if value is None:
            self.tensors.pop(tid, None)
            return
        nbytes = TENSOR_OVERHEAD if meta is None else meta.nbytes + TENSOR_OVERHEAD
        limits = self.limits
        if meta is None and (len(self.sizes) >= limits.max_session_tensors or
                             self.used + nbytes > limits.max_session_bytes):  # the common refusal, without its message
            self.tensors.pop(tid, None)
            self._remember(self.unkept, tid, value)
            return
        if not counted:
            reason = self._reserve(nbytes, 1)
        elif len(self.sizes) >= limits.max_session_tensors:  # its bytes were reserved as it arrived; its id was not
            self._give(nbytes)
            reason = self._reserve(0, 1)
        else:
            reason = None
        if reason is not None:
            self.tensors.pop(tid, None)
            if meta is None:  # a failure with no room: the id stays free, its failure is remembered (UNKEPT)
                self._remember(self.unkept, tid, value)
                return
            poison = self._fail("ResourceLimitError", f"put of tensor {tid}: {reason}")
            self._report(poison)
            self._store(tid, poison, None, False)
            return
        if meta is not None:
            self.metas[tid] = meta
        sizes = self.sizes
        sizes[tid] = nbytes
        self.tensors[tid] = value
        # _room, inline (every put comes here): its reservation may predate the last time the ceiling was set
        self.ceiling = min(limits.max_session_bytes,
                           self.used + TENSOR_OVERHEAD * (limits.max_session_tensors - len(sizes)))

    def _fail(self, kind: str, message: str) -> Failure:
        """A new failure, counted by kind for the peer's status (its message is shown there too)."""
        with self.watch_lock:  # failures are rare: the lock costs the op path nothing
            self.errors[kind] += 1
            self.recent.append((time.time(), kind, message[:KEPT_CHARACTERS]))
        return Failure(kind, message)

    def _report(self, failure: Failure) -> None:
        """Report ``failure`` at the next sync, unless one is reported there already: a sync
        reports the first, so only the first is kept (a client that never syncs holds no list)."""
        if not self.unreported:
            self.unreported.append(failure)

    def _poison(self, outputs, kind: str, message: str) -> None:
        poison = self._fail(kind, message)
        for tid in outputs:
            self._store(tid, poison, None, False)
        self._report(poison)

    def _remember(self, unkept: dict, key: int, failure: Failure) -> None:
        """Remember ``failure`` as that of ``key`` (a tensor or graph id) that had no room to be kept."""
        if len(unkept) >= UNKEPT:  # the older half goes at once: a constant cost per failure, however many come
            newer = list(unkept.items())[UNKEPT // 2:]
            unkept.clear()
            unkept.update(newer)
            self.forgot_unkept = True
        unkept[key] = failure

    def _unknown(self, tid) -> str:
        """Why tensor ``tid`` is unknown to this session."""
        if self.forgot_unkept:
            return f"unknown tensor id {tid!r} (dropped, from another session, or a failure this session had no room to keep)"
        return f"unknown tensor id {tid!r} (dropped, or from another session)"

    # -- the frame handler --
    def handle(self, frame: Frame) -> list[tuple[dict, list]]:
        if self.replying:  # the last replies were sent before this frame was read: their copies are gone
            self._give(self.replying)
            self.replying = 0
        if self.granted:
            self.transfers.purge()  # grants past their time end, and give their bytes back here
            ended = self.ended
            while ended:
                nbytes = ended.popleft()
                self.granted -= nbytes
                self._give(nbytes)
        if self._sent:
            self._sent = {}
        if self._outgoing:
            self._outgoing = 0
        if not frame.segments:  # most frames: ops, drops and reads
            if self._reasons:
                self._reasons = {}
            replies = self._handle(frame)
        else:
            self._reasons = {i: self._declined.popleft() if self._declined else "declined"
                             for i, segment in enumerate(frame.segments) if segment is None}
            self.bytes_in += sum(s.nbytes for s in frame.segments if s is not None)
            try:
                replies = self._handle(frame)
            finally:  # received tensors no message kept (a refused frame, an unused segment) count no more
                received = self._received
                for segment in frame.segments:
                    nbytes = received.pop(id(segment), 0) if segment is not None else 0
                    if nbytes:
                        self._give(nbytes)
        for _, segments in replies:  # the client waits for each reply: one round trip
            self.round_trips += 1
            for segment in segments:
                self.bytes_out += segment.nbytes
        return replies

    def _handle(self, frame: Frame) -> list[tuple[dict, list]]:
        header = frame.header
        kind = header.get("t")
        if kind == "close":
            return []
        if kind != "batch":
            raise ProtocolError(f"unexpected frame type {kind!r} in a session")
        messages = header.get("m", ())
        if not isinstance(messages, tuple):
            raise ProtocolError("a batch's 'm' must be a list of messages")
        replies: list = []
        segments: list = []
        handlers, run_op, received = self._HANDLERS, self._op, frame.segments
        for message in messages:
            try:
                if type(message) is not tuple or not message or type(message[0]) is not str:
                    raise ProtocolError(f"malformed message {message!r:.80}")
                if message[0] == "op" and len(message) == 5:
                    run_op(message)  # an op alone: no dispatch, no slicing
                    continue
                handler = handlers.get(message[0])
                if handler is None:
                    raise ProtocolError(f"unknown message type {message[0]!r}")
                handler(self, message[1:], received, replies, segments)
            except (TypeError, ValueError, IndexError) as error:
                if isinstance(error, EmberError):
                    raise
                raise ProtocolError(f"malformed {message[0]!r:.20} message: {error}") from None
        return [({"t": "reply", "m": replies}, segments)] if replies else []

    def _op(self, message) -> None:
        _, name, inputs, outputs, attrs = message  # ("op", *record): ops/records.py
        if type(outputs) is not tuple or type(inputs) is not tuple or type(attrs) is not dict:
            raise ProtocolError("an op message is (name, inputs, outputs, attrs)")
        self.ops += 1
        tensors, known = self.tensors, self.metas
        handles, metas = [], []
        for ref in inputs:
            if type(ref) is int:
                value = tensors.get(ref)
                if value is not None and type(value) is not Failure:
                    handles.append(value)
                    metas.append(known[ref])
                    continue
            if type(ref) is tuple:  # a literal: (value, dtype name), in the form the engine's kernels take fastest
                meta = literal_meta(name, ref)
                metas.append(meta)
                handles.append(self.engine.literal(ref[0], meta.dtype))
                continue
            # here the reference names no live tensor: a failure upstream, one being fetched, or nothing at all
            value = tensors.get(ref) if type(ref) is int else None
            if value is None and self.incoming and type(ref) is int and ref in self.incoming:
                self.ops -= 1  # counted again by the retry
                self._settle(ref)
                self._op(message)
                return
            if value is None and self.unkept and type(ref) is int:
                value = self.unkept.get(ref)  # a failure that had no room: it travels all the same
            if type(value) is Failure:  # the failure travels to everything that depends on it
                for tid in outputs:
                    self._store(tid, value, None, False)
            else:
                self._poison(outputs, "ExecutionError", f"{name}: {self._unknown(ref)}")
            return
        try:
            metas = tuple(metas)
            op, attrs, out_metas = infer_record(name, metas, outputs, attrs)
            # most ops: one output of a known size and no scratch, counted inline (this is every op's path)
            simple = len(out_metas) == 1 and not op.multiple and op.scratch is None and not op.data_dependent
            if simple:
                meta = out_metas[0]
                need = meta.nbytes
                if need > self.limits.max_tensor_bytes:
                    self._check_size(name, out_metas)
                need += TENSOR_OVERHEAD  # its id's entries, in the one reservation
            else:
                need = self._need(op, metas, attrs, out_metas)
            if need <= self.credit and self.used + need <= self.ceiling:  # the quota and the cap on tensors (_room)
                self.credit -= need
                self.used += need
            else:
                self._take(name, need, sum(type(o) is int and o not in self.sizes for o in outputs))
            try:
                if simple:
                    value = self.engine.apply(op, tuple(handles), metas, attrs, meta)
                else:
                    values, out_metas = self.engine.execute(op, tuple(handles), metas, attrs, out_metas)
                    if op.data_dependent:  # now that the sizes are known, each must fit the tensor limit
                        self._check_size(name, out_metas)
            except BaseException:
                self._give(need)
                raise
        except Exception as error:  # a peer never crashes on bad input: the outputs carry the error
            text = str(error)
            self._poison(outputs, _error_kind(error), text if text.startswith((str(name), "unknown op")) else f"{name}: {text}")
            return
        tid = outputs[0] if simple else None
        if type(tid) is int and tid >= 0 and tid not in self.sizes and not self._sent:
            tensors[tid] = value  # a new tensor: the reservation is its size
            known[tid] = meta
            self.sizes[tid] = need
        else:
            self._keep(outputs, (value,) if simple else values, out_metas, need, not simple)

    def _ops(self, body, frame_segments, replies, segments) -> None:
        """A run of one-output ops, its tensor ids relative (runs.py): replayed from its plan when the
        session has one that fits, else op by op — and compiled at its second sighting."""
        base, inputs, blob = body
        if type(base) is not int or type(inputs) is not tuple:
            raise ProtocolError("an ops message is (base, inputs, blob)")
        known = self.runs.get(blob) if type(blob) is bytes else None
        if type(known) is RunPlan and known.replay(self, base, inputs):
            return
        records, let_go = records_of(blob)
        ended = endings(records, let_go) if let_go else {}
        run_op = self._op
        for index, message in enumerate(absolute(records, base, inputs)):
            run_op(message)
            if index in ended:  # outputs the client let go, after their last use here
                self._drop((tuple(base + ref for ref in ended[index]),), None, None, None)
        # what the session learns of runs is counted like the rest; with no room for it, a run goes op by op
        if known is None and len(blob) <= KEPT_BLOB_BYTES:
            if len(self.runs) >= KEPT_RUNS:
                self.runs.clear()
                self._give(self.runs_bytes)
                self.runs_bytes = 0
            cost = len(blob) + RUN_OVERHEAD
            if self._reserve(cost) is None:
                self.runs[blob] = 1
                self.runs_bytes += cost
        elif type(known) is int:  # the second sighting
            cost, plan = RUN_OP_BYTES * len(records), NOT_COMPILED
            if self._reserve(cost) is None:
                plan = RunPlan.compile(self, records, let_go, ended, base, inputs, TENSOR_OVERHEAD)
                if plan is NOT_COMPILED:
                    self._give(cost)
                else:
                    self.runs_bytes += cost
            self.runs[blob] = plan

    def _keep(self, outputs: tuple, values, out_metas: tuple, reserved: int, partly: bool = True) -> None:
        """Store an op's or a run's outputs; of the bytes ``reserved`` for it, they keep theirs — data
        and id overhead — (all of them unless ``partly``: the outputs' sizes were all the reservation)."""
        for tid in outputs:
            if type(tid) is not int or tid < 0:
                self._give(reserved)
                _check_id(tid)
        if self.incoming:
            for tid in outputs:
                if tid in self.incoming:
                    self._forget_fetch(tid)
        freed = 0
        if len(outputs) == 1 and not partly:
            kept = (reserved,)
        else:
            kept = [m.nbytes + TENSOR_OVERHEAD for m in out_metas]
            if partly:
                freed = reserved - sum(kept)
        tensors, known, sizes = self.tensors, self.metas, self.sizes
        for tid, value, meta, nbytes in zip(outputs, values, out_metas, kept):
            old = sizes.get(tid)
            if old is not None:  # a tensor written again: the old one's bytes go back
                freed += old
            tensors[tid] = value
            known[tid] = meta
            sizes[tid] = nbytes
        self._give(freed)  # after the ids are in: the op path's ceiling counts them (_room)
        if self._sent:
            for tid in outputs:
                self._sent.pop(tid, None)

    def _need(self, op, in_metas: tuple, attrs: dict, out_metas: tuple) -> int:
        """The bytes an op may hold while it runs: its outputs — a data-dependent one at its largest,
        as many elements as the largest input — with their ids' overhead, and its kernels' scratch
        (the row's ``scratch`` rule). An output or a scratch past the peer's tensor limit is refused:
        the limit bounds every allocation a client causes, not only the tensors it names."""
        need = TENSOR_OVERHEAD * len(out_metas)
        for meta in out_metas:
            shape = meta.shape
            if None in shape:  # its size is checked against the tensor limit once it is known
                need += max(math.prod(m.shape) for m in in_metas) * meta.dtype.itemsize  # such ops have inputs
                continue
            nbytes = meta.nbytes
            if nbytes > self.limits.max_tensor_bytes:
                self._check_size(op.name, (meta,))
            need += nbytes
        if op.scratch is not None:
            scratch = op.scratch(in_metas, out_metas, attrs)
            limit = self.limits.max_tensor_bytes
            if scratch > limit:
                raise ResourceLimitError(f"{op.name}: its kernels need {scratch} bytes of scratch, more than the peer's "
                                         f"tensor limit of {limit} bytes")
            need += scratch
        return need

    def _put(self, body, frame_segments, replies, segments) -> None:
        tid, index = body
        host = frame_segments[index]
        if host is None:  # declined while it was received: the quota or the budget had no room
            self._poison((tid,), "ResourceLimitError", f"put of tensor {tid}: {self._reason(index)}")
            return
        _check_id(tid)  # before its buffer's reservation passes to the tensor
        counted = self._received.pop(id(host), None) is not None
        handle = self.engine.upload(host)
        self._store(tid, handle, Meta(tuple(host.shape), dt.FROM_NUMPY[host.dtype]), counted)
        if handle is not host:  # the backend copied it (to a GPU): the buffer can serve the next upload
            frame_segments[index] = None
            offered = [host]
            del host  # the list holds the only reference
            self.pool.release(offered)

    def _reason(self, index: int) -> str:
        """Why segment ``index`` of the frame being handled was declined."""
        return self._reasons.get(index, "declined")

    def _read(self, tid, rid, replies) -> object | None:
        value = self.tensors.get(tid) if isinstance(tid, int) else None
        if value is not None and type(value) is not Failure:  # the common case: a live tensor
            return value
        if value is None and self.incoming and type(tid) is int and tid in self.incoming:
            self._settle(tid)
            value = self.tensors.get(tid)
        if value is None and self.unkept and type(tid) is int:
            value = self.unkept.get(tid)
        if value is None:
            failure = self._fail("ExecutionError", self._unknown(tid))
            replies.append(("error", rid, failure.kind, failure.message))
            return None
        if type(value) is Failure:
            replies.append(("error", rid, value.kind, value.message))
            return None
        return value

    def _get(self, body, frame_segments, replies, segments) -> None:
        rid, tid = body
        index = self._sent.get(tid) if type(tid) is int else None
        if index is None:  # each tensor goes once per reply, however often a batch reads it
            value = self._read(tid, rid, replies)
            if value is None:
                return
            host = self.engine.download(value)
            try:
                # a reply is one frame: the client refuses one past the frame limit, so none is built
                limits = self.limits
                room = limits.max_frame_bytes - limits.max_header_bytes
                if self._outgoing + host.nbytes > room:
                    raise ResourceLimitError(f"get of tensor {tid}: the reply would hold {self._outgoing + host.nbytes} "
                                             f"bytes of tensors, more than the peer's frame limit of "
                                             f"{limits.max_frame_bytes} bytes allows; read fewer tensors at once")
                if not host.flags.c_contiguous:  # the frame needs its bytes in C order: a copy, counted
                    # a reply's copies are scratch of one answer: together held to the tensor limit, so a few KB of
                    # reads of views cannot make the peer copy more than one tensor's worth
                    copies = self.replying + host.nbytes
                    if copies > limits.max_tensor_bytes:
                        raise ResourceLimitError(f"get of tensor {tid}: this reply's copies of tensors not in C order "
                                                 f"would take {copies} bytes, more than the peer's tensor limit of "
                                                 f"{limits.max_tensor_bytes} bytes; read fewer such views at once")
                    self._take(f"get of tensor {tid}", host.nbytes)
                    self.replying += host.nbytes
                    host = np.ascontiguousarray(host)
            except ResourceLimitError as error:
                failure = self._fail("ResourceLimitError", str(error))
                replies.append(("error", rid, failure.kind, failure.message))
                return
            self._outgoing += host.nbytes
            index = self._sent[tid] = len(segments)
            segments.append(host)
        replies.append(("data", rid, index))

    def _shape(self, body, frame_segments, replies, segments) -> None:
        rid, ids = body
        shapes = []
        for tid in ids:
            if self._read(tid, rid, replies) is None:
                return
            shapes.append(self.metas[tid].shape)
        replies.append(("shapes", rid, tuple(shapes)))

    def _sync(self, body, frame_segments, replies, segments) -> None:
        (rid,) = body
        for tid in list(self.incoming):  # every transfer is done, and its failure reported, by a sync
            self._settle(tid)
        if self.unreported:
            first = self.unreported[0]
            self.unreported.clear()
            replies.append(("error", rid, first.kind, first.message))
        else:
            replies.append(("ok", rid))

    def _drop(self, body, frame_segments, replies, segments) -> None:
        (ids,) = body
        tensors, metas, sizes = self.tensors, self.metas, self.sizes
        dropped: list = []  # the only references to the values dropped, for the pool to judge
        freed, unkept = 0, self.unkept
        try:
            for tid in ids:
                if self.incoming and tid in self.incoming:
                    self._forget_fetch(tid)  # its fetch is cancelled
                dropped.append(tensors.pop(tid, None))
                metas.pop(tid, None)
                freed += sizes.pop(tid, 0)
                if unkept:
                    unkept.pop(tid, None)
        finally:  # a malformed id ends the frame; what was dropped before it is given back
            self.pool.release(dropped)
            if freed:
                self._give(freed)

    def _stats(self, body, frame_segments, replies, segments) -> None:
        (rid,) = body
        # session_bytes: its tensors' (and their ids'); session_used_bytes: all its quota counts (graphs, runs, grants…)
        stats = {"session_tensors": len(self.tensors), "session_bytes": self.live_bytes(), "session_used_bytes": self.used,
                 "session_ops": self.ops,
                 "session_runs_replayed": self.runs_replayed, "session_graphs": len(self.graphs)}
        if self.registry is not None:
            stats.update(self.registry.stats())
        replies.append(("stats", rid, stats))

    # -- graphs: registered once, then run by number --
    def _graph(self, body, frame_segments, replies, segments) -> None:
        gid, inputs, outputs, ops, constants = body
        _check_graph_id(gid)
        self._drop_graph(gid)  # a number registered again is a new graph
        if self.unkept_graphs:
            self.unkept_graphs.pop(gid, None)
        self.graphs_registered += 1
        limits = self.limits
        # its entry, kept even if the graph is refused (its runs report why): unless there is no room for one
        reason = f"this session keeps {limits.max_session_graphs} graphs, the peer's limit; forget some first" \
            if len(self.graphs) >= limits.max_session_graphs else self._reserve(GRAPH_OVERHEAD)
        if reason is not None:
            failure = self._fail("ResourceLimitError", f"graph: graph {gid} is not kept: {reason}")
            self._report(failure)
            self._remember(self.unkept_graphs, gid, failure)  # its runs report it
            return
        known, values, held, transient, need = {}, {}, GRAPH_OVERHEAD, 0, 0
        records, needs, error, plan = [], [], None, None
        try:  # validate the whole graph once: its size, every constant, every row's meta rule, every limit
            for what, nodes in (("ops", ops), ("inputs", inputs), ("outputs", outputs), ("constants", constants)):
                if type(nodes) is not tuple:
                    raise ProtocolError(f"a graph's {what} are a list")
                if len(nodes) > limits.max_graph_ops:  # refused before anything is built from it
                    raise ResourceLimitError(f"{len(nodes)} {what} in graph {gid}, more than the peer's limit of "
                                             f"{limits.max_graph_ops} per graph")
            nodes = GRAPH_NODE_BYTES * (len(ops) + len(inputs) + len(outputs))
            self._take(f"registering graph {gid}", nodes)  # what the registered graph keeps of each node
            held += nodes
            self._take(f"registering graph {gid}", GRAPH_COMPILE_BYTES * len(ops))  # while it is checked and compiled
            transient = GRAPH_COMPILE_BYTES * len(ops)
            known = {tid: Meta(tuple(shape), dtype) for tid, dtype, shape in inputs}
            for tid, index in constants:
                host = frame_segments[index]
                if host is None:
                    raise ResourceLimitError(f"constant {tid}: {self._reason(index)}")
                meta = Meta(tuple(host.shape), dt.FROM_NUMPY[host.dtype])
                nbytes = self._received.pop(id(host), None)  # reserved as it arrived
                if nbytes is None:
                    nbytes = host.nbytes + TENSOR_OVERHEAD
                    self._take(f"constant {tid}", nbytes)
                held += nbytes  # the graph keeps its constants until it is forgotten
                values[tid], known[tid] = self.engine.upload(host), meta
            for row, refs, outs, attrs, in_metas, out_metas in check_records(ops, known):
                if any(None in m.shape for m in out_metas):
                    raise ProtocolError(f"{row.name}: data-dependent shapes cannot be part of a graph")
                needs.append(self._need(row, in_metas, attrs, out_metas))  # its outputs and its kernels' scratch
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
            error = self._fail(_error_kind(failure), f"graph: {failure}")
            self._give(held - GRAPH_OVERHEAD)  # a refused graph keeps its entry alone
            held = GRAPH_OVERHEAD
        finally:
            self._give(transient)
        if error is not None:
            self.graphs[gid] = RegisteredGraph.refused(error, held)
            return
        input_metas = tuple((tid, known[tid]) for tid, _, _ in inputs)
        self.graphs[gid] = RegisteredGraph(input_metas, tuple(outputs), plan, {o: known[o] for o in outputs}, None,
                                           held, need)

    def _run(self, body, frame_segments, replies, segments) -> None:
        gid, input_ids, output_ids = body
        _check_graph_id(gid)
        graph = self.graphs.get(gid)
        if graph is None and self.unkept_graphs and gid in self.unkept_graphs:
            graph = RegisteredGraph.refused(self.unkept_graphs[gid])  # refused with no room for its entry
        if graph is None:
            self._poison(output_ids, "ExecutionError", f"run: unknown graph {gid!r}")
            return
        inputs, outputs, error = graph.inputs, graph.outputs, graph.error
        self.graph_runs += 1  # a run of a registered graph: the registration is reused (a cache hit)
        if error is not None:
            for tid in output_ids:
                self._store(tid, error, None, False)
            self._report(error)
            return
        if len(input_ids) != len(inputs) or len(output_ids) != len(outputs):
            self._poison(output_ids, "ProtocolError", f"run: graph {gid!r} takes {len(inputs)} inputs and gives "
                                                      f"{len(outputs)} outputs; got {len(input_ids)} input ids and "
                                                      f"{len(output_ids)} output ids")
            return
        values = []
        for (node, meta), tid in zip(inputs, input_ids):
            value = self.tensors.get(tid)
            if value is None and self.incoming and type(tid) is int and tid in self.incoming:
                self._settle(tid)
                value = self.tensors.get(tid)
            if value is None and self.unkept and type(tid) is int:
                value = self.unkept.get(tid)
            if value is None:
                self._poison(output_ids, "ExecutionError", f"run: {self._unknown(tid)}")
                return
            if type(value) is Failure:  # the failure travels on, reported once
                for out in output_ids:
                    self._store(out, value, None, False)
                return
            if self.metas[tid] != meta:
                self._poison(output_ids, "ShapeError", f"run: input {node} expects {meta.shape} {meta.dtype}, "
                                                        f"got {self.metas[tid].shape} {self.metas[tid].dtype}")
                return
            values.append(value)
        plan, need = graph.plan, graph.need
        try:
            self._take(f"run of graph {gid}", need, sum(type(o) is int and o not in self.sizes for o in output_ids))
            try:
                results = plan.run(values)
            except BaseException:
                self._give(need)
                raise
        except Exception as failure:
            self._poison(output_ids, _error_kind(failure), str(failure))
            return
        self.ops += len(plan.steps)
        self._keep(output_ids, results, tuple(graph.out_metas[node] for node in outputs), need)

    def _forget(self, body, frame_segments, replies, segments) -> None:
        (gid,) = body
        _check_graph_id(gid)
        self._drop_graph(gid)
        if self.unkept_graphs:
            self.unkept_graphs.pop(gid, None)

    def _drop_graph(self, gid) -> None:
        graph = self.graphs.pop(gid, None)
        if graph is not None:
            self._give(graph.held)  # its entry, nodes and constants

    def _check_size(self, name, out_metas) -> None:
        limit = self.limits.max_tensor_bytes
        for meta in out_metas:
            if None not in meta.shape and meta.nbytes > limit:
                raise ResourceLimitError(f"{name}: an output of shape {meta.shape} {meta.dtype} exceeds the peer's "
                                         f"tensor limit of {limit} bytes")

    # -- transfers between peers (transfers.py): grant on the source, fetch on the destination --
    def _grant(self, body, frame_segments, replies, segments) -> None:
        """``["grant", id, capability, session]``: tensor ``id`` may be read once by ``session`` with
        ``capability``. The value is taken now (every earlier op has run); its bytes stay counted
        until the grant ends, so a dropped tensor cannot outlive the quota through a grant."""
        tid, capability, session = body
        if type(capability) is not bytes or len(capability) != CAPABILITY_BYTES:
            raise ProtocolError(f"a capability is {CAPABILITY_BYTES} random bytes")
        if type(session) is not str or not 0 < len(session) <= 64:
            raise ProtocolError("a grant names the session it is for")
        _check_id(tid)
        if tid in self.incoming:
            self._settle(tid)
        value, meta, nbytes = self.tensors.get(tid), self.metas.get(tid), 0
        if value is None:
            value = self._fail("ExecutionError", self._unknown(tid))
        elif type(value) is not Failure:
            nbytes = meta.nbytes
            reason = self._reserve(nbytes)
            if reason is not None:
                value, nbytes = self._fail("ResourceLimitError", f"grant of tensor {tid}: {reason}"), 0
        refusal = self.transfers.grant(Grant(capability, session, value, self, nbytes))
        if refusal is not None:
            self._give(nbytes)
            self._report(self._fail("ResourceLimitError", refusal))
        else:
            self.granted += nbytes

    def _fetch(self, body, frame_segments, replies, segments) -> None:
        """``["fetch", id, dtype, shape, scheme, host, port, capability, peer]``: tensor ``id`` is the
        tensor granted with ``capability`` on the peer at ``scheme://host:port`` (whose identity is
        ``peer``). Its bytes are counted now; the shell fetches it (see transfers.Fetch) and the
        session takes the outcome when the tensor is first used."""
        tid, dtype, shape, scheme, host, port, capability, peer = body
        _check_id(tid)
        if not isinstance(dtype, dt.DType) or type(shape) is not tuple or len(shape) > 64 or \
                not all(type(n) is int and n >= 0 for n in shape):
            raise ProtocolError("a fetch names the tensor's dtype and shape")
        if scheme not in SCHEMES or not is_host(host) or type(port) is not int \
                or not 0 < port < 65536 or type(peer) is not str or len(peer) > 64:
            raise ProtocolError("a fetch names the source peer as scheme, host, port and identity")
        if type(capability) is not bytes or len(capability) != CAPABILITY_BYTES:
            raise ProtocolError(f"a capability is {CAPABILITY_BYTES} random bytes")
        meta = Meta(shape, dtype)
        job = Fetch(tid, meta, scheme, host, port, capability, self.id, local=peer == self.peer, peer=peer)
        try:
            if len(self.incoming) + len(self.cancelled) >= FETCHES_PER_SESSION:
                # those of dropped tensors count until their worker ends: a drop does not make room for more threads
                self.cancelled = [f for f in self.cancelled if not f.over]
                if sum(not f.done.is_set() for f in self.incoming.values()) + len(self.cancelled) >= FETCHES_PER_SESSION:
                    raise ResourceLimitError(f"transfer from {job.source}: {FETCHES_PER_SESSION} transfers to this session "
                                             f"are running already (those of dropped tensors until they stop); read "
                                             f"some of their tensors first")
            self._check_size(f"transfer from {job.source}", (meta,))
            nbytes = meta.nbytes + TENSOR_OVERHEAD
            self._take(f"transfer from {job.source}", nbytes, 1)
        except ResourceLimitError as error:
            self._poison((tid,), "ResourceLimitError", str(error))
            return
        self._store(tid, None, None, False)  # whatever the id held goes
        self.tensors.pop(tid, None)
        self.sizes[tid] = nbytes
        self._room()
        self.incoming[tid] = job
        if self.runner is not None:
            self.runner(job)
        else:
            self.fetches.append(job)

    def _settle(self, tid) -> None:
        """Wait for the fetch of tensor ``tid`` and keep its value, or the failure naming it."""
        job = self.incoming.pop(tid)
        outcome = job.wait()
        if type(outcome) is not Failure:
            try:
                value = self.engine.backend.adopt(outcome) if job.local else self.engine.upload(outcome)
            except Exception as error:
                outcome = Failure(_error_kind(error), f"transfer from {job.source}: {error}")
        if type(outcome) is Failure:
            self._poison((tid,), outcome.kind, outcome.message)
            return
        self.tensors[tid] = value
        self.metas[tid] = job.meta

    def _forget_fetch(self, tid) -> None:
        """Tensor ``tid``, being fetched, goes (dropped, written again): its fetch is cancelled. While
        a worker still performs it, its bytes stay counted (moved to ``granted``): the buffer it
        receives into exists until the worker ends, and hands them back then (``ended``)."""
        job = self.incoming.pop(tid)
        if job.cancel(self.ended.append):  # the worker hands back the tensor's bytes; its id's overhead goes now
            self._give(self.sizes.pop(tid) - job.meta.nbytes)
            self.granted += job.meta.nbytes
            self.cancelled.append(job)
        if len(self.cancelled) > 64:  # those over are let go now and then, not at each drop
            self.cancelled = [f for f in self.cancelled if not f.over]

    # "op" messages of the right length go straight to _op; this entry sees malformed ones
    _HANDLERS = {"op": lambda self, body, *_: self._op(("op", *body)), "put": _put, "get": _get, "shape": _shape,
                 "sync": _sync, "drop": _drop, "stats": _stats, "graph": _graph, "run": _run, "forget": _forget,
                 "grant": _grant, "fetch": _fetch, "ops": _ops}


class Registry:
    """The open sessions of a peer, each naming its client (``session.client``, as logs and the
    status name it), for its counters and its status. The peer's caps on tensors and graphs
    follow from theirs: at most ``max_sessions`` sessions, each within ``max_session_tensors``
    and ``max_session_graphs``, and every id and graph costs its overhead (TENSOR_OVERHEAD,
    GRAPH_OVERHEAD) of the one budget, so the budget over the overhead bounds them all together."""

    def __init__(self):
        self.lock = threading.RLock()  # reentrant: a status snapshot holds it while it sums the host's totals
        self.sessions: set[Session] = set()

    def stats(self) -> dict:
        with self.lock:
            sessions = list(self.sessions)
        return {"sessions": len(sessions), "live_tensors": sum(len(s.tensors) for s in sessions)}


class Host:
    """The peer's side of every handshake: the hosted devices, who may connect (a token, or an
    authorizer: see access.py), the limits, the cap on sessions and the registry of open
    sessions. :meth:`open` is the handshake, fed the first frame."""

    def __init__(self, devices: list[LocalDevice], token: str | None, limits: Limits, budget: Budget | None = None, *,
                 authorize=None, max_sessions: int | None = None, transfers: Transfers | None = None):
        self.devices, self.token, self.limits = devices, token, limits
        self.identity = uuid.uuid4().hex  # tells a client that two of its sessions are on this one peer
        self.transfers = transfers if transfers is not None else Transfers()  # grants, for every session
        self.authorize = authorize or (single_token(token) if token else None)
        self.throttle = Throttle()  # failed tokens, per address: at the handshake and on the status paths alike
        self.max_sessions = max_sessions
        self.registry = Registry()
        self.budget = budget or Budget()
        self.pool = BufferPool(budget=self.budget)  # shared by every session, within the budget
        # for the status page and /metrics (status.py): what closed sessions did, failures, throughput samples
        self.started = time.time()
        self.retired: Counter[str] = Counter()  # the counters of closed sessions (COUNTED), summed
        self.errors: Counter[str] = Counter()   # refusals, protocol errors and closed sessions' failures, by kind
        self.recent: deque[tuple] = deque(maxlen=RECENT_ERRORS)  # (time, client, kind, message)
        self.history: deque[tuple] = deque(maxlen=HISTORY)  # (time, {counter: total}) every few seconds
        self.watch_lock = threading.Lock()  # guards the four above (taken after registry.lock, never before)

    def failed(self, client: str, kind: str, message: str) -> None:
        """Count a failure outside any session's ops (a refused handshake, a broken frame)."""
        with self.watch_lock:
            self.errors[kind] += 1
            self.recent.append((time.time(), client, kind, message[:KEPT_CHARACTERS]))

    def totals(self) -> dict:
        """Each of COUNTED summed over every session the peer has had, open or closed."""
        with self.registry.lock:  # a closing session moves its counts into retired under this lock
            with self.watch_lock:
                totals = Counter(self.retired)
            for session in self.registry.sessions:
                for name in COUNTED:
                    totals[name] += getattr(session, name)
        return {name: totals[name] for name in COUNTED}

    def sample(self, now: float) -> None:
        """Remember the totals at ``now`` (the shell calls it every few seconds: the throughput chart)."""
        totals = self.totals()
        with self.watch_lock:
            self.history.append((now, totals))

    def admits(self, address: str, token) -> Viewer | None:
        """Who a request for the status presenting ``token`` is — a :class:`Viewer`: its name (else
        its address) and role — if this peer's access rule knows the token; None if not. Tokens are
        compared as the handshake compares them (in constant time), and counted by its throttle:
        Throttled (an AccessDenied saying how long) while the address must wait. Without a rule
        every request is the admin's."""
        if self.authorize is None:
            return Viewer(address, "admin")
        guess = is_guess(token)
        if guess:
            wait = self.throttle.admit(address, time.monotonic())
            if wait:
                raise Throttled(address, wait)
        viewer, known = self._viewer(address, token)
        if guess and (viewer is not None or known):
            self.throttle.passed(address, good=viewer is not None)
        elif guess:
            log.warning("%s: refused a request for the status: a wrong token (%d from this address lately)", address,
                        self.throttle.failures(address)[0])
        return viewer

    def _viewer(self, address: str, token) -> tuple[Viewer | None, bool]:
        """The viewer ``token`` is (or None), and whether the rule knew the token all the same."""
        rule = getattr(self.authorize, "viewer", None)
        if rule is not None:
            try:
                return rule(address, token), False
            except Exception as error:  # a broken rule admits no one
                log.error("%s: refused a request for the status: the authorizer's viewer() failed: %s", address,
                          _redact("".join(traceback.format_exception(error)).rstrip(), token))
                return None, False
        known = False
        for index in range(len(self.devices)):  # admitted to any hosted device: it sees the sessions of its name
            try:
                verdict = self.authorize(address, token, index)
            except NotPermitted:
                known = True
                continue
            except Exception:  # AccessDenied, or a broken authorizer: not admitted
                continue
            if verdict is not False:
                return Viewer(verdict if isinstance(verdict, str) else address), True
        return None, known

    @property
    def backend_name(self) -> str:
        return self.devices[0].backend_name

    def open(self, frame: Frame, pool: BufferPool | None = None, address: str = "") -> tuple[Session | None, list[Reply]]:
        """The handshake: an ``init`` frame in; a new session and its ``info`` reply, or None and
        a ``refuse`` reply (a wrong version, a refused client, a device index it lacks, no room
        left). ``address`` ("host:port") is the client's, for the authorizer and as its name.
        ProtocolError if it is not an init at all."""
        header = frame.header
        if header.get("t") != "init":
            raise ProtocolError("the first frame must be an init")

        def refuse(kind: str, reason: str, **extra) -> tuple[None, list[Reply]]:
            self.failed(address, kind, reason)
            return None, [({"t": "refuse", "kind": kind, "reason": reason, **extra}, [])]

        version = header.get("v")
        if version != wire.VERSION:
            return refuse("ProtocolError", f"protocol version {version!r} is not supported: this peer speaks version "
                                           f"{wire.VERSION}")
        token = header.get("token")
        index = header.get("device", 0)
        client = address
        if self.authorize is not None:
            guess = is_guess(token)  # no token tries none: it is not counted, nor slowed down
            if guess:
                wait = self.throttle.admit(address, time.monotonic())
                if wait:  # refused unchecked: no thread waits, and the answer says nothing of the token
                    return refuse("AccessDenied", str(Throttled(address, wait)), wait=round(wait, 3))
            try:
                verdict = self.authorize(address, token, index)
            except NotPermitted as denied:  # a good token, for something else: no failure
                if guess:
                    self.throttle.passed(address, good=False)
                return refuse("AccessDenied", _redact(str(denied), token))
            except AccessDenied as denied:
                return refuse("AccessDenied", _redact(str(denied), token))
            except Exception as error:  # a broken authorizer refuses; the peer lives on
                if guess:
                    self.throttle.passed(address, good=False)  # the peer's failure, not the client's
                log.error("%s: refused: the authorizer failed: %s", address,
                          _redact("".join(traceback.format_exception(error)).rstrip(), token))
                return refuse("AccessDenied", "the peer could not check this client's access: its authorizer failed "
                                              "(the peer's log says why)")
            if verdict is False:
                return refuse("AccessDenied", "the peer's authorizer refused this client")
            if guess:
                self.throttle.passed(address)
            if isinstance(verdict, str):
                client = verdict
        if not isinstance(index, int) or not 0 <= index < len(self.devices):
            return refuse("DeviceError", f"this peer hosts {len(self.devices)} device(s) "
                                         f"({', '.join(str(d) for d in self.devices)}); index {index!r} does not exist")
        hosted = self.devices[index]
        session = Session(LocalEngine(hosted.engine.backend), self.limits, self.registry, pool or self.pool, self.budget,
                          self.transfers, self.identity)
        session.client, session.address, session.device = client, address, str(hosted)  # named before it is seen
        with self.registry.lock:
            if self.max_sessions is not None and len(self.registry.sessions) >= self.max_sessions:
                return refuse("PeerBusy", f"this peer is full: it serves at most {self.max_sessions} session(s) at "
                                          f"once; try again later")
            self.registry.sessions.add(session)
        info = {
            "t": "info", "v": wire.VERSION, "session": session.id, "peer": self.identity, "backend": self.backend_name,
            "device": str(hosted), "devices": tuple(str(d) for d in self.devices), "device_count": len(self.devices),
            "dtypes": tuple(d.name for d in hosted.engine.backend.dtypes), "limits": self.limits.as_dict(),
        }
        window = header.get("keepalive")  # the longest silence the client waits through
        if type(window) in (int, float) and 0 < window < 1e6:
            info["keepalive"] = max(window / 4, MIN_KEEPALIVE)  # "alive" frames this often while a batch runs
        return session, [(info, [])]

    def close(self, session: Session) -> None:
        """Forget ``session`` and free its tensors (its client went away)."""
        with self.registry.lock:
            if session in self.registry.sessions:  # its counters stay in the peer's totals
                with self.watch_lock:
                    for name in COUNTED:
                        self.retired[name] += getattr(session, name)
                    self.errors.update(session.errors)
                    self.recent.extend((when, session.client, kind, message) for when, kind, message in session.recent)
            self.registry.sessions.discard(session)
            idle = not self.registry.sessions
        self.transfers.revoke(session)
        session.close()
        if idle:  # no session left to reuse a buffer: the pool's go back at once, not after POOL_IDLE_SECONDS
            self.pool.clear()

    # -- transfers (transfers.py): this peer as the source of a fetch --
    def answer_fetch(self, frame: Frame, final: bool = True) -> tuple[list[Reply], Grant | None] | None:
        """Another peer's ``fetch`` frame in (the first frame of its connection, or a later one on
        a connection kept for more): the reply frames — the granted tensor, or a refusal — and the
        grant to ``release`` once they are sent. None while the capability is unknown and not
        ``final``: it may not be granted yet (the shell waits for :attr:`transfers` to change,
        within its handshake deadline, and asks again). The capability is the only credential: no
        token is asked for. A fetch frame with neither capability nor session is the destination's
        hello: the answer is this peer's identity (``{"t": "peer"}``), so the destination sends the
        capability only once it knows it speaks to the peer the client named."""
        header = frame.header

        def refuse(kind: str, reason: str, **extra) -> tuple[list[Reply], None]:
            return [({"t": "refuse", "kind": kind, "reason": reason, **extra}, [])], None

        if header.get("v") != wire.VERSION:
            return refuse("ProtocolError", f"protocol version {header.get('v')!r} is not supported: this peer speaks "
                                           f"version {wire.VERSION}")
        if "capability" not in header and "session" not in header:
            return [({"t": "peer", "v": wire.VERSION, "peer": self.identity}, [])], None
        capability, session = header.get("capability"), header.get("session")
        if type(capability) is not bytes or len(capability) != CAPABILITY_BYTES or type(session) is not str:
            return refuse("AccessDenied", f"a fetch presents a capability ({CAPABILITY_BYTES} bytes) and a session")
        outcome = self.transfers.claim(capability, session)
        if outcome is None:
            if not final:
                return None
            return refuse("AccessDenied", "unknown capability: this peer has not granted it (yet)", retry=True)
        if isinstance(outcome, str):
            return refuse("AccessDenied", outcome)
        value = outcome.value
        if type(value) is Failure:  # the source tensor failed: its error travels on
            outcome.release()
            return refuse(value.kind, value.message)
        try:
            host = outcome.download()
        except Exception as error:
            outcome.release()
            return refuse(_error_kind(error), f"reading the granted tensor: {error}")
        return [({"t": "tensor"}, [host])], outcome

    def fetch_locally(self, job: Fetch, final: bool = True) -> bool:
        """Perform ``job`` from this peer's own grants (its source is another session here): True once
        it is over, False while the capability is unknown and not ``final`` (wait and ask again)."""
        outcome = self.transfers.claim(job.capability, job.session)
        if outcome is None:
            if final:
                job.fail("AccessDenied", "unknown capability: the peer has not granted it")
            return final
        if isinstance(outcome, str):
            job.fail("AccessDenied", outcome)
            return True
        if type(outcome.value) is Failure:
            job.fail(outcome.value.kind, outcome.value.message)
        else:
            job.deliver(outcome.value)  # the native array itself: the destination adopts it, no host copy
        outcome.release()
        return True


def _redact(text: str, token) -> str:
    """``text`` without the token a client presented: what an authorizer says never shows it
    (tokens of a few characters are no secret, and would garble the text)."""
    return text.replace(token, "<token>") if isinstance(token, str) and len(token) >= 4 else text
