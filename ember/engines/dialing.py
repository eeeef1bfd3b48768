"""Reaching a compute peer: a session's first connection (:func:`handshake`), and a new one when a
connection is lost (:func:`reconnect`), which resumes the session where it stood.

A client asks for a resumable session unless EMBER_RESUME is 0. When its connection breaks or
goes silent, :func:`reconnect` dials the peer again — at once, then after jittered waits that
double up to 2 s — for up to EMBER_RESUME seconds (default 300), sends the ``resume`` frame, and
sends again every batch the peer has not acknowledged (wire/replay.py); the peer runs each batch
once and answers a read it had answered from the reply it kept (remote/resume.py). The user's
code sees a delay; ``em.stats`` counts ``resumes`` and ``resume_seconds``, ``em.profile()``
records the wait under the user's line, and one log line says "resumed after N s".
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import time
import weakref

from .. import profiling
from ..backends.buffers import BufferCache
from ..errors import ConnectionLost, EmberError
from ..wire.client import init_frame, keepalive_window, refusal, setting, unanswered
from ..wire.protocol import HANDSHAKE_LIMITS, Limits
from ..wire.replay import RESUME_BUFFER
from ..wire.tcp import spin_window

log = logging.getLogger("ember.remote")
DEFAULT_TIMEOUT = float(os.environ.get("EMBER_TIMEOUT", "600"))
RESUME_SECONDS = 300.0  # how long a lost connection is dialled again for, by default (EMBER_RESUME)
_clock = time.perf_counter


def resume_seconds() -> float:
    """EMBER_RESUME: how long a lost connection is dialled again for, in seconds (0: a lost connection ends the session)."""
    return setting("EMBER_RESUME", RESUME_SECONDS, "a number of seconds ≥ 0 (0: sessions do not resume)", 1e15)


def resume_buffer() -> int:
    """EMBER_RESUME_BUFFER: the bytes of unacknowledged batches a session keeps for a resume."""
    return int(setting("EMBER_RESUME_BUFFER", RESUME_BUFFER, "a number of bytes ≥ 0", 1e15))


def backoff(attempt: int, rand=random.random) -> float:
    """Seconds before dial ``attempt`` (0, 1, …): none for the first, then 50 ms doubling to 2 s, each
    jittered down by up to half, so clients cut off together do not all come back together."""
    if attempt == 0:
        return 0.0
    return min(2.0, 0.05 * 2.0 ** (attempt - 1)) * (0.5 + rand() / 2)


def dial(device, timeout: float | None = None):
    """A new frame connection to ``device``'s peer (TCP or WebSocket, TLS where its scheme says), with the
    handshake's limits until the session's are known, established within ``timeout`` seconds
    (default EMBER_TIMEOUT)."""
    from ..wire import tcp, tls, websocket
    module = websocket if device.scheme in ("ws", "wss") else tcp
    context = tls.client_context(device.tls_ca) if device.tls else None
    # nothing large before the handshake is done, on either side
    return module.connect(device.host, device.port, HANDSHAKE_LIMITS, timeout=timeout or DEFAULT_TIMEOUT, tls=context,
                          allocate=BufferCache(capacity=64 << 20, recall=True).allocate)


_OPEN: weakref.WeakSet = weakref.WeakSet()  # the engines of open sessions, closed at exit (below)


def opened(engine):
    """Note ``engine``'s session as open: at exit it is closed, so that the peer frees it at once rather
    than keeping it for its client to resume (a process's end closes its sockets as a drop would)."""
    _OPEN.add(engine)
    return engine


@atexit.register
def _close_open_sessions() -> None:
    for engine in list(_OPEN):
        with contextlib.suppress(Exception):
            engine.close()


def handshake(device) -> tuple:
    """A session's first connection to ``device``'s peer, handshaken: the arguments of its engine after
    the device — the connection, the peer's ``info``, the keepalive window, the spin, the seconds a lost
    connection is dialled again for and the bytes kept for a resume."""
    window, spin, resume = keepalive_window(), spin_window(), resume_seconds()
    connection = dial(device)
    try:
        connection.send(init_frame(device.index, device.token, window, resume=resume > 0))
        info = connection.receive().header
    except EmberError as error:  # lost, silent, or a reply no peer sends (over a handshake's limits, malformed)
        connection.close()
        raise unanswered(error, device, DEFAULT_TIMEOUT) from None
    if info.get("t") != "info":
        connection.close()
        raise refusal(info, device)
    connection.set_limits(Limits.from_dict(info.get("limits", {})))
    return connection, info, window, spin, resume, resume_buffer()


def reconnect(engine, cause: EmberError) -> EmberError | None:
    """Resume ``engine``'s session on a new connection after ``cause`` lost the old one (the engine's
    lock held): None once it has, its unacknowledged batches sent again; else the error that ends the
    session — it is not resumable, or the peer no longer has it, or EMBER_RESUME seconds passed."""
    protocol, device = engine.protocol, engine.device
    if protocol.outbox is None or engine.resume_for <= 0:
        return cause
    started, attempt, last = _clock(), 0, ""
    with contextlib.suppress(EmberError, OSError):
        engine.connection.close()
    while True:
        wait = backoff(attempt)
        attempt += 1
        left = engine.resume_for - (_clock() + wait - started)
        if left <= 0:
            tried = f"; the last try: {last}" if last else ""
            return ConnectionLost(f"{cause}; the session could not be resumed within {engine.resume_for:g} s "
                                  f"(EMBER_RESUME){tried}; every array of the session is lost with it")
        time.sleep(wait)
        connection = None
        try:
            connection = dial(device, timeout=min(left, DEFAULT_TIMEOUT))
            connection.send(protocol.resume_frame(device.index, device.token, engine.window))
            # the session's limits at once: a reply the peer kept (a large read) may come in the answer's recv
            connection.set_limits(protocol.limits)
            answer = connection.receive(min(left, DEFAULT_TIMEOUT)).header
            if answer.get("t") != "resumed":
                if answer.get("gone"):
                    connection.close()
                    return ConnectionLost(f"{cause}; {answer.get('reason')}; every array of the session is lost "
                                          f"with it")
                raise refusal(answer, device)  # busy or throttled: dialled again
            replayed = protocol.resumed(answer)
            for frame in replayed:
                engine.counters["bytes_up"] += connection.send(frame)
        except (EmberError, OSError) as error:
            if connection is not None:
                with contextlib.suppress(EmberError, OSError):
                    connection.close()
            last = str(error)  # not the error: its traceback holds this frame, and the caller's arrays with it
            continue
        engine.connection, engine.last_io = connection, _clock()
        seconds = _clock() - started
        protocol.count_resume(len(replayed), seconds)
        if profiling.watching:
            profiling.record("resume", engine.name, seconds, 0)
        log.warning("%s: resumed after %.1f s (%s; %d batch(es) sent again)", engine.name, seconds, cause,
                    len(replayed))
        return None
