"""A compute peer in a child process (for the demo, the benchmarks and the tests).

``PeerProcess()`` runs ``ember serve`` on 127.0.0.1 with a free port and stops it on exit —
a context manager, so a Ctrl-C never leaves it behind. Its output is read as it comes (a peer
whose log nobody reads would block in logging once the pipe fills); ``log`` keeps the last
lines of its stderr.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque

_LISTENING = re.compile(r"listening on (\S+:\d+)")
LOG_LINES = 1000  # the stderr lines a PeerProcess keeps
# A peer spawned here shares this machine's CPUs with its client and any other local peer. OpenBLAS's
# worker threads poll for new work for about 2**28 cycles (~0.1 s) after each call, holding a CPU the
# others need: 2^4 cycles makes them sleep at once. The caller's environment still decides.
SHARED_CPU_ENV = {"OPENBLAS_THREAD_TIMEOUT": "4"}


class PeerProcess:
    """An ``ember serve`` child process on 127.0.0.1; ``address`` is "127.0.0.1:PORT"."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 60, prefix: tuple = ()):
        # prefix: a command that execs the peer (``ip netns exec NS`` for a namespace); a --listen in args wins
        command = [*prefix, sys.executable, "-m", "ember.cli", "serve", "--listen", "127.0.0.1:0", *args]
        # the peer stops when this pipe closes, so a parent that dies (even by SIGKILL) leaves no peer behind
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True,
                                        env={**SHARED_CPU_ENV, **os.environ, **(env or {}), "EMBER_STOP_WITH_PARENT": "1"})
        self.address: str | None = None
        self.output: list[str] = []
        self.log: deque[str] = deque(maxlen=LOG_LINES)
        self.tracebacks = 0  # tracebacks the peer logged: an error it did not expect
        found = threading.Event()

        def watch():
            for line in self.process.stdout:
                self.output.append(line)
                match = _LISTENING.search(line)
                if match and not found.is_set():
                    self.address = match.group(1)
                    found.set()
            found.set()

        def drain():
            for line in self.process.stderr:
                self.log.append(line)
                self.tracebacks += line.startswith("Traceback (most recent call last)")

        self._readers = [threading.Thread(target=target, daemon=True) for target in (watch, drain)]
        for reader in self._readers:
            reader.start()
        if not found.wait(timeout) or self.address is None:
            self.stop()
            raise RuntimeError(f"ember serve did not start: {''.join(self.output)}{''.join(self.log)[-2000:]}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def url(self, scheme: str = "ember", index: int = 0, token: str | None = None) -> str:
        """The device string of this peer's device ``index``."""
        return f"{scheme}://{token + '@' if token else ''}{self.address}/{index}"

    def kill(self) -> None:
        """Kill the peer abruptly (SIGKILL), as a crash would."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        """Stop the peer (SIGTERM, then SIGKILL after 10 s) and reap it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for reader in self._readers:  # the pipes end with the process
            reader.join(5)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream:
                stream.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
