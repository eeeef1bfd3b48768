"""The client side of a compute peer: the remote engine, a thin shell around the sans-I/O
``wire.client.ClientProtocol`` (which holds the batch and its rules: see there). This shell owns
the connection, the lock, the waits and their time limits, the watch for a quiet connection, and
the handles arrays hold. An op of one output whose meta is known (most) is only logged, without
a lock: the hot path appends to the protocol's log.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
import weakref

import numpy as np

from .. import profiling
from ..backends.base import held_alone
from ..errors import ConnectionLost, DeviceError, EmberError
from ..ops.table import Meta
from ..wire import messages
from ..wire.client import ClientProtocol, init_frame, keepalive_window, refusal
from ..wire.protocol import CAPABILITY_BYTES, HANDSHAKE_LIMITS, Limits
from ..wire.tcp import TimedOut, spin_wait, spin_window
from .base import Engine

DEFAULT_TIMEOUT = float(os.environ.get("EMBER_TIMEOUT", "600"))
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
        self.device, self.connection, self.info, self.spin = device, connection, info, spin
        self.name = str(device)  # as profiles name it (never with the token)
        self.window = window if info.get("keepalive") else None
        self.protocol = protocol = ClientProtocol(info, self.name, RemoteHandle, _clock)
        self.limits, self.dtypes, self.counters = protocol.limits, protocol.dtypes, protocol.counters
        self._ids, self._log, self._drops = protocol.ids, protocol.log, protocol.drops  # the hot path's, lock-free
        self._lock = threading.RLock()
        self._last_io = _clock()  # when a frame was last sent or received …
        self.recheck = False      # … and since then, whether the device should call check() first
        self.owed = False         # whether the watch will set recheck once the connection is quiet

    # -- the engine interface --
    def execute(self, op, inputs, in_metas, attrs, metas):
        self._check_inputs(op, inputs, lost_first=True)
        refs = tuple(v.id if type(v) is RemoteHandle else (v, m.dtype.name) for v, m in zip(inputs, in_metas))
        outs = tuple(RemoteHandle(self, next(self._ids)) for _ in metas)
        message = messages.Op(op.name, refs, tuple(o.id for o in outs), attrs)
        with self._lock:  # another thread may be sending the batch
            if op.data_dependent and any(None in m.shape for m in metas):
                self.protocol.op(message, 0)
                shapes = self._call(messages.Shape, message.outputs)[0].shapes
                return outs, tuple(Meta(tuple(s), m.dtype) for s, m in zip(shapes, metas))
            self.protocol.op(message, sum(m.nbytes for m in metas))
            self._transmit()
        return outs, metas

    def apply(self, op, inputs, in_metas, attrs, meta):
        """Log an op of one output whose meta is known: the log joins the batch, as runs of ops,
        before anything else does. The hot path only appends to a deque, which is atomic: no lock."""
        for value in inputs:
            if type(value) is RemoteHandle and value.engine is not self:
                self._check_inputs(op, inputs)  # raises: an input of another session, or of a lost one
        if self.lost is not None:
            raise self.lost
        tid = next(self._ids)
        log = self._log
        log.append((op.name, inputs, in_metas, attrs, tid))  # the inputs' handles live on until the log is taken
        logged = len(log)
        if logged & 7 == 0:
            if self.protocol.due():  # every 8 ops: is the batch full or old?
                self.flush()
        elif logged == 1:
            self.protocol.started()
        out = _new_handle(RemoteHandle)
        out.engine, out.id = self, tid
        return out

    def _check_inputs(self, op, inputs: tuple, lost_first: bool = False) -> None:
        """Raise for an input of another session (one peer, two tokens) or of a lost one."""
        if lost_first and self.lost is not None:
            raise self.lost
        for value in inputs:
            if type(value) is RemoteHandle and value.engine is not self:
                if value.engine.lost is None:
                    raise DeviceError(f"{op.name}: an input lives in another session with {self.device}, opened "
                                      f"with another token; move it into this one with x.to_device(device), "
                                      f"passing the Device its other inputs are on (a device string omits the token)")
                raise lost_session(op.name, "an input", value.engine)

    def run_graph(self, graph, inputs: list) -> list:
        """Run a captured graph on the peer (registered once per session: ClientProtocol.run_graph)."""
        if self.lost is not None:
            raise self.lost
        for handle in inputs:
            if handle.engine is not self:
                raise lost_session("replay", "an input", handle.engine)
        return [RemoteHandle(self, tid) for tid in self._locked(self.protocol.run_graph, graph,
                                                                tuple(h.id for h in inputs))]

    def upload(self, host: np.ndarray) -> RemoteHandle:
        return RemoteHandle(self, self._locked(self.protocol.put, host))

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
        bytes), before the peer's transfer TTL runs out: sent at once, after every op it depends on;
        no reply is awaited. A step of :meth:`move`, and of any plan moving tensors between peers."""
        if handle.engine is not self:
            raise lost_session("to_device", "the array", handle.engine)
        with self._lock:
            self.protocol.grant(handle.id, capability, session)
            self.flush()  # the source starts serving it as soon as it gets there, not at the next read

    def fetch(self, source: RemoteEngine, capability: bytes, meta: Meta) -> RemoteHandle:
        """A new tensor of this session: the one ``source``'s session granted with ``capability``, of
        ``meta``, fetched by this peer from that one. Sent at once, nothing awaited; a failure surfaces
        at the first read that depends on it, as a typed error naming the transfer."""
        with self._lock:
            out = RemoteHandle(self, self._locked(self.protocol.fetch, meta, capability, source.device,
                                                  source.info.get("peer", "")))
            self.flush()  # the fetch starts now, well within the capability's lifetime
        return out

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
                try:
                    self._locked(self.protocol.close)
                except EmberError:
                    pass
                self.lost = ConnectionLost(f"the session with {self.device} was closed")
            self.connection.close()

    def flush(self) -> None:
        """Send every pending message now."""
        with self._lock:
            self.protocol.flush()
            self._transmit()

    # -- I/O: the lock held while the protocol's frames are sent, and while a reply is awaited --
    def _locked(self, call, *args):
        """``call(*args)`` of the protocol and the frames it made sent, the lock held."""
        if self.lost is not None:
            raise self.lost
        with self._lock:
            result = call(*args)
            self._transmit()
        return result

    def _transmit(self) -> None:
        frames = self.protocol.data_to_send()
        if frames and self.lost is not None:
            raise self.lost
        for frame in frames:
            try:
                self.counters["bytes_up"] += self.connection.send(frame)
                self.counters["batches"] += 1
            except ConnectionLost as error:
                raise self._lose(error) from None
            self._last_io, self.recheck = _clock(), True

    def check(self) -> None:
        """Before the next batch on a connection quiet for QUIET_SECONDS, read what the peer said
        meanwhile (the device calls this): a session the peer ended (idle timeout, restart) is found
        lost now, and the device opens a new one. Asked too soon, the question stays owed: the watch
        asks again once the connection has been quiet that long."""
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

    def _call(self, record: type, *fields):
        """Send request ``record(rid, *fields)`` with everything pending and wait for its reply and
        its frame's segments: one round trip (reported to open profiles, ember/profiling.py)."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            rid = self.protocol.request(record, *fields)
            if not profiling.watching:
                return self._wait(rid)
            started, received = _clock(), self.counters["bytes_down"]
            try:
                return self._wait(rid)
            finally:
                profiling.record(record.KIND, self.name, _clock() - started, self.counters["bytes_down"] - received)

    def _wait(self, rid: int):
        """Send the batch and wait for reply ``rid`` (``_call`` holds the lock)."""
        self._transmit()
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
            self._heed(frame)
            answer = self.protocol.answer(rid)
            if answer is not None:
                return answer

    def _heed(self, frame) -> None:
        """Give a received frame to the protocol; the peer's end of the session is raised as this
        session's loss, with its reason."""
        self._last_io, self.recheck = _clock(), True
        self.protocol.receive_frame(frame)
        if self.protocol.ended is not None:
            raise self._lose(ConnectionLost(self.protocol.ended))


def connect(device) -> RemoteEngine:
    """Open a session with the peer of ``device`` (a RemoteDevice) and return its engine."""
    from ..wire import tcp, tls, websocket
    window, spin = keepalive_window(), spin_window()
    module = websocket if device.scheme in ("ws", "wss") else tcp
    context = tls.client_context(device.tls_ca) if device.tls else None
    # nothing large before the handshake is done, on either side
    connection = module.connect(device.host, device.port, HANDSHAKE_LIMITS, timeout=DEFAULT_TIMEOUT, tls=context,
                                allocate=DownloadBuffers().allocate)
    try:
        connection.send(init_frame(device.index, device.token, window))
        info = connection.receive().header
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
    if info.get("t") != "info":
        connection.close()
        raise refusal(info, device)
    connection.set_limits(Limits.from_dict(info.get("limits", {})))
    return RemoteEngine(device, connection, info, window, spin)
