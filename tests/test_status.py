"""A compute peer watched over HTTP on its own port (/metrics, /status.json, /), ``ember top``, and
``em.profile``: all against real ``ember serve`` processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ember as em
from ember.remote.access import Viewer
from ember.remote.memory import TENSOR_OVERHEAD
from ember.wire import protocol as wire

from .peers import Peer

TOKEN = "watch-token-0123456789"
OTHER = "other-token-9876543210"
THIRD = "third-token-5555555555"
ADMIN = "admin-token-4444444444"
pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("watch") / "tokens"
    path.write_text(f"alice {TOKEN}\nbob {OTHER} 0\ncarol {THIRD} 1\nops {ADMIN} role=admin\n")
    return path


@pytest.fixture(scope="module")
def guarded(tokens_file):
    """A peer whose clients are named in a tokens file; its handshake deadline is long, so a prompt
    answer to a bad request cannot be that deadline running out."""
    with Peer("--tokens-file", str(tokens_file), "--handshake-timeout", "60") as running:
        yield running


def get(peer, path: str, token: str | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    request = urllib.request.Request(f"http://{peer.address}{path}", method=method,
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def raw_answer(peer, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; all the peer answers before it closes. A peer that waits (for
    its 60 s handshake deadline) instead fails the test at the socket's 10 s timeout."""
    host, port = peer.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            pytest.fail(f"the peer neither answered nor closed after {data[:30]!r}")
        except ConnectionResetError:  # a refused request whose rest was never read
            pass
    return received


def test_metrics_and_status_count_a_real_session(guarded):
    remote = em.device(guarded.url(token=TOKEN))
    x = em.asarray(np.arange(1000, dtype=np.float32), device=remote)
    for i in range(5):
        float(em.sum(x * i))
    with pytest.raises(em.ExecutionError, match="Singular"):
        em.asnumpy(em.linalg.inv(em.zeros((2, 2), device=remote)))
    step = em.jit(lambda a: em.sin(a) + 1)
    for _ in range(3):
        em.asnumpy(step(x))
    client = em.stats(remote)

    status, headers, body = get(guarded, "/status.json", TOKEN)
    assert status == 200 and headers["Content-Type"] == "application/json" and headers["Cache-Control"] == "no-store"
    state = json.loads(body)
    (row,) = [r for r in state["sessions"] if r["client"] == "alice"]
    assert row["ops"] == client["ops"] + 3 * 2  # the client's op messages, and the graph's two ops run three times
    assert row["round_trips"] == client["round_trips"]
    assert row["graphs_registered"] == 1 and row["graph_runs"] == 3
    assert row["live_tensors"] >= 1 and row["live_bytes"] >= x.size * 4
    assert row["bytes_in"] == 4000 and row["bytes_out"] >= 5 * 4 + 3 * 4000
    assert row["errors"] == {"ExecutionError": 1} and row["last_error"]["message"].startswith("inv: Singular matrix")
    assert row["address"].startswith("127.0.0.1:") and state["devices"] == ["numpy"]
    assert any(e["client"] == "alice" and e["kind"] == "ExecutionError" for e in state["recent_errors"])
    assert state["view"]["sessions"] == "own" and state["history"] == []  # alice's view: her sessions alone
    assert TOKEN.encode() not in body and OTHER.encode() not in body
    everything = json.loads(get(guarded, "/status.json", ADMIN)[2])  # the admin's: the whole peer
    assert everything["history"][-1]["ops"] >= row["ops"] and everything["totals"]["sessions"] >= 1

    from prometheus_client.parser import text_string_to_metric_families
    status, headers, body = get(guarded, "/metrics", TOKEN)
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    labels = (("client", "alice"), ("session", row["session"]))
    assert samples[("ember_session_ops_total", labels)] == row["ops"]
    assert samples[("ember_session_round_trips_total", labels)] == row["round_trips"]
    assert samples[("ember_session_live_bytes", labels)] >= x.size * 4
    assert samples[("ember_memory_budget_bytes", ())] > 0 and samples[("ember_uptime_seconds", ())] > 0
    assert TOKEN.encode() not in body and ("ember_graph_runs_total", ()) not in samples  # the peer's counters: the admin's
    body = get(guarded, "/metrics", ADMIN)[2]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    assert samples[("ember_graph_runs_total", ())] >= 3 and samples[("ember_errors_total", (("kind", "ExecutionError"),))] >= 1
    remote.engine.close()


