"""What a compute peer shows of itself over HTTP, without I/O: ``/status.json``, ``/metrics``, ``/``.

:func:`snapshot` reads the counters that :class:`~ember.remote.host.Host` and its sessions keep
into one plain dict; :func:`prometheus` renders it in Prometheus' text format (with the
``prometheus-client`` library, the ``metrics`` extra); :data:`PAGE` is a status page that draws
``/status.json`` in the browser, itself, every two seconds (inline script and SVG: no network).
:func:`answer` is the routing: a parsed request in, a response out, so ``http.py``, the shell,
only reads and writes bytes. When the peer admits clients by token, every path but the page
itself (which holds no data: it asks for the token in a form, then sends it as a bearer header)
requires one; no path shows a token. Who presents it decides what is shown (``view``): the admin
(``--token-file``'s one client, a tokens file's ``role=admin`` or ``role=metrics``, anyone where
the peer asks for no token) sees the whole peer; any other client only its own sessions and the
peer's configuration, nothing another client did or holds.
"""

from __future__ import annotations

import json
import math
from collections import Counter

from .access import Throttled, Viewer
from .host import COUNTED, Host
from .page import PAGE as _PAGE

REFRESH_SECONDS = 2  # how often the page asks for /status.json
MESSAGE_CHARACTERS = 300  # an error's message, as the page and the JSON show it
PAGE = _PAGE.replace("{{refresh}}", str(REFRESH_SECONDS * 1000))


def _clip(text: str) -> str:
    return text if len(text) <= MESSAGE_CHARACTERS else text[:MESSAGE_CHARACTERS - 1] + "…"


def snapshot(host: Host, now: float, viewer: Viewer | None = None) -> dict:
    """The peer's state at ``now`` (``time.time()``) as ``viewer`` may see it (None: the admin):
    hosted devices, memory, totals, one entry per session, throughput samples (the last one is
    now) and recent errors. Plain JSON values.

    A viewer that does not see all (``viewer.sees_all``) gets its own sessions only: the totals
    are those of its open sessions, the recent errors those of its sessions, open or closed, and
    what the whole peer holds or did — memory in use, the throughput samples — is left out
    (``memory.used_bytes`` null, ``history`` empty): with two clients, the peer's figures less
    one's own would be the other's."""
    viewer = viewer or Viewer("", "admin")
    everyone = viewer.sees_all
    with host.registry.lock:  # one view: a closing session moves its counts into the host's under this lock
        sessions = sorted((s for s in host.registry.sessions if everyone or s.client == viewer.name), key=lambda s: s.opened)
        counts = [s.counted() for s in sessions]  # read once, under the lock: the rows, and a client's own totals their sum
        totals = host.totals() if everyone else {name: sum(c[name] for c in counts) for name in COUNTED}
        with host.watch_lock:  # copies: the host's and the sessions' threads go on changing them
            errors, recent, history = host.errors.copy(), list(host.recent), [*host.history, (now, totals)]
        copies = []
        for session in sessions:
            with session.watch_lock:
                copies.append((session.errors.copy(), list(session.recent)))
    if not everyone:  # its closed sessions' last failures are among the peer's, by its name (refusals: by address)
        recent = [entry for entry in recent if entry[1] == viewer.name]
        errors, history = Counter(), []
    rows = []
    for session, counted, (session_errors, session_recent) in zip(sessions, counts, copies):
        errors.update(session_errors)
        recent += [(when, session.client, kind, message) for when, kind, message in session_recent]
        last = session_recent[-1] if session_recent else None
        rows.append({
            "session": session.id[:8], "client": session.client, "address": session.address, "device": session.device,
            "age_seconds": round(now - session.opened, 3), "live_tensors": len(session.table.tensors),
            "live_bytes": session.quota.used, **counted,
            "errors": dict(session_errors),
            "last_error": None if last is None else {"kind": last[1], "message": _clip(last[2])},
        })
    recent.sort()
    return {
        "view": {"client": viewer.name, "role": viewer.role, "sessions": "all" if everyone else "own"},
        "backend": host.backend_name, "devices": [str(d) for d in host.devices],
        "started": host.started, "uptime_seconds": round(now - host.started, 3),
        "memory": {"budget_bytes": host.budget.limit, "used_bytes": host.budget.used if everyone else None,
                   "session_quota_bytes": host.limits.max_session_bytes},
        "totals": {"sessions": len(rows), "live_tensors": sum(r["live_tensors"] for r in rows),
                   "live_bytes": sum(r["live_bytes"] for r in rows), **totals, "errors": dict(errors)},
        "sessions": rows,
        "history": [{"time": when, **counts} for when, counts in history],
        "recent_errors": [{"time": when, "client": client, "kind": kind, "message": _clip(message)}
                          for when, client, kind, message in recent[-20:]],
    }


