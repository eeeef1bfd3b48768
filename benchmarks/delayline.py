"""A delay line for TCP on loopback: a proxy that holds each chunk for a one-way delay.

``DelayLine(delay=0.010)`` starts the proxy in a child process (so that the process it measures
never competes with it for the GIL); ``line.route("127.0.0.1:PORT")`` opens a listening port on
127.0.0.1 whose connections are forwarded to that address, each direction through its own line:
a chunk read at time t is written on at t + delay, whatever else is in flight — a latency line,
not a stop-and-wait, so a stream of batches sent back to back arrives back to back, one delay
later. With ``bandwidth`` (bytes per second), each direction is also a link of that speed: a
chunk leaves once the chunks before it have been carried, len/bandwidth seconds each, then
travels the delay. No root, no kernel module, loopback only.

The line's real round trip (the event loop wakes on millisecond ticks, so each way is ``delay``
plus up to about a millisecond) is best measured through it: a raw echo, as
``benchmarks/wan.py`` does. The proxy reads as fast as it is sent to, so unlike a real network's
TCP window it never slows a sender down: a bulk transfer measures the link's speed, not a window.

Run as ``python -m ember.benchmarks.delayline --delay S [--bandwidth B]``: each line read on
stdin, ``HOST:PORT``, opens a route and prints its port; the proxy stops when stdin closes
(its parent gone, even killed).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import threading
from collections import deque

LOOPBACK = ("127.0.0.1", "localhost")
_CHUNK = 1 << 16  # bytes read at a time: at a bandwidth cap, a chunk is carried whole before it travels


class _Line:
    """One direction of one connection: chunks in, each written out once its time has come,
    in order. ``None`` in the queue stands for the sender's EOF, ``...`` for its close."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float, bandwidth: float | None):
        self.loop, self.delay, self.bandwidth = loop, delay, bandwidth
        self.queue: deque = deque()
        self.out: asyncio.Transport | None = None
        self.free = 0.0   # when the link has carried everything queued so far
        self.timer: asyncio.TimerHandle | None = None

    def push(self, data) -> None:
        now = self.loop.time()
        if self.bandwidth and isinstance(data, bytes):
            self.free = max(now, self.free) + len(data) / self.bandwidth
            due = self.free + self.delay
        else:
            due = max(now, self.free) + self.delay
        self.queue.append((due, data))
        self.schedule()

    def attach(self, out: asyncio.Transport) -> None:
        self.out = out
        self.schedule()

    def schedule(self) -> None:
        if self.timer is None and self.queue and self.out is not None:
            self.timer = self.loop.call_at(self.queue[0][0], self._deliver)

    def _deliver(self) -> None:
        self.timer = None
        now = self.loop.time()
        while self.queue and self.queue[0][0] <= now:
            data = self.queue.popleft()[1]
            if data is None:
                if self.out.can_write_eof():
                    self.out.write_eof()
            elif data is ...:
                self.out.close()
            else:
                self.out.write(data)
        self.schedule()


class _End(asyncio.Protocol):
    """One socket of a proxied connection: what it reads goes into ``line``."""

    def __init__(self, line: _Line):
        self.line = line
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.line.push(data)

    def eof_received(self) -> bool:
        self.line.push(None)
        return True  # half-open: the other direction may still be talking

    def connection_lost(self, exc) -> None:
        self.line.push(...)


def _accept(loop, target: tuple[str, int], delay: float, bandwidth: float | None):
    """The protocol factory of a route: each accepted connection opens its own to ``target``."""
    def make() -> _End:
        up, down = _Line(loop, delay, bandwidth), _Line(loop, delay, bandwidth)
        client = _End(up)  # what the client sends goes up, towards the target

        async def open_upstream():
            try:
                transport, _ = await loop.create_connection(lambda: _End(down), *target)
            except OSError:
                client.transport.close()
                return
            up.attach(transport)
            down.attach(client.transport)

        loop.create_task(open_upstream())
        return client
    return make


def _serve(delay: float, bandwidth: float | None) -> None:
    loop = asyncio.new_event_loop()

    def open_route(target: tuple[str, int], listener: socket.socket) -> None:
        loop.create_task(loop.create_server(_accept(loop, target, delay, bandwidth), sock=listener))

    def commands() -> None:
        for text in sys.stdin:
            host, _, port = text.strip().rpartition(":")
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(64)  # connections queue in the kernel until the loop serves the route
            loop.call_soon_threadsafe(open_route, (host, int(port)), listener)
            print(listener.getsockname()[1], flush=True)
        loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=commands, daemon=True).start()
    loop.run_forever()


class DelayLine:
    """A delaying TCP proxy in a child process; a context manager. ``delay``: seconds each way;
    ``bandwidth``: bytes per second each way, or None for as fast as the proxy moves them."""

    def __init__(self, delay: float, bandwidth: float | None = None):
        if delay < 0 or (bandwidth is not None and bandwidth <= 0):
            raise ValueError(f"a delay line needs delay ≥ 0 and bandwidth > 0, got {delay}, {bandwidth}")
        self.delay, self.bandwidth = delay, bandwidth
        command = [sys.executable, "-m", "ember.benchmarks.delayline", "--delay", repr(delay)]
        if bandwidth is not None:
            command += ["--bandwidth", repr(bandwidth)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def route(self, address: str) -> str:
        """The address ("127.0.0.1:PORT") of a new listening port that forwards to ``address``
        ("HOST:PORT" on loopback) through the line."""
        host, _, port = address.rpartition(":")
        if host not in LOOPBACK:
            raise ValueError(f"a delay line forwards to loopback only, not {address!r}")
        self.process.stdin.write(f"{host}:{int(port)}\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer.strip().isdigit():
            raise RuntimeError(f"the delay line did not open a route to {address}: {answer!r}")
        return f"127.0.0.1:{int(answer)}"

    def close(self) -> None:
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()  # the proxy's cue to stop
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.process.stdout.close()

    def __enter__(self) -> DelayLine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    arguments = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arguments.add_argument("--delay", type=float, required=True, help="seconds each way")
    arguments.add_argument("--bandwidth", type=float, default=None, help="bytes per second each way")
    options = arguments.parse_args()
    _serve(options.delay, options.bandwidth)
