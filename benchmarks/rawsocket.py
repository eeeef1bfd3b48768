"""Raw-socket baselines in a child process: the fastest a loopback transfer or round trip gets.

Run as ``python -m ember.benchmarks.rawsocket``; it prints its port, then serves one client:
8-byte commands ``sink N`` (receive N bytes into a preallocated buffer, answer one byte),
``source N`` (send N bytes), ``echo N`` (echo N-byte messages until the client closes).
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys

import numpy as np

_COMMAND = struct.Struct("<4sQ")


def _serve() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = None
    while True:
        header = conn.recv(_COMMAND.size, socket.MSG_WAITALL)
        if len(header) < _COMMAND.size:
            return
        command, n = _COMMAND.unpack(header)
        if buffer is None or buffer.nbytes < n:
            buffer = np.empty(n, np.uint8)
        view = memoryview(buffer)[:n]
        if command == b"sink":
            got = 0
            while got < n:
                got += conn.recv_into(view[got:])
            conn.sendall(b"k")
        elif command == b"srce":
            conn.sendall(view)
        elif command == b"echo":
            while (got := conn.recv_into(view, n, socket.MSG_WAITALL)) == n:
                conn.sendall(view)
            return


class RawPeer:
    """A client of the raw-socket child process; ``through`` maps the child's address
    ("127.0.0.1:PORT") to the one to connect to (a route of a delay line, benchmarks/delayline.py)."""

    def __init__(self, through=None):
        self.process = subprocess.Popen([sys.executable, "-m", "ember.benchmarks.rawsocket"], stdout=subprocess.PIPE, text=True)
        address = f"127.0.0.1:{int(self.process.stdout.readline())}"
        host, _, port = (through(address) if through else address).rpartition(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = None

    def upload(self, data: np.ndarray) -> None:
        self.sock.sendall(_COMMAND.pack(b"sink", data.nbytes))
        self.sock.sendall(memoryview(data).cast("B"))
        self.sock.recv(1)

    def download(self, n: int) -> np.ndarray:
        self.sock.sendall(_COMMAND.pack(b"srce", n))
        out = np.empty(n, np.uint8)
        view, got = memoryview(out), 0
        while got < n:
            got += self.sock.recv_into(view[got:])
        return out

    def start_echo(self, n: int) -> None:
        self.sock.sendall(_COMMAND.pack(b"echo", n))
        self._buffer = bytearray(n)

    def echo(self) -> None:
        self.sock.sendall(self._buffer)
        self.sock.recv_into(self._buffer, len(self._buffer), socket.MSG_WAITALL)

    def close(self) -> None:
        self.sock.close()
        self.process.wait(10)
        self.process.stdout.close()


if __name__ == "__main__":
    _serve()
