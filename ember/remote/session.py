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
import sys
import threading
import traceback
import uuid

import numpy as np

from .. import dtypes as dt
from ..devices import LocalDevice
from ..devices import device as as_device
from ..engines.local import LocalEngine
from ..errors import AccessDenied, EmberError, HostDeviceError, ProtocolError
from ..ops.records import check_records, infer_record, literal_meta
from ..ops.table import Meta
from ..wire import protocol as wire
from ..wire.protocol import Frame, Limits
from .access import single_token

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
    of that kind: ``torch:cuda:1`` hosts every CUDA device.
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
    family = name.rsplit(":", 1)[0] if name.startswith("torch:cuda") else name
    return [n for n in names if n == family or n.startswith(family + ":")] or [name]


class BufferPool:
    """Keeps the buffers of freed received tensors for the next upload of the same size (a
    caching allocator): a fresh 256 MiB buffer costs tens of milliseconds of page faults that a
    reused one does not. A buffer is kept only when nothing else refers to it."""

    def __init__(self, capacity: int = 1 << 30, minimum: int = 1 << 20):
        self.capacity, self.minimum = capacity, minimum
        self.free: dict[int, list] = {}
        self.total = 0

    def allocate(self, shape: tuple, dtype) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.minimum:
            return np.empty(shape, dtype)
        stack = self.free.get(nbytes)
        if stack:
            buffer = stack.pop()
            self.total -= nbytes
        else:
            buffer = np.empty(nbytes, np.uint8)
        return buffer.view(dtype).reshape(shape)

    def release(self, array) -> None:
        """Offer ``array`` (just removed from a session) for reuse."""
        if type(array) is not np.ndarray:
            return
        root = array.base
        if type(root) is not np.ndarray or root.dtype != np.uint8 or root.ndim != 1 or root.nbytes < self.minimum:
            return
        # held only by the caller, this call and getrefcount: no view or other tensor shares it
        if sys.getrefcount(array) > 3 or sys.getrefcount(root) > 3 or self.total + root.nbytes > self.capacity:
            return
        self.free.setdefault(root.nbytes, []).append(root)
        self.total += root.nbytes


class Poison:
    """What a failed op leaves in its outputs: the error, raised where they are read."""

    __slots__ = ("kind", "message")

    def __init__(self, kind: str, message: str):
        self.kind, self.message = kind, message


def _error_kind(error: Exception) -> str:
    return type(error).__name__ if isinstance(error, EmberError) else "ExecutionError"


