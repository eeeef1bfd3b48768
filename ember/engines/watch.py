"""The watch for quiet connections: one daemon thread that tells remote engines when to look at
what their peer said unasked.

Before the next batch, a remote engine whose connection has been quiet for QUIET_SECONDS reads
what the peer sent meanwhile (``RemoteEngine.check``), so that a session the peer ended (its idle
timeout, a restart) is found lost before ops are written into it. A check that comes too soon owes
the question: the engine is handed to this watch, which sets the engine's ``recheck`` again once
its connection has been quiet that long, so a use after a long quiet is checked even if an op came
right after the last batch. One thread for all engines keeps the device's check per op one
attribute read (a clock read per op instead cost 4% on the peer's chain of small ops).
"""

from __future__ import annotations

import os
import threading
import time
import weakref

QUIET_SECONDS = 0.05  # a connection silent this long is asked whether the peer ended the session
_clock = time.perf_counter


class QuietWatch:
    """The engines that owe a check: each has ``last_io`` (the clock when its connection last sent or
    received a frame), ``lost`` (None while its session lives), ``owed`` and ``recheck``."""

    def __init__(self):
        self._owing: weakref.WeakSet = weakref.WeakSet()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def owe(self, engine) -> None:
        """Set ``engine.recheck`` once its connection has been quiet for QUIET_SECONDS (or it is lost)."""
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
                    quiet_at = engine.last_io + QUIET_SECONDS  # later ops' I/O moves it on
                    if engine.lost is not None or now >= quiet_at:
                        engine.owed, engine.recheck = False, engine.lost is None
                        self._owing.discard(engine)
                    elif wait is None or quiet_at - now < wait:
                        wait = quiet_at - now
                self._changed.wait(wait)


def check(engine) -> None:
    """Before the next batch on a connection quiet for QUIET_SECONDS, have ``engine`` read what the
    peer said meanwhile (``engine.read_unasked()``; the device calls this as ``engine.check()`` when
    ``recheck`` is set), so a session the peer ended is found lost now and the device opens a new
    one. Asked too soon, the question stays owed: the watch asks again once the connection has been
    quiet that long."""
    engine.recheck = False
    if _clock() - engine.last_io < QUIET_SECONDS:
        if not engine.owed:
            watch.owe(engine)
        return
    engine.read_unasked()


watch = QuietWatch()
os.register_at_fork(after_in_child=watch.__init__)  # the lock may have been held by the thread, which the child lacks
