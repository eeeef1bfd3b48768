"""Probe issue 44's rows 8 and 9 against a real ``ember serve``: what one tenant of a tokens file
sees of another, how fast wrong tokens are checked (HTTP and the handshake) and whether they are
logged, and where a token shows in error messages, tracebacks and CLI output.

    python tools/probes/tenants.py                                                 # this tree
    git archive 2a8b11e | tar -xC OLD; cd OLD; PYTHONPATH=OLD python $CHECKOUT/tools/probes/tenants.py   # the tree issue 44 found

(from another directory: ``python -m ember.cli serve``, which the probe starts, looks in the
current directory before PYTHONPATH.)

Prints one Markdown table row per attack. Uses only what both trees have (``PeerProcess``, the
client, the wire codec, raw sockets). Linux only (/proc). About 30 s.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import ember as em
from ember.remote.spawn import LOG_LINES, PeerProcess
from ember.wire import protocol as wire

ALICE, BOB = "alice-3f0c9e1d7b2a5c48e1", "bob-8e2d4a6c1f9b3e70a2"
FLOOD_SECONDS = 3.0
WORKERS = 4


def process(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {"rss": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"]),
            "files": len(os.listdir(f"/proc/{pid}/fd"))}


def row(number: str, sent: str, measured: str) -> None:
    print(f"| {number} | {sent} | {measured.replace('|', '/')} |", flush=True)


def get(address: str, path: str, token: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://{address}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def tokens_file(folder: str) -> str:
    path = os.path.join(folder, "tokens")
    with open(path, "w") as f:
        f.write(f"alice {ALICE}\nbob {BOB}\n")
    os.chmod(path, 0o600)
    return path


def http_guess(address: str, guess: str) -> int:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"GET /status.json HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {guess}\r\n\r\n".encode())
        head = b""
        while b"\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0


def handshake_guess(address: str, guess: str) -> str:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"".join(wire.encode_frame({"t": "init", "v": wire.VERSION, "device": 0, "token": guess})))
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    frames = wire.FrameReader().feed(received)
    return frames[0].header.get("reason", "") if frames else ""


def flood(attempt, classify) -> tuple[int, int, float]:
    """WORKERS threads trying wrong tokens for FLOOD_SECONDS: tries checked, tries refused unchecked, seconds."""
    counts = {"checked": 0, "refused": 0}
    lock = threading.Lock()
    stop = time.monotonic() + FLOOD_SECONDS

    def work(worker: int):
        k = 0
        while time.monotonic() < stop:
            outcome = classify(attempt(f"guess-{worker}-{k:06d}-0123456789"))
            k += 1
            with lock:
                counts[outcome] += 1
    started = time.monotonic()
    threads = [threading.Thread(target=work, args=(w,)) for w in range(WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return counts["checked"], counts["refused"], time.monotonic() - started


def logged(peer: PeerProcess, guesses_prefix: str = "guess-") -> str:
    time.sleep(0.3)
    log = list(peer.log)
    checked = sum("wrong token" in line or "bad or missing token" in line for line in log)
    unchecked = sum("too many failed tokens" in line for line in log)
    shows_guess = any(guesses_prefix in line for line in log)
    kept = " (the last lines, as many as PeerProcess keeps)" if len(log) >= LOG_LINES else ""
    return (f"log{kept}: {checked} warnings of a wrong token, {unchecked} of a try refused unchecked, "
            f"{'some show the guess' if shows_guess else 'none shows a guess'}")


def tenants(folder: str) -> None:
    with PeerProcess("--tokens-file", tokens_file(folder)) as peer:
        alice = em.device(f"ember://{ALICE}@{peer.address}/0")
        bob = em.device(f"ws://{BOB}@{peer.address}/0")
        assert float(em.sum(em.ones(1000, device=alice))) == 1000.0
        try:
            em.asnumpy(em.linalg.inv(em.zeros((3, 3), device=bob)))
        except em.ExecutionError:
            pass
        held = em.ones(4321, device=bob, dtype=em.uint8)
        assert int(em.sum(held)) == 4321
        session = bob.engine.info.get("session", "")[:8]
        for path in ("/status.json", "/metrics"):
            status, body = get(peer.address, path, ALICE)
            text = body.decode("utf-8", "replace")
            shown = [what for what, value in (("name", "bob"), ("session id", session), ("error text", "Singular"))
                     if value and value in text]
            if path == "/status.json" and status == 200:
                state = json.loads(body)
                rows = [r for r in state["sessions"] if r["client"] != "alice"]
                shown += [f"{len(rows)} row(s) of others' sessions (address, live bytes)"] if rows else []
                used = state["memory"].get("used_bytes")
                shown += ["memory in use of the whole peer"] if used is not None else []
            row("8", f"alice's token on `{path}` (a tokens file of alice and bob, bob with a failed op)",
                f"HTTP {status}; alice sees of bob: {', '.join(shown) or 'nothing'}")


def guesses() -> None:
    with tempfile.TemporaryDirectory() as folder:
        with PeerProcess("--tokens-file", tokens_file(folder)) as peer:
            before = process(peer.pid)
            checked, refused, seconds = flood(lambda guess: http_guess(peer.address, guess),
                                              lambda status: "checked" if status == 401 else "refused")
            after = process(peer.pid)
            row("8", f"wrong bearer tokens on `/status.json`, {WORKERS} clients for {FLOOD_SECONDS:g} s",
                f"{checked / seconds:,.0f} guesses/s checked, {refused / seconds:,.0f}/s refused unchecked (429); "
                f"{logged(peer)}; RSS {before['rss']:.0f}→{after['rss']:.0f} MB, threads {before['threads']}→"
                f"{after['threads']}, files {before['files']}→{after['files']}")
        with PeerProcess("--tokens-file", tokens_file(folder)) as peer:
            before = process(peer.pid)
            reasons = []

            def classify(reason: str) -> str:
                if len(reasons) < 1 and not reason.startswith("bad or missing"):
                    reasons.append(reason)
                return "checked" if reason.startswith("bad or missing") else "refused"
            checked, refused, seconds = flood(lambda guess: handshake_guess(peer.address, guess), classify)
            after = process(peer.pid)
            row("8", f"wrong tokens in `init` frames (the handshake), {WORKERS} clients for {FLOOD_SECONDS:g} s",
                f"{checked / seconds:,.0f} guesses/s checked, {refused / seconds:,.0f}/s refused unchecked"
                f"{' (' + repr(reasons[0][:110]) + ')' if reasons else ''}; {logged(peer)}; RSS {before['rss']:.0f}→"
                f"{after['rss']:.0f} MB, threads {before['threads']}→{after['threads']}")


SECRET = "SECRETTOKEN-0123456789"
ERRORS = """
import sys, traceback, ember as em
try:
    em.device(sys.argv[1])
