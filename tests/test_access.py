"""Issue 44, rows 8 and 9 and "also found": tenants of one peer see only themselves, wrong tokens are
slowed down per address and logged without the guess, tokens never show in an error or a CLI
message, a weak or exposed token is refused or warned of, drops that free quota go ahead of the ops
behind them, and a read of an array whose session died says so. Against real ``ember serve``
processes on 127.0.0.1, or the sans-I/O Host and Throttle fed what a peer is fed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ember as em
from ember.remote.access import (
    FREE_FAILURES,
    MIN_TOKEN_CHARACTERS,
    NotPermitted,
    Throttle,
    TokenFile,
    Viewer,
    address_key,
)
from ember.remote.host import Host, hosted_devices
from ember.remote.memory import BufferPool
from ember.wire import protocol as wire

from .peers import Peer
from .test_connections import device_of, session
from .test_remote import free_port, messages_sent

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

ALICE, BOB = "alice-3f0c9e1d7b2a5c48", "bob-8e2d4a6c1f9b3e70"
ADMIN, SCRAPER = "admin-5b7d9f1a3c5e7092", "scraper-c4e6a8b0d2f41638"


def tokens_file(folder) -> str:
    path = folder / "tokens"
    path.write_text(f"alice {ALICE}\nbob {BOB}\nops {ADMIN} role=admin\nprometheus {SCRAPER} role=metrics\n")
    path.chmod(0o600)
    return str(path)


def get(peer, path: str, token: str | None = None) -> tuple[int, dict, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://{peer.address}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


# --- row 8: tenants see only themselves -------------------------------------------------------------

def test_a_client_of_a_tokens_file_sees_only_its_own_sessions_and_a_role_sees_all(tmp_path):
    """Was: alice's token on /status.json and /metrics showed bob's name, address, session id, live
    bytes and error texts (and ``role=`` was no field a tokens file took)."""
    with Peer("--tokens-file", tokens_file(tmp_path)) as peer:
        alice = device_of(peer.url(token=ALICE))
        bob = device_of(peer.url("ws", token=BOB))
        kept = em.asarray(np.arange(1000.0), device=alice) * 2
        assert float(em.sum(kept)) == 999000.0
        with pytest.raises(em.ExecutionError, match="Singular"):
            em.asnumpy(em.linalg.inv(em.zeros((3, 3), device=bob)))
        held = em.ones(4321, device=bob, dtype=em.uint8)
        assert int(em.sum(held)) == 4321
        bob_session = bob.engine.session[:8]
        bob_port = str(bob.engine.connection.sock.getsockname()[1])

        status, _, body = get(peer, "/status.json", ALICE)
        state = json.loads(body)
        assert status == 200 and state["view"] == {"client": "alice", "role": None, "sessions": "own"}
        assert [row["client"] for row in state["sessions"]] == ["alice"] and state["totals"]["sessions"] == 1
        assert state["sessions"][0]["live_bytes"] >= kept.size * 8
        assert state["memory"]["used_bytes"] is None and state["history"] == []  # the peer's figures: others' in them
        assert state["memory"]["budget_bytes"] > 0 and state["devices"] == ["numpy"]
        assert state["totals"]["live_bytes"] == state["sessions"][0]["live_bytes"]  # nothing of bob's in the sums
        for leak in (b"bob", bob_session.encode(), bob_port.encode(), b"Singular", BOB.encode(), ALICE.encode()):
            assert leak not in body, leak

        status, _, body = get(peer, "/metrics", ALICE)
        assert status == 200 and b'client="alice"' in body and b"bob" not in body and bob_session.encode() not in body
        assert b"ember_ops_total" not in body and b"ember_memory_used_bytes" not in body
        assert b"ember_session_ops_total" in body

        for token, role in ((ADMIN, "admin"), (SCRAPER, "metrics")):  # the roles see every session
            state = json.loads(get(peer, "/status.json", token)[2])
            assert state["view"]["role"] == role and {r["client"] for r in state["sessions"]} == {"alice", "bob"}
            assert state["memory"]["used_bytes"] > 0 and any("Singular" in e["message"] for e in state["recent_errors"])
            assert b"ember_ops_total" in get(peer, "/metrics", token)[2]
        with pytest.raises(em.AccessDenied, match="client prometheus has the role metrics: it may read /status.json and "
                                                 "/metrics, not open sessions"):
            session(peer, token=SCRAPER)
        assert float(em.sum(em.ones(2, device=device_of(peer.url(token=ADMIN))))) == 2.0  # an admin computes too

        top = subprocess.run([sys.executable, "-m", "ember.cli", "top", f"ember://{peer.address}", "--once"],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "EMBER_TOKEN": ALICE})
        assert top.returncode == 0, top.stderr
        assert "the sessions of alice only" in top.stdout and "alice" in top.stdout and "bob" not in top.stdout


def test_a_clients_view_without_sockets_holds_only_its_own_sessions_and_closed_ones():
    from ember.remote import status
    from ember.remote.access import Client
    rule = TokenFile([Client("alice", ALICE), Client("bob", BOB), Client("ops", ADMIN, role="admin")])
    host = Host(hosted_devices("numpy"), None, wire.Limits(), authorize=rule)

    def opened(token, address):
        found, _ = host.open(wire.Frame({"t": "init", "v": wire.VERSION, "token": token}, []), BufferPool(), address)
        return found

    alice, bob = opened(ALICE, "10.0.0.1:1"), opened(BOB, "10.0.0.2:2")
    earlier = opened(ALICE, "10.0.0.1:3")
    for who in (bob, earlier):
        who.handle(wire.Frame({"t": "batch", "m": (("get", 1, 99),)}, []))  # an unknown tensor: a failure each
    host.close(earlier)  # its failure stays in the peer's, under alice's name
    assert host.admits("10.0.0.1:9", ALICE) == Viewer("alice") and host.admits("10.0.0.1:9", ADMIN) == Viewer("ops", "admin")
    now = time.time()
    state = status.snapshot(host, now, Viewer("alice"))
    assert [row["session"] for row in state["sessions"]] == [alice.id[:8]]
    assert [e["client"] for e in state["recent_errors"]] == ["alice"]  # the closed session's, not bob's
    assert state["totals"]["errors"] == {} and state["memory"]["used_bytes"] is None and state["history"] == []
    everything = status.snapshot(host, now, Viewer("ops", "admin"))
    assert {row["client"] for row in everything["sessions"]} == {"alice", "bob"} and len(everything["recent_errors"]) == 2
    assert status.snapshot(host, now)["sessions"] == everything["sessions"]  # no viewer: the admin's view


@pytest.mark.parametrize("line, message", [
    (f"alice {ALICE} role=root", "after the devices comes role=admin or role=metrics, got 'role=root'"),
    (f"alice {ALICE} 0 colour=red", "after the devices comes role=admin or role=metrics, got 'colour=red'"),
    ("alice qzx5w", f"the token of 'alice' has 5 characters, and a token needs {MIN_TOKEN_CHARACTERS} or more"),
])
def test_a_tokens_file_takes_a_role_and_refuses_anything_else(tmp_path, line, message):
    path = tmp_path / "tokens"
    path.write_text(line + "\n")
    with pytest.raises(em.ArgumentError, match=re.escape(message)) as refused:
        TokenFile.load(path)
    assert ALICE not in str(refused.value) and "qzx5w" not in str(refused.value)
    path.write_text(f"ci {ALICE} 0,1 role=admin\nshort abc\n")
    (ci, weak) = TokenFile.load(path, min_token_characters=0).clients
    assert (ci.devices, ci.role, weak.role) == (frozenset({0, 1}), "admin", None)


# --- row 8: failed tokens throttled per address, logged without the guess ---------------------------

def test_wrong_tokens_are_slowed_down_per_address_on_http_and_the_handshake(tmp_path):
    """Was: 2,217 wrong bearer tokens a second were checked, and nothing was logged."""
    with Peer("--tokens-file", tokens_file(tmp_path)) as peer:
        guesses = [f"guess-{k:04d}-0123456789" for k in range(FREE_FAILURES + 20)]
        answers = [get(peer, "/status.json", guess) for guess in guesses]
        statuses = [status for status, _, _ in answers]
        assert statuses[:FREE_FAILURES] == [401] * FREE_FAILURES and statuses[-1] == 429
        checked = statuses.count(401)
        assert checked <= FREE_FAILURES + 2  # the waits grow from 0.5 s: a few more at most, whatever the speed
        status, headers, body = answers[-1]
        assert int(headers["Retry-After"]) >= 1 and body.startswith(b"too many failed tokens from 127.0.0.1: the next "
                                                                    b"one is checked in ")
        assert get(peer, "/status.json", ALICE)[0] == 429  # within the wait, a good token is not even checked
        assert get(peer, "/status.json")[0] == 401  # no token is no guess: answered as ever
        with pytest.raises(em.AccessDenied, match=r"refused the session: too many failed tokens from 127\.0\.0\.1: the "
                                                  r"next one is checked in [0-9.]+ s"):
            session(peer, token="guess-at-the-handshake-01")  # the handshake counts with the same throttle
        time.sleep(0.3)
        log = "".join(peer.log)
        assert log.count("refused a request for the status: a wrong token") == checked
        assert "127.0.0.1:" in log and not any(guess in log for guess in guesses) and ALICE not in log


def test_the_throttle_without_sockets():
    throttle = Throttle(free=3, first_wait=1.0, longest_wait=8.0, forget=100.0, addresses=4)
    now = 1000.0
    for _ in range(3):
        assert throttle.admit("10.0.0.1:5", now) == 0.0  # each counted as a failure: nothing follows to clear it
    assert throttle.admit("10.0.0.1:6", now) == 1.0  # another port of the same host waits as well
    assert throttle.admit("10.0.0.2:5", now) == 0.0  # another host does not
    assert throttle.admit("10.0.0.1:5", now + 1.0) == 0.0  # its wait over: one try, then twice as long
    assert throttle.admit("10.0.0.1:5", now + 2.0) == pytest.approx(1.0)
    assert throttle.failures("10.0.0.1:1") == (4, 2)
    assert throttle.admit("10.0.0.1:5", now + 3.0) == 0.0
    throttle.passed("10.0.0.1:5", good=False)  # refused for another reason: that try does not count
    assert throttle.failures("10.0.0.1:1")[0] == 4
    assert throttle.admit("10.0.0.1:5", now + 3.0 + 200.0) == 0.0 and throttle.failures("10.0.0.1:1")[0] == 1  # forgotten
    throttle.passed("10.0.0.1:5")  # a good token: the address starts afresh
    assert throttle.failures("10.0.0.1:1") == (0, 0) and throttle.admit("10.0.0.1:5", now + 204.0) == 0.0
    for k in range(10):
        throttle.admit(f"192.168.0.{k}:1", now)
    assert len(throttle) == 4  # the least recently seen go first
    assert address_key("[2001:db8::1]:5") == address_key("[2001:db8::ffff]:6") == "2001:db8::/64"
    assert address_key("[::ffff:10.1.2.3]:7") == "10.1.2.3" and address_key("[::1]:7") == "::1"


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 5), st.booleans()), max_size=200))
def test_an_address_is_never_checked_sooner_than_its_wait(tries):
    """Whatever the order of tries, good tokens and pauses: after FREE failures an address's checked
    failures are at least the growing waits apart, and the memory stays bounded."""
    throttle = Throttle(free=4, first_wait=0.5, longest_wait=4.0, forget=30.0, addresses=3)
    now = 0.0
    failures: dict[int, list[float]] = {}
    for who, pause, good in tries:
        now += pause
        if throttle.admit(f"10.0.0.{who}:1", now):
            continue
        if good:
            throttle.passed(f"10.0.0.{who}:1")
            failures.pop(who, None)
            continue
        mine = failures.setdefault(who, [])
        if mine and now - mine[-1] >= 30.0 or throttle.failures(f"10.0.0.{who}:1")[0] == 1:
            mine.clear()  # forgotten (or evicted): it starts afresh
        mine.append(now)
        if len(mine) > 4:
            assert mine[-1] - mine[-2] >= throttle.delay(len(mine) - 1) - 1e-9
        assert len(throttle) <= 3


def test_the_handshake_counts_only_wrong_tokens():
    """A refusal of a good token (a device its client may not use) and a missing token are no guesses."""
    from ember.remote.access import Client
    host = Host(hosted_devices("numpy") * 2, None, wire.Limits(),
                authorize=TokenFile([Client("bob", BOB, frozenset({1}))]))

    def reason(token, device=0):
        header = {"t": "init", "v": wire.VERSION, "device": device} | ({} if token is None else {"token": token})
        found, ((reply, _),) = host.open(wire.Frame(header, []), BufferPool(), "10.9.8.7:6")
        return reply.get("reason", "opened")

    for _ in range(3 * FREE_FAILURES):
        assert reason(BOB).startswith("client bob may not use device 0") and reason(None).startswith("bad or missing")
    assert reason(BOB, 1) == "opened" and host.throttle.failures("10.9.8.7:6") == (0, 0)
    for k in range(FREE_FAILURES):
        assert reason(f"wrong-{k}").startswith("bad or missing token")
    assert reason("wrong-again").startswith("too many failed tokens from 10.9.8.7: the next one is checked in 0.5 s")
    assert issubclass(NotPermitted, em.AccessDenied)


@given(st.lists(st.tuples(st.sampled_from(["alice", "bob", "wrong", "none", "garbage"]), st.integers(0, 2)), max_size=60))
def test_a_host_fed_any_handshakes_admits_good_tokens_until_their_address_must_wait(tries):
    """Init frames of good, wrong, missing and non-string tokens from three addresses, in any order: a
    good token is refused only while its address waits after FREE_FAILURES wrong ones (never for a
    missing one), and each client's view of the status holds only its own sessions."""
    from ember.remote import status
    from ember.remote.access import Client
    host = Host(hosted_devices("numpy"), None, wire.Limits(),
                authorize=TokenFile([Client("alice", ALICE), Client("bob", BOB)]))
    tokens = {"alice": ALICE, "bob": BOB, "wrong": "wrong-token-0123456789", "none": None, "garbage": ("x", 5)}
    wrong_in_a_row = {}
    for who, place in tries:
        address = f"10.1.1.{place}:{1000 + len(wrong_in_a_row)}"
        header = {"t": "init", "v": wire.VERSION} | ({} if tokens[who] is None else {"token": tokens[who]})
        opened, ((reply, _),) = host.open(wire.Frame(header, []), BufferPool(), address)
        waiting = reply.get("reason", "").startswith("too many failed tokens")
        if who in ("alice", "bob"):
            assert (opened is not None) is not waiting
            assert not waiting or wrong_in_a_row.get(place, 0) >= FREE_FAILURES
            if opened is not None:
                wrong_in_a_row[place] = 0
        elif who == "none":
            assert opened is None and not waiting
        else:
            assert opened is None
            wrong_in_a_row[place] = wrong_in_a_row.get(place, 0) + (not waiting)
    for name in ("alice", "bob"):
        state = status.snapshot(host, time.time(), Viewer(name))
        assert {row["client"] for row in state["sessions"]} <= {name}
        assert all(entry["client"] == name for entry in state["recent_errors"])