def prometheus(state: dict) -> bytes:
    """``state`` (a :func:`snapshot`) in Prometheus' text exposition format. A client's own view
    has its sessions' series and the gauges over them, not the peer's counters or memory in use."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    totals, sessions = state["totals"], state["sessions"]
    everyone = state.get("view", {}).get("sessions", "all") == "all"
    labels = ["session", "client"]

    def per_session(family, field):
        for row in sessions:
            family.add_metric([row["session"], row["client"]], row[field])
        return family

    def families():
        yield GaugeMetricFamily("ember_uptime_seconds", "Seconds since the peer started", value=state["uptime_seconds"])
        yield GaugeMetricFamily("ember_sessions", "Open sessions", value=totals["sessions"])
        yield GaugeMetricFamily("ember_memory_budget_bytes", "The bytes all sessions may hold together",
                                value=state["memory"]["budget_bytes"])
        if everyone:
            yield GaugeMetricFamily("ember_memory_used_bytes", "The bytes counted against the budget (tensors, frames, "
                                    "pool)", value=state["memory"]["used_bytes"])
        yield GaugeMetricFamily("ember_live_tensors", "Tensors held by all sessions", value=totals["live_tensors"])
        yield GaugeMetricFamily("ember_live_bytes", "Bytes held by all sessions", value=totals["live_bytes"])
        yield per_session(GaugeMetricFamily("ember_session_live_tensors", "Tensors held by a session", labels=labels),
                          "live_tensors")
        yield per_session(GaugeMetricFamily("ember_session_live_bytes", "Bytes held by a session (its quota counts them)",
                                            labels=labels), "live_bytes")
        for field, text in (("ops", "Ops executed"), ("round_trips", "Replies a client waited for"),
                            ("bytes_in", "Tensor bytes received"), ("bytes_out", "Tensor bytes sent"),
                            ("graphs_registered", "Captured graphs registered"),
                            ("graph_runs", "Runs of a registered graph (registration cache hits)")):
            if everyone:  # the peer's counters; a client's own open sessions' sums would fall as they close
                yield CounterMetricFamily(f"ember_{field}", f"{text}, by all sessions since the peer started",
                                          value=totals[field])
            yield per_session(CounterMetricFamily(f"ember_session_{field}", f"{text}, by a session", labels=labels), field)
        if everyone:
            errors = CounterMetricFamily("ember_errors", "Failures (failed ops, refusals, broken frames), by kind",
                                         labels=["kind"])
            for kind, count in sorted(totals["errors"].items()):
                errors.add_metric([kind], count)
            yield errors

    class Collector:
        def collect(self):
            return families()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry)


class Response:
    """What :func:`answer` tells the shell to send."""

    def __init__(self, status: int, body: bytes | str, content_type: str = "text/plain; charset=utf-8", **headers: str):
        self.status, self.content_type, self.headers = status, content_type, headers
        self.body = body.encode() if isinstance(body, str) else body


def answer(host: Host, method: str, path: str, authorization: str | None, address: str, now: float) -> Response:
    """The response to a request for ``path`` (the query is ignored) with the ``Authorization``
    header ``authorization``: 405 for methods other than GET and HEAD, 404 for unknown paths, 401
    without an accepted bearer token where the peer asks for one, 429 (with ``Retry-After``) while
    the address must wait after too many wrong ones (``Host.throttle``)."""
    path = path.split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return Response(405, "only GET and HEAD are served here\n", Allow="GET, HEAD")
    if path not in ("/", "/index.html", "/status.json", "/metrics"):
        return Response(404, f"no page at {path[:100]}; try /, /status.json or /metrics\n")
    if path in ("/", "/index.html"):
        return Response(200, PAGE, "text/html; charset=utf-8")
    scheme, _, token = (authorization or "").partition(" ")
    try:
        viewer = host.admits(address, token.strip() if scheme.lower() == "bearer" else None)
    except Throttled as wait:
        return Response(429, f"{wait}\n", **{"Retry-After": str(max(1, math.ceil(wait.wait)))})
    if viewer is None:
        return Response(401, "this peer asks for a token: send the header Authorization: Bearer TOKEN\n",
                        **{"WWW-Authenticate": 'Bearer realm="ember"'})
    state = snapshot(host, now, viewer)
    if path == "/status.json":
        return Response(200, json.dumps(state), "application/json")
    try:
        text = prometheus(state)
    except ImportError:
        return Response(501, "/metrics needs prometheus-client: pip install 'ember[metrics]'\n")
    return Response(200, text, "text/plain; version=0.0.4; charset=utf-8")
