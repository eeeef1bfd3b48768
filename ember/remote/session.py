"""A client's session on a compute peer, without I/O: each frame in, the reply frames out.

Like the ``websockets`` library's protocol objects, nothing here touches a socket: a
:class:`~ember.remote.host.Host` turns an ``init`` frame into a :class:`Session` (or a refusal),
and a session turns each frame into the reply frames to send; ``server.py`` is the shell that
moves frames between these objects and sockets. Ops run through the same :class:`LocalEngine` as
local execution, after the op row's meta rule has validated them, so a peer executes nothing the
table would refuse locally. The session's tensors are its :class:`TensorTable`'s (tensors.py),
its graphs its :class:`Graphs`' (graphs.py); runs of ops seen before replay as plans (runs.py).
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
from ..wire.protocol import Frame, Limits
from ..wire.runs import absolute, decode_run
from .failures import Failure
from .graphs import Graphs
from .memory import RUN_OP_BYTES, RUN_OVERHEAD, TENSOR_OVERHEAD, Budget, BufferPool
from .moves import Moves
from .runs import KEPT_BLOB_BYTES, KEPT_RUNS, NOT_COMPILED, RunPlan, endings
from .tensors import TensorTable, check_id, check_size, error_kind, need_of
from .transfers import Fetch, Transfers
from .uploads import Uploads

Reply = tuple  # (header, segments): one frame to send
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

    def _ops(self, body, frame_segments, replies, segments) -> None:
        """A run of one-output ops, its tensor ids relative (wire/runs.py): replayed from its plan when the
        session has one that fits, else op by op — and compiled at its second sighting."""
        base, inputs, blob = body
        if type(base) is not int or type(inputs) is not tuple:
            raise ProtocolError("an ops message is (base, inputs, blob)")
        known = self.runs.get(blob) if type(blob) is bytes else None
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

    def _put(self, body, frame_segments, replies, segments) -> None:
        tid, index = body
        host = frame_segments[index]
        if host is None:  # declined while it was received: the quota or the budget had no room
            self.table.poison((tid,), "ResourceLimitError", f"put of tensor {tid}: {self.uploads.reason(index)}")
            return
        check_id(tid)  # before its buffer's reservation passes to the tensor
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
            replies.append(("error", rid, value.kind, value.message))
            return None
        return value

    def _get(self, body, frame_segments, replies, segments) -> None:
        rid, tid = body
        sent = self.table.sent
        index = sent.get(tid) if type(tid) is int else None
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
                    self.table.take(f"get of tensor {tid}", host.nbytes)
                    self.replying += host.nbytes
                    host = np.ascontiguousarray(host)
            except ResourceLimitError as error:
                failure = self._fail("ResourceLimitError", str(error))
                replies.append(("error", rid, failure.kind, failure.message))
                return
            self._outgoing += host.nbytes
            index = sent[tid] = len(segments)
            segments.append(host)
        replies.append(("data", rid, index))

    def _shape(self, body, frame_segments, replies, segments) -> None:
        rid, ids = body
        shapes = []
        for tid in ids:
            if self._read(tid, rid, replies) is None:
                return
            shapes.append(self.table.metas[tid].shape)
        replies.append(("shapes", rid, tuple(shapes)))

    def _sync(self, body, frame_segments, replies, segments) -> None:
        (rid,) = body
        self.table.settle_all()  # every transfer is done, and its failure reported, by a sync
        unreported = self.table.unreported
        if unreported:
            first = unreported[0]
            unreported.clear()
            replies.append(("error", rid, first.kind, first.message))
        else:
            replies.append(("ok", rid))

    def _drop(self, body, frame_segments, replies, segments) -> None:
        (ids,) = body
        self.table.drop(ids)

    def _stats(self, body, frame_segments, replies, segments) -> None:
        (rid,) = body
        # session_bytes: its tensors' (and their ids'); session_used_bytes: all its quota counts (graphs, runs, grants…)
        stats = {"session_tensors": len(self.table.tensors), "session_bytes": self.table.live_bytes(),
                 "session_used_bytes": self.quota.used, "session_ops": self.ops,
                 "session_runs_replayed": self.runs_replayed, "session_graphs": len(self.registered.graphs)}
        if self.registry is not None:
            stats.update(self.registry.stats())
        replies.append(("stats", rid, stats))

    # -- graphs (graphs.py): registered once, then run by number --
    def _graph(self, body, frame_segments, replies, segments) -> None:
        gid, inputs, outputs, ops, constants = body
        self.registered.register(gid, inputs, outputs, ops, constants, frame_segments, self.uploads)

    def _run(self, body, frame_segments, replies, segments) -> None:
        gid, input_ids, output_ids = body
        self.ops += self.registered.run(gid, input_ids, output_ids)

    def _forget(self, body, frame_segments, replies, segments) -> None:
        (gid,) = body
        self.registered.forget(gid)

    # -- transfers between peers (moves.py): grant on the source, fetch on the destination --
    def _grant(self, body, frame_segments, replies, segments) -> None:
        tid, capability, session = body
        self.moves.grant(tid, capability, session)

    def _fetch(self, body, frame_segments, replies, segments) -> None:
        tid, dtype, shape, scheme, host, port, capability, peer = body
        job = self.moves.fetch(tid, dtype, shape, scheme, host, port, capability, peer)
        if job is not None and self.runner is not None:
            self.runner(job)
        elif job is not None:
            self.fetches.append(job)

    # "op" messages of the right length go straight to _op; this entry sees malformed ones
    _HANDLERS = {"op": lambda self, body, *_: self._op(("op", *body)), "put": _put, "get": _get, "shape": _shape,
                 "sync": _sync, "drop": _drop, "stats": _stats, "graph": _graph, "run": _run, "forget": _forget,
                 "grant": _grant, "fetch": _fetch, "ops": _ops}