# --- row 9: tokens stay secret ---------------------------------------------------------------------

MALFORMED = ["ember://{}@host:badport/0", "ember://{}@host:99999/0", "ember://{}@[bad/0", "emberx://{}@h:1/0",
             "ember://{}@/0", "ember://{}@h:1/x", "ember:/{}@h:1/0", "ember://{}@hóst\uff0f:1/0", "torch:{}@x",
             "ember://{}:pw@h:bad/0", "wss://{}@h:1/0/0", " ember://{}@h:-1/0"]


@given(token=st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~", min_size=8, max_size=40),
       template=st.sampled_from(MALFORMED))
def test_a_malformed_device_string_never_shows_its_token(token, template):
    """Was: ``ember://TOKEN@host:badport/0`` raised a DeviceError quoting the token, and its traceback
    held a ValueError that quoted it too."""
    spec = template.format(token)
    with pytest.raises(em.DeviceError) as raised:
        em.device(spec)
    error = raised.value
    assert error.__cause__ is None and error.__context__ is None
    shown = "".join(traceback.format_exception(error)) + repr(error.args)
    assert token not in shown and "***@" in str(error)


def test_a_remote_device_prints_and_reprs_without_its_token():
    device = em.device(f"ember://{ALICE}@127.0.0.1:9/0")
    assert ALICE not in str(device) + repr(device) and repr(device) == "ember.device('ember://127.0.0.1:9/0')"


