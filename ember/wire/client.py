"""The client side of a session, without I/O: the mirror of the peer's ``Session``.

Ops are fire-and-forget: the client allocates tensor ids, knows every output's shape and dtype
from the meta rules, and adds the op to a batch. A batch is sent when it is large or old enough,
or when something must wait — a read, a sync, a data-dependent shape — so a chain of N ops and one
read costs one round trip. An op of one output whose meta is known (most) is only logged, without
a lock; the log joins the batch as runs of ops (wire/runs.py) before anything else does. Arrays
the program drops are freed on the peer: an output of the batch's last run is listed in the run as
let go, so the peer never stores it (a chain of large arrays holds on the peer what it holds
locally); any other array in a drop message, in the next batch or, once the batch's op messages
have made DROP_BYTES, ahead of the next one (and of one that makes as many itself). An array
dropped before ops were logged goes ahead of them when the log joins the batch: no logged op
reads it, and the bytes it frees count for those ops (a program that frees most of its quota and
computes is not refused).

:class:`ClientProtocol` holds all of that, as ``websockets``' ``Protocol`` does for its
protocol: ops, uploads, requests and moves go in through its methods, the frames to write come out
of :meth:`~ClientProtocol.data_to_send` (each a list of buffers for one scatter-gather send; a
request hands back its frames itself), and each frame received goes in through
:meth:`~ClientProtocol.receive_frame`, which returns the reply to the request it names by its
integer id. It reads no socket, takes no lock and waits for nothing: the shell
(``engines/remote.py``) does, and sends what it is given.
Size limits live here, time limits in the shell. A read crosses the boundary twice, one call each
way (:meth:`~ClientProtocol.request`, :meth:`~ClientProtocol.receive_frame`): on a one-op read,
every Python call is ~2% of the client's time.
"""

from __future__ import annotations

import itertools
import os
import time
import weakref
from collections import deque

import numpy as np

from ..errors import ArgumentError, ConnectionLost, EmberError, NotSupportedError, ProtocolError, ResourceLimitError
from . import protocol as wire
from .messages import REPLIES, Error, Fetch, Forget, Grant, Graph, Op, Put, RunGraph, parse
from .protocol import Limits
from .replay import RESUME_BUFFER, Outbox
from .runs import Run, encode_run
from .tcp import TimedOut

BATCH_OPS = 64          # send a batch once it holds this many messages …
BATCH_SECONDS = 0.002    # … or once its first message is this old …
BATCH_BYTES = 8 << 20    # … or once its copied uploads reach this size
INLINE_BYTES = 1 << 20   # uploads up to this size are copied into the batch; larger ones go at once
DROP_IDS = 1 << 16       # dropped ids per message: very many go in frames of their own
DROP_BYTES = 1 << 20     # once the batch's op messages have made this many bytes, drops go ahead of the next one
KEEPALIVE = 30.0         # seconds a read waits through silence, by default (EMBER_KEEPALIVE)
_tuple_new = tuple.__new__  # a record from its fields, without the Python call of its __new__
# _PLAIN: the messages of a round trip (the read, the drops, the run) are the plain tuples their
# records pack to: a record costs ~0.12 µs more (its __new__ and packing a subclass), the three
# ~0.4 µs of a one-op read's ~8 µs of client time. The records are their schema, and the peer's.


def init_frame(device: int, token: str | None, keepalive: float | None, resume: bool = False) -> list:
    """The session's first frame: the device index asked for, the token, the longest silence the
    client waits through (None: it asks for no keepalives), and whether it asks for a session that
    resumes after a lost connection. The peer names the session."""
    init = {"t": "init", "v": wire.VERSION, "device": device, "token": token}
    return wire.encode_frame(init | ({"keepalive": keepalive} if keepalive else {}) | ({"resume": True} if resume else {}))