def test_closing_a_session_sends_what_is_pending_and_ends_it_without_an_error():
    """``engine.close()`` sends the batch it holds, then a close frame: the peer counts the ops and
    ends the session as asked (no error, nothing left live); the closed session's arrays are lost
    with a message that says so, and the device opens a new session at its next use."""
    with Peer() as fresh:
        remote = em.device(fresh.url())
        x = em.asarray(np.arange(4.0), device=remote)
        assert float(em.sum(x)) == 6.0
        engine = remote.engine
        sent = engine.counters["ops"]
        y = x * 2.0 + 1.0  # logged, not yet sent
        engine.close()
        assert engine.counters["ops"] == sent + 2
        deadline = time.monotonic() + 10
        while (state := json.loads(get(fresh, "/status.json")[2]))["totals"]["sessions"] and time.monotonic() < deadline:
            time.sleep(0.01)  # the peer's thread ends the session as the frame arrives, beside this request
        assert state["totals"]["sessions"] == 0 and state["totals"]["live_tensors"] == 0
        assert state["totals"]["ops"] == sent + 2  # the held batch reached the peer before the close
        assert state["totals"]["errors"] == {} and state["recent_errors"] == []  # a close, not a broken frame
        assert fresh.tracebacks == 0 and not any("closing the connection" in line for line in fresh.log)
        with pytest.raises(em.ConnectionLost, match=r"lives in a lost session .*\(the session with .* was closed\)"):
            em.asnumpy(y)
        assert float(em.sum(em.ones(3, device=remote))) == 3.0 and remote.engine is not engine  # a new session
        remote.engine.close()


def test_the_data_asks_for_a_token_compared_as_the_handshake_does(guarded):
    for token in (None, "wrong-token-000000", TOKEN + "x"):
        for path in ("/status.json", "/metrics"):
            status, headers, body = get(guarded, path, token)
            assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="ember"' and b"sessions" not in body
    assert get(guarded, "/status.json", OTHER)[0] == 200  # bob may use device 0, which this peer hosts
    carol = json.loads(get(guarded, "/status.json", THIRD)[2])  # carol may use only device 1, which it does not:
    assert carol["view"]["client"] == "carol" and carol["sessions"] == []  # she sees her sessions, which are none
    status, headers, page = get(guarded, "/")  # the page holds no data: it asks for the token itself
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b'id="login"' in page
    assert "default-src 'none'" in headers["Content-Security-Policy"] and b"<script src" not in page
    assert TOKEN.encode() not in page