class Session:
    """One client's session, without I/O: :meth:`handle` takes a frame and returns the reply
    frames to send (header, segments)."""

    def __init__(self, engine: LocalEngine, limits: Limits, registry: Registry | None = None,
                 pool: BufferPool | None = None):
        self.engine = engine
        self.pool = pool or BufferPool()
        self.limits = limits
        self.registry = registry
        self.tensors: dict[int, object] = {}   # id -> native array or Poison
        self.metas: dict[int, Meta] = {}
        self.unreported: list[Poison] = []      # failures since the last sync
        self.graphs: dict[int, tuple] = {}      # registered graphs, by number
        self.ops = 0

    # -- bookkeeping --
    def live_bytes(self) -> int:
        return sum(math.prod(m.shape) * m.dtype.itemsize for m in self.metas.values() if None not in m.shape)

    def close(self) -> None:
        self.tensors.clear()
        self.metas.clear()
        self.graphs.clear()

    def _store(self, tid, value, meta: Meta | None) -> None:
        if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
            raise ProtocolError(f"tensor ids are non-negative integers, got {tid!r}")
        self.tensors[tid] = value
        if meta is not None:
            self.metas[tid] = meta
        else:
            self.metas.pop(tid, None)

    def _poison(self, outputs, kind: str, message: str) -> None:
        poison = Poison(kind, message)
        for tid in outputs:
            self._store(tid, poison, None)
        self.unreported.append(poison)

    # -- the frame handler --
    def handle(self, frame: Frame) -> list[tuple[dict, list]]:
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
        handlers, run_op = self._HANDLERS, self._op
        for message in messages:
            try:
                if type(message) is tuple and len(message) == 5 and message[0] == "op":
                    run_op(message)  # ops are most messages: no dispatch, no slicing
                    continue
                if type(message) is not tuple or not message or type(message[0]) is not str:
                    raise ProtocolError(f"malformed message {message!r:.80}")
                handler = handlers.get(message[0])
                if handler is None:
                    raise ProtocolError(f"unknown message type {message[0]!r}")
                handler(self, message[1:], frame.segments, replies, segments)
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
                if value is not None and type(value) is not Poison:
                    handles.append(value)
                    metas.append(known[ref])
                    continue
            if type(ref) is tuple:  # a literal: (value, dtype name)
                metas.append(literal_meta(name, ref))
                handles.append(ref[0])
                continue
            # here the reference names no live tensor: a failure upstream, or nothing at all
            value = tensors.get(ref) if type(ref) is int else None
            if type(value) is Poison:  # the failure travels to everything that depends on it
                for tid in outputs:
                    self._store(tid, value, None)
            else:
                self._poison(outputs, "ExecutionError", f"{name}: unknown tensor id {ref!r} (dropped, or from another session)")
            return
        try:
            metas = tuple(metas)
            op, attrs, out_metas = infer_record(name, metas, outputs, attrs)
            self._check_size(name, out_metas)
            values, out_metas = self.engine.execute(op, tuple(handles), metas, attrs, out_metas)
        except Exception as error:  # a peer never crashes on bad input: the outputs carry the error
            text = str(error)
            self._poison(outputs, _error_kind(error), text if text.startswith((str(name), "unknown op")) else f"{name}: {text}")
            return
        for tid, value, meta in zip(outputs, values, out_metas):
            if type(tid) is not int or tid < 0:
                raise ProtocolError(f"tensor ids are non-negative integers, got {tid!r}")
            tensors[tid] = value
            known[tid] = meta

    def _put(self, body, frame_segments, replies, segments) -> None:
        tid, index = body
        host = frame_segments[index]
        handle = self.engine.upload(host)
        self._store(tid, handle, Meta(tuple(host.shape), dt.FROM_NUMPY[host.dtype]))
        if handle is not host:  # the backend copied it (to a GPU): the buffer can serve the next upload
            frame_segments[index] = None
            self.pool.release(host)

    def _read(self, tid, rid, replies) -> object | None:
        value = self.tensors.get(tid) if isinstance(tid, int) else None
        if value is None:
            replies.append(("error", rid, "ExecutionError", f"unknown tensor id {tid!r} (dropped, or from another session)"))
            return None
        if isinstance(value, Poison):
            replies.append(("error", rid, value.kind, value.message))
            return None
        return value

    def _get(self, body, frame_segments, replies, segments) -> None:
        rid, tid = body
        value = self._read(tid, rid, replies)
        if value is not None:
            replies.append(("data", rid, len(segments)))
            segments.append(self.engine.download(value))

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
        if self.unreported:
            first = self.unreported[0]
            self.unreported.clear()
            replies.append(("error", rid, first.kind, first.message))
        else:
            replies.append(("ok", rid))

    def _drop(self, body, frame_segments, replies, segments) -> None:
        (ids,) = body
        release = self.pool.release
        for tid in ids:
            value = self.tensors.pop(tid, None)
            self.metas.pop(tid, None)
            release(value)
            del value

    def _stats(self, body, frame_segments, replies, segments) -> None:
        (rid,) = body
        stats = {"session_tensors": len(self.tensors), "session_bytes": self.live_bytes(), "session_ops": self.ops}
        if self.registry is not None:
            stats.update(self.registry.stats())
        replies.append(("stats", rid, stats))

    # -- graphs: registered once, then run by number --
    def _graph(self, body, frame_segments, replies, segments) -> None:
        gid, inputs, outputs, ops, constants = body
        known = {tid: Meta(tuple(shape), dtype) for tid, dtype, shape in inputs}
        values = {}
        for tid, index in constants:
            host = frame_segments[index]
            values[tid] = self.engine.upload(host)
            known[tid] = Meta(tuple(host.shape), dt.FROM_NUMPY[host.dtype])
        records, error, plan = [], None, None
        try:  # validate the whole graph once: every row's meta rule, every size limit
            for row, refs, outs, attrs, out_metas in check_records(ops, known):
                if any(None in m.shape for m in out_metas):
                    raise ProtocolError(f"{row.name}: data-dependent shapes cannot be part of a graph")
                self._check_size(row.name, out_metas)
                records.append((row, refs, outs, attrs))
            missing = [o for o in outputs if o not in known]
            if missing:
                raise ProtocolError(f"graph output {missing[0]} is not produced by the graph")
            plan = self.engine.compile(records, [tid for tid, _, _ in inputs], values, outputs)
        except Exception as failure:
            error = Poison(_error_kind(failure), f"graph: {failure}")
        input_metas = tuple((tid, known[tid]) for tid, _, _ in inputs)
        self.graphs[gid] = (input_metas, tuple(outputs), plan, {o: known.get(o) for o in outputs}, error)

    def _run(self, body, frame_segments, replies, segments) -> None:
        gid, input_ids, output_ids = body
        graph = self.graphs.get(gid)
        if graph is None:
            self._poison(output_ids, "ExecutionError", f"run: unknown graph {gid!r}")
            return
        inputs, outputs, plan, out_metas, error = graph
        if error is not None:
            for tid in output_ids:
                self._store(tid, error, None)
            self.unreported.append(error)
            return
        if len(input_ids) != len(inputs) or len(output_ids) != len(outputs):
            self._poison(output_ids, "ProtocolError", f"run: graph {gid!r} takes {len(inputs)} inputs and gives "
                                                      f"{len(outputs)} outputs; got {len(input_ids)} input ids and "
                                                      f"{len(output_ids)} output ids")
            return
        values = []
        for (node, meta), tid in zip(inputs, input_ids):
            value = self.tensors.get(tid)
            if value is None:
                self._poison(output_ids, "ExecutionError", f"run: unknown tensor id {tid!r} (dropped, or from another session)")
                return
            if type(value) is Poison:  # the failure travels on, reported once
                for out in output_ids:
                    self._store(out, value, None)
                return
            if self.metas[tid] != meta:
                self._poison(output_ids, "ShapeError", f"run: input {node} expects {meta.shape} {meta.dtype}, "
                                                        f"got {self.metas[tid].shape} {self.metas[tid].dtype}")
                return
            values.append(value)
        try:
            results = plan.run(values)
        except Exception as failure:
            self._poison(output_ids, _error_kind(failure), str(failure))
            return
        self.ops += len(plan.steps)
        for tid, node, value in zip(output_ids, outputs, results):
            self._store(tid, value, out_metas[node])

    def _forget(self, body, frame_segments, replies, segments) -> None:
        (gid,) = body
        self.graphs.pop(gid, None)

    def _check_size(self, name, out_metas) -> None:
        limit = self.limits.max_tensor_bytes
        for meta in out_metas:
            if None not in meta.shape and math.prod(meta.shape) * meta.dtype.itemsize > limit:
                raise ProtocolError(f"{name}: an output of shape {meta.shape} {meta.dtype} exceeds the peer's "
                                    f"tensor limit of {limit} bytes")

    # "op" messages of the right length go straight to _op; this entry sees malformed ones
    _HANDLERS = {"op": lambda self, body, *_: self._op(("op", *body)), "put": _put, "get": _get, "shape": _shape,
                 "sync": _sync, "drop": _drop, "stats": _stats, "graph": _graph, "run": _run, "forget": _forget}


