"""The client side of a compute peer: the remote engine.

Ops are fire-and-forget: the client allocates tensor ids, knows every output's shape and dtype
from the meta rules, and appends the op to a batch. A batch is sent when it is large or old
enough, or when something must wait — a read, a sync, a data-dependent shape — so a chain of N
ops and one read costs one round trip. An op of one output whose meta is known (most) is only
logged, without a lock; the log joins the batch as runs of ops (wire/runs.py) before anything
else does. Arrays the program drops are freed on the peer: an output of the batch's last run is
listed in the run as let go, so the peer never stores it (a chain of large arrays holds on the
peer what it holds locally); any other array in a drop message, in the next batch or, once the
batch's op messages have made DROP_BYTES, ahead of the next one (and of one that makes as many
itself). An array dropped before ops were logged goes ahead of them when the log joins the batch:
no logged op reads it, and the bytes it frees count for those ops (a program that frees most of
its quota and computes is not refused).
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
import threading
import time
import weakref
from collections import deque

import numpy as np

from .. import profiling
from ..backends.base import held_alone
from ..errors import ArgumentError, ConnectionLost, DeviceError, EmberError, NotSupportedError, ProtocolError, ResourceLimitError
from ..ops.table import Meta
from ..wire import protocol as wire
from ..wire.protocol import CAPABILITY_BYTES, HANDSHAKE_LIMITS, Limits
from ..wire.runs import Run, append_ops, encode_run
from ..wire.tcp import TimedOut, spin_wait, spin_window
from .base import Engine

BATCH_OPS = 64          # send a batch once it holds this many messages …
BATCH_SECONDS = 0.002    # … or once its first message is this old …
BATCH_BYTES = 8 << 20    # … or once its copied uploads reach this size
INLINE_BYTES = 1 << 20   # uploads up to this size are copied into the batch; larger ones go at once
DROP_IDS = 1 << 16       # dropped ids per message: very many go in frames of their own
DROP_BYTES = 1 << 20     # once the batch's op messages have made this many bytes, drops go ahead of the next one
DEFAULT_TIMEOUT = float(os.environ.get("EMBER_TIMEOUT", "600"))
KEEPALIVE = 30.0         # seconds a read waits through silence, by default (EMBER_KEEPALIVE)
QUIET_SECONDS = 0.05     # a connection silent this long is asked whether the peer ended the session …
QUIET_READ = 1.0         # … and a frame it holds is read within this many seconds
_clock = time.perf_counter


class _QuietWatch:
    """Sets ``recheck`` again on engines whose check came too soon, once their connection has been
    quiet for QUIET_SECONDS: one daemon thread for all of them, so the device's check per op stays
    one attribute read (a clock read per op instead cost 4% on the peer's chain of small ops)."""

    def __init__(self):
        self._owing: weakref.WeakSet = weakref.WeakSet()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def owe(self, engine: RemoteEngine) -> None:
        with self._changed:
            engine.owed = True
            self._owing.add(engine)
            if self._thread is None or not self._thread.is_alive():  # first use, or a fork's child
                self._thread = threading.Thread(target=self._run, name="ember-quiet-watch", daemon=True)
                self._thread.start()
            self._changed.notify()

    def _run(self) -> None:
        with self._changed:
            while True:
                wait = None
                now = _clock()
                for engine in list(self._owing):
                    quiet_at = engine._last_io + QUIET_SECONDS  # later ops' I/O moves it on
                    if engine.lost is not None or now >= quiet_at:
                        engine.owed, engine.recheck = False, engine.lost is None
                        self._owing.discard(engine)
                    elif wait is None or quiet_at - now < wait:
                        wait = quiet_at - now
                self._changed.wait(wait)


_watch = _QuietWatch()
os.register_at_fork(after_in_child=_watch.__init__)  # the lock may have been held by the thread, which the child lacks


class RemoteHandle:
    """A tensor id on a peer; when the last array holding it goes, the peer frees it."""

    __slots__ = ("id", "engine")

    def __init__(self, engine: RemoteEngine, tid: int):
        self.engine, self.id = engine, tid

    def __del__(self):
        try:
            self.engine._drops.append(self.id)
        except Exception:  # interpreter shutdown
            pass


_new_handle = object.__new__


class DownloadBuffers:
    """The memory downloads are received into, taken back for the next download of the same size
    once nothing refers to the array made of it any more (a caching allocator, as a peer keeps its
    uploads'): a fresh 4 MB array costs its page faults, about 1,000, where a reused one costs none.

    The arrays a read returns are views of these buffers. A buffer is reused only when this object
    holds its one reference (:func:`held_alone`): an array the program keeps, or any view of it,
    keeps its memory its own. At most ``capacity`` bytes are kept, the most recently lent; buffers
    under ``minimum`` bytes are not kept at all."""

    def __init__(self, capacity: int = 64 << 20, minimum: int = 1 << 20):
        self.capacity, self.minimum = capacity, minimum
        self.lent: list[np.ndarray] = []  # oldest first

    @property
    def total(self) -> int:
        """Bytes of the buffers kept."""
        return sum(buffer.nbytes for buffer in self.lent)

    def allocate(self, shape: tuple, dtype) -> np.ndarray:
        """An array of ``shape`` and ``dtype`` to receive a download into (the frame reader's hook)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.minimum <= nbytes <= self.capacity:
            return np.empty(shape, dtype)
        lent = self.lent
        alone = held_alone(lent)  # no array or view uses it
        for i in range(len(lent)):
            if lent[i].nbytes == nbytes and alone[i]:
                buffer = lent.pop(i)
                lent.append(buffer)
                return buffer.view(dtype).reshape(shape)
        buffer = np.empty(nbytes, np.uint8)
        lent.append(buffer)
        while self.total > self.capacity:  # forget the oldest: a program still using it keeps it
            lent.pop(0)
        return buffer.view(dtype).reshape(shape)


def lost_session(what: str, subject: str, engine: RemoteEngine) -> ConnectionLost:
    """The error for ``subject`` (an array of ``engine``'s ended session) used by ``what``: its data is
    gone with the session, and the message says why the session ended."""
    return ConnectionLost(f"{what}: {subject} lives in a lost session with {engine.device}; its data is gone "
                          f"({engine.lost or 'the session ended'})")


class RemoteEngine(Engine):
    """A session with a compute peer, over a frame connection (TCP or WebSocket). ``window`` is
    the longest silence a read waits through when the peer keeps alive (None: it does not, and
    reads wait up to EMBER_TIMEOUT); ``spin`` how long a wait for a reply polls before it sleeps
    (EMBER_SPIN_US)."""

    def __init__(self, device, connection, info: dict, window: float | None = None, spin: float = 0.0):
        self.device = device
        self.name = str(device)  # as profiles name it (never with the token)
        self.connection = connection
        self.info = info
        self.window = window if info.get("keepalive") else None
        self.spin = spin
        self.limits = Limits.from_dict(info.get("limits", {}))
        self.dtypes = info.get("dtypes", ())
        self._ids = itertools.count(1)
        self._rids = itertools.count(1)
        self._pending: list = []
        self._run: Run | None = None  # the run of ops the batch ends with, while it does (_take_log)
        self._blobs: list = []  # (records, outputs let go, their msgpack) of the runs sent lately (encode_run)
        self._extra = 0  # ops in the batch beyond one per message (a run holds many)
        self._log: deque = deque()  # (name, inputs, input metas, attrs, output id) of ops not yet in the batch (apply)
        self._segments: list = []
        self._drops: deque = deque()
        self._drops_graph: deque = deque()
        self._graph_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._gids = itertools.count(1)
        self._first_pending = 0.0
        self._pending_bytes = 0
        self._made_bytes = 0     # bytes the ops made since drops were last queued
        self._lock = threading.RLock()
        self._last_io = _clock()  # when a frame was last sent or received …
        self.recheck = False      # … and since then, whether the device should call check() first
        self.owed = False         # whether the watch will set recheck once the connection is quiet
        self.counters = {"ops": 0, "round_trips": 0, "bytes_up": 0, "bytes_down": 0, "batches": 0,
                         "graphs_registered": 0, "graph_runs": 0, "keepalives": 0}

    # -- the engine interface --
    def execute(self, op, inputs, in_metas, attrs, metas):
        refs = self._refs(op, inputs, in_metas)
        outs = tuple(RemoteHandle(self, next(self._ids)) for _ in metas)
        out_ids = tuple(o.id for o in outs)
        message = ("op", op.name, refs, out_ids, attrs)
        with self._lock:  # another thread may be sending the batch
            if op.data_dependent and any(None in m.shape for m in metas):
                self._enqueue(message, 0)
                shapes = self._call("shape", out_ids)[2]
                metas = tuple(Meta(tuple(s), m.dtype) for s, m in zip(shapes, metas))
            else:
                self._enqueue(message, sum(m.nbytes for m in metas))
        return outs, metas

    def apply(self, op, inputs, in_metas, attrs, meta):
        """Log an op of one output whose meta is known. The log joins the batch, as runs of ops
        (wire/runs.py, ``_take_log``), before anything else does and before the batch leaves:
        the hot path only appends to a deque, which is atomic, so it takes no lock."""
        for value in inputs:
            if type(value) is RemoteHandle and value.engine is not self:
                self._refs(op, inputs, in_metas)  # raises: an input of another session, or of a lost one
        if self.lost is not None:
            raise self.lost
        tid = next(self._ids)
        log = self._log
        log.append((op.name, inputs, in_metas, attrs, tid))  # the inputs' handles live on until the log is taken
        logged = len(log)
        if logged & 7 == 0:
            self._count(0)  # every 8 ops: is the batch full or old?
        elif logged == 1 and not self._pending:
            self._first_pending = _clock()  # the batch's first op: its clock starts (as _count starts it)
        out = _new_handle(RemoteHandle)
        out.engine, out.id = self, tid
        return out

    def _take_log(self) -> None:
        """Move the logged ops into the batch (the lock held), each into the run of one-output ops
        the batch ends with, or a new one (wire/runs.py: a loop sends the same bytes each time, and
        the peer replays what it compiled of them)."""
        run = self._run
        if not self._pending or self._pending[-1] is not run:
            run = None
        self._run, taken = append_ops(self._log, self._pending, run, RemoteHandle)
        self._extra += taken

    def _refs(self, op, inputs: tuple, in_metas: tuple) -> tuple:
        """How an op message names ``inputs``: this session's tensor ids, and ``(value, dtype
        name)`` for literals (ops/records.py)."""
        if self.lost is not None:
            raise self.lost
        refs = []
        for value, meta in zip(inputs, in_metas):
            if type(value) is RemoteHandle:
                if value.engine is not self:
                    if value.engine.lost is None:  # equal devices, two sessions: one peer, two tokens
                        raise DeviceError(f"{op.name}: an input lives in another session with {self.device}, opened "
                                          f"with another token; move it into this one with x.to_device(device), "
                                          f"passing the Device its other inputs are on (a device string omits the token)")
                    raise lost_session(op.name, "an input", value.engine)
                refs.append(value.id)
            else:
                refs.append((value, meta.dtype.name))
        return tuple(refs)

    def _enqueue(self, message: tuple, made: int) -> None:
        """Add an op message that makes ``made`` bytes to the batch (the lock held), after the drops
        so far (no later op reads them) once the batch's ops have made DROP_BYTES, or when it makes
        that many itself (the bytes they free may be the room it needs); send the batch once it is
        full or old."""
        if self._drops and (self._made_bytes >= DROP_BYTES or made >= DROP_BYTES):
            self._queue_drops()  # the log too
        else:
            self._take_log()
        self._pending.append(message)
        self._count(made)

    def _count(self, made: int) -> None:
        """Count an op just added to the batch or its log, which makes ``made`` bytes; send the
        batch once it is full or old."""
        if made:
            self._made_bytes += made
        n = len(self._pending) + self._extra + len(self._log)  # a run's ops each count
        if n == 1:
            self._first_pending = _clock()
        elif n >= BATCH_OPS or (n & 7 == 0 and _clock() - self._first_pending > BATCH_SECONDS):
            self.flush()  # the clock is read every 8 ops: cheap enough, prompt enough

    def run_graph(self, graph, inputs: list) -> list:
        """Run a captured graph on the peer: registered once per session, then each call sends
        only the graph's number and tensor ids (Burn's RegisterAndExecuteGraph/ExecuteGraph)."""
        if self.lost is not None:
            raise self.lost
        for handle in inputs:
            if handle.engine is not self:
                raise lost_session("replay", "an input", handle.engine)
        with self._lock:
            self._take_log()
            if not self._pending:
                self._first_pending = _clock()  # the batch starts here, with a registration or the run
            gid = self._graph_ids.get(graph)
            if gid is None:
                gid = next(self._gids)
                first = len(self._segments)
                constant_ids = list(graph.constants)
                self._segments.extend(graph.constants[i] for i in constant_ids)
                self._pending.append(("graph", gid,
                                      tuple((i, m.dtype, m.shape) for _, i, m in graph.inputs),
                                      tuple(i for _, i in graph.outputs),
                                      tuple(op[:4] for op in graph.ops),  # records as the wire carries them
                                      tuple((i, first + k) for k, i in enumerate(constant_ids))))
                self._graph_ids[graph] = gid
                weakref.finalize(graph, self._drops_graph.append, gid)
                self.counters["graphs_registered"] += 1
            outs = [RemoteHandle(self, next(self._ids)) for _ in graph.outputs]
            made = 0
            for _, node in graph.outputs:
                made += graph.metas[node].nbytes
            if self._drops and (self._made_bytes >= DROP_BYTES or made >= DROP_BYTES):
                self._queue_drops()
            self._made_bytes += made
            self._pending.append(("run", gid, tuple(h.id for h in inputs), tuple(o.id for o in outs)))
            self.counters["graph_runs"] += 1
            if len(self._pending) >= BATCH_OPS or _clock() - self._first_pending > BATCH_SECONDS:
                self.flush()
        return outs

    def upload(self, host: np.ndarray) -> RemoteHandle:
        if self.lost is not None:
            raise self.lost
        if host.nbytes > self.limits.max_tensor_bytes:
            raise ResourceLimitError(f"upload: a tensor of {host.nbytes} bytes exceeds {self.device}'s limit of "
                                     f"{self.limits.max_tensor_bytes} bytes")
        if host.dtype.name not in self.dtypes:
            raise NotSupportedError(f"upload: {self.device} ({self.info.get('device')}) does not support {host.dtype}")
        handle = RemoteHandle(self, next(self._ids))
        with self._lock:
            if host.nbytes > INLINE_BYTES:
                self.flush()  # keep order, then send the tensor straight from the caller's memory
                self._send({"t": "batch", "m": (("put", handle.id, 0),)}, [host])
            else:
                self._take_log()
                if not self._pending:
                    self._first_pending = time.perf_counter()
                self._pending.append(("put", handle.id, len(self._segments)))
                self._segments.append(np.array(host, copy=True))  # the caller may change its array later
                self._pending_bytes += host.nbytes
                if self._pending_bytes > BATCH_BYTES:
                    self.flush()
        return handle

    # -- transfers between peers: no byte passes through the client, and nothing waits --
    def move(self, handle, meta: Meta, target) -> RemoteHandle | None:
        """Move ``handle`` to another peer's session ``target`` directly (None for any other target):
        a fresh capability, granted here and presented there; see :meth:`grant` and :meth:`fetch`."""
        if type(target) is not RemoteEngine or target is self or type(handle) is not RemoteHandle \
                or handle.engine is not self or self.lost is not None:
            return None
        capability = secrets.token_bytes(CAPABILITY_BYTES)
        self.grant(handle, capability, target.session)
        return target.fetch(self, capability, meta)

    @property
    def session(self) -> str:
        """This session's name on its peer (what a grant binds a transfer to)."""
        return self.info.get("session", "")

    def grant(self, handle: RemoteHandle, capability: bytes, session: str) -> None:
        """Let ``session`` (of any peer) read ``handle``'s tensor once, with ``capability`` (32 random
        bytes), before the peer's transfer TTL runs out. Sent at once, after every op it depends on;
        no reply is awaited. A step of :meth:`move`, and of any plan moving tensors between peers."""
        if handle.engine is not self:
            raise lost_session("to_device", "the array", handle.engine)
        with self._lock:
            self._take_log()
            self._pending.append(("grant", handle.id, capability, session))
            self.flush()  # the source starts serving it as soon as it gets there, not at the next read

    def fetch(self, source: RemoteEngine, capability: bytes, meta: Meta) -> RemoteHandle:
        """A new tensor of this session: the one ``source``'s session granted with ``capability``, of
        ``meta``'s shape and dtype, fetched by this peer from that one. Sent at once, nothing awaited;
        a failure (unreachable source, refused capability) surfaces at the first read that depends
        on the new tensor, as a typed error naming the transfer."""
        if self.lost is not None:
            raise self.lost
        if meta.dtype.name not in self.dtypes:
            raise NotSupportedError(f"to_device: {self.device} ({self.info.get('device')}) does not support {meta.dtype}")
        where = source.device
        out = RemoteHandle(self, next(self._ids))
        with self._lock:
            self._queue_drops()  # the bytes the program let go are freed before the fetch counts its own
            self._pending.append(("fetch", out.id, meta.dtype, tuple(meta.shape), where.scheme, where.host, where.port,
                                  capability, source.info.get("peer", "")))
            self.flush()  # the fetch starts now, well within the capability's lifetime
        return out

    def download(self, handle) -> np.ndarray:
        if handle.engine is not self:  # an array of an earlier session with this device
            raise lost_session("download", "the array", handle.engine)
        reply, segments = self._call("get", handle.id, want_segments=True)
        return segments[reply[2]]

    def sync(self) -> None:
        self._call("sync")

    def stats(self) -> dict:
        """This session's counters: ``round_trips`` (blocking waits), ``ops``, ``bytes_up`` …"""
        return dict(self.counters)

    def peer_stats(self) -> dict:
        """The peer's counters: this session's live tensors, and the server's sessions and tensors."""
        return dict(self._call("stats")[2])

    def close(self) -> None:
        """End the session (the peer frees its tensors)."""
        with self._lock:
            if self.lost is None:
                try:
                    self.flush()
                    self.connection.send(wire.encode_frame({"t": "close"}))
                except EmberError:
                    pass
                self.lost = ConnectionLost(f"the session with {self.device} was closed")
            self.connection.close()

    # -- batching --
    def _queue_drops(self) -> None:
        """Move dropped ids into the batch, each after every op that may still read it: first those
        dropped before the log is taken, ahead of the logged ops (the log holds its inputs' handles,
        so none of them reads these; outputs of logged ops wait for them), so that the peer frees
        their bytes before it runs those ops; then the log; then the ids its handles let go. An
        output of the run the batch ends with goes into that run's list of outputs let go (no
        message after it can read it), any other in a drop message (beyond DROP_IDS of them, each
        message in a frame of its own: headers stay small)."""
        drops, log = self._drops, self._log
        if drops and log:
            floor = log[0][4]
            for entry in log:  # threads may log out of order: the log's lowest output id (~1 µs for 64 ops)
                if entry[4] < floor:
                    floor = entry[4]
            self._place_drops(len(drops), floor)
        self._take_log()  # the log's ops (and its inputs' handles, which may now be dropped, let go)
        self._made_bytes = 0
        if drops:
            self._place_drops(len(drops))  # handles dropped meanwhile wait for the next
        while self._drops_graph:
            self._pending.append(("forget", self._drops_graph.popleft()))

    def _place_drops(self, count: int, floor: int | None = None) -> None:
        """Put the first ``count`` dropped ids at the batch's end (the lock held); those at or past
        ``floor`` (outputs of ops still in the log, perhaps) go back to wait for the next time."""
        drops = self._drops
        ids = []
        for _ in range(count):
            ids.append(drops.popleft())
        if floor is not None and max(ids) >= floor:
            drops.extend(tid for tid in ids if tid >= floor)
            ids = [tid for tid in ids if tid < floor]
        run = self._run
        if run is not None and self._pending and self._pending[-1] is run:
            ids = run.release(ids)
        for start in range(0, len(ids), DROP_IDS):
            if start:
                self._send_pending()
            self._pending.append(("drop", tuple(ids[start:start + DROP_IDS])))

    def flush(self) -> None:
        """Send every pending message now."""
        with self._lock:
            self._queue_drops()
            if self._pending:
                self._send_pending()

    def _send_pending(self) -> None:
        messages, self._pending = self._pending, []
        segments, self._segments = self._segments, []
        self._pending_bytes = self._extra = 0
        self._run = None
        ops = 0
        for i, message in enumerate(messages):
            if type(message) is Run:  # its records and the outputs let go as msgpack bytes, the key the peer knows it by
                messages[i] = encode_run(message, self._blobs)
                ops += len(message.records)
            elif message[0] == "op":
                ops += 1
        self.counters["ops"] += ops
        self._send({"t": "batch", "m": tuple(messages)}, segments)

    def _send(self, header: dict, segments: list) -> None:
        if self.lost is not None:
            raise self.lost
        try:
            self.counters["bytes_up"] += self.connection.send(wire.encode_frame(header, segments))
            self.counters["batches"] += 1
        except ConnectionLost as error:
            raise self._lose(error) from None
        self._last_io, self.recheck = _clock(), True

    def check(self) -> None:
        """Before the next batch on a connection quiet for QUIET_SECONDS, read what the peer said
        meanwhile (the device calls this): a session the peer ended — its idle timeout, a restart,
        perhaps with another peer now at the address — is found lost now, and the device opens a
        new one, rather than ops being written into a dead connection and checked against the old
        session's limits until the next read. Asked too soon, the question stays owed: the watch
        asks the device to call again once the connection has been quiet that long, so a use after
        a long quiet is checked even if an op came right after the last batch."""
        self.recheck = False
        if _clock() - self._last_io < QUIET_SECONDS:
            if not self.owed:
                _watch.owe(self)
            return
        with self._lock:
            try:
                while self.lost is None and self.connection.readable():
                    self._heed(self.connection.receive(QUIET_READ))  # only alive or error frames come unasked
            except TimedOut:
                pass  # part of a frame: the rest is read with the next reply
            except ConnectionLost as error:
                if self.lost is None:
                    self._lose(error)

    def _lose(self, error: ConnectionLost) -> ConnectionLost:
        self.lost = ConnectionLost(f"lost the connection to {self.device}: {error}")
        try:
            self.connection.close()
        except Exception:
            pass
        return self.lost

    def _call(self, kind: str, *fields, want_segments: bool = False):
        """Send the request ``(kind, rid, *fields)`` with everything pending, and wait for its reply:
        one round trip (reported to open profiles, ember/profiling.py)."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            rid = next(self._rids)
            self._queue_drops()  # so the reply (peer counters above all) sees them freed
            self._pending.append((kind, rid, *fields))
            if not profiling.watching:
                return self._wait(rid, want_segments)
            started, received = _clock(), self.counters["bytes_down"]
            try:
                return self._wait(rid, want_segments)
            finally:
                profiling.record(kind, self.name, _clock() - started, self.counters["bytes_down"] - received)

    def _wait(self, rid: int, want_segments: bool):
        """Send the batch and wait for reply ``rid`` (``_call`` holds the lock)."""
        self._send_pending()  # _call queued the drops
        self.counters["round_trips"] += 1
        spin_wait(self.connection, self.spin)  # a small reply comes back in microseconds: catch it awake
        while True:
            try:
                frame = self.connection.receive(self.window)
            except TimedOut as error:
                if self.window is None:
                    raise self._lose(error) from None
                raise self._lose(ConnectionLost(
                    f"no sign of life for {self.window:g} s (EMBER_KEEPALIVE), although the peer keeps alive "
                    f"while it works: it is hung or unreachable")) from None
            except ConnectionLost as error:
                raise self._lose(error) from None
            header = self._heed(frame)
            for reply in header.get("m", ()):
                if reply[1] == rid:
                    if reply[0] == "error":
                        raise wire.error_from_reply(reply[2], reply[3])
                    return (reply, frame.segments) if want_segments else reply

    def _heed(self, frame) -> dict:
        """Count a received frame and return its header; the peer's end of the session is raised
        as this session's loss, with its reason."""
        self._last_io, self.recheck = _clock(), True
        received = wire.PREFIX_SIZE
        for segment in frame.segments:
            received += segment.nbytes
        self.counters["bytes_down"] += received
        header = frame.header
        kind = header.get("t")
        if kind == "alive":  # the peer is still working on what we (or a batch before) wait for
            self.counters["keepalives"] += 1
        elif kind == "error":
            raise self._lose(ConnectionLost(f"the peer ended the session: {header.get('reason')}"))
        return header