def test_bad_requests_are_answered_at_once(guarded):
    assert get(guarded, "/nothing-here", TOKEN)[0] == 404
    status, headers, _ = get(guarded, "/metrics", TOKEN, method="DELETE")
    assert status == 405 and headers["Allow"] == "GET, HEAD"
    status, headers, body = get(guarded, "/status.json", TOKEN, method="HEAD")
    assert status == 200 and int(headers["Content-Length"]) > 0 and body == b""
    for request, answer in ((b"POST / HTTP/1.1\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 1000, b"405"),
                            (b"GET / HTTP/9.9\r\n\r\n", b"400"),
                            (b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n"
                             b"Authorization: Bearer x\r\n\r\n", b"401"),  # two: neither counts
                            (b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nUpgrade: h2c\r\n\r\n", b"200"),
                            (b"GET / HTTP/1.1\r\n" + b"X-Many: 1\r\n" * 70 + b"\r\n", b"431"),
                            (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 7000 + b"\r\nX-Big2: " + b"b" * 7000 + b"\r\n"
                             + b"X-Big3: " + b"c" * 7000, b"431"),
                            (b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\n", b"414")):
        assert raw_answer(guarded, request).startswith(b"HTTP/1.1 " + answer), request[:40]
    remote = em.device(guarded.url(token=TOKEN))  # the peer serves sessions as before
    assert float(em.sum(em.ones(3, device=remote))) == 3.0 and guarded.tracebacks == 0
    remote.engine.close()


def test_a_request_whose_first_bytes_come_one_at_a_time_is_told_from_a_frame(guarded):
    """The peer tells HTTP, TLS and ember's frames apart by a connection's first four bytes; a slow
    link or a hand at a terminal may send fewer first. Each request here is answered as HTTP, and an
    ember client's handshake cut the same way still opens a session."""
    host, port = guarded.address.rsplit(":", 1)
    request = b"GET /status.json HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
    for first in (1, 2, 3):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            for i in range(first):
                sock.sendall(request[i:i + 1])
                time.sleep(0.05)  # each byte its own segment, read by the peer before the next
            sock.sendall(request[first:])
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        assert received.startswith(b"HTTP/1.1 200 OK") and b'"sessions"' in received, (first, received[:80])
    init = wire.encode_frame({"t": "init", "v": wire.VERSION, "device": 0, "token": TOKEN})
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        data = b"".join(bytes(part) for part in init)
        sock.sendall(data[:2])
        time.sleep(0.05)
        sock.sendall(data[2:])
        reply = wire.FrameReader().feed(sock.recv(65536))
    assert reply[0].header["t"] == "info", reply
    assert guarded.tracebacks == 0


def test_a_head_is_answered_with_the_gets_headers_and_no_body(guarded):
    """HEAD mirrors GET without its body: read off the socket (a client library would drop a body
    that followed, and hide the fault)."""
    request = b" /status.json HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
    head, _, body = raw_answer(guarded, b"HEAD" + request).partition(b"\r\n\r\n")
    got_head, _, got_body = raw_answer(guarded, b"GET" + request).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and body == b"", (head, body[:40])
    length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
    assert length > 0 and len(got_body) == int(re.search(rb"Content-Length: (\d+)", got_head).group(1))


def test_ember_top_prints_the_sessions(guarded):
    remote = em.device(guarded.url(token=TOKEN))
    float(em.sum(em.ones(3, device=remote)))
    command = [sys.executable, "-m", "ember.cli", "top", f"ember://{guarded.address}", "--once"]
    shown = subprocess.run(command, capture_output=True, text=True, timeout=60, env={**os.environ, "EMBER_TOKEN": TOKEN})
    assert shown.returncode == 0, shown.stderr
    assert "ember peer: numpy (numpy)" in shown.stdout and "sessions" in shown.stdout
    (line,) = [line for line in shown.stdout.splitlines() if line.startswith("alice ")]
    assert "127.0.0.1:" in line and "numpy" in line and TOKEN not in shown.stdout
    refused = subprocess.run([*command, "--token", "wrong-token-000000"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "asks for a token" in refused.stderr and "wrong-token" not in refused.stderr
    bad = subprocess.run([*command[:-2], f"ember://{TOKEN}@{guarded.address}/x", "--once"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 1 and "bad remote device" in bad.stderr and TOKEN not in bad.stderr
    remote.engine.close()


def test_ember_top_refreshes_until_interrupted(peer):
    import signal
    # as in a terminal, where Ctrl-C is not ignored: a job a shell starts in the background (a mutation
    # run) inherits SIGINT ignored, and then Python installs no KeyboardInterrupt handler
    watching = subprocess.Popen([sys.executable, "-m", "ember.cli", "top", f"ember://{peer.address}", "--interval", "0.2"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    shown = ""
    try:
        while shown.count("ember peer: numpy") < 2:  # until it has refreshed once
            line = watching.stdout.readline()
            assert line, watching.stderr.read()
            shown += line
        watching.send_signal(signal.SIGINT)
        out, err = watching.communicate(timeout=30)
    finally:
        watching.kill()
        watching.wait()
    assert watching.returncode == 0 and "Traceback" not in err  # Ctrl-C ends it cleanly
    assert shown.count("\x1b[H\x1b[2J") >= 2  # each refresh from the top of a cleared screen


def test_profile_attributes_waits_to_the_users_line(peer, tmp_path):
    remote = em.device(peer.url())
    x = em.asarray(np.arange(100.0), device=remote)
    with em.profile() as p:
        for i in range(7):
            total = float(em.sum(x * i))  # the line that waits, seven times
        em.nonzero(x > 50)  # a data-dependent shape
        em.sync(remote)
    assert total == 6 * 4950.0
    rows = {(os.path.basename(r.file), r.source): r for r in p.rows()}
    loop = rows[("test_status.py", "total = float(em.sum(x * i))  # the line that waits, seven times")]
    assert loop.waits == 7 and dict(loop.kinds) == {"read": 7} and loop.bytes == 7 * (16 + 8)  # prefix + one float64
    assert loop.devices == {str(remote): 7} and loop.seconds > 0
    assert loop.function == "test_profile_attributes_waits_to_the_users_line"
    assert dict(rows[("test_status.py", "em.nonzero(x > 50)  # a data-dependent shape")].kinds) == {"shape": 1}
    assert dict(rows[("test_status.py", "em.sync(remote)")].kinds) == {"sync": 1}
    assert p.rows()[0].seconds >= p.rows()[-1].seconds and p.waits == 9
    table = p.table()
    assert "9 waits" in table and "read×7" in table and "total = float(em.sum(x * i))" in table
    saved = json.loads(p.save(tmp_path / "profile.json").read_text())
    assert saved["waits"] == 9 and len(saved["events"]) == 9
    assert {line["line"] for line in saved["lines"] if line["waits"] == 7} == {loop.line}
    float(em.sum(x))  # after the profile: not recorded
    assert p.waits == 9


def test_ember_profile_reports_a_whole_program_at_exit(peer, tmp_path):
    program = tmp_path / "loop.py"
    program.write_text(f"import ember as em\nx = em.ones(4, device={peer.url()!r})\n"
                       "for i in range(3):\n    print(float(em.sum(x * i)))\n")
    done = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "EMBER_PROFILE": str(tmp_path / "out.json")}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.0", "4.0", "8.0"]
    assert "ember profile: 3 waits" in done.stderr and "loop.py:4" in done.stderr and "read×3" in done.stderr
    assert json.loads((tmp_path / "out.json").read_text())["lines"][0]["line"] == 4


def test_the_counts_and_the_routing_without_sockets():
    """A Host fed frames directly: what a session did is counted once, kept after it closes, and answer()
    routes and checks tokens with no socket in the way."""
    from ember.remote import status
    from ember.remote.host import Host, hosted_devices
    from ember.remote.memory import BufferPool
    from ember.wire import protocol as wire
    from ember.wire.protocol import Frame, Limits

    host = Host(hosted_devices("numpy"), TOKEN, Limits())
    refused, _ = host.open(Frame({"t": "init", "v": wire.VERSION, "device": 0, "token": "nope-nope"}, []), BufferPool())
    session, _ = host.open(Frame({"t": "init", "v": wire.VERSION, "device": 0, "token": TOKEN}, []), BufferPool(), "1.2.3.4:5")
    data = np.arange(4.0)
    batch = ({"t": "batch", "m": (("put", 1, 0), ("op", "add", (1, 1), (2,), {}), ("op", "inv", (2,), (3,), {}),
                                  ("get", 1, 2), ("get", 2, 3))}, [data])
    replies = session.handle(Frame(*batch))
    assert [m[0] for m in replies[0][0]["m"]] == ["data", "error"]
    state = status.snapshot(host, now=session.opened + 10)
    (row,) = state["sessions"]
    assert (row["ops"], row["round_trips"], row["bytes_in"], row["bytes_out"]) == (2, 1, 32, 32)
    assert row["client"] == row["address"] == "1.2.3.4:5" and row["age_seconds"] == 10 and row["live_tensors"] == 3
    assert row["errors"] == {"ShapeError": 1} and row["last_error"]["kind"] == "ShapeError"
    assert state["totals"]["errors"] == {"ShapeError": 1, "AccessDenied": 1}
    host.close(session)
    after = status.snapshot(host, now=session.opened + 20)
    assert after["sessions"] == [] and after["totals"]["ops"] == 2 and after["totals"]["errors"]["ShapeError"] == 1
    assert [e["kind"] for e in after["recent_errors"]] == ["AccessDenied", "ShapeError"]

    def answer(method, path, authorization=None):
        return status.answer(host, method, path, authorization, "1.2.3.4:6", 0.0)

    assert answer("GET", "/status.json").status == 401 and answer("GET", "/metrics", f"Basic {TOKEN}").status == 401
    assert answer("GET", "/status.json?x=1", f"Bearer {TOKEN}").status == 200
    assert answer("GET", "/metrics", f"bearer {TOKEN}").body.startswith(b"# HELP ember_uptime_seconds")
    assert answer("GET", "/").status == 200 and answer("GET", "/admin").status == 404
    assert answer("PUT", "/").status == 405 and answer("PUT", "/").headers == {"Allow": "GET, HEAD"}


def test_a_tls_peer_shows_its_status_over_https_only(pki):  # noqa: F811
    import ssl
    with Peer(*pki.local.serve_args()) as running:
        context = ssl.create_default_context(cafile=pki.ca)
        with urllib.request.urlopen(f"https://{running.address}/status.json", context=context, timeout=10) as reply:
            assert reply.status == 200 and json.loads(reply.read())["devices"] == ["numpy"]
        assert raw_answer(running, b"GET /status.json HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400")  # plain: refused
        shown = subprocess.run([sys.executable, "-m", "ember.cli", "top", f"embers://{running.address}", "--once",
                                "--tls-ca", pki.ca], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "ember peer: numpy (numpy)" in shown.stdout, shown.stderr


def test_counts_add_up_over_sessions_and_what_is_remembered_is_bounded():
    from ember.remote.host import HISTORY, Host, hosted_devices
    from ember.remote.session import RECENT_ERRORS
    from ember.wire import protocol as wire
    from ember.wire.protocol import Frame, Limits

    host = Host(hosted_devices("numpy"), None, Limits())
    sessions = [host.open(Frame({"t": "init", "v": wire.VERSION}, []), address=f"10.0.0.{k}:1")[0] for k in range(3)]
    for k, session in enumerate(sessions):  # session k makes k + 1 tensors
        ops = tuple(("op", "full", (), (j,), {"shape": (1,), "fill_value": 1.0, "dtype": em.float64}) for j in range(k + 1))
        session.handle(Frame({"t": "batch", "m": ops}, []))
    assert host.totals()["ops"] == 6  # 1 + 2 + 3, over the open sessions
    for _ in range(2):
        sessions[2].handle(Frame({"t": "batch", "m": (("put", 9, 0),)}, [np.ones(3)]))
    assert (sessions[2].bytes_in, sessions[2].round_trips) == (48, 0)  # two frames of 24 bytes; no reply asked for
    host.close(sessions[0])
    host.close(sessions[1])
    host.close(sessions[0])  # again: nothing changes, nothing raises
    assert host.totals()["ops"] == 6 and [s.client for s in host.registry.sessions] == ["10.0.0.2:1"]
    reads = tuple(("get", rid, 99) for rid in range(RECENT_ERRORS + 5))  # unknown tensor ids: each one a failure
    sessions[2].handle(Frame({"t": "batch", "m": reads}, []))
    assert sessions[2].errors["ExecutionError"] == RECENT_ERRORS + 5 and len(sessions[2].recent) == RECENT_ERRORS
    for _ in range(RECENT_ERRORS + 5):
        refused, _ = host.open(Frame({"t": "init", "v": wire.VERSION + 1}, []), address="9.9.9.9:9")
        assert refused is None
    assert host.errors["ProtocolError"] == RECENT_ERRORS + 5 and len(host.recent) == RECENT_ERRORS
    assert host.recent[-1][1:3] == ("9.9.9.9:9", "ProtocolError")  # who was refused, and why
    for now in range(HISTORY + 5):
        host.sample(float(now))
    assert len(host.history) == HISTORY and host.history[-1] == (float(HISTORY + 4), host.totals())


def test_the_status_pages_access_rule_asks_each_hosted_device_as_the_handshake_does():
    from ember.remote.host import Host, hosted_devices
    from ember.wire.protocol import Limits

    asked = []

    def authorize(address, token, index):
        asked.append((address, token, index))
        if index == 0:
            raise em.AccessDenied("not on the first device")  # the second may still admit
        return {"alice's token": "alice", "anyone's": True}.get(token, False)
    host = Host(hosted_devices("numpy") * 2, None, Limits(), authorize=authorize)
    assert host.admits("1.2.3.4:5", "alice's token") == Viewer("alice")  # a name, when the rule gives one …
    assert asked == [("1.2.3.4:5", "alice's token", 0), ("1.2.3.4:5", "alice's token", 1)]
    assert host.admits("1.2.3.4:5", "anyone's") == Viewer("1.2.3.4:5")  # … else the address; neither sees all
    assert host.admits("1.2.3.4:5", "nobody's") is None
    # no rule: open, to an admin; the rule of --token-file makes its one client the admin
    assert Host(hosted_devices("numpy"), None, Limits()).admits("1.2.3.4:5", None) == Viewer("1.2.3.4:5", "admin")
    assert Host(hosted_devices("numpy"), TOKEN, Limits()).admits("1.2.3.4:5", TOKEN) == Viewer("1.2.3.4:5", "admin")


# --- reading a request's head: the parser alone, its bytes arriving in any pieces ---

class _ArrivingSocket:
    """A client's bytes as a socket gives them to ``read_request``: in the given pieces, one a recv."""

    def __init__(self, pieces):
        self.pieces = list(pieces)

    def settimeout(self, seconds):
        pass

    def recv(self, n):
        piece = self.pieces.pop(0) if self.pieces else b""
        if len(piece) > n:  # what is not asked for stays in the socket
            piece, rest = piece[:n], piece[n:]
            self.pieces.insert(0, rest)
        return piece


def _read(request: bytes, cuts) -> object:
    import time

    from ember.remote.http import read_request
    cuts = sorted({c for c in cuts if 0 < c < len(request)})
    pieces = [request[a:b] for a, b in zip([0, *cuts], [*cuts, len(request)])]
    # the server hands on the first four bytes it read to tell HTTP from the ember protocol, or none
    received, pieces = (pieces[0], pieces[1:]) if len(pieces[0]) <= 4 else (b"", pieces)
    return read_request(_ArrivingSocket(pieces), received, time.monotonic() + 5)


HEAD_REQUEST = b"HEAD /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer x\r\n\r\n"
UPGRADE_REQUEST = (b"GET /ember HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(UPGRADE_REQUEST)), max_size=8))
def test_a_head_reads_the_same_in_any_pieces(cuts):
    """HEAD is read as HEAD by every websockets version (16, the last for Python 3.10, parses GET only),
    and a WebSocket upgrade as an upgrade, however the bytes arrive; every byte is kept for the handshake."""
    head = _read(HEAD_REQUEST, cuts)
    assert (head.method, head.path, head.refusal, head.raw) == ("HEAD", "/status.json", None, HEAD_REQUEST)
    assert head.header("Authorization") == "Bearer x" and not head.upgrade
    upgrade = _read(UPGRADE_REQUEST, cuts)
    assert (upgrade.method, upgrade.path, upgrade.refusal, upgrade.raw) == ("GET", "/ember", None, UPGRADE_REQUEST)
    assert upgrade.upgrade


LINE_TOO_LONG = r"read \d+ bytes, expected no more than 8192 bytes|line too long"  # websockets 17 | 16 says


@pytest.mark.parametrize("request_head, status, says, method, path", [
    # the request line past websockets' limit, whole or still arriving
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414, LINE_TOO_LONG, "GET", "/" + "a" * 9000),
    (b"HEAD /" + b"a" * 9000, 414, LINE_TOO_LONG, "HEAD", ""),
    (b"GET / HTTP/1.1\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n", 431, LINE_TOO_LONG, "GET", "/"),
    (b"GET / HTTP/1.1\r\n" + b"X-Header: 1\r\n" * 65 + b"\r\n", 431, "a request has at most 64 headers", "GET", "/"),
    # short lines, but more of them than a head may hold
    (b"HEAD /x HTTP/1.1\r\n" + (b"X-Header: " + b"a" * 400 + b"\r\n") * 50, 431, "a request's head is at most 16384 bytes",
     "HEAD", "/x"),
    (b"POST /up HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", 405, "only GET and HEAD are served here", "POST", "/up"),
    (b"GET / FOO\r\n\r\n", 400, "not a request this peer reads: .+", "GET", "/"),  # not HTTP
    (b"POST\t/ HTTP/1.1\r\n\r\n", 400, "not a request this peer reads: .+", "POST\t/", ""),  # no method: a tab is no space
    (b"HEAD / HTTP/1.1\r\nno colon here\r\n\r\n", 400, "not a request this peer reads: .+", "HEAD", "/"),
])
def test_a_head_past_a_limit_or_unreadable_is_refused_by_its_status(request_head, status, says, method, path):
    """Refused with the status and the reason a client is shown, the method kept (a HEAD is answered
    without a body) and the path as far as it arrived (the log shows it)."""
    from ember.remote.http import MAX_HEAD_BYTES
    for cuts in ([], range(1, len(request_head), 1000), [1, 2, 3, 4, 5, 6]):
        request = _read(request_head, cuts)
        refusal = request.refusal
        assert refusal is not None and refusal.status == status, (cuts, refusal and refusal.status)
        assert re.fullmatch(says, refusal.body.decode()[:-1]) and refusal.body.endswith(b"\n"), refusal.body
        assert refusal.headers == ({"Allow": "GET, HEAD"} if status == 405 else {})
        line_read = b"\r\n" in request.raw  # a request line refused before its end has no path yet
        assert (request.method, request.path, request.headers) == (method, path if line_read else "", None)
        assert request.raw and request_head.startswith(request.raw)  # what was read: a refusal reads no further …
        assert len(request.raw) <= MAX_HEAD_BYTES  # … and never past the head's limit
        assert not request.upgrade and request.header("Host") is None


def test_a_client_leaving_within_its_head_is_a_lost_connection():
    with pytest.raises(em.ConnectionLost, match="^the client closed the connection within its request$"):
        _read(b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\n", [3])  # and then nothing: the socket's end


def test_a_head_of_as_many_headers_as_allowed_is_read():
    """64 headers, each named once or more: a header given twice reads as absent (which of the two?)."""
    head = b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-H%d: %d\r\n" % (k, k) for k in range(62))
    request = _read(head + b"Authorization: Bearer a\r\nAuthorization: Bearer b\r\n\r\n", [7])
    assert request.refusal is None and (request.method, request.path) == ("GET", "/metrics")
    assert request.header("X-H61") == "61" and request.header("X-H62") is None
    assert request.header("Authorization") is None  # given twice: ember reads neither


def test_the_request_line_is_told_from_a_header_line_with_any_websockets():
    """websockets 17 names the line that was too long by the error's type; 16 (the last for Python
    3.10) says "line too long" for both, and then the request line is the one not ended in time."""
    from websockets.exceptions import SecurityError

    from ember.remote.http import _request_line_too_long

    class RequestLineTooLong(SecurityError):
        pass

    class HeaderLineTooLong(SecurityError):
        pass

    unended, long_line = bytearray(b"GET /" + b"a" * 9000), bytearray(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n")
    header = bytearray(b"GET / HTTP/1.1\r\nX-Long: " + b"a" * 9000)
    assert _request_line_too_long(RequestLineTooLong("line too long"), header)  # the type decides …
    assert not _request_line_too_long(HeaderLineTooLong("line too long"), unended)
    old = SecurityError("line too long")  # … else where the first line ends
    assert _request_line_too_long(old, unended) and _request_line_too_long(old, long_line)
    assert not _request_line_too_long(old, header)
    assert not _request_line_too_long(old, bytearray(b"GET / HTTP/1.1\r\n" + b"a" * 8190 + b"\r\n"))
    assert _request_line_too_long(old, bytearray(b"GET /" + b"a" * 8186 + b"\r\n"))  # 8193 bytes with its end
    assert not _request_line_too_long(old, bytearray(b"GET /" + b"a" * 8185 + b"\r\n"))  # 8192: a header was too long
    assert not _request_line_too_long(SecurityError("too many HTTP headers"), unended)


# --- /status.json and /metrics against docs/status.md, without sockets ---

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "status.md")


def _documented_rows(heading: str) -> list[list[str]]:
    """The rows of the table under ``heading`` in docs/status.md, cells stripped of their backticks."""
    text = open(DOCS, encoding="utf-8").read().split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip().strip("`") for cell in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return rows[1:]  # after the header row


def _fields(value, path: str = "") -> set[str]:
    """The paths of a JSON value's leaves as docs/status.md writes them (``sessions[].client``); a
    list of plain values is one, and so is an ``errors`` map (its keys are error kinds)."""
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return set().union(*(_fields(item, path + "[]") for item in value))
    if isinstance(value, dict) and not path.endswith("errors"):
        return set().union(*(_fields(item, f"{path}.{key}" if path else key) for key, item in value.items()))
    return {path}


class _NamedByToken:
    """An authorizer naming each client by its token; the token ``root`` reads the status as the admin."""

    def __call__(self, address, token, device):
        return token or False

    def viewer(self, address, token):
        return Viewer(token, "admin" if token == "root" else None) if token else None


def _busy_host():
    """A Host with three sessions (clients a, b, c, opened in the order b, c, a), a refused
    handshake, and more failures than the status remembers: a failed 25 times, then b, then c."""
    from ember.remote.host import Host, hosted_devices
    from ember.remote.memory import BufferPool
    from ember.wire.protocol import Frame, Limits

    host = Host(hosted_devices("numpy"), None, Limits(), authorize=_NamedByToken())
    refused, _ = host.open(Frame({"t": "init", "v": wire.VERSION, "device": 0}, []), BufferPool(), "9.9.9.9:9")
    assert refused is None
    sessions = {}
    for name, opened in (("a", 300.0), ("b", 100.0), ("c", 200.0)):
        sessions[name], _ = host.open(Frame({"t": "init", "v": wire.VERSION, "device": 0, "token": name}, []),
                                      BufferPool(), f"10.0.0.{len(sessions)}:1")
        sessions[name].opened = host.started + opened
    data = np.arange(6.0, dtype=np.float32)
    sessions["a"].handle(Frame({"t": "batch", "m": (("put", 1, 0), ("op", "sin", (1,), (2,), {}))}, [data]))
    for name, failures in (("a", 25), ("b", 1), ("c", 1)):
        sessions[name].handle(Frame({"t": "batch", "m": tuple(("get", k, 99) for k in range(failures))}, []))
    return host, sessions


def test_the_status_json_has_the_fields_docs_status_md_lists():
    from ember.remote import status

    host, sessions = _busy_host()
    state = json.loads(status.answer(host, "GET", "/status.json", "Bearer root", "1.2.3.4:5", host.started + 400.12345).body)
    documented = [row[0] for row in _documented_rows("`/status.json`")]
    assert len(documented) == len(set(documented)) and _fields(state) == set(documented)
    assert state["uptime_seconds"] == 400.123 and state["started"] == host.started
    assert state["memory"] == {"budget_bytes": host.budget.limit, "used_bytes": host.budget.used,
                               "session_quota_bytes": host.limits.max_session_bytes}
    assert [row["client"] for row in state["sessions"]] == ["b", "c", "a"]  # in the order they opened
    assert [row["age_seconds"] for row in state["sessions"]] == [300.123, 200.123, 100.123]
    for row in state["sessions"]:
        assert len(row["session"]) == 8 and sessions[row["client"]].id.startswith(row["session"])
    (a,) = [row for row in state["sessions"] if row["client"] == "a"]
    assert (a["ops"], a["live_tensors"], a["live_bytes"], a["bytes_in"]) == (1, 2, 48 + 2 * TENSOR_OVERHEAD, 24)
    assert a["errors"] == {"ExecutionError": 25} and a["last_error"]["kind"] == "ExecutionError"
    assert state["totals"]["errors"] == {"ExecutionError": 27, "AccessDenied": 1} and state["totals"]["sessions"] == 3
    # the last 20 failures of the peer and every session, oldest first
    assert [e["client"] for e in state["recent_errors"]] == ["a"] * 18 + ["b", "c"]
    times = [e["time"] for e in state["recent_errors"]]
    assert times == sorted(times)


def test_a_message_is_shown_whole_up_to_300_characters_then_cut():
    from ember.remote.status import MESSAGE_CHARACTERS, _clip

    assert MESSAGE_CHARACTERS == 300 and _clip("x" * 300) == "x" * 300
    assert _clip("x" * 301) == "x" * 299 + "…" and _clip("y" * 5000) == "y" * 299 + "…"


def test_the_metrics_are_those_docs_status_md_lists_with_the_status_json_values():
    from prometheus_client.parser import text_string_to_metric_families

    from ember.remote import status
    from ember.remote.host import COUNTED

    host, _ = _busy_host()
    state = status.snapshot(host, host.started + 400.0)
    text = status.answer(host, "GET", "/metrics", "Bearer root", "1.2.3.4:5", host.started + 400.0).body.decode()
    documented = {name: (kind, labels, help) for name, kind, labels, help in _documented_rows("`/metrics`")}
    assert dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M)) == {name: h for name, (_, _, h) in documented.items()}
    assert dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)) == {name: k for name, (k, _, _) in documented.items()}

    totals, memory = state["totals"], state["memory"]
    expected = {("ember_uptime_seconds", ()): state["uptime_seconds"], ("ember_sessions", ()): totals["sessions"],
                ("ember_memory_budget_bytes", ()): memory["budget_bytes"],
                ("ember_memory_used_bytes", ()): memory["used_bytes"],
                ("ember_live_tensors", ()): totals["live_tensors"], ("ember_live_bytes", ()): totals["live_bytes"]}
    expected.update({("ember_errors_total", (("kind", kind),)): n for kind, n in totals["errors"].items()})
    for field in COUNTED:
        expected[(f"ember_{field}_total", ())] = totals[field]
    for row in state["sessions"]:
        labels = (("client", row["client"]), ("session", row["session"]))
        for field in ("live_tensors", "live_bytes"):
            expected[(f"ember_session_{field}", labels)] = row[field]
        for field in COUNTED:
            expected[(f"ember_session_{field}_total", labels)] = row[field]
    served = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    assert served == expected
    for name, (_, labels, _) in documented.items():  # every series of a metric has the labels listed for it
        assert {tuple(k for k, _ in key[1]) for key in served if key[0] == name} == {
            tuple(sorted(label.strip() for label in labels.split(",") if label.strip()))}


def test_every_answer_says_what_was_wrong_and_what_to_do(monkeypatch):
    from ember.remote import status
    from ember.remote.host import Host, hosted_devices
    from ember.wire.protocol import Limits

    host = Host(hosted_devices("numpy"), TOKEN, Limits())

    def answer(path, authorization=None, method="GET"):
        return status.answer(host, method, path, authorization, "1.2.3.4:6", 0.0)

    for page in ("/", "/index.html", "/index.html?refresh=1"):
        reply = answer(page)
        assert (reply.status, reply.content_type, reply.body) == (200, "text/html; charset=utf-8", status.PAGE.encode())
    missing = answer("/" + "a" * 200)
    assert (missing.status, missing.content_type) == (404, "text/plain; charset=utf-8")
    assert missing.body == b"no page at /" + b"a" * 99 + b"; try /, /status.json or /metrics\n"  # the path cut to 100
    wrong = answer("/", method="DELETE")
    assert (wrong.status, wrong.body, wrong.headers) == (405, b"only GET and HEAD are served here\n", {"Allow": "GET, HEAD"})
    unknown = answer("/metrics", "Bearer not-the-token")
    assert unknown.status == 401 and unknown.headers == {"WWW-Authenticate": 'Bearer realm="ember"'}
    assert unknown.body == b"this peer asks for a token: send the header Authorization: Bearer TOKEN\n"
    assert answer("/status.json?a=1?b=2", f"Bearer  {TOKEN}").status == 200  # one query, however it reads; 1*SP
    assert answer("/status.json", f"{TOKEN} Bearer").status == 401
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # the metrics extra not installed
    lacking = answer("/metrics", f"Bearer {TOKEN}")
    assert (lacking.status, lacking.content_type) == (501, "text/plain; charset=utf-8")
    assert lacking.body == b"/metrics needs prometheus-client: pip install 'ember[metrics]'\n"
    assert answer("/status.json", f"Bearer {TOKEN}").status == 200  # the rest is served without it
