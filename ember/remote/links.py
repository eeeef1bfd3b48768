"""Fetch links: the connections peers fetch tensors over, kept open between fetches.

A fetch whose tensor came keeps its connection: the source (:class:`~ember.remote.sources.Sources`)
answers the next fetch on it for FETCH_LINK_SECONDS, and the destination keeps it idle for half
that (:class:`KeptLinks`), so a peer fetching again from the same source (an ``all_reduce``'s
rounds, a training loop's moves) pays no new connection, thread or TLS handshake. The destination
keeps a few a source and a bounded number in all; one timer closes those past their time.
"""

from __future__ import annotations

import threading
import time

FETCH_LINK_SECONDS = 30  # a fetch connection whose last fetch got its tensor stays open this long for the next one …
FETCH_LINKS_KEPT = 4     # … and a peer keeps this many of them idle to each source …
KEPT_LINKS = 64          # … and this many in all (the oldest goes first)


class KeptLinks:
    """The idle connections a destination keeps to the sources it fetched from, by source
    (``(scheme, address, port)``), each with when it was kept and the peer id its source named:
    for half the source's FETCH_LINK_SECONDS (a timer closes it then), at most FETCH_LINKS_KEPT a
    source and KEPT_LINKS in all. None is kept once ``stopping`` is set."""

    def __init__(self, stopping: threading.Event):
        self.stopping = stopping
        self.idle: dict[tuple, list] = {}  # (scheme, address, port) -> idle connections to it: (connection, since, peer)
        self._lock = threading.Lock()
        self._sweeper: threading.Timer | None = None  # closes kept connections past their time

    def take(self, source: tuple, peer: str):
        """An idle connection to ``source`` (whose peer is ``peer``) kept from an earlier fetch, if one
        is young enough that the source has not closed it (half its FETCH_LINK_SECONDS), else None."""
        now = time.monotonic()
        stale, found = [], None
        with self._lock:
            kept = self.idle.get(source, [])
            for entry in reversed(kept):  # the youngest first
                connection, since, named = entry
                if now - since >= FETCH_LINK_SECONDS / 2:
                    stale.append(entry)
                elif named == peer and found is None:
                    found = entry
            for entry in stale + ([found] if found else []):
                kept.remove(entry)
            if not kept:
                self.idle.pop(source, None)
        for connection, _, _ in stale:
            connection.close()
        return found[0] if found else None

    def keep(self, source: tuple, peer: str, connection) -> None:
        """Keep ``connection`` to ``source`` (whose peer is ``peer``) for the next fetch from it, or
        close it where the source has its share already or the peer stops; past KEPT_LINKS, the
        oldest kept connection of all is closed."""
        closing = []
        with self._lock:
            kept = self.idle.setdefault(source, [])
            if len(kept) >= FETCH_LINKS_KEPT or self.stopping.is_set():
                closing.append(connection)
            else:
                kept.append((connection, time.monotonic(), peer))
                if sum(map(len, self.idle.values())) > KEPT_LINKS:  # the oldest of all goes
                    oldest = min((entry[1], key) for key, entries in self.idle.items() for entry in entries[:1])[1]
                    closing.append(self.idle[oldest].pop(0)[0])
                self._sweep_later()
            if not kept:
                self.idle.pop(source, None)
        for one in closing:
            one.close()

    def close(self) -> None:
        """Close every kept connection and the timer (the peer is stopping)."""
        with self._lock:
            kept, self.idle = self.idle, {}
            if self._sweeper is not None:
                self._sweeper.cancel()
                self._sweeper = None
        for connection, _, _ in (entry for entries in kept.values() for entry in entries):
            connection.close()

    def _sweep_later(self) -> None:
        """Have a timer close the kept connections as their time runs out (the lock is held): one
        timer at a time, not a thread a connection."""
        if self._sweeper is not None or not self.idle or self.stopping.is_set():
            return
        oldest = min(entry[1] for entries in self.idle.values() for entry in entries)
        delay = max(oldest + FETCH_LINK_SECONDS / 2 - time.monotonic(), 0.05)
        self._sweeper = threading.Timer(delay, self._sweep)
        self._sweeper.name, self._sweeper.daemon = "ember-fetch-links", True
        self._sweeper.start()

    def _sweep(self) -> None:
        now = time.monotonic()
        expired = []
        with self._lock:
            self._sweeper = None
            for source in list(self.idle):
                entries = self.idle[source]
                expired += [entry[0] for entry in entries if now - entry[1] >= FETCH_LINK_SECONDS / 2]
                entries[:] = [entry for entry in entries if now - entry[1] < FETCH_LINK_SECONDS / 2]
                if not entries:
                    del self.idle[source]
            self._sweep_later()
        for connection in expired:
            connection.close()