def refusal(header: dict, device) -> EmberError:
    """The error for the peer's answer to the init frame when it is not ``info``: the one a refusal
    names (AccessDenied, TLSError, DeviceError, PeerBusy …), else ProtocolError."""
    reason = header.get("reason", f"unexpected reply {header.get('t')!r}")
    return wire.ERROR_KINDS.get(header.get("kind"), ProtocolError)(f"{device} refused the session: {reason}")


def unanswered(error: EmberError, device, timeout: float) -> EmberError:
    """The error for a session's init answered with ``error`` (the handshake's timeout is
    ``timeout``): silence, or a connection closed unanswered (a peer answers even a refusal), in
    words that say what to do; any other (a reply no peer sends) as it is."""
    if isinstance(error, TimedOut):
        return ConnectionLost(f"{device} did not answer the session's init within {timeout:g} s (EMBER_TIMEOUT)")
    if isinstance(error, ConnectionLost):  # closed or reset unanswered
        return ConnectionLost(f"{device}: the peer closed the connection before answering the session's init (it may "
                              f"be busy, with more connections than it takes at once, or not be an ember peer); try "
                              f"again later ({error})")
    return error


def silent(window: float) -> ConnectionLost:
    """The loss of a peer that keeps alive while it works, silent for ``window`` seconds anyway."""
    return ConnectionLost(f"no sign of life for {window:g} s (EMBER_KEEPALIVE), although the peer keeps alive "
                          f"while it works: it is hung or unreachable")


def setting(name: str, default: float, what: str, limit: float = 1e6) -> float:
    """The number environment variable ``name`` holds (``default`` when it is unset or blank);
    ArgumentError saying it must be ``what`` unless it is ≥ 0 and under ``limit``."""
    text = os.environ.get(name, "")
    try:
        value = float(text) if text.strip() else default
    except ValueError:
        value = -1.0
    if not 0 <= value < limit:
        raise ArgumentError(f"{name} must be {what}, got {text!r}")
    return value


def keepalive_window() -> float | None:
    """EMBER_KEEPALIVE: the longest silence a read waits through, in seconds, before the peer is
    declared lost (default 30; 0 turns keepalives off, and reads wait up to EMBER_TIMEOUT)."""
    return setting("EMBER_KEEPALIVE", KEEPALIVE, "a number of seconds ≥ 0 and under 1000000 (0: no keepalives)") or None


_REPLY_SIZES = {kind: (record, len(record._fields)) for kind, record in REPLIES.items()}  # a reply's length, checked
_UNKNOWN = (None, -1)  # of a kind no peer sends: parse() names it


