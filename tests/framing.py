"""What the wire tests share (test_frames.py, test_tcp.py, test_websocket.py): a frame's bytes, and
shells over loopback connections with a far end driven by hand."""

from __future__ import annotations

import socket

from ember.wire import protocol as wire


def frame_bytes(header, segments=()) -> bytes:
    """The bytes of the frame of ``header`` and ``segments``, as a sender writes them."""
    return b"".join(bytes(b) for b in wire.encode_frame(header, list(segments)))


class WebSocketFar:
    """A WebSocket client's end written by hand: each ``sendall`` one masked binary message."""

    def __init__(self, sock, protocol):
        self.sock, self.protocol = sock, protocol

    def sendall(self, data: bytes) -> None:
        self.protocol.send_binary(data)
        self.sock.sendall(b"".join(self.protocol.data_to_send()))

    def close(self) -> None:
        self.sock.close()


def loopback_pair() -> tuple[socket.socket, socket.socket]:
    """The two ends of a loopback TCP connection: the accepted one, and the one that connected."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        far = socket.create_connection(listener.getsockname())
        near, _ = listener.accept()
    return near, far


def upgrade_request():
    """A hand-driven WebSocket client's protocol, and the bytes of its upgrade request."""
    from websockets.client import ClientProtocol
    from websockets.uri import parse_uri
    client = ClientProtocol(parse_uri("ws://127.0.0.1/"))
    client.send_request(client.connect())
    return client, b"".join(client.data_to_send())


def shell_pair(transport: str):
    """A shell over one end of a loopback TCP connection (its timeout 10 s) and the other end."""
    from websockets.http11 import Response

    from ember.wire import websocket
    from ember.wire.tcp import TcpConnection
    near, far = loopback_pair()
    if transport == "tcp":
        return TcpConnection(near, timeout=10), far
    client, request = upgrade_request()
    far.sendall(request)  # the upgrade request, before the server reads it
    near.settimeout(10)
    connection = websocket.accept(near)
    while not any(isinstance(event, Response) for event in client.events_received()):
        client.receive_data(far.recv(4096))
    return connection, WebSocketFar(far, client)
