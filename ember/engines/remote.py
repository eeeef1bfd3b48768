"""The client side of a compute peer: the remote engine, a thin shell around the sans-I/O
``wire.client.ClientProtocol`` (the batch and its rules, how inputs are named, the requests
awaited). The shell owns the connection, the lock, the waits and their time limits, the reads of a
quiet connection (when: ``engines/watch.py``) and the handles arrays hold; an op of one output whose
meta is known (most) is only logged, without a lock, in the protocol's log.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np

from .. import profiling
from ..errors import ConnectionLost, EmberError
from ..ops.table import Meta
from ..wire import messages
from ..wire.client import ClientProtocol, silent
from ..wire.tcp import TimedOut, spin_wait
from .base import Engine
from .dialing import handshake, opened, reconnect
from .sessions import PeerTransfers, check_inputs, lost_session  # lost_session: distributed.py's too
from .watch import check as quiet_check

QUIET_READ = 1.0  # a frame a quiet connection holds is read within this many seconds (read_unasked)
_clock = time.perf_counter


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


class RemoteEngine(PeerTransfers, Engine):
    """A session with a compute peer, over a frame connection (TCP or WebSocket). ``window`` is
    the longest silence a read waits through when the peer keeps alive (None: it does not, and
    reads wait up to EMBER_TIMEOUT); ``spin`` how long a wait for a reply polls before it sleeps
    (EMBER_SPIN_US)."""

    def __init__(self, device, connection, info: dict, window: float | None = None, spin: float = 0.0,
                 resume_for: float = 0.0, resume_buffer: int = 0):
        self.device, self.connection, self.info, self.spin = device, connection, info, spin
        self.name = str(device)  # as profiles name it (never with the token)
        self.window = window if info.get("keepalive") else None
        self.resume_for = resume_for  # seconds a lost connection is dialled again for (EMBER_RESUME; dialing.py)
        self.protocol = protocol = ClientProtocol(info, self.name, RemoteHandle, _clock, resume_buffer)
        self.limits, self.dtypes, self.counters = protocol.limits, protocol.dtypes, protocol.counters
        self._ids, self._log, self._drops = protocol.ids, protocol.log, protocol.drops  # the hot path's, lock-free
        self._due, self._request, self._receive = protocol.due, protocol.request, protocol.receive_frame  # bound once
        self._lock = threading.RLock()
        self.last_io = _clock()  # when a frame was last sent or received …
        self.recheck = False     # … and since then, whether the device should call check() first
        self.owed = False        # whether the watch will set recheck once the connection is quiet

    # -- the engine interface --
    def execute(self, op, inputs, in_metas, attrs, metas):
        check_inputs(self, op.name, inputs, RemoteHandle)
        with self._lock:  # another thread may be sending the batch
            outs = tuple(RemoteHandle(self, tid) for tid in self.protocol.op(op.name, inputs, in_metas, attrs, metas))
            if op.data_dependent and any(None in m.shape for m in metas):
                shapes = self._call(messages.Shape, tuple(o.id for o in outs))[0].shapes
                return outs, tuple(Meta(tuple(s), m.dtype) for s, m in zip(shapes, metas))
            self._transmit()
        return outs, metas

    def apply(self, op, inputs, in_metas, attrs, meta):
        """Log an op of one output whose meta is known: the log joins the batch, as runs of ops,
        before anything else does. The hot path only appends to a deque, which is atomic: no lock."""
        for value in inputs:
            if type(value) is RemoteHandle and value.engine is not self:
                check_inputs(self, op.name, inputs, RemoteHandle)  # raises: an input of another session, or of a lost one
        if self.lost is not None:
            raise self.lost
        tid = next(self._ids)
        log = self._log
        log.append((op.name, inputs, in_metas, attrs, tid))  # the inputs' handles live on until the log is taken
        logged = len(log)
        if logged & 7 == 0:
            if self._due():  # every 8 ops: is the batch full or old?
                self.flush()
        elif logged == 1:
            self.protocol.began = _clock()  # the batch's clock starts here, unless it had begun
        out = _new_handle(RemoteHandle)
        out.engine, out.id = self, tid
        return out

    def run_graph(self, graph, inputs: list) -> list:
        """Run a captured graph on the peer (registered once per session: ClientProtocol.run_graph)."""
        for handle in inputs:
            if handle.engine is not self:
                raise self.lost or lost_session("replay", "an input", handle.engine)
        ids = self._locked(self.protocol.run_graph, graph, tuple(h.id for h in inputs))
        return [RemoteHandle(self, tid) for tid in ids]

    def upload(self, host: np.ndarray) -> RemoteHandle:
        handle = RemoteHandle(self, self._locked(self.protocol.put, host))
        if self.protocol.holding_too_much():  # past EMBER_RESUME_BUFFER: wait until the peer has what was sent
            self.sync()
        return handle

    def download(self, handle) -> np.ndarray:
        if handle.engine is not self:  # an array of an earlier session with this device
            raise lost_session("download", "the array", handle.engine)
        reply, segments = self._call(messages.Get, handle.id)
        return segments[reply.segment]

    def sync(self) -> None:
        self._call(messages.Sync)

    def stats(self) -> dict:
        """This session's counters: ``round_trips`` (blocking waits), ``ops``, ``bytes_up`` …"""
        return dict(self.counters)

    def peer_stats(self) -> dict:
        """The peer's counters: this session's live tensors, and the server's sessions and tensors."""
        return dict(self._call(messages.Stats)[0].stats)

    def close(self) -> None:
        """End the session (the peer frees its tensors)."""
        with self._lock:
            if self.lost is None:
                with contextlib.suppress(EmberError):
                    self._locked(self.protocol.close)
                self.lost = ConnectionLost(f"the session with {self.device} was closed")
            self.connection.close()

    def flush(self) -> None:
        """Send every pending message now."""
        with self._lock:
            self.protocol.flush()
            self._transmit()

    # -- I/O: the lock held while the protocol's frames are sent, and while a reply is awaited --
    def _locked(self, call, *args, now: bool = False):
        """``call(*args)`` of the protocol and the frames it made sent (``now``: with everything
        pending), the lock held."""
        if self.lost is not None:
            raise self.lost
        with self._lock:
            result = call(*args)
            if now:
                self.protocol.flush()
            self._transmit()
        return result

    def _transmit(self, frames: list | None = None) -> None:
        """Send ``frames``, or else the protocol's frames to send."""
        frames = self.protocol.data_to_send() if frames is None else frames
        if frames and self.lost is not None:
            raise self.lost
        for frame in frames:
            try:
                self.counters["bytes_up"] += self.connection.send(frame)
                self.counters["batches"] += 1
            except ConnectionLost as error:
                self._recover(error)  # resumed: this frame and those after it were sent again, as unacknowledged
                return
            self.last_io, self.recheck = _clock(), True

    check = quiet_check  # the device's call before the next batch: when to read what came unasked (watch.py) …

    def read_unasked(self) -> None:
        """… and reading it: a session the peer ended (idle timeout, restart) is found lost now."""
        with self._lock:
            try:
                while self.lost is None and self.connection.readable():
                    frame = self.connection.receive(QUIET_READ)  # only alive or error frames come unasked
                    self.last_io, self.recheck = _clock(), True
                    self._receive(frame)
                    if self.protocol.ended is not None:
                        raise self._lose(ConnectionLost(self.protocol.ended))
            except TimedOut:
                pass  # part of a frame: the rest is read with the next reply
            except ConnectionLost as error:
                if self.lost is None:
                    self._recover(error, raising=False)

    def _recover(self, error: EmberError, raising: bool = True) -> None:
        """The connection is lost (``error``): resume the session on a new one (dialing.py), else lose
        it — raising the loss unless ``raising`` is False."""
        ended = reconnect(self, error) if self.lost is None else self.lost
        if ended is not None:
            lost = self.lost or self._lose(ended)
            if raising:
                raise lost from None

    def _lose(self, error: ConnectionLost) -> ConnectionLost:
        self.lost = ConnectionLost(f"lost the connection to {self.device}: {error}")
        with contextlib.suppress(Exception):
            self.connection.close()
        return self.lost

    def _call(self, record: type, *fields):
        """Send request ``record(rid, *fields)`` with everything pending and wait for its reply and
        its frame's segments: one round trip (reported to open profiles, ember/profiling.py)."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            rid, frames = self._request(record, *fields)
            if not profiling.watching:
                return self._wait(rid, frames)
            started, received = _clock(), self.counters["bytes_down"]
            try:
                return self._wait(rid, frames)
            finally:
                profiling.record(record.KIND, self.name, _clock() - started, self.counters["bytes_down"] - received)

    def _wait(self, rid: int, frames: list):
        """Send the batch's ``frames`` and wait for reply ``rid`` (``_call`` holds the lock)."""
        self._transmit(frames)
        spin_wait(self.connection, self.spin)  # a small reply comes back in microseconds: catch it awake
        while True:
            try:
                frame = self.connection.receive(self.window)
            except TimedOut as error:  # silent for EMBER_TIMEOUT, or through a keepalive window: dialled again
                self._recover(error if self.window is None else silent(self.window))
                continue  # resumed: the reply comes on the new connection (kept by the peer, or of a batch sent again)
            except ConnectionLost as error:
                self._recover(error)
                continue
            self.last_io, self.recheck = _clock(), True
            answer = self._receive(frame, rid)
            if self.protocol.ended is not None:
                raise self._lose(ConnectionLost(self.protocol.ended))
            if answer is not None:
                return answer


def connect(device) -> RemoteEngine:
    """Open a session with the peer of ``device`` (a RemoteDevice) and return its engine (dialing.py)."""
    return opened(RemoteEngine(device, *handshake(device)))