def keepalive_window() -> float | None:
    """EMBER_KEEPALIVE: the longest silence a read waits through, in seconds, before the peer is
    declared lost (default 30; 0 turns keepalives off, and reads wait up to EMBER_TIMEOUT)."""
    text = os.environ.get("EMBER_KEEPALIVE", "")
    try:
        window = float(text) if text.strip() else KEEPALIVE
    except ValueError:
        window = -1.0
    if not 0 <= window < 1e6:
        raise ArgumentError(f"EMBER_KEEPALIVE must be a number of seconds ≥ 0 and under 1000000 (0: no keepalives), got {text!r}")
    return window or None


def connect(device) -> RemoteEngine:
    """Open a session with the peer of ``device`` (a RemoteDevice) and return its engine."""
    from ..wire import tcp, tls, websocket
    window, spin = keepalive_window(), spin_window()
    module = websocket if device.scheme in ("ws", "wss") else tcp
    context = tls.client_context(device.tls_ca) if device.tls else None
    # nothing large before the handshake is done, on either side
    connection = module.connect(device.host, device.port, HANDSHAKE_LIMITS, timeout=DEFAULT_TIMEOUT, tls=context,
                                allocate=DownloadBuffers().allocate)
    init = {"t": "init", "v": wire.VERSION, "device": device.index, "token": device.token}  # the peer names the session
    try:
        connection.send(wire.encode_frame(init | ({"keepalive": window} if window else {})))
        header = connection.receive().header
    except EmberError as error:  # lost, silent, or a reply no peer sends (over a handshake's limits, malformed)
        connection.close()
        if isinstance(error, TimedOut):
            raise ConnectionLost(f"{device} did not answer the session's init within {DEFAULT_TIMEOUT:g} s "
                                 f"(EMBER_TIMEOUT)") from None
        if isinstance(error, ConnectionLost):  # closed or reset unanswered: a peer answers even a refusal
            raise ConnectionLost(f"{device}: the peer closed the connection before answering the session's init (it may "
                                 f"be busy, with more connections than it takes at once, or not be an ember peer); try "
                                 f"again later ({error})") from None
        raise
    kind = header.get("t")
    if kind != "info":
        connection.close()
        reason = header.get("reason", f"unexpected reply {kind!r}")
        error = wire.ERROR_KINDS.get(header.get("kind"), ProtocolError)  # AccessDenied, TLSError, DeviceError, PeerBusy …
        raise error(f"{device} refused the session: {reason}")
    connection.set_limits(Limits.from_dict(header.get("limits", {})))
    return RemoteEngine(device, connection, header, window, spin)