class ClientProtocol:
    """One session's protocol state: ids, the batch and its rules, drops, registered graphs and the
    counters. ``info`` is the peer's handshake answer; ``name`` the device as
    errors name it; inputs of type ``handle`` (with an ``id``) are tensors, others literals;
    ``clock`` times the batch (BATCH_SECONDS)."""

    def __init__(self, info: dict, name: str = "the peer", handle: type = object, clock=time.perf_counter,
                 resume_buffer: int = RESUME_BUFFER):
        self.info, self.name, self.handle, self.clock = info, name, handle, clock
        # a resumable session (the peer gave it a secret) numbers its batches and keeps them until acknowledged
        self.outbox = Outbox(resume_buffer) if isinstance(info.get("secret"), bytes) else None
        self.limits = Limits.from_dict(info.get("limits", {}))
        self.dtypes = info.get("dtypes", ())
        self.ids = itertools.count(1)  # tensor ids: next() of a count is atomic, so taken without a lock
        self.log: deque = deque()      # (name, inputs, input metas, attrs, output id) of ops not in the batch yet
        self.drops: deque = deque()    # ids the program let go (a handle's __del__ appends them, without a lock)
        self.ended: str | None = None  # why the peer ended the session, once it has
        self.counters = {"ops": 0, "round_trips": 0, "bytes_up": 0, "bytes_down": 0, "batches": 0,
                         "graphs_registered": 0, "graph_runs": 0, "keepalives": 0, "resumes": 0, "resume_seconds": 0.0,
                         "batches_replayed": 0}
        self._rids = itertools.count(1)
        self._gids = itertools.count(1)
        self._graph_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> its number here
        self._forgotten: deque = deque()  # numbers of registered graphs the program let go
        self._batch: list = []     # its messages; a Run stands for its ops message until the batch is encoded
        self._segments: list = []  # the batch's tensors
        self._run: Run | None = None  # the run the batch ends with, while it does
        self._blobs: list = []     # the runs sent lately (encode_run)
        self._extra = 0            # ops in the batch beyond one per message (a run holds many)
        self._first = 0.0          # when the batch's first message came
        self.began = 0.0           # when the log's first op came (the shell sets it: a call less per read)
        self._copied = 0           # bytes of the uploads copied into it
        self._made = 0             # bytes the ops made since drops were last queued
        self._outgoing: list = []  # frames to send, each a list of buffers

    # -- what goes in --
    def due(self) -> bool:
        """Whether the batch and its log should be sent: full, or old (asked every 8 ops logged). The
        batch's clock starts at its first message, or at its log's first op (``began``) if that came
        first."""
        n = len(self._batch) + self._extra + len(self.log)  # a run's ops each count
        first = self._first if self._batch else self.began
        return n >= BATCH_OPS or (n & 7 == 0 and self.clock() - first > BATCH_SECONDS)

    def op(self, name: str, inputs: tuple, in_metas: tuple, attrs: dict, metas: tuple) -> tuple:
        """Add op ``name`` of ``metas`` (several outputs, or shapes known only once it ran) as a message
        of its own: the ids of its outputs. Its inputs are named as the wire names them: a handle by
        its tensor id, a literal as ``(value, dtype name)``. The drops so far go ahead of it (no later
        op reads them) once the batch's ops have made DROP_BYTES, or when it makes that many itself
        (the bytes they free may be the room it needs); the batch goes once it is full or old."""
        handle = self.handle
        refs = tuple(v.id if type(v) is handle else (v, m.dtype.name) for v, m in zip(inputs, in_metas))
        outputs = tuple(next(self.ids) for _ in metas)
        made = 0 if any(None in m.shape for m in metas) else sum(m.nbytes for m in metas)
        if self.drops and (self._made >= DROP_BYTES or made >= DROP_BYTES):
            self._queue_drops()  # the log too
        elif self.log:
            self._take_log()
        self._batch.append(Op(name, refs, outputs, attrs))
        if made:
            self._made += made
        if len(self._batch) == 1:  # the log, if any, was taken above: the batch starts with this op
            self._first = self.clock()
        elif self.due():
            self.flush()
        return outputs

    def put(self, host: np.ndarray) -> int:
        """Upload ``host``: the id of its tensor. Up to INLINE_BYTES it is copied into the batch (the
        caller may change its array later); a larger one goes at once, from the caller's memory."""
        if host.nbytes > self.limits.max_tensor_bytes:
            raise ResourceLimitError(f"upload: a tensor of {host.nbytes} bytes exceeds {self.name}'s limit of "
                                     f"{self.limits.max_tensor_bytes} bytes")
        if host.dtype.name not in self.dtypes:
            raise NotSupportedError(f"upload: {self.name} ({self.info.get('device')}) does not support {host.dtype}")
        tid = next(self.ids)
        if host.nbytes > INLINE_BYTES:
            self.flush()  # keep order
            # a resumable session may send it again after a lost connection: a copy, which the caller cannot change
            self._frame((Put(tid, 0),), [host if self.outbox is None else np.array(host, copy=True)])
            return tid
        if self.log:
            self._take_log()
        if not self._batch:
            self._first = self.clock()
        self._batch.append(Put(tid, len(self._segments)))
        self._segments.append(np.array(host, copy=True))
        self._copied += host.nbytes
        if self._copied > BATCH_BYTES:
            self.flush()
        return tid

    def run_graph(self, graph, inputs: tuple) -> list[int]:
        """Run a captured graph on tensors ``inputs``: the ids of its outputs. Registered once per
        session (its constants as the frame's segments), then each call sends only the graph's
        number and tensor ids (Burn's RegisterAndExecuteGraph/ExecuteGraph)."""
        if self.log:
            self._take_log()
        if not self._batch:
            self._first = self.clock()  # the batch starts here, with a registration or the run
        gid = self._graph_ids.get(graph)
        if gid is None:
            gid = next(self._gids)
            first, constant_ids = len(self._segments), list(graph.constants)
            self._segments.extend(graph.constants[i] for i in constant_ids)
            self._batch.append(Graph(gid, tuple((i, m.dtype, m.shape) for _, i, m in graph.inputs),
                                     tuple(i for _, i in graph.outputs),
                                     tuple(op[:4] for op in graph.ops),  # records as the wire carries them
                                     tuple((i, first + k) for k, i in enumerate(constant_ids))))
            self._graph_ids[graph] = gid
            weakref.finalize(graph, self._forgotten.append, gid)
            self.counters["graphs_registered"] += 1
        outputs = [next(self.ids) for _ in graph.outputs]
        made = sum(graph.metas[node].nbytes for _, node in graph.outputs)
        if self.drops and (self._made >= DROP_BYTES or made >= DROP_BYTES):
            self._queue_drops()
        self._made += made
        self._batch.append(RunGraph(gid, inputs, tuple(outputs)))
        self.counters["graph_runs"] += 1
        if len(self._batch) >= BATCH_OPS or self.clock() - self._first > BATCH_SECONDS:
            self.flush()
        return outputs

    def grant(self, tid: int, capability: bytes, session: str) -> None:
        """Let ``session`` read tensor ``tid`` once with ``capability``, after every op before it."""
        if self.log:
            self._take_log()
        self._batch.append(Grant(tid, capability, session))

    def fetch(self, meta, capability: bytes, where, peer: str) -> int:
        """A new tensor of ``meta``, the one granted with ``capability`` on the peer at ``where`` (a
        device with a scheme, host and port) whose identity is ``peer``: its id."""
        if meta.dtype.name not in self.dtypes:
            raise NotSupportedError(f"to_device: {self.name} ({self.info.get('device')}) does not support {meta.dtype}")
        tid = next(self.ids)
        self._queue_drops()  # the bytes the program let go are freed before the fetch counts its own
        self._batch.append(Fetch(tid, meta.dtype, tuple(meta.shape), where.scheme, where.host, where.port,
                                 capability, peer))
        return tid

    def request(self, record: type, *fields) -> tuple[int, list]:
        """Add request ``record(rid, *fields)`` (Get, Shape, Sync, Stats) after everything so far and
        the drops (so the reply, peer counters above all, sees them freed), and end the batch: its
        request id, whose reply :meth:`receive_frame` returns, and the frames to send (as
        :meth:`data_to_send` gives them, without that call on the round trip)."""
        rid = next(self._rids)
        self._queue_drops()
        self._batch.append((record.KIND, rid, *fields))  # what record(rid, *fields) packs to (_PLAIN)
        self.counters["round_trips"] += 1  # the shell waits for each reply
        self._encode_batch()
        frames, self._outgoing = self._outgoing, []
        return rid, frames

    def flush(self) -> None:
        """Make every pending message part of a frame to send."""
        self._queue_drops()
        if self._batch:
            self._encode_batch()

    def holding_too_much(self) -> bool:
        """Whether the batches kept for a resume hold more than EMBER_RESUME_BUFFER bytes: the shell
        then waits for the peer to acknowledge them (a ``sync``) before the program uploads more."""
        return self.outbox is not None and self.outbox.full()

    def close(self) -> None:
        """End the session: the batch, then a close frame."""
        self.flush()
        self._outgoing.append(wire.encode_frame({"t": "close"}))

    # -- what comes out, and what comes back --
    def data_to_send(self) -> list:
        """The frames to write, in order, each a list of buffers; they are the caller's now."""
        frames, self._outgoing = self._outgoing, []
        return frames

    def receive_frame(self, frame: wire.Frame, rid: int | None = None):
        """Take a frame the peer sent: count it, note (``ended``) a peer's end of the session with its
        reason, and return request ``rid``'s reply and the frame's segments if the frame holds it (an
        error reply raises the typed exception it names), else None. The shell waits for one request
        at a time, the lock held: no other reply is awaited. ``alive`` frames only count."""
        received = wire.PREFIX_SIZE
        for segment in frame.segments:
            received += segment.nbytes
        self.counters["bytes_down"] += received
        header = frame.header
        kind = header.get("t")
        if kind == "alive":  # the peer is still working on what we (or a batch before) wait for
            self.counters["keepalives"] += 1
        elif kind == "error":
            self.ended = f"the peer ended the session: {header.get('reason')}"
        outbox = self.outbox
        if outbox is not None:
            acked = header.get("ack")
            if acked is None and kind == "ack":
                acked = header.get("n")
            if acked is not None and acked != outbox.acked:
                outbox.acknowledge(acked)
        for reply in header.get("m", ()):
            if type(reply) is tuple and len(reply) > 1 and reply[1] == rid:
                record, size = _REPLY_SIZES.get(reply[0], _UNKNOWN)
                if len(reply) != size:
                    parse(reply, REPLIES)  # raises, naming what is wrong
                if record is Error:
                    raise wire.error_from_reply(reply[2], reply[3])
                return _tuple_new(record, reply), frame.segments
        return None

    # -- resuming a session after a lost connection (wire/replay.py) --
    def resume_frame(self, device: int, token: str | None, keepalive: float | None) -> list:
        """The first frame of a new connection that resumes this session: its id and resume secret,
        the peer it lives on, and the highest batch number acknowledged so far."""
        info = self.info
        return wire.encode_frame({"t": "resume", "v": wire.VERSION, "session": info.get("session"),
                                  "secret": info.get("secret"), "peer": info.get("peer"), "device": device,
                                  "token": token, "keepalive": keepalive, "acked": self.outbox.acked})

    def resumed(self, header: dict) -> list:
        """Take the peer's ``resumed`` answer (the highest batch number it handled): the frames to
        send again, oldest first — every batch it has not handled."""
        self.outbox.acknowledge(header.get("ack"))
        return self.outbox.frames()

    def count_resume(self, replayed: int, seconds: float) -> None:
        """Count a resume that worked (its ``replayed`` batches sent again, ``seconds`` after the loss):
        once, though a connection may be lost again while the batches are sent and dialled anew."""
        counters = self.counters
        counters["resumes"] += 1
        counters["batches_replayed"] += replayed
        counters["resume_seconds"] += seconds

    # -- the batch --
    def _take_log(self) -> None:
        """Move the logged ops into the batch, each into the run of one-output ops the batch ends
        with, or a new one (wire/runs.py): a loop sends the same bytes each time, and the peer
        replays what it compiled of them. Entries logged by other threads meanwhile are taken too."""
        batch, run = self._batch, self._run
        if run is not None:
            if batch and batch[-1] is run:
                base, records, before = run.base, run.records, run.inputs
            else:
                run = None
        if not batch:
            self._first = self.began  # the log's first op is the batch's first
        handle, log, taken = self.handle, self.log, 0
        popleft = log.popleft
        while log:
            name, inputs, in_metas, attrs, tid = popleft()
            if run is None or tid < base:  # a run's outputs are at or past its base (threads may log out of order)
                run = self._run = Run(tid)
                base, records, before = tid, run.records, run.inputs
                batch.append(run)
                taken -= 1  # the run's message counts as its first op
            refs = []
            for value in inputs:  # not a zip: a zip of two tuples costs more
                if type(value) is handle:
                    ref = value.id - base
                    if ref < 0:  # made before the run: its position among the run's inputs
                        ref = before.get(value.id)
                        if ref is None:
                            ref = before[value.id] = len(before)
                        ref = -1 - ref
                    refs.append(ref)
                else:
                    refs.append((value, in_metas[len(refs)].dtype.name))
                    if not value or type(value) is complex:
                        run.reusable = False  # == cannot tell -0.0 from 0.0: the run's bytes are packed afresh
            if attrs:
                run.reusable = False
            out = tid - base
            if out != len(records):
                run.in_order = False
            records.append((name, refs, (out,), attrs))  # a list: msgpack packs it as the tuple it stands for
            taken += 1
        self._extra += taken

    def _queue_drops(self) -> None:
        """Move dropped ids into the batch, each after every op that may still read it: first those
        dropped before the log is taken, ahead of the logged ops (the log holds its inputs' handles,
        so none of them reads these; outputs of logged ops wait for them), so that the peer frees
        their bytes before it runs those ops; then the log; then the ids its handles let go."""
        drops, log = self.drops, self.log
        if drops and log:
            floor = log[0][4]
            for entry in log:  # threads may log out of order: the log's lowest output id (~1 µs for 64 ops)
                if entry[4] < floor:
                    floor = entry[4]
            self._place_drops(len(drops), floor)
        if log:
            self._take_log()  # the log's ops (and its inputs' handles, which may now be dropped, let go)
        self._made = 0
        if drops:
            self._place_drops(len(drops))  # handles dropped meanwhile wait for the next
        while self._forgotten:
            self._batch.append(Forget(self._forgotten.popleft()))

    def _place_drops(self, count: int, floor: int | None = None) -> None:
        """Put the first ``count`` dropped ids at the batch's end; those at or past ``floor`` (outputs
        of ops still in the log, perhaps) go back to wait for the next time. An output of the run
        the batch ends with goes into that run's outputs let go (no message after it can read it),
        any other in a drop message (beyond DROP_IDS of them, each in a frame of its own: headers
        stay small)."""
        drops = self.drops
        ids = []
        for _ in range(count):  # not a comprehension: its call costs more than the loop (~1 per batch)
            ids.append(drops.popleft())
        if floor is not None and max(ids) >= floor:
            drops.extend(tid for tid in ids if tid >= floor)
            ids = [tid for tid in ids if tid < floor]
        run = self._run
        if run is not None and self._batch and self._batch[-1] is run:
            ids = run.release(ids)
        if len(ids) <= DROP_IDS:  # as they most often are: one message
            if ids:
                self._batch.append(("drop", tuple(ids)))  # what Drop(…) packs to (_PLAIN)
            return
        for start in range(0, len(ids), DROP_IDS):
            if start:
                self._encode_batch()
            self._batch.append(("drop", tuple(ids[start:start + DROP_IDS])))

    def _encode_batch(self) -> None:
        messages, self._batch = self._batch, []
        segments, self._segments = self._segments, []
        self._copied = self._extra = 0
        self._run = None
        ops = 0
        for i, message in enumerate(messages):
            if type(message) is Run:  # its records and outputs let go as msgpack bytes, the key the peer knows it by
                messages[i] = encode_run(message, self._blobs)
                ops += len(message.records)
            elif message[0] == "op":
                ops += 1
        self.counters["ops"] += ops
        self._frame(tuple(messages), segments)

    def _frame(self, messages: tuple, segments: list) -> None:
        """A batch frame to send; in a resumable session numbered, and kept until acknowledged."""
        outbox = self.outbox
        if outbox is None:
            self._outgoing.append(wire.encode_frame({"t": "batch", "m": messages}, segments))
            return
        self._outgoing.append(outbox.frame({"t": "batch", "m": messages}, segments))
