"""``ember top PEER``: a compute peer's sessions and throughput in the terminal, from its ``/status.json``.

The peer is named as a device is (``ember://host:port``, ``ws://``, ``embers://``, ``wss://`` —
the last two read it over HTTPS, trusting ``--tls-ca`` or ``EMBER_TLS_CA``); the token comes from
``EMBER_TOKEN`` (or the address's ``TOKEN@``, or ``--token``: both show it to anyone who lists this
machine's processes) and travels as a bearer header, never shown. A client other than the admin
sees its own sessions only.
"""

from __future__ import annotations

import json
import shutil
import ssl
import sys
import time
import urllib.error
import urllib.request

from ..devices import RemoteDevice, redact_secrets, redacted
from ..devices import device as as_device
from ..errors import AccessDenied, ConnectionLost, DeviceError
from ..profiling import format_bytes
from ..wire.tls import client_context

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


def status_url(peer: str, tls_ca: str | None = None) -> tuple[str, str | None, ssl.SSLContext | None]:
    """The ``/status.json`` URL of ``peer`` (a device string without or with its index), its token and
    the TLS context to read it with (None for plain HTTP)."""
    text = peer.rstrip("/")
    remote = as_device(text + ("/0" if text.count("/") == 2 else ""), tls_ca=tls_ca)
    if not isinstance(remote, RemoteDevice):
        raise DeviceError(f"ember top watches a compute peer (ember://host:port), not {redacted(peer)!r}")
    secure = remote.scheme in ("embers", "wss")
    host = f"[{remote.host}]" if ":" in remote.host else remote.host
    url = f"{'https' if secure else 'http'}://{host}:{remote.port}/status.json"
    return url, remote.token, client_context(remote.tls_ca) if secure else None


def fetch(url: str, token: str | None, context: ssl.SSLContext | None, timeout: float = 10) -> dict:
    """The peer's status; AccessDenied for a refused token, ConnectionLost when it cannot be read."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as error:
        if error.code == 401:
            raise AccessDenied("the peer asks for a token: set EMBER_TOKEN (or pass ember://TOKEN@host:port)") from None
        if error.code == 429:  # too many wrong tokens from this address
            raise AccessDenied(f"the peer refused: {error.read().decode('utf-8', 'replace').strip()[:200]}") from None
        raise ConnectionLost(f"the peer answered {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise ConnectionLost(f"cannot read the peer's status at {url}: {getattr(error, 'reason', error)}") from None


def _age(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def render(state: dict, width: int = 160) -> str:
    """The status as a table: a summary, throughput now, one line per session, the last errors."""
    totals, memory, history = state["totals"], state["memory"], state["history"]
    rate = {}
    if len(history) >= 2:
        last, before = history[-1], history[-2]
        span = max(last["time"] - before["time"], 1e-9)
        rate = {k: (last[k] - before[k]) / span for k in ("ops", "round_trips", "bytes_in", "bytes_out")}
    view = state.get("view", {})
    own = view.get("sessions") == "own"  # a client's own view: its sessions, not the peer's memory in use
    lines = [f"ember peer: {', '.join(state['devices'])} ({state['backend']}), up {_age(state['uptime_seconds'])}"
             + (f"; the sessions of {view.get('client')} only" if own else ""),
             f"  {totals['sessions']} sessions, {totals['live_tensors']} tensors, {format_bytes(totals['live_bytes'])} live; "
             + (f"memory budget {format_bytes(memory['budget_bytes'])}" if own else
                f"memory {format_bytes(memory['used_bytes'])} of {format_bytes(memory['budget_bytes'])}"),
             f"  {totals['ops']} ops, {totals['round_trips']} round trips, {format_bytes(totals['bytes_in'])} in, "
             f"{format_bytes(totals['bytes_out'])} out, {totals['graphs_registered']} graphs registered, "
             f"{totals['graph_runs']} graph runs"]
    if rate:
        lines.append(f"  now: {rate['ops']:.0f} ops/s, {rate['round_trips']:.1f} round trips/s, "
                     f"{format_bytes(rate['bytes_in'])}/s in, {format_bytes(rate['bytes_out'])}/s out")
    lines.append("")
    lines.append(f"{'client':<20} {'address':<22} {'device':<14} {'age':>7} {'tensors':>8} {'live':>10} {'ops':>9} "
                 f"{'trips':>7}  last error")
    for row in state["sessions"]:
        error = row["last_error"]
        lines.append(f"{row['client'][:20]:<20} {row['address'][:22]:<22} {row['device'][:14]:<14} {_age(row['age_seconds']):>7} "
                     f"{row['live_tensors']:>8} {format_bytes(row['live_bytes']):>10} {row['ops']:>9} {row['round_trips']:>7}  "
                     f"{error['kind'] + ': ' + error['message'] if error else ''}")
    if not state["sessions"]:
        lines.append("(no sessions)")
    if state["recent_errors"]:
        lines.append("")
        lines.append("recent errors:")
        lines += [f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['client']}: {e['kind']}: {e['message']}"
                  for e in state["recent_errors"][-5:]]
    return "\n".join(line[:width] for line in lines)


def run(peer: str, token: str | None = None, interval: float = 2.0, once: bool = False, tls_ca: str | None = None,
        out=None) -> int:
    """Show ``peer``'s status, refreshed every ``interval`` seconds until Ctrl-C (once with ``once``);
    returns the exit status."""
    out = out or sys.stdout
    try:
        url, found, context = status_url(peer, tls_ca)
        token = token or found
        while True:
            text = render(fetch(url, token, context), shutil.get_terminal_size((160, 40)).columns)
            out.write(text + "\n" if once else CLEAR + text + "\n\n(refreshing every "
                      f"{interval:g} s; Ctrl-C quits)\n")
            out.flush()
            if once:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        out.write("\n")
        return 0
    except (AccessDenied, ConnectionLost, DeviceError) as error:
        print(f"ember top: {redact_secrets(str(error), peer, token)}", file=sys.stderr)
        return 1