except Exception as error:
    text = "".join(traceback.format_exception(error))
    chained = error.__context__ is not None or error.__cause__ is not None
    print(repr(str(error)), sys.argv[2] in text, chained)
"""


def secrets_shown() -> None:
    for spec in (f"ember://{SECRET}@host:badport/0", f"ember://{SECRET}@hóst\uff0f:1/0", f"ember:/{SECRET}@host:1/0"):
        done = subprocess.run([sys.executable, "-c", ERRORS, spec, SECRET], capture_output=True, text=True, timeout=60)
        message, in_traceback, chained = done.stdout.strip().rsplit(" ", 2)
        row("9", f"`em.device({spec.replace(SECRET, 'TOKEN')!r})`",
            f"{message.replace(SECRET, '<TOKEN>')[:160]}; token in message: {SECRET in message}, in traceback: "
            f"{in_traceback}, exception chained: {chained}")
    done = subprocess.run([sys.executable, "-m", "ember.cli", "devices", f"ember://{SECRET}@127.0.0.1:badport"],
                          capture_output=True, text=True, timeout=60)
    row("9", "`ember devices ember://TOKEN@127.0.0.1:badport`",
        f"exit {done.returncode}, stderr {done.stderr.strip().replace(SECRET, '<TOKEN>')[:160]!r}; token shown: "
        f"{SECRET in done.stderr}")
    with tempfile.TemporaryDirectory() as folder:
        for token, mode in (("abc", 0o600), (ALICE, 0o644)):
            path = os.path.join(folder, "token")
            with open(path, "w") as f:
                f.write(token + "\n")
            os.chmod(path, mode)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            served = subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", "--listen", f"127.0.0.1:{port}",
                                       "--token-file", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                out, err = served.communicate(timeout=3)
            except subprocess.TimeoutExpired:
                served.terminate()
                out, err = served.communicate(timeout=10)
                outcome = "serves"
            else:
                outcome = f"exit {served.returncode}"
            said = " ".join(line for line in err.splitlines() if "warning" in line or "characters" in line)
            row("9", f"`ember serve --token-file F`, a {len(token)}-character token, F of mode {mode:04o}",
                f"{outcome}; {said.replace(folder, '…')[:200] or 'nothing said'}")


def main() -> None:
    print("| row | what was sent | what the peer did (measured) |")
    print("| --- | --- | --- |")
    with tempfile.TemporaryDirectory() as folder:
        tenants(folder)
    guesses()
    secrets_shown()


if __name__ == "__main__":
    main()
