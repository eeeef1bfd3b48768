"""Where a program waited: ``with em.profile() as p:`` records every wait for a device.

A read (``float(x)``, ``em.asnumpy``), a sync and a data-dependent shape (``nonzero``, ``unique``,
a boolean mask) on a compute peer each wait a round trip. Each wait is recorded with the user's
source line — the first frame outside ember's library (ember's own programs, the demo, the
spirals job and the benchmarks, count as user code) — its kind, how long it waited, the bytes it
received and the device. ``p.report()`` prints the lines that waited longest first;
``p.save(path)`` writes JSON. ``EMBER_PROFILE=1`` profiles a whole program and prints the report
to stderr when it exits (``EMBER_PROFILE=FILE.json`` also saves it there).

Engines call :func:`record` where they block (the remote engine's one round-trip path), only
while :data:`watching` is true: a profile costs nothing when none is open.
"""

from __future__ import annotations

import atexit
import json
import linecache
import os
import sys
import threading
import time
from pathlib import Path

_LIBRARY = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: files of the ember package that are programs, not library: their lines are where waits are attributed
_PROGRAMS = tuple(_LIBRARY + name for name in ("demo.py", "spirals.py", "benchmarks" + os.sep))
KINDS = {"get": "read", "sync": "sync", "shape": "shape", "stats": "stats"}  # wire message → kind of wait
EVENT_FIELDS = ("time", "file", "line", "kind", "device", "seconds", "bytes")
MAX_EVENTS = 100_000  # waits a profile keeps one by one (beyond, only the per-line totals grow)

_open: list[Profile] = []
_lock = threading.Lock()
watching = False  # whether any profile is open (engines read this before timing a wait)


def _caller() -> tuple[str, int, str]:
    """The first frame outside ember's library: (file, line, function)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_LIBRARY) or name.startswith(_PROGRAMS):
            return name, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return "<ember>", 0, "?"


def record(message: str, device: str, seconds: float, nbytes: int) -> None:
    """Report one wait to every open profile: the wire message that waited (``get``, ``sync`` …),
    the device, the seconds it took and the bytes it received."""
    where = _caller()
    kind = KINDS.get(message, message)
    for profile in list(_open):
        profile._add(where, kind, device, seconds, nbytes)


class Line:
    """The waits of one source line."""

    def __init__(self, file: str, line: int, function: str):
        self.file, self.line, self.function = file, line, function
        self.waits, self.seconds, self.bytes = 0, 0.0, 0
        self.kinds: dict[str, int] = {}
        self.devices: dict[str, int] = {}

    @property
    def source(self) -> str:
        return linecache.getline(self.file, self.line).strip()

    def as_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "function": self.function, "source": self.source,
                "waits": self.waits, "seconds": self.seconds, "bytes": self.bytes, "kinds": dict(self.kinds),
                "devices": dict(self.devices)}


class Profile:
    """The waits recorded while it is open (a context manager; :func:`profile` makes one)."""

    def __init__(self):
        self.lines: dict[tuple[str, int], Line] = {}
        self.events: list[tuple] = []  # (time, file, line, kind, device, seconds, bytes)
        self._lock = threading.Lock()

    def __enter__(self) -> Profile:
        global watching
        with _lock:
            _open.append(self)
            watching = True
        return self

    def __exit__(self, *exc) -> None:
        global watching
        with _lock:
            if self in _open:
                _open.remove(self)
            watching = bool(_open)

    def _add(self, where: tuple, kind: str, device: str, seconds: float, nbytes: int) -> None:
        with self._lock:  # plain dict updates: a wait on loopback lasts ~100 µs, this a few
            line = self.lines.get(where[:2])
            if line is None:
                line = self.lines[where[:2]] = Line(*where)
            line.waits += 1
            line.seconds += seconds
            line.bytes += nbytes
            line.kinds[kind] = line.kinds.get(kind, 0) + 1
            line.devices[device] = line.devices.get(device, 0) + 1
            if len(self.events) < MAX_EVENTS:
                self.events.append((time.time(), where[0], where[1], kind, device, seconds, nbytes))

    def rows(self) -> list[Line]:
        """One entry per source line, the longest total wait first."""
        with self._lock:
            return sorted(self.lines.values(), key=lambda line: (-line.seconds, -line.waits))

    @property
    def waits(self) -> int:
        return sum(line.waits for line in self.rows())

    def table(self, limit: int = 20) -> str:
        """The report as text: a line per source line, the costliest first (``limit`` of them)."""
        rows = self.rows()
        seconds = sum(r.seconds for r in rows) or 1e-12
        text = [f"ember profile: {sum(r.waits for r in rows)} waits, {sum(r.seconds for r in rows):.4f} s waiting, "
                f"{format_bytes(sum(r.bytes for r in rows))} received",
                f"  {'waits':>6} {'wait (s)':>10} {'share':>6} {'received':>10}  {'kinds':<18} where"]
        for r in rows[:limit]:
            kinds = " ".join(f"{kind}×{n}" for kind, n in sorted(r.kinds.items(), key=lambda item: -item[1]))
            devices = ", ".join(r.devices)
            text.append(f"  {r.waits:>6} {r.seconds:>10.4f} {r.seconds / seconds:>6.1%} {format_bytes(r.bytes):>10}  {kinds:<18} "
                        f"{_short(r.file)}:{r.line} ({r.function}, {devices})")
            if r.source:
                text.append(f"  {'':>6} {'':>10} {'':>6} {'':>10}  {'':<18}   {r.source}")
        if len(rows) > limit:
            text.append(f"  … and {len(rows) - limit} more lines")
        return "\n".join(text)

    def report(self, file=None, limit: int = 20) -> None:
        """Print :meth:`table` (to ``file``, default stdout)."""
        print(self.table(limit), file=file or sys.stdout, flush=True)

    def as_dict(self) -> dict:
        rows = self.rows()
        return {"waits": sum(r.waits for r in rows), "seconds": sum(r.seconds for r in rows),
                "bytes": sum(r.bytes for r in rows), "lines": [r.as_dict() for r in rows],
                "events": [dict(zip(EVENT_FIELDS, event)) for event in self.events]}

    def save(self, path) -> Path:
        """Write the profile as JSON (per line and per wait) to ``path``; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.as_dict(), indent=1))
        return path


def profile() -> Profile:
    """A profile of the waits for devices: ``with em.profile() as p: ...`` then ``p.report()``."""
    return Profile()


def format_bytes(n: float) -> str:
    """A byte count as people read it: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _short(file: str) -> str:
    """``file`` relative to the working directory when it is below it."""
    try:
        return os.path.relpath(file) if not os.path.relpath(file).startswith("..") else file
    except ValueError:
        return file


def profile_program(setting: str) -> Profile:
    """``EMBER_PROFILE``: profile until the program exits, then print the report to stderr (and
    save it when ``setting`` names a ``.json`` file)."""
    whole = Profile().__enter__()

    def finish():
        whole.__exit__(None, None, None)
        whole.report(file=sys.stderr)
        if setting.endswith(".json"):
            whole.save(setting)

    atexit.register(finish)
    return whole
