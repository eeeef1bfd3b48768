"""The WebSocket shell: what ends a connection, pings, large frames in 4 MiB fragments, the
client's and the server's handshakes (IPv6, a refused upgrade, limits from the start, frames right
behind the upgrade).
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time

import numpy as np
import pytest

from ember import errors
from ember.wire import protocol as wire
from ember.wire.protocol import Limits
from ember.wire.tcp import TimedOut

from .conftest import too_large
from .framing import WebSocketFar as _WebSocketFar
from .framing import frame_bytes as _bytes
from .framing import loopback_pair as _loopback_pair
from .framing import shell_pair as _shell_pair
from .framing import upgrade_request as _upgrade_request

# --- the WebSocket shell: what ends a connection, and how large messages go -------------------------

@pytest.fixture(params=[True, False], ids=["kernel timeouts", "python timeouts"])
def websocket_pairs(request, monkeypatch):
    """Pairs of a server's WebSocketConnection and a hand-driven client end (:class:`_WebSocketFar`),
    with plain TCP's kernel timeouts, then Python's; all closed after the test."""
    from ember.wire import tcp
    monkeypatch.setattr(tcp, "_KERNEL_TIMEOUTS", request.param and tcp._KERNEL_TIMEOUTS)
    made = []

    def make():
        made.append(_shell_pair("websocket"))
        return made[-1]
    yield make
    for connection, far in made:
        connection.close()
        far.close()


def _far_writes(far: _WebSocketFar, *writes) -> None:
    """Have the far end's protocol write each of ``writes`` (a method name and its arguments), then
    send all of it in one ``sendall``."""
    for name, *args in writes:
        getattr(far.protocol, name)(*args)
    far.sock.sendall(b"".join(far.protocol.data_to_send()))


def test_a_websocket_says_what_ended_it(websocket_pairs):
    """Each way a WebSocket connection ends or is refused raises the error that says so: a text
    message (not ember's), the far end's close frame (also found by every look until a receive,
    and a send after it), the stream's end without one, a reset, a receive's own timeout, and a message
    past the connection's limits, refused at its WebSocket header, before its bytes come."""
    from ember.wire import websocket
    connection, far = websocket_pairs()
    _far_writes(far, ("send_text", b"hello"))
    with pytest.raises(errors.ProtocolError, match="^text WebSocket messages are not part of the ember protocol$"):
        connection.receive()

    connection, far = websocket_pairs()
    _far_writes(far, ("send_close",))
    time.sleep(0.05)
    assert connection.readable() and connection.readable()  # the close, until a receive reports it
    with pytest.raises(errors.ConnectionLost, match="^the peer closed the WebSocket$"):
        connection.receive()
    with pytest.raises(errors.ConnectionLost, match="^the WebSocket is (closing|closed)$"):
        connection.send(wire.encode_frame({"t": "reply"}))

    connection, far = websocket_pairs()
    far.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(errors.ConnectionLost, match="^the peer closed the connection$"):
        connection.receive()

    connection, far = websocket_pairs()
    far.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    far.sock.close()  # a reset, not an end
    with pytest.raises(errors.ConnectionLost, match="^connection lost: .*[Rr]eset"):
        connection.receive()

    connection, far = websocket_pairs()
    with pytest.raises(TimedOut, match="^timed out waiting for the peer$"):
        connection.receive(timeout=0.05)

    connection, far = websocket_pairs()
    connection.set_limits(Limits(max_frame_bytes=1 << 16))
    far.sock.sendall(b"\x82\xff" + (1 << 20).to_bytes(8, "big") + b"mask")  # a 1 MiB binary message's header alone
    with pytest.raises(errors.ConnectionLost) as lost:
        connection.receive(timeout=2)
    assert not isinstance(lost.value, TimedOut)  # refused at the header, not waited for
    assert re.fullmatch("the WebSocket closed: " + too_large(1 << 20, websocket._max_size(Limits(max_frame_bytes=1 << 16))),
                        str(lost.value))


def test_pings_are_answered_and_the_connection_works_on(websocket_pairs):
    """Pings (a browser's or a proxy's) are answered with pongs, two in one read as well, and the
    ember frame that came with them is received."""
    from websockets.frames import Opcode
    connection, far = websocket_pairs()
    _far_writes(far, ("send_ping", b"one"), ("send_ping", b"two"), ("send_binary", _bytes({"t": "reply", "n": 7})))
    assert connection.receive().header == {"t": "reply", "n": 7}
    far.sock.settimeout(5)
    pongs = []
    while len(pongs) < 2:
        far.protocol.receive_data(far.sock.recv(4096))
        assert far.protocol.parser_exc is None
        pongs += [event.data for event in far.protocol.events_received() if event.opcode is Opcode.PONG]
    assert pongs == [b"one", b"two"]


def test_a_large_frame_goes_in_fragments_that_end_at_the_first_buffer_past_4_mib():
    """A frame of many buffers is sent as one message in fragments: buffers are joined until a
    fragment holds 4 MiB or more (no join of the whole frame), a buffer of 4 MiB or more is cut at
    4 MiB; the far end receives the frame whole."""
    from ember.wire import websocket
    mib = 1 << 20
    port, server, accepted = _one_connection()
    client = websocket.connect("127.0.0.1", port, timeout=10)
    server.join(10)
    near, = accepted
    sent = []
    for name in ("send_binary", "send_continuation"):
        original = getattr(client.protocol, name)
        setattr(client.protocol, name, lambda data, fin=True, original=original: (sent.append(len(data)),
                                                                                    original(data, fin=fin))[1])
    try:
        for sizes, fragments in (([4 * mib, 3 * mib], [4 * mib, 3 * mib]),
                                 ([mib] * 9, [4 * mib, 4 * mib, mib]),
                                 ([9 * mib], [4 * mib, 4 * mib, mib])):
            sent.clear()
            chunks = [np.full(n, k, np.uint8) for k, n in enumerate(sizes)]
            arrived = []

            def read_message():  # fragment by fragment, below the ember frame reader, as the client sends
                ended = False
                while not ended:
                    for event in near._pump():
                        arrived.append(event.data)
                        ended = event.fin
            reader = threading.Thread(target=read_message)
            reader.start()
            assert client.send(chunks) == sum(sizes)
            reader.join(10)
            assert sent == fragments
            assert b"".join(arrived) == b"".join(chunk.tobytes() for chunk in chunks)
        sent.clear()  # an ember frame of two large tensors behind its header: several fragments, received whole
        frames = []
        reader = threading.Thread(target=lambda: frames.append(near.receive()))
        reader.start()
        assert client.send(wire.encode_frame({"t": "batch"}, [np.arange(mib, dtype=np.float64), np.ones(3 * mib, np.uint8)]))
        reader.join(10)
        assert max(sent) < 2 * websocket._FRAGMENT and len(sent) > 1
        frame, = frames
        np.testing.assert_array_equal(frame.segments[0], np.arange(mib, dtype=np.float64))
        np.testing.assert_array_equal(frame.segments[1], np.ones(3 * mib, np.uint8))
    finally:
        client.close()
        near.close()


def _one_connection(family=socket.AF_INET, host="127.0.0.1"):
    """A listener on loopback and a thread that accepts one connection as a WebSocket server's
    (``websocket.accept``, default limits): (port, thread, [the connection once accepted])."""
    from ember.wire import websocket
    listener = socket.create_server((host, 0), family=family)
    accepted = []

    def serve():
        with listener:
            sock, _ = listener.accept()
        sock.settimeout(10)
        accepted.append(websocket.accept(sock))
    thread = threading.Thread(target=serve)
    thread.start()
    return listener.getsockname()[1], thread, accepted


def test_a_websocket_client_reaches_ipv6_loopback_and_takes_messages_to_its_limits_from_the_start():
    """``websocket.connect`` writes an IPv6 host in brackets (ws://[::1]:port); a connection made
    with the default limits takes a 2 MiB message at once (not the library's 1 MiB default), and one
    made with the handshake's limits refuses a larger message at its WebSocket header, before its
    bytes come."""
    from ember.wire import websocket
    port, thread, accepted = _one_connection(socket.AF_INET6, "::1")
    client = websocket.connect("::1", port, timeout=10)
    thread.join(10)
    server, = accepted
    try:
        big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB
        client.send(wire.encode_frame({"t": "batch"}, [big]))
        np.testing.assert_array_equal(server.receive().segments[0], big)
        server.send(wire.encode_frame({"t": "reply"}, [big]))
        np.testing.assert_array_equal(client.receive().segments[0], big)
    finally:
        client.close()
        server.close()
    port, thread, accepted = _one_connection()
    client = websocket.connect("127.0.0.1", port, wire.HANDSHAKE_LIMITS, timeout=10)
    thread.join(10)
    server, = accepted
    try:
        server.sock.sendall(b"\x82\x7f" + (1 << 20).to_bytes(8, "big"))  # a server's 1 MiB binary message, its header alone
        with pytest.raises(errors.ConnectionLost) as lost:
            client.receive(timeout=2)
        assert not isinstance(lost.value, TimedOut)  # refused at the header, not waited for
        limit = websocket._max_size(wire.HANDSHAKE_LIMITS)
        assert re.search(too_large(1 << 20, limit), str(lost.value))
    finally:
        client.close()
        server.close()


def test_a_refused_websocket_upgrade_is_named_as_refused_not_as_a_timeout():
    """A server answering the upgrade with an HTTP error: ``connect`` raises ConnectionLost naming
    the address and the refusal (with a timeout given too: not a TimedOut) and closes its socket."""
    from ember.wire import websocket
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def refuse():
            sock, _ = listener.accept()
            with sock:
                sock.settimeout(10)
                request = b""
                while b"\r\n\r\n" not in request:
                    request += sock.recv(4096)
                sock.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                closed.append(sock.recv(1) == b"")  # the client closes its end
        closed = []
        thread = threading.Thread(target=refuse)
        thread.start()
        with pytest.raises(errors.ConnectionLost) as lost:
            websocket.connect("127.0.0.1", port, timeout=5)
        thread.join(10)
    assert not isinstance(lost.value, TimedOut)
    assert str(lost.value).startswith(f"WebSocket handshake with 127.0.0.1:{port} failed: ") and "403" in str(lost.value)
    assert closed == [True]


def test_a_websocket_server_keeps_what_it_was_given_and_names_a_failed_upgrade():
    """``websocket.accept`` hands its connection the allocator (tensors arrive in its arrays) and
    the socket's timeout (a wait after the handshake ends by it), waits for the upgrade no longer
    than its deadline, and refuses a request that is no WebSocket upgrade, naming the handshake."""
    from websockets.http11 import Response

    from ember.wire import websocket
    near, far = _loopback_pair()
    client, request = _upgrade_request()
    far.sendall(request)
    near.settimeout(0.3)
    made = []

    def allocate(shape, dtype):
        made.append(np.empty(shape, dtype))
        return made[-1]
    connection = websocket.accept(near, allocate=allocate)
    watchdog = threading.Timer(5, connection.close)  # a wait without its timeout ends, and the test fails
    watchdog.start()
    try:
        while not any(isinstance(event, Response) for event in client.events_received()):
            client.receive_data(far.recv(4096))
        client.send_binary(_bytes({"t": "batch"}, [np.arange(3.0)]))
        far.sendall(b"".join(client.data_to_send()))
        frame = connection.receive()
        assert frame.segments[0] is made[0] and frame.segments[0].tolist() == [0.0, 1.0, 2.0]
        started = time.monotonic()
        with pytest.raises(TimedOut):
            connection.receive()
        assert time.monotonic() - started < 4  # the socket's 0.3 s, well before the watchdog's 5
    finally:
        watchdog.cancel()
        connection.close()
        far.close()

    near, far = _loopback_pair()
    near.settimeout(10)
    started = time.monotonic()
    try:
        with pytest.raises(TimedOut):
            websocket.accept(near, deadline=time.monotonic() + 0.3)  # the client says nothing
        assert time.monotonic() - started < 5  # the deadline's 0.3 s, not the socket's 10
    finally:
        near.close()
        far.close()

    near, far = _loopback_pair()
    near.settimeout(10)
    try:
        far.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # no upgrade asked
        with pytest.raises(errors.ProtocolError, match="^WebSocket handshake failed: "):
            websocket.accept(near)
    finally:
        near.close()
        far.close()


def test_frames_sent_right_behind_the_websocket_upgrade_are_received():
    """A server may send its first frame right behind its upgrade response, and a hasty client its
    first behind its request (RFC 6455 asks it to wait): each arrives in the same read as the
    handshake and is received, not dropped. A text message there is refused as it would be later,
    and ``connect`` closes its socket."""
    from websockets.frames import Frame as WebSocketFrame
    from websockets.frames import Opcode
    from websockets.server import ServerProtocol

    from ember.wire import websocket
    first = _bytes({"t": "init", "n": 1})
    near, far = _loopback_pair()
    try:
        far.sendall(_upgrade_request()[1] + WebSocketFrame(Opcode.BINARY, first).serialize(mask=True, extensions=[]))
        near.settimeout(10)
        connection = websocket.accept(near)
        assert connection.receive().header == {"t": "init", "n": 1}
    finally:
        near.close()
        far.close()

    def connect_behind(frame: bytes):
        """``connect`` to a server that sends ``frame`` in the same write as its response:
        (the connection or the error connect raised, whether the server saw the client close)."""
        with socket.create_server(("127.0.0.1", 0)) as listener:
            def answer():
                sock, _ = listener.accept()
                with sock:
                    sock.settimeout(10)
                    server = ServerProtocol()
                    while not (events := server.events_received()):
                        server.receive_data(sock.recv(4096))
                    server.send_response(server.accept(events[0]))
                    sock.sendall(b"".join(server.data_to_send()) + frame)
                    while sock.recv(4096):  # a close frame, perhaps, then the client's end of the stream
                        pass
                    closed.append(True)
            closed = []
            thread = threading.Thread(target=answer)
            thread.start()
            try:
                made = websocket.connect("127.0.0.1", listener.getsockname()[1], timeout=10)
            except errors.EmberError as error:
                made = error
            if not isinstance(made, errors.EmberError):
                try:
                    assert made.receive(timeout=5).header == {"t": "init", "n": 1}
                finally:
                    made.close()
            thread.join(10)
        return made, closed

    made, _ = connect_behind(WebSocketFrame(Opcode.BINARY, first).serialize(mask=False, extensions=[]))
    assert not isinstance(made, errors.EmberError)
    # a text message behind the response: refused, and the client's socket closed
    made, closed = connect_behind(WebSocketFrame(Opcode.TEXT, b"hello").serialize(mask=False, extensions=[]))
    assert isinstance(made, errors.ProtocolError) and "text WebSocket messages" in str(made) and closed == [True]
