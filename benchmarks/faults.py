"""A fault line for process tests: a TCP proxy on 127.0.0.1 in front of a real peer that forwards
bytes both ways until told to fail — cut every connection (a reset, or a FIN), cut the next one
as the peer starts to answer, or refuse new connections for a while (the link down)."""

from __future__ import annotations

import socket
import struct
import threading
import time


class FaultLine:
    """Connections to :attr:`address` are forwarded to ``target`` ("host:port")."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.pairs: list[_Pair] = []
        self.lock = threading.Lock()
        self.down_until = 0.0
        self.cut_on_answer = None  # "rst"/"fin": cut as soon as the peer sends bytes on any connection
        self.accepted = 0
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, scheme: str = "ember") -> str:
        return f"{scheme}://{self.address}/0"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if time.monotonic() < self.down_until:  # the link is down: the connection is reset at once
                _reset(client)
                continue
            try:
                peer = socket.create_connection(self.target)
            except OSError:
                _reset(client)
                continue
            pair = _Pair(client, peer)
            with self.lock:
                self.pairs.append(pair)
                self.accepted += 1
            pair.pumps = [threading.Thread(target=self._pump, args=(pair, client, peer, False), daemon=True),
                          threading.Thread(target=self._pump, args=(pair, peer, client, True), daemon=True)]
            for pump in pair.pumps:
                pump.start()

    def _pump(self, pair, source: socket.socket, sink: socket.socket, answering: bool) -> None:
        try:
            while True:
                data = source.recv(1 << 16)
                if not data or pair.cutting:
                    break
                if answering and self.cut_on_answer is not None:  # the peer's answer is lost with the connection
                    how, self.cut_on_answer = self.cut_on_answer, None
                    threading.Thread(target=self.cut, args=(how,), daemon=True).start()
                    return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            if not pair.cutting:  # the other end closed: close this one the same way
                for sock in (source, sink):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def cut(self, how: str = "rst") -> None:
        """End every connection through the line: a reset (RST) or an orderly close (FIN) each way."""
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            pair.cutting = True
            for sock in pair.sockets:
                if how == "rst":  # a close with nothing lingering resets; the pumps are woken first
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                try:
                    sock.shutdown(socket.SHUT_RD if how == "rst" else socket.SHUT_RDWR)
                except OSError:
                    pass
            for pump in pair.pumps:
                if pump is not threading.current_thread():
                    pump.join(5)
            for sock in pair.sockets:
                sock.close()

    def down(self, seconds: float, how: str = "rst") -> None:
        """Cut every connection and refuse new ones for ``seconds``."""
        self.down_until = time.monotonic() + seconds
        self.cut(how)

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        self.cut()

    def __enter__(self) -> FaultLine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Pair:
    """The two sockets of one connection through the line, and the threads pumping between them."""

    def __init__(self, client: socket.socket, peer: socket.socket):
        self.sockets = (client, peer)
        self.pumps: list[threading.Thread] = []
        self.cutting = False


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset: SO_LINGER with a zero timeout."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