def test_ember_devices_and_top_never_print_a_token():
    """Was: ``ember devices ember://TOKEN@host:badport`` printed the token on stderr."""
    port = free_port()
    for command in (["devices", f"ember://{ALICE}@127.0.0.1:badport"], ["devices", f"ember://{ALICE}@127.0.0.1:{port}"],
                    ["top", f"ember://{ALICE}@127.0.0.1:badport", "--once"],
                    ["top", f"ember://{ALICE}@127.0.0.1:{port}", "--once"]):
        done = subprocess.run([sys.executable, "-m", "ember.cli", *command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and done.stderr.startswith(f"ember {command[0]}: "), done.stderr
        assert ALICE not in done.stderr + done.stdout and "Traceback" not in done.stderr


def test_ember_serve_refuses_a_short_token_and_warns_of_a_readable_token_file(tmp_path):
    """Was: token files of mode 0644 and 3-character tokens were taken silently."""
    weak = tmp_path / "weak"
    weak.write_text("abc\n")
    weak.chmod(0o600)
    refused = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--listen", f"127.0.0.1:{free_port()}",
                              "--token-file", str(weak)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "abc" not in refused.stderr
    assert f"the token in {weak} has 3 characters, and a token needs {MIN_TOKEN_CHARACTERS} or more" in refused.stderr
    with Peer("--token-file", str(weak), "--insecure") as insecure:  # said aloud: a loopback test peer, say
        assert float(em.sum(em.ones(2, device=device_of(insecure.url(token="abc"))))) == 2.0
    strong = tmp_path / "strong"
    strong.write_text(ALICE + "\n")
    for mode, warned in ((0o644, "may be read by its group and others (mode 0644)"), (0o640, "may be read by its group"),
                         (0o600, None)):
        strong.chmod(mode)
        with Peer("--token-file", str(strong)) as running:
            time.sleep(0.1)
            log = "".join(running.log)
            if warned:
                assert f"ember serve: warning: the token file {strong} {warned}" in log and f"chmod 600 {strong}" in log
            else:
                assert "warning" not in log
            assert ALICE not in log
    listed = tmp_path / "tokens"
    listed.write_text(f"alice {ALICE}\nbob abc\n")
    refused = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--listen", f"127.0.0.1:{free_port()}",
                              "--tokens-file", str(listed)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and f"tokens file {listed}, line 2: the token of 'bob' has 3 characters" in refused.stderr
    assert "warning: the token file" in refused.stderr and ALICE not in refused.stderr


# --- also found: the client's order and wording ----------------------------------------------------

def test_drops_that_free_quota_go_ahead_of_the_ops_behind_them():
    """Was: freeing 31 of 32 MiB and then computing failed the first op with ResourceLimitError: the
    drop went after the batch's ops."""
    with Peer("--max-session-bytes", str(32 << 20)) as peer:
        device = device_of(peer.url())
        big = em.ones((31 << 20) // 4, dtype=em.float32, device=device)
        em.sync(device)
        del big

        def compute():
            assert float(em.sum(em.ones((8 << 20) // 4, dtype=em.float32, device=device) + 1)) == 2.0 * (2 << 20)
        messages = messages_sent(device.engine, compute)
        kinds = [m[0] for m in messages]
        assert kinds.index("drop") < kinds.index("ops")  # the drop first, then the run of ops that needs its room


def test_a_read_pending_across_a_peer_restart_says_its_session_and_data_are_gone():
    """Was: ``cannot connect to …: Connection refused``, as if nothing but the connection were amiss."""
    first = Peer()
    device = device_of(first.url())
    assert float(em.sum(em.ones(3, device=device))) == 3.0
    pending = em.ones(2, device=device) * 3
    first.kill()
    time.sleep(0.1)
    with pytest.raises(em.ConnectionLost, match=rf"^the session with {re.escape(str(device))} is lost, and the data of "
                                                rf"its arrays with it \(lost the connection .*\); a new one cannot be "
                                                rf"opened: cannot connect"):
        em.asnumpy(pending)
    with Peer("--listen", first.address):
        with pytest.raises(em.ConnectionLost, match="^download: the array lives in a lost session with .*; its data is gone"):
            em.asnumpy(pending)
        assert float(em.sum(em.ones(2, device=device))) == 2.0  # a new session, with the restarted peer
