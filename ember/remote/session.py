"""A client's session on a compute peer, without I/O: each frame in, the reply frames out.

Like the ``websockets`` library's protocol objects, nothing here touches a socket: a
:class:`~ember.remote.host.Host` turns an ``init`` frame into a :class:`Session` (or a refusal),
and a session turns each frame into the reply frames to send; ``connections.py`` is the shell that
moves frames between these objects and sockets. Ops run through the same :class:`LocalEngine` as
local execution, after the op row's meta rule has validated them, so a peer executes nothing the
table would refuse locally. The session's tensors are its :class:`TensorTable`'s (tensors.py),
its graphs its :class:`Graphs`' (graphs.py); runs of ops seen before replay as plans (runs.py).
Each message is checked against its ``wire/messages.py`` record by :func:`~ember.wire.messages.check`
(its length, each field's type) and unpacked by the record's fields, and each reply built as one:
that module is the schema.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, deque

import numpy as np

from .. import dtypes as dt
from ..engines.local import LocalEngine
from ..errors import EmberError, ProtocolError, ResourceLimitError
from ..ops.records import infer_record, literal_meta
from ..ops.table import Meta
from ..wire import messages
from ..wire.messages import Data, Error, Ok, PeerStats, Shapes, check
from ..wire.protocol import Frame, Limits
from ..wire.runs import absolute, decode_run
from .failures import Failure
from .graphs import Graphs
from .memory import RUN_OP_BYTES, RUN_OVERHEAD, TENSOR_OVERHEAD, Budget, BufferPool
from .moves import Moves
from .resume import NOTHING_KEPT
from .runs import KEPT_BLOB_BYTES, KEPT_RUNS, NOT_COMPILED, RunPlan, endings
from .tensors import TensorTable, check_size, error_kind, need_of
from .transfers import Fetch, Transfers
from .uploads import Uploads

Reply = tuple  # (header, segments): one frame to send
_tuple_new = tuple.__new__
RECENT_ERRORS = 20  # the failures a session (and a host) remembers for the status page
KEPT_CHARACTERS = 1000  # of a remembered failure's message (the status shows 300 characters)


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

    def __init__(self, engine: LocalEngine, limits: Limits, registry, pool: BufferPool, budget: Budget,
                 transfers: Transfers, peer: str):
        self.engine = engine
        self.id = uuid.uuid4().hex  # the session's name: grants bind a transfer to it
        self.transfers = transfers  # the peer's table of grants, shared by its sessions
        self.runner = None          # the shell's: runner(fetch) starts a Fetch at once; None keeps them in fetches
        self.fetches: list[Fetch] = []
        self.pool = pool
        self.registry = registry    # the host's open sessions (host.py), for the peer's figures in stats
        self.table = TensorTable(limits, budget, pool, engine, self._fail)
        self.quota = self.table.quota  # everything the session holds is counted there
        self.registered = Graphs(self.table, engine)
        self.moves = Moves(self.table, transfers, self.id, peer)
        self.ops = 0
        self.runs: dict[bytes, object] = {}  # a run's blob -> sightings, its RunPlan, or NOT_COMPILED (runs.py)
        self.runs_replayed = 0
        self.runs_bytes = 0  # of the quota's: the runs remembered in self.runs (their blobs, and their plans)
        # what the peer's status page and /metrics show (ember/remote/status.py reads them, from another thread)
        self.client = self.address = self.device = ""
        self.opened = time.time()
        self.round_trips = self.bytes_in = self.bytes_out = 0
        self.errors: Counter[str] = Counter()  # failures this session met, by kind
        self.recent: deque[tuple] = deque(maxlen=RECENT_ERRORS)  # (time, kind, message) of the last ones
        self.watch_lock = threading.Lock()  # errors and recent change on the session's thread, are read on another
        self.uploads = Uploads(self.quota, pool)  # its frames' tensors, counted as they arrive
        self.allocate = self.uploads.allocate  # the frame reader's hook, once the session is open
        self.replying = 0   # bytes of copies made for the last replies (sent by the time the next frame comes)
        self._outgoing = 0  # bytes of the segments of the reply being built (a reply is one frame)
        self.resumable = None  # a resume.Resumable where the client asked for a session that resumes (host.py)

    limits = property(lambda self: self.quota.limits, lambda self, limits: setattr(self.quota, "limits", limits))

    def counted(self) -> dict[str, int]:
        """The session's counters that only grow, by name (``host.COUNTED``, in its order): the
        peer's status page shows them per session, and the host's totals sum them."""
        registered = self.registered
        return {"ops": self.ops, "round_trips": self.round_trips, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "graphs_registered": registered.graphs_registered,
                "graph_runs": registered.graph_runs}

    def close(self) -> None:
        self.table.close()
        self.registered.clear()
        self.runs.clear()
        self.replying = self.runs_bytes = self._outgoing = 0

    def _fail(self, kind: str, message: str) -> Failure:
        """A new failure, counted by kind for the peer's status (its message is shown there too)."""
        with self.watch_lock:  # failures are rare: the lock costs the op path nothing
            self.errors[kind] += 1
            self.recent.append((time.time(), kind, message[:KEPT_CHARACTERS]))
        return Failure(kind, message)

    # -- the frame handler --
    def handle(self, frame: Frame) -> list[tuple[dict, list]]:
        resumable = self.resumable
        if resumable is None or frame.header.get("t") != "batch":
            return self._handle_new(frame)
        n = frame.header.get("n")
        if type(n) is int and n == resumable.done + 1:  # the next batch: what Resumable.admit says, without its call
            resumable.kept = NOTHING_KEPT
        elif not resumable.admit(n):  # handled before the connection was lost, and sent again: run once
            self.uploads.begin(frame.segments)
            self.uploads.end(frame.segments)
            return resumable.repeat(n)
        return resumable.handled(n, frame.header, self._handle_new(frame))

    def _handle_new(self, frame: Frame) -> list[tuple[dict, list]]:
        table = self.table
        if self.replying:  # the last replies were sent before this frame was read: their copies are gone
            self.quota.give(self.replying)
            self.replying = 0
        if table.granted:
            self.transfers.purge()  # grants past their time end, and give their bytes back here
            table.give_ended()
        if table.sent:
            table.sent = {}
        if self._outgoing:
            self._outgoing = 0
        if not frame.segments:  # most frames: ops, drops and reads
            replies = self._handle(frame)
        else:
            self.bytes_in += self.uploads.begin(frame.segments)
            try:
                replies = self._handle(frame)
            finally:
                self.uploads.end(frame.segments)
        if replies:  # one reply frame, which the client waits for: one round trip
            self.round_trips += 1
            self.bytes_out += self._outgoing  # its segments' bytes (_get counts them as it adds them)
        return replies

    def _handle(self, frame: Frame) -> list[tuple[dict, list]]:
        header = frame.header
        kind = header.get("t")
        if kind == "close":
            return []
        if kind != "batch":
            raise ProtocolError(f"unexpected frame type {kind!r} in a session")
        batch = header.get("m", ())
        if not isinstance(batch, tuple):
            raise ProtocolError("a batch's 'm' must be a list of messages")
        replies: list = []
        segments: list = []
        handlers, run_op, received = self._HANDLERS, self._op, frame.segments
        for message in batch:
            try:
                if type(message) is tuple and len(message) == 5 and message[0] == "op":
                    run_op(message)  # an op alone: its fields checked inline, no parse, no dispatch
                    continue
                # ProtocolError naming the field that is wrong; the handler unpacks the record's fields
                handlers[check(message)](self, message, received, replies, segments)
            except (TypeError, ValueError, IndexError) as error:  # inside a field's list: the message is malformed
                if isinstance(error, EmberError):
                    raise
                raise ProtocolError(f"malformed {message[0]!r:.20} message: {error}") from None
        return [({"t": "reply", "m": replies}, segments)] if replies else []

    def _op(self, message) -> None:
        """An ``op`` message: a :class:`~ember.wire.messages.Op`'s array, as it arrived or as a run's record."""
        _, name, inputs, outputs, attrs = message  # ("op", *record): ops/records.py
        if type(outputs) is not tuple or type(inputs) is not tuple or type(attrs) is not dict:  # Op's checks, inline
            check(message)  # raises, naming the field
        self.ops += 1
        table = self.table
        tensors, known = table.tensors, table.metas
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
            value = table.lookup(ref) if type(ref) is int else None
            if type(value) is Failure:  # the failure travels to everything that depends on it
                for tid in outputs:
                    table.store(tid, value, None, False)
            elif value is None:
                table.poison(outputs, "ExecutionError", f"{name}: {table.unknown(ref)}")
            else:  # it was being fetched, and is here now
                self.ops -= 1  # counted again by the retry
                self._op(message)
            return
        quota = self.quota
        try:
            metas = tuple(metas)
            op, attrs, out_metas = infer_record(name, metas, outputs, attrs)
            # most ops: one output of a known size and no scratch, counted inline (this is every op's path)
            simple = len(out_metas) == 1 and not op.multiple and op.scratch is None and not op.data_dependent
            if simple:
                meta = out_metas[0]
                need = meta.nbytes
                if need > quota.limits.max_tensor_bytes:
                    check_size(name, out_metas, quota.limits.max_tensor_bytes)
                need += TENSOR_OVERHEAD  # its id's entries, in the one reservation
            else:
                need = need_of(op, metas, attrs, out_metas, quota.limits.max_tensor_bytes)
            if not quota.fits(need):  # the new ids are counted only where the fast path cannot vouch for them
                table.take(name, need, table.new_ids(outputs))
            try:
                if simple:
                    value = self.engine.apply(op, tuple(handles), metas, attrs, meta)
                else:
                    values, out_metas = self.engine.execute(op, tuple(handles), metas, attrs, out_metas)
                    if op.data_dependent:  # now that the sizes are known, each must fit the tensor limit
                        check_size(name, out_metas, quota.limits.max_tensor_bytes)
            except BaseException:
                quota.give(need)
                raise
        except Exception as error:  # a peer never crashes on bad input: the outputs carry the error
            text = str(error)
            table.poison(outputs, error_kind(error), text if text.startswith((str(name), "unknown op")) else f"{name}: {text}")
            return
        if not (simple and table.add(outputs[0], value, meta, need)):  # a new tensor: the reservation is its size
            table.keep(outputs, (value,) if simple else values, out_metas, need, not simple)

    # each handler below takes a message :func:`check` passed, and unpacks it by its record's fields
    def _ops(self, ops: messages.Ops, frame_segments, replies, segments) -> None:
        """A run of one-output ops, its tensor ids relative (wire/runs.py): replayed from its plan when the
        session has one that fits, else op by op — and compiled at its second sighting."""
        _, base, inputs, blob = ops
        known = self.runs.get(blob)
        if type(known) is RunPlan and known.replay(self.table, base, inputs):
            self.ops += len(known.outputs)
            self.runs_replayed += 1
            return
        records, let_go = decode_run(blob)
        ended = endings(records, let_go) if let_go else {}
        run_op, table, quota = self._op, self.table, self.quota
        for index, message in enumerate(absolute(records, base, inputs)):
            run_op(message)
            if index in ended:  # outputs the client let go, after their last use here
                table.drop(tuple(base + ref for ref in ended[index]))
        # what the session learns of runs is counted like the rest; with no room for it, a run goes op by op
        if known is None and len(blob) <= KEPT_BLOB_BYTES:
            if len(self.runs) >= KEPT_RUNS:
                self.runs.clear()
                quota.give(self.runs_bytes)
                self.runs_bytes = 0
            cost = len(blob) + RUN_OVERHEAD
            if quota.reserve(cost) is None:
                self.runs[blob] = 1
                self.runs_bytes += cost
        elif type(known) is int:  # the second sighting
            cost, plan = RUN_OP_BYTES * len(records), NOT_COMPILED
            if quota.reserve(cost) is None:
                plan = RunPlan.compile(table, self.engine, records, let_go, ended, base, inputs, TENSOR_OVERHEAD)
                if plan is NOT_COMPILED:
                    quota.give(cost)
                else:
                    self.runs_bytes += cost
            self.runs[blob] = plan

    def _put(self, put: messages.Put, frame_segments, replies, segments) -> None:
        _, tid, index = put
        host = frame_segments[index]
        if host is None:  # declined while it was received: the quota or the budget had no room
            self.table.poison((tid,), "ResourceLimitError", f"put of tensor {tid}: {self.uploads.reason(index)}")
            return
        counted = self.uploads.claim(host) is not None
        handle = self.engine.upload(host)
        self.table.store(tid, handle, Meta(tuple(host.shape), dt.FROM_NUMPY[host.dtype]), counted)
        if handle is not host:  # the backend copied it (to a GPU): the buffer can serve the next upload
            frame_segments[index] = None
            offered = [host]
            del host  # the list holds the only reference
            self.pool.release(offered)

    def _read(self, tid, rid, replies) -> object | None:
        """Tensor ``tid``'s live value, or None having replied the error a read of it meets."""
        value = self.table.read(tid)
        if type(value) is Failure:
            replies.append(Error(rid, value.kind, value.message))
            return None
        return value

    def _get(self, get: messages.Get, frame_segments, replies, segments) -> None:
        _, rid, tid = get
        table = self.table
        sent = table.sent
        index = sent.get(tid)
        if index is None:  # each tensor goes once per reply, however often a batch reads it
            value = table.tensors.get(tid)
            if value is None or type(value) is Failure:  # not live: what a read of it meets
                value = self._read(tid, rid, replies)
                if value is None:
                    return
            host = self.engine.download(value)
            nbytes = host.nbytes
            try:
                # a reply is one frame: the client refuses one past the frame limit, so none is built
                limits = self.quota.limits
                if self._outgoing + nbytes > limits.max_frame_bytes - limits.max_header_bytes:
                    raise ResourceLimitError(f"get of tensor {tid}: the reply would hold {self._outgoing + nbytes} "
                                             f"bytes of tensors, more than the peer's frame limit of "
                                             f"{limits.max_frame_bytes} bytes allows; read fewer tensors at once")
                if not host.flags.c_contiguous:  # the frame needs its bytes in C order: a copy, counted
                    # a reply's copies are scratch of one answer: together held to the tensor limit, so a few KB of
                    # reads of views cannot make the peer copy more than one tensor's worth
                    copies = self.replying + nbytes
                    if copies > limits.max_tensor_bytes:
                        raise ResourceLimitError(f"get of tensor {tid}: this reply's copies of tensors not in C order "
                                                 f"would take {copies} bytes, more than the peer's tensor limit of "
                                                 f"{limits.max_tensor_bytes} bytes; read fewer such views at once")
                    table.take(f"get of tensor {tid}", nbytes)
                    self.replying += nbytes
                    host = np.ascontiguousarray(host)
            except ResourceLimitError as error:
                failure = self._fail("ResourceLimitError", str(error))
                replies.append(Error(rid, failure.kind, failure.message))
                return
            self._outgoing += nbytes
            index = sent[tid] = len(segments)
            segments.append(host)
        replies.append(_tuple_new(Data, ("data", rid, index)))  # Data(rid, index), without its __new__'s call

    def _shape(self, shape: messages.Shape, frame_segments, replies, segments) -> None:
        _, rid, ids = shape
        shapes = []
        for tid in ids:  # what is no id names no tensor: an error reply, as for an op's input
            if self._read(tid, rid, replies) is None:
                return
            shapes.append(self.table.metas[tid].shape)
        replies.append(Shapes(rid, tuple(shapes)))

    def _sync(self, sync: messages.Sync, frame_segments, replies, segments) -> None:
        _, rid = sync
        self.table.settle_all()  # every transfer is done, and its failure reported, by a sync
        unreported = self.table.unreported
        if unreported:
            first = unreported[0]
            unreported.clear()
            replies.append(Error(rid, first.kind, first.message))
        else:
            replies.append(Ok(rid))

    def _drop(self, drop: messages.Drop, frame_segments, replies, segments) -> None:
        _, ids = drop
        self.table.drop(ids)

    def _stats(self, asked: messages.Stats, frame_segments, replies, segments) -> None:
        # session_bytes: its tensors' (and their ids'); session_used_bytes: all its quota counts (graphs, runs, grants…)
        stats = {"session_tensors": len(self.table.tensors), "session_bytes": self.table.live_bytes(),
                 "session_used_bytes": self.quota.used, "session_ops": self.ops,
                 "session_runs_replayed": self.runs_replayed, "session_graphs": len(self.registered.graphs)}
        if self.registry is not None:
            stats.update(self.registry.stats())
        _, rid = asked
        replies.append(PeerStats(rid, stats))

    # -- graphs (graphs.py): registered once, then run by number --
    def _graph(self, graph: messages.Graph, frame_segments, replies, segments) -> None:
        self.registered.register(*graph[1:], frame_segments, self.uploads)  # gid, inputs, outputs, ops, constants

    def _run(self, run: messages.RunGraph, frame_segments, replies, segments) -> None:
        self.ops += self.registered.run(*run[1:])  # gid, inputs, outputs

    def _forget(self, forget: messages.Forget, frame_segments, replies, segments) -> None:
        _, gid = forget
        self.registered.forget(gid)

    # -- transfers between peers (moves.py): grant on the source, fetch on the destination --
    def _grant(self, grant: messages.Grant, frame_segments, replies, segments) -> None:
        self.moves.grant(_tuple_new(messages.Grant, grant))  # the record: moves.py reads its fields by name

    def _fetch(self, fetch: messages.Fetch, frame_segments, replies, segments) -> None:
        job = self.moves.fetch(_tuple_new(messages.Fetch, fetch))
        if job is not None and self.runner is not None:
            self.runner(job)
        elif job is not None:
            self.fetches.append(job)

    # by record; an op of five items never comes here: _handle gives it to _op before parse (a parsed Op has five)
    _HANDLERS = {messages.Ops: _ops, messages.Put: _put, messages.Get: _get, messages.Shape: _shape,
                 messages.Sync: _sync, messages.Drop: _drop, messages.Stats: _stats, messages.Graph: _graph,
                 messages.RunGraph: _run, messages.Forget: _forget, messages.Grant: _grant, messages.Fetch: _fetch}
