"""Two hosts on one machine for tests: a "gpu" and a "laptop" network namespace joined by a veth pair.

The gpu end is 10.231.0.1/24, the laptop's 10.231.0.2/24, loopback is up in each, and nothing else
is reachable from either (no route leaves the pair). ``TwoHosts`` makes them with names of its own
(``ember-<pid>-gpu``, ``ember-<pid>-laptop``, a counter added for a second pair), runs commands in
them (``run_in``, ``popen_in``, ``serve_in``), breaks the link as a network would (``link_down``,
``change_address``) and, on exit, kills every process it started and every process left in its
namespaces and deletes both; what a killed run left, the next one deletes (:func:`sweep`). It needs
root and iproute2's ``ip``: :func:`unavailable` says why not.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time

from ember.remote.spawn import PeerProcess

SUBNET = "10.231.0"
PEER_ADDRESS = f"{SUBNET}.1"
LAPTOP_ADDRESS = f"{SUBNET}.2"
_LISTENING = re.compile(r"listening on (\S+:\d+)")
_pairs = itertools.count()
_OURS = re.compile(r"ember-(\d+)(?:-\d+)?-(?:gpu|laptop|probe)")


def sweep() -> list[str]:
    """Delete the namespaces a killed test run left behind: those named by this module for a process that is
    gone, with no process left in them; the names deleted."""
    deleted = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split(" ", 1)[0]
        match = _OURS.fullmatch(name)
        if match is None or _ip("netns", "pids", name, check=False).stdout.split():
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # its run is still going (or its pid is another's now: left alone)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        if _ip("netns", "del", name, check=False).returncode == 0:
            deleted.append(name)
    return deleted


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why this machine cannot make network namespaces (not root, no ``ip``, ``ip netns add`` refused), or None."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "no `ip` command on the PATH (apt-get install iproute2)"
    probe = f"ember-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add {probe}` failed: {made.stderr.strip() or made.returncode}"
    # a namespace is not enough: the pair needs veth links (a kernel without the veth module refuses them)
    link = _ip("-n", probe, "link", "add", f"em{os.getpid()}p", "type", "veth", "peer", "name", f"em{os.getpid()}q",
               check=False)
    _ip("netns", "del", probe, check=False)
    if link.returncode != 0:
        return f"`ip link add … type veth` failed: {link.stderr.strip() or link.returncode}"
    return None


class TwoHosts:
    """The gpu and laptop namespaces and the veth pair between them (a context manager)."""

    def __init__(self):
        k = next(_pairs)
        pid = os.getpid()
        tag = f"{pid}" if k == 0 else f"{pid}-{k}"
        self.gpu, self.laptop = f"ember-{tag}-gpu", f"ember-{tag}-laptop"
        self.gpu_link, self.laptop_link = f"em{pid}g{k}", f"em{pid}l{k}"  # interface names: 15 characters at most
        self.peer_address, self.laptop_address = PEER_ADDRESS, LAPTOP_ADDRESS
        self.started: list[subprocess.Popen] = []
        self._made: list[str] = []
        sweep()
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        for ns in (self.gpu, self.laptop):
            _ip("netns", "add", ns)
            self._made.append(ns)
        # each end is born in its namespace: the pair never appears on this machine's own network
        _ip("link", "add", self.gpu_link, "netns", self.gpu, "type", "veth", "peer", "name", self.laptop_link,
            "netns", self.laptop)
        _ip("-n", self.gpu, "addr", "add", f"{self.peer_address}/24", "dev", self.gpu_link)
        _ip("-n", self.laptop, "addr", "add", f"{self.laptop_address}/24", "dev", self.laptop_link)
        # without it, deleting the laptop's first address deletes every other one of its subnet with it
        self.run_in(self.laptop, ["sh", "-c", f"echo 1 > /proc/sys/net/ipv4/conf/{self.laptop_link}/promote_secondaries"])
        for ns, link in ((self.gpu, self.gpu_link), (self.laptop, self.laptop_link)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", link, "up")

    def run_in(self, ns: str, argv: list[str], timeout: float = 60, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` in namespace ``ns`` to its end; its output captured as text."""
        return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=timeout,
                              check=check, **kwargs)

    def popen_in(self, ns: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in namespace ``ns`` (``ip netns exec`` execs it: the process is ``argv`` itself);
        it is killed on :meth:`close` if it still runs."""
        process = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kwargs)
        self.started.append(process)
        return process

    def serve_in(self, ns: str, *args: str, env: dict | None = None, timeout: float = 60) -> PeerProcess:
        """``ember serve *args`` in namespace ``ns``, once it listens (args name its ``--listen``); it is
        stopped on :meth:`close` if it still runs."""
        peer = PeerProcess(*args, env=env, timeout=timeout, prefix=("ip", "netns", "exec", ns))
        self.started.append(peer.process)
        return peer

    def link_down(self, seconds: float, while_down=None, ns: str | None = None) -> float:
        """Take the veth end in ``ns`` (default: the laptop's) down for ``seconds``, calling ``while_down()``
        once it is down, then up again; the seconds it was down."""
        ns = ns or self.laptop
        link = self.laptop_link if ns == self.laptop else self.gpu_link
        _ip("-n", ns, "link", "set", link, "down")
        down = time.monotonic()
        try:
            if while_down is not None:
                while_down()
            time.sleep(max(0.0, seconds - (time.monotonic() - down)))
        finally:
            _ip("-n", ns, "link", "set", link, "up")
        return time.monotonic() - down

    def change_address(self, new: str) -> None:
        """The laptop moves to address ``new`` (as on joining another Wi-Fi): ``new`` is added, the old one
        deleted, so packets to the old address go nowhere."""
        old = self.laptop_address
        _ip("-n", self.laptop, "addr", "add", f"{new}/24", "dev", self.laptop_link)
        _ip("-n", self.laptop, "addr", "del", f"{old}/24", "dev", self.laptop_link)
        self.laptop_address = new

    def close(self) -> None:
        """Kill what was started and what runs in the namespaces, and delete them (the veth pair goes with them)."""
        for process in self.started:
            if process.poll() is None:
                process.terminate()
        for process in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)
            if process.poll() is None:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(5)
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream:
                    with contextlib.suppress(OSError):
                        stream.close()
        for ns in self._made:
            # anything still in a namespace of ours was started in it by us (a child of what ran there)
            found = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in found:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
        self._made = []

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