class Registry:
    """The live sessions of a server (for its counters)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sessions: set[Session] = set()

    def stats(self) -> dict:
        with self.lock:
            sessions = list(self.sessions)
        return {"sessions": len(sessions), "live_tensors": sum(len(s.tensors) for s in sessions)}


class Host:
    """The peer's side of every handshake: the hosted devices, who may connect (a token, or an
    authorizer: see access.py), the limits, the cap on sessions and the registry of open
    sessions. :meth:`open` is the handshake, fed the first frame."""

    def __init__(self, devices: list[LocalDevice], token: str | None, limits: Limits, *, authorize=None,
                 max_sessions: int | None = None):
        self.devices, self.token, self.limits = devices, token, limits
        self.authorize = authorize or (single_token(token) if token else None)
        self.max_sessions = max_sessions
        self.registry = Registry()
        self.clients: dict[Session, str] = {}  # each open session's client, as logs and stats name it

    @property
    def backend_name(self) -> str:
        return self.devices[0].backend_name

    def open(self, frame: Frame, pool: BufferPool, address: str = "") -> tuple[Session | None, list[Reply]]:
        """The handshake: an ``init`` frame in; a new session and its ``info`` reply, or None and
        a ``refuse`` reply (a wrong version, a refused client, a device index it lacks, no room
        left). ``address`` ("host:port") is the client's, for the authorizer and as its name.
        ProtocolError if it is not an init at all."""
        header = frame.header
        if header.get("t") != "init":
            raise ProtocolError("the first frame must be an init")

        def refuse(kind: str, reason: str) -> tuple[None, list[Reply]]:
            return None, [({"t": "refuse", "kind": kind, "reason": reason}, [])]

        version = header.get("v")
        if version != wire.VERSION:
            return refuse("ProtocolError", f"protocol version {version!r} is not supported: this peer speaks version "
                                           f"{wire.VERSION}")
        token = header.get("token")
        index = header.get("device", 0)
        client = address
        if self.authorize is not None:
            try:
                verdict = self.authorize(address, token, index)
            except AccessDenied as denied:
                return refuse("AccessDenied", _redact(str(denied), token))
            except Exception as error:  # a broken authorizer refuses; the peer lives on
                log.error("%s: refused: the authorizer failed: %s", address,
                          _redact("".join(traceback.format_exception(error)).rstrip(), token))
                return refuse("AccessDenied", "the peer could not check this client's access: its authorizer failed "
                                              "(the peer's log says why)")
            if verdict is False:
                return refuse("AccessDenied", "the peer's authorizer refused this client")
            if isinstance(verdict, str):
                client = verdict
        if not isinstance(index, int) or not 0 <= index < len(self.devices):
            return refuse("DeviceError", f"this peer hosts {len(self.devices)} device(s) "
                                         f"({', '.join(str(d) for d in self.devices)}); index {index!r} does not exist")
        hosted = self.devices[index]
        session = Session(LocalEngine(hosted.engine.backend), self.limits, self.registry, pool)
        with self.registry.lock:
            if self.max_sessions is not None and len(self.registry.sessions) >= self.max_sessions:
                return refuse("PeerBusy", f"this peer is full: it serves at most {self.max_sessions} session(s) at "
                                          f"once; try again later")
            self.registry.sessions.add(session)
            self.clients[session] = client
        info = {
            "t": "info", "v": wire.VERSION, "session": uuid.uuid4().hex, "backend": self.backend_name,
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
            self.registry.sessions.discard(session)
            self.clients.pop(session, None)
        session.close()


def _redact(text: str, token) -> str:
    """``text`` without the token a client presented: what an authorizer says never shows it
    (tokens of a few characters are no secret, and would garble the text)."""
    return text.replace(token, "<token>") if isinstance(token, str) and len(token) >= 4 else text
