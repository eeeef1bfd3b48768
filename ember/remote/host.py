"""A compute peer's side of every handshake, without I/O: the hosted devices, who may connect, the open sessions.

A :class:`Host` turns a connection's ``init`` frame into a :class:`~ember.remote.session.Session`
(or a refusal), keeps the :class:`Registry` of open sessions and the counters the peer's status
page shows, and answers another peer's ``fetch`` of a tensor granted here (transfers.py).
``connections.py`` is the shell that moves frames between these objects and sockets;
:func:`hosted_devices` says which devices a peer serving a device hosts.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
import uuid
from collections import Counter, deque
from functools import partial

from ..devices import LocalDevice
from ..devices import device as as_device
from ..engines.local import LocalEngine
from ..errors import AccessDenied, HostDeviceError, ProtocolError
from ..wire import protocol as wire
from ..wire.protocol import CAPABILITY_BYTES, Frame, Limits
from .access import NotPermitted, Throttle, Throttled, Viewer, is_guess, single_token
from .failures import Failure
from .memory import Budget, BufferPool
from .resume import RESUME_WINDOW, Parking
from .session import KEPT_CHARACTERS, RECENT_ERRORS, Reply, Session
from .tensors import error_kind
from .transfers import Fetch, Grant, Transfers

log = logging.getLogger("ember.serve")

MIN_KEEPALIVE = 0.05  # seconds: the shortest interval between "alive" frames a client may ask for
HISTORY = 150       # throughput samples a host keeps (five minutes, one every two seconds)
#: a session's counters that only grow (Session.counted), and that the peer's totals sum over its sessions
COUNTED = ("ops", "round_trips", "bytes_in", "bytes_out", "graphs_registered", "graph_runs")



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
        return {"sessions": len(sessions), "live_tensors": sum(len(s.table.tensors) for s in sessions)}


class Host:
    """The peer's side of every handshake: the hosted devices, who may connect (a token, or an
    authorizer: see access.py), the limits, the cap on sessions and the registry of open
    sessions. :meth:`open` is the handshake, fed the first frame."""

    def __init__(self, devices: list[LocalDevice], token: str | None, limits: Limits, budget: Budget | None = None, *,
                 authorize=None, max_sessions: int | None = None, transfers: Transfers | None = None,
                 resume_window: float = RESUME_WINDOW):
        self.devices, self.token, self.limits = devices, token, limits
        self.parking = Parking(resume_window)  # resumable sessions, and those waiting for their client (resume.py)
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

    def _refused(self, address: str, kind: str, reason: str, **extra) -> tuple[None, list[Reply]]:
        """No session, and the ``refuse`` reply saying why (counted as a failure of ``address``)."""
        self.failed(address, kind, reason)
        return None, [({"t": "refuse", "kind": kind, "reason": reason, **extra}, [])]

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
                totals.update(session.counted())
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
        refuse = partial(self._refused, address)

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
        interval = _alive_interval(header)  # the client waits through header["keepalive"] s of silence
        if interval:
            info["keepalive"] = interval  # "alive" frames this often while a batch runs
        if header.get("resume") is True and self.parking.window > 0:  # kept for its client if the connection is lost
            info["secret"], info["window"] = self.parking.issue(session), self.parking.window
        return session, [(info, [])]

    def resume(self, frame: Frame, address: str = "") -> tuple[Session | None, list[Reply]]:
        """A ``resume`` frame, the first of a new connection: the session it names back, if the
        frame proves it is its client — its secret, and the token the access rule admits again (a
        named client must be the same) — and no reply; else None and a refusal,
        ``"gone": true`` where retrying cannot help. The caller then takes the session's lock (its old
        connection may still hold it) and answers with :meth:`resumed`."""
        header, refuse = frame.header, partial(self._refused, address)

        if header.get("v") != wire.VERSION:
            return refuse("ProtocolError", f"protocol version {header.get('v')!r} is not supported: this peer speaks "
                                           f"version {wire.VERSION}")
        wanted = header.get("session")
        if header.get("peer") != self.identity:
            return refuse("ConnectionLost", "the session cannot be resumed: the peer restarted since the session began",
                          gone=True)
        token = header.get("token")
        wait = self.throttle.admit(address, time.monotonic())  # the try counts as a failure until it passes
        if wait:  # guesses of secrets are throttled as guesses of tokens are
            return refuse("AccessDenied", str(Throttled(address, wait)), wait=round(wait, 3))
        session = self.parking.find(wanted, header.get("secret"))
        if session is None:
            return refuse("ConnectionLost", f"the session cannot be resumed: {self.parking.why_gone(wanted)}", gone=True)
        if self.authorize is not None:
            try:
                verdict = self.authorize(address, token, header.get("device", 0))
            except Exception as error:  # noqa: BLE001 — refused, or a broken authorizer: not resumed, nor worth retrying
                return refuse("AccessDenied", _redact(str(error), token), gone=True)
            if verdict is False or (isinstance(verdict, str) and verdict != session.client):
                return refuse("AccessDenied", "this token is not the session's client's", gone=True)
        self.throttle.passed(address)
        return session, []

    def resumed(self, session: Session, frame: Frame, address: str) -> list[Reply]:
        """The answer to ``session``'s resume (``frame``, checked by :meth:`resume`), once the caller
        holds its lock: ``resumed`` with the highest batch handled, then the replies to that batch if
        the client has not seen them acknowledged."""
        session.address = address
        resumable = session.resumable
        resumable.parked_at = None
        answer = {"t": "resumed", "v": wire.VERSION, "session": session.id, "ack": resumable.done}
        interval = _alive_interval(frame.header)  # as at the handshake
        if interval:
            answer["keepalive"] = interval
        acked = frame.header.get("acked")
        kept_n, kept = resumable.kept
        return [(answer, [])] + (kept if type(acked) is int and kept_n > acked else [])

    def park(self, session: Session, now: float) -> None:
        """``session``'s connection is lost: keep it for its client, for the resume window."""
        self.parking.park(session, now)

    def expire(self, now: float) -> int:
        """Close the parked sessions whose window has passed; how many."""
        late = self.parking.expired(now)
        for session in late:
            self.close(session)
        return len(late)

    def close(self, session: Session) -> None:
        """Forget ``session`` and free its tensors (its client went away)."""
        if session.resumable is not None:
            self.parking.forget(session, "its client closed it")
        with self.registry.lock:
            if session in self.registry.sessions:  # its counters stay in the peer's totals
                with self.watch_lock:
                    self.retired.update(session.counted())
                    self.errors.update(session.errors)
                    self.recent.extend((when, session.client, kind, message) for when, kind, message in session.recent)
            self.registry.sessions.discard(session)
            idle = not self.registry.sessions
        self.transfers.revoke(session.table)  # the owner of its grants
        session.close()
        if idle:  # no session left to reuse a buffer: the pool's go back at once, not after POOL_IDLE_SECONDS
            self.pool.clear()

    # -- transfers (transfers.py): this peer as the source of a fetch --
    def answer_fetch(self, frame: Frame, final: bool = True) -> tuple[list[Reply], Grant | None] | None:
        """Another peer's ``fetch`` frame in (the first frame of its connection, or a later one on
        a connection kept for more): the reply frames — the granted tensor, or a refusal — and the
        grant to confirm once the destination says it arrived (or to unclaim). None while the capability is unknown and not
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
            self.transfers.confirm(outcome)
            return refuse(value.kind, value.message)
        try:
            host = outcome.download()
        except Exception as error:
            self.transfers.confirm(outcome)
            return refuse(error_kind(error), f"reading the granted tensor: {error}")
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
        self.transfers.confirm(outcome)
        return True


def _alive_interval(header: dict) -> float | None:
    """How often to send "alive" frames while a batch runs, for a client that waits through
    ``header["keepalive"]`` seconds of silence (an init or a resume), or None where it asked for none."""
    window = header.get("keepalive")
    if type(window) in (int, float) and 0 < window < 1e6:
        return max(window / 4, MIN_KEEPALIVE)
    return None


def _redact(text: str, token) -> str:
    """``text`` without the token a client presented: what an authorizer says never shows it
    (tokens of a few characters are no secret, and would garble the text)."""
    return text.replace(token, "<token>") if isinstance(token, str) and len(token) >= 4 else text
