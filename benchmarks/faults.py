"""A fault line for resume tests and `ember bench resume`: a TCP proxy on 127.0.0.1 in front of a real peer that forwards
bytes both ways until told to fail — cut every connection (a reset, or a FIN), cut the next one
as the peer starts to answer, or refuse new connections for a while (the link down); or, leaving
every connection open, forward nothing (a black hole, as after a Wi-Fi roam) or nothing one way
(a stall), until healed."""

from __future__ import annotations

import socket
import struct
import threading
import time

DIRECTIONS = ("up", "down")  # up: client → peer; down: peer → client
HOLD_BYTES = 4 << 20  # what a connection's direction holds before the line reads no more of it (a route's buffers)


class FaultLine:
    """Connections to :attr:`address` are forwarded to ``target`` ("host:port"). :attr:`source_ports`
    lists the client-side port of each connection accepted, in order."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.pairs: list[_Pair] = []
        self.lock = threading.Lock()
        self.down_until = 0.0
        self.cut_on_answer = None  # "rst"/"fin": cut as soon as the peer sends bytes on any connection; "hole": black hole
        self.accepted = 0
        self.source_ports: list[int] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, scheme: str = "ember") -> str:
        return f"{scheme}://{self.address}/0"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, (_, port) = self.listener.accept()
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
            for sock in (client, peer):  # each frame forwarded at once, not behind a delayed ACK (Nagle)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, peer)
            with self.lock:
                self.pairs.append(pair)
                self.accepted += 1
                self.source_ports.append(port)
            pair.pumps = [threading.Thread(target=self._pump, args=(pair, client, peer, "up"), daemon=True),
                          threading.Thread(target=self._pump, args=(pair, peer, client, "down"), daemon=True)]
            for pump in pair.pumps:
                pump.start()

    def _pump(self, pair, source: socket.socket, sink: socket.socket, direction: str) -> None:
        flow = pair.flows[direction]
        try:
            while True:
                data = source.recv(1 << 16)
                if not data or pair.cutting:
                    break
                if direction == "down" and self.cut_on_answer is not None:  # the peer's answer is lost
                    how, self.cut_on_answer = self.cut_on_answer, None
                    if how == "hole":
                        self.black_hole()  # … in a hole that holds it, this connection's with the others'
                    else:  # … with the connection
                        threading.Thread(target=self.cut, args=(how,), daemon=True).start()
                        return
                with flow:  # held bytes are sent before any that come after them (heal)
                    held = pair.held[direction]
                    if held is None:
                        sink.sendall(data)
                        pair.carried[direction] += len(data)
                        continue
                    held.append(data)
                    # a full hole reads no more: the sender's own buffers fill, and its sends block, as on a real route
                    flow.wait_for(lambda: pair.held[direction] is not held or pair.cutting
                                  or sum(map(len, held)) < HOLD_BYTES)
        except OSError:
            pass
        finally:
            with flow:
                ended = not pair.cutting and pair.held[direction] is None
                if not pair.cutting and not ended:  # held: the end is held too, and passed on by heal
                    pair.ended.add(direction)
            if ended:  # the other end closed: close this one the same way
                pair.shut()

    def black_hole(self) -> None:
        """Forward nothing on any connection open now, either way, and close or reset nothing: what
        each side sends is held, up to HOLD_BYTES a direction, after which the sender's sends block (as
        a network that lost the route, and the sender's kernel, would). New connections get through."""
        self.stall("up")
        self.stall("down")

    def stall(self, direction: str) -> None:
        """Hold the bytes one way ("up": the client's to the peer; "down": the peer's to the client) on
        every connection open now, while the other way flows. New connections get through as usual."""
        if direction not in DIRECTIONS:
            raise ValueError(f"a stall is 'up' or 'down', got {direction!r}")
        with self.lock:
            pairs = list(self.pairs)
        for pair in pairs:
            with pair.flows[direction]:
                if pair.held[direction] is None:
                    pair.held[direction] = []

    def heal(self) -> None:
        """End every stall and black hole: the bytes held are sent on, in order (an end of the stream
        held with them too), and the connections forward again."""
        with self.lock:
            pairs = list(self.pairs)
        for pair in pairs:
            ended = False
            for direction, sink in zip(DIRECTIONS, reversed(pair.sockets)):
                with pair.flows[direction]:
                    held, pair.held[direction] = pair.held[direction], None
                    pair.flows[direction].notify_all()
                    try:
                        for data in held or ():
                            sink.sendall(data)
                    except OSError:
                        ended = True
                    ended = ended or direction in pair.ended
            if ended and not pair.cutting:
                pair.shut()

    def carried(self, connection: int) -> dict:
        """The bytes forwarded so far each way on open connection number ``connection`` (0: the oldest)."""
        with self.lock:
            return dict(self.pairs[connection].carried)

    def held(self) -> dict:
        """The bytes held now, by direction, on every connection."""
        with self.lock:
            pairs = list(self.pairs)
        held = dict.fromkeys(DIRECTIONS, 0)
        for pair in pairs:
            for direction in DIRECTIONS:
                with pair.flows[direction]:
                    held[direction] += sum(map(len, pair.held[direction] or ()))
        return held

    def cut(self, how: str = "rst") -> None:
        """End every connection through the line: a reset (RST) or an orderly close (FIN) each way."""
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            pair.cutting = True
            for flow in pair.flows.values():  # a pump waiting in a full hole
                with flow:
                    flow.notify_all()
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
    """The two sockets of one connection through the line, the threads pumping between them, and
    what each direction holds: None while it flows, else the bytes held, in order."""

    def __init__(self, client: socket.socket, peer: socket.socket):
        self.sockets = (client, peer)
        self.pumps: list[threading.Thread] = []
        self.cutting = False
        self.held: dict = dict.fromkeys(DIRECTIONS)
        self.carried: dict = dict.fromkeys(DIRECTIONS, 0)  # bytes forwarded each way
        self.ended: set[str] = set()  # the directions whose source ended while they were held
        self.flows = {direction: threading.Condition() for direction in DIRECTIONS}  # a direction's sends and holds

    def shut(self) -> None:
        """Pass an end on: both sockets shut down, both ways."""
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset: SO_LINGER with a zero timeout."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
