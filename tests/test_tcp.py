"""The socket shells over loopback connections: TCP's sends (scatter-gather, or one write cut short
by a full buffer), the kernel's timeouts and Python's, deadlines, looks and spin waits for an
expected frame, and a close under a blocked receive. The tests over ``shell_pairs`` run on the
WebSocket shell as well, which takes its waits from tcp.py's SocketShell; ``connect`` is checked
for both shells.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

import ember as em
from ember import errors
from ember.wire import protocol as wire
from ember.wire.protocol import Limits
from ember.wire.tcp import TimedOut

from .framing import frame_bytes as _bytes
from .framing import shell_pair as _shell_pair


def test_waits_never_pass_a_deadline():
    from ember.wire.tcp import TimedOut, wait_limit
    assert wait_limit(None, None) is None and wait_limit(5.0, None) == 5.0
    soon = time.monotonic() + 2
    assert 1 < wait_limit(None, soon) <= 2 and wait_limit(0.5, soon) == 0.5 and 1 < wait_limit(30, soon) <= 2
    assert 0 < wait_limit(30, time.monotonic() + 0.5) <= 0.5  # however little is left, until none is
    with pytest.raises(TimedOut, match="^the deadline passed$"):
        wait_limit(30, time.monotonic() - 0.001)
    assert issubclass(TimedOut, errors.ConnectionLost)


@pytest.fixture(params=[("tcp", True), ("tcp", False), ("websocket", True), ("websocket", False)],
                ids=["tcp, kernel timeouts", "tcp, python timeouts", "websocket, kernel timeouts",
                     "websocket, python timeouts"])
def shell_pairs(request, monkeypatch):
    """Makes pairs of a shell (a TcpConnection, or a WebSocketConnection as a server's) and the
    far end of its loopback connection, with plain TCP's kernel timeouts (where this system has
    them), then with Python's, and closes every one after the test. The far end sends frame bytes
    as the transport carries them (:class:`_WebSocketFar`: one binary message a ``sendall``)."""
    from ember.wire import tcp
    transport, kernel = request.param
    monkeypatch.setattr(tcp, "_KERNEL_TIMEOUTS", kernel and tcp._KERNEL_TIMEOUTS)
    made = []

    def make():
        made.append(_shell_pair(transport))
        return made[-1]
    yield make
    for connection, far in made:
        connection.close()
        far.close()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel timeouts", "python timeouts"])
def test_a_frame_with_empty_tensors_between_and_after_large_ones_arrives_whole(kernel, monkeypatch):
    """A large frame goes scatter-gather, a buffer a segment: an empty tensor's buffer is empty, and
    one between, after or in place of large ones neither stops the send nor is sent twice. The send
    returns the frame's bytes and leaves the socket's timeouts as it found them."""
    from ember.wire import tcp
    monkeypatch.setattr(tcp, "_KERNEL_TIMEOUTS", kernel and tcp._KERNEL_TIMEOUTS)
    near, far = _shell_pair("tcp")
    far = tcp.TcpConnection(far, timeout=10)
    try:
        rng = np.random.default_rng(5)
        for layout in ([3000, 0], [0, 3000, 0, 0], [3000, 0, 5000, 0], [200_000, 0]):  # float64: 24 kB and more
            segments = [rng.random(n) for n in layout]
            buffers = wire.encode_frame({"t": "batch"}, segments)
            assert near.send(buffers) == sum(memoryview(b).nbytes for b in buffers)  # what the counters count
            # a large frame may be sent with Python's timeouts: the socket's own are as they were after it
            assert near.sock.gettimeout() == (None if near._kernel else near.timeout)
            frame = far.receive()
            assert frame.header == {"t": "batch", "seg": tuple(("float64", (n,)) for n in layout)}
            for sent, received in zip(segments, frame.segments, strict=True):
                np.testing.assert_array_equal(received, sent)
    finally:
        near.close()
        far.close()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel timeouts", "python timeouts"])
def test_frames_of_one_buffer_sent_faster_than_the_far_end_reads_arrive_whole(kernel, monkeypatch):
    """A frame of one buffer (a header of many ops, with small tensors or none) goes in one write,
    which a full socket buffer may cut short: the rest follows, and the count returned is the
    frame's. Fifty such frames of 200 kB, sent through small socket buffers while the far end starts
    reading late, all arrive whole and in order."""
    from ember.wire import tcp
    monkeypatch.setattr(tcp, "_KERNEL_TIMEOUTS", kernel and tcp._KERNEL_TIMEOUTS)
    near, far = _shell_pair("tcp")
    near.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # smaller than a frame: writes cut short
    far.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    far = tcp.TcpConnection(far, timeout=10)
    frames = [wire.encode_frame({"t": "batch", "k": k, "ops": bytes([k]) * 200_000}, [np.full(3, k, np.float32)])
              for k in range(50)]
    assert all(len(buffers) == 1 for buffers in frames)
    counts = []
    sender = threading.Thread(target=lambda: counts.extend(near.send(buffers) for buffers in frames))
    try:
        sender.start()
        time.sleep(0.2)  # the buffers fill
        for k in range(50):
            frame = far.receive()
            assert frame.header["ops"] == bytes([k]) * 200_000 and (frame.segments[0] == k).all()
        sender.join(10)
        assert counts == [len(buffers[0]) for buffers in frames]
    finally:
        near.close()
        far.close()
        sender.join(10)


def test_a_kernel_timeout_is_whole_microseconds_rounded_up_and_none_is_zero():
    """The kernel reads a socket timeout as a struct timeval, where zero means none: no timeout is
    zero, and a timeout of any length (zero included: do not wait) is at least a microsecond,
    rounded up, never down to none."""
    from ember.wire.tcp import _TIMEVAL, _timeval
    for seconds, expected in ((None, (0, 0)), (0.0, (0, 1)), (1e-9, (0, 1)), (1e-6, (0, 1)), (2.5e-6, (0, 3)),
                              (1.5, (1, 500_000)), (2.0000001, (2, 1)), (600.0, (600, 0))):
        assert _TIMEVAL.unpack(_timeval(seconds)) == expected, seconds


@pytest.mark.parametrize("transport", ["tcp", "websocket"])
def test_a_connection_made_keeps_the_timeout_limits_and_allocator_it_was_given(transport):
    """``connect`` of either shell hands its connection what it was given: tensors arrive in the
    allocator's arrays, a wait for bytes ends after the timeout, and a frame over the limits is
    refused naming them. A port nobody listens on is named in the error."""
    from ember.wire import tcp, websocket
    module = tcp if transport == "tcp" else websocket
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        far = []

        def serve():
            sock, _ = listener.accept()
            sock.settimeout(10)
            far.append(tcp.TcpConnection(sock, timeout=10) if transport == "tcp" else websocket.accept(sock))
        server = threading.Thread(target=serve)
        server.start()
        made = []

        def allocate(shape, dtype):
            made.append(np.empty(shape, dtype))
            return made[-1]
        near = module.connect("127.0.0.1", port, Limits(max_tensor_bytes=64), timeout=0.5, allocate=allocate)
        server.join(10)
        watchdog = threading.Timer(10, far[0].close)  # a wait without its timeout ends, and the test fails
        watchdog.start()
        try:
            far[0].send(wire.encode_frame({"t": "batch"}, [np.arange(4.0)]))
            frame = near.receive()
            assert frame.segments[0] is made[0] and frame.segments[0].tolist() == [0.0, 1.0, 2.0, 3.0]
            start = time.monotonic()
            with pytest.raises(TimedOut):
                near.receive()  # nothing more comes
            assert time.monotonic() - start < 5
            far[0].send(wire.encode_frame({"t": "batch"}, [np.arange(9.0)]))
            with pytest.raises(errors.ProtocolError, match="a tensor of 72 bytes exceeds the limit of 64 bytes"):
                near.receive()
        finally:
            watchdog.cancel()
            near.close()
            far[0].close()
    with pytest.raises(errors.ConnectionLost, match=rf"^cannot connect to 127\.0\.0\.1:{port}: "):
        module.connect("127.0.0.1", port, timeout=5)


@pytest.mark.parametrize("transport", ["tcp", "websocket"])
def test_a_connection_sends_at_once_and_notices_a_vanished_host(transport):
    """Both shells' sockets send small frames at once (no Nagle delay) and keep the connection alive
    where the system lets them tune it: a host that vanishes is noticed after 10 s of silence and
    3 probes 5 s apart, even while nothing is sent."""
    from ember.wire import tcp, websocket
    with socket.create_server(("127.0.0.1", 0)) as listener:
        accepted = []
        server = threading.Thread(target=lambda: accepted.append(listener.accept()[0]))
        server.start()
        if transport == "tcp":
            connection = tcp.connect("127.0.0.1", listener.getsockname()[1], timeout=10)
        else:
            def upgrade():
                server.join(10)
                accepted[0].settimeout(10)
                accepted.append(websocket.accept(accepted[0]))
            upgrading = threading.Thread(target=upgrade)
            upgrading.start()
            connection = websocket.connect("127.0.0.1", listener.getsockname()[1], timeout=10)
            upgrading.join(10)
        server.join(10)
        try:
            sock = connection.sock
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
                if hasattr(socket, option):
                    assert sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, option)) == value, option
        finally:
            connection.close()
            for far in accepted:
                far.close()


@pytest.mark.parametrize("poll", [True, False], ids=["poll", "select"])
def test_a_look_for_a_frame_never_waits_and_works_without_poll_too(monkeypatch, poll):
    """A look asks ``poll`` where the system has it, and ``select`` where not (Windows): not readable
    before bytes come, readable once a frame has, and at the stream's end; and it never waits (a
    thousand looks at a quiet connection take a few milliseconds, where a look that waited even a
    millisecond would take a second)."""
    import select
    if not poll:
        monkeypatch.delattr(select, "poll")
    from ember.wire import tcp
    monkeypatch.setattr(tcp, "_KERNEL_TIMEOUTS", False)  # with the kernel's timeouts a look reads instead
    near, far = _shell_pair("tcp")
    watchdog = threading.Timer(10, far.close)  # a look that waits ends, and the test fails
    watchdog.start()
    try:
        start = time.monotonic()
        assert not any(near.readable() for _ in range(1000))
        assert time.monotonic() - start < 0.5
        far.sendall(_bytes({"t": "batch"}))
        assert tcp.spin_wait(near, 5.0) and near.receive().header == {"t": "batch"}
        assert not near.readable()
        far.close()
        assert tcp.spin_wait(near, 5.0)
        with pytest.raises(errors.ConnectionLost, match="the peer closed the connection"):
            near.receive()
    finally:
        watchdog.cancel()
        near.close()


def test_receives_and_sends_time_out_each_by_its_own_limit(shell_pairs):
    """Plain TCP on 64-bit Linux keeps a blocking socket with the kernel's timeouts (one system call a
    receive); TLS, and other systems, keep Python's. Either way: a receive's timeout is its own,
    the connection's is the default, and a send to a peer that reads nothing times out too."""
    from ember.wire import tcp
    connection, far = shell_pairs()
    assert connection._kernel is tcp._KERNEL_TIMEOUTS
    connection.set_timeout(1.0)
    for timeout, least, most in ((0.2, 0.15, 0.8), (None, 0.9, 5)):  # its own, then the connection's
        started = time.monotonic()
        with pytest.raises(tcp.TimedOut, match="timed out waiting for the peer"):
            connection.receive(timeout)
        assert least < time.monotonic() - started < most
    connection.set_timeout(0.3)
    far.sendall(_bytes({"t": "reply", "n": 1}))
    assert connection.receive(30).header == {"t": "reply", "n": 1}  # a long limit returns at once
    big = np.arange(1 << 16, dtype=np.float32)  # 256 KiB: received straight into its array, as with Python's timeouts
    assert big.nbytes > tcp._DIRECT
    far.sendall(_bytes({"t": "reply", "n": 2}, [big]))
    frame = connection.receive(30)
    assert frame.header["n"] == 2 and np.array_equal(frame.segments[0], big)
    data = _bytes({"t": "reply", "n": 3}, [big])
    far.sendall(data[:len(data) // 2])  # half a large frame, then nothing
    started = time.monotonic()
    with pytest.raises(tcp.TimedOut, match="timed out waiting for the peer"):
        connection.receive(0.2)
    assert 0.15 < time.monotonic() - started < 5
    assert connection.sock.gettimeout() == (None if connection._kernel else 0.3)  # as it was before the receive
    started = time.monotonic()
    with pytest.raises(errors.ConnectionLost, match="connection lost while sending"):
        connection.send(wire.encode_frame({"t": "batch"}, [np.zeros(64 << 20, np.uint8)]))  # far reads nothing
    assert 0.25 < time.monotonic() - started < 10  # the connection's 0.3 s, not the last receive's 30 s


def test_a_connection_without_a_timeout_waits_as_long_as_it_takes(shell_pairs):
    connection, far = shell_pairs()
    connection.set_timeout(None)  # a peer's --idle-timeout 0
    later = threading.Timer(1.2, lambda: far.sendall(_bytes({"t": "reply", "n": 1})))
    later.start()
    assert connection.receive().header == {"t": "reply", "n": 1}
    later.join()


def test_a_receive_never_waits_past_the_connections_deadline(shell_pairs):
    """While a connection has a deadline (a server's handshake), a receive ends there, however long
    its timeout, and a frame that came before it is still received."""
    connection, far = shell_pairs()
    connection.deadline = time.monotonic() + 0.5
    far.sendall(_bytes({"t": "init"}))
    assert connection.receive().header == {"t": "init"}
    watchdog = threading.Timer(10, far.close)  # a receive that waits on ends, and the test fails
    watchdog.start()
    try:
        start = time.monotonic()
        with pytest.raises(TimedOut):
            connection.receive(30.0)
        assert time.monotonic() - start < 5
    finally:
        watchdog.cancel()


def test_small_sends_time_out_once_the_far_end_reads_nothing(shell_pairs):
    """Small frames go in one send each (one buffer): once the far end's buffers are full, a send
    waits the connection's timeout and no longer."""
    connection, far = shell_pairs()
    connection.set_timeout(0.3)
    small = wire.encode_frame({"t": "batch"}, [np.zeros(2000, np.uint8)])
    assert len(small) == 1
    started = time.monotonic()
    with pytest.raises(errors.ConnectionLost, match="connection lost while sending"):
        for _ in range(1_000_000):  # far reads nothing: its buffers fill within a few MB
            connection.send(small)
    assert time.monotonic() - started < 30


def test_a_spin_wait_sees_a_frame_arrive_and_leaves_it_for_the_receive(shell_pairs):
    from ember.wire.tcp import spin_wait
    connection, far = shell_pairs()
    data = _bytes({"t": "reply", "n": 0})
    far.sendall(data[:7])  # part of a frame: with the kernel's timeouts polling reads it, and finds no frame
    time.sleep(0.05)
    assert spin_wait(connection, 0.002) is not connection._kernel  # with Python's, bytes wait: a receive's turn
    far.sendall(data[7:])
    assert spin_wait(connection, 5)
    assert connection.receive().header == {"t": "reply", "n": 0}
    started = time.monotonic()
    assert not spin_wait(connection, 0) and not spin_wait(connection, 0.002)  # nothing came …
    assert time.monotonic() - started < 5  # … and the window ended the polling
    far.sendall(_bytes({"t": "reply", "n": 1}))
    time.sleep(0.05)
    assert not spin_wait(connection, 0)  # a window of 0 (EMBER_SPIN_US=0) never polls
    assert spin_wait(connection, 5)
    assert connection.receive().header == {"t": "reply", "n": 1}  # the frame polling saw, whole
    later = threading.Timer(0.05, lambda: far.sendall(_bytes({"t": "reply", "n": 2})))
    started = time.monotonic()
    later.start()
    assert spin_wait(connection, 30)  # it arrived while polling: no need to wait out the window
    assert time.monotonic() - started < 15
    assert connection.receive().header == {"t": "reply", "n": 2}
    connection.close()  # as a stopping server closes a session's socket under its thread
    assert spin_wait(connection, 5)  # readable, for the receive to report the loss
    with pytest.raises(errors.ConnectionLost):
        connection.receive()
    connection, far = shell_pairs()
    far.sendall(_bytes({"t": "reply", "n": 4}) + b"EMBX" + bytes(12))  # a frame, then a malformed one
    time.sleep(0.05)
    assert spin_wait(connection, 5)
    with pytest.raises(errors.ProtocolError, match="bad frame magic b'EMBX'"):
        connection.receive()  # the receive reports it, as if it had read the bytes itself
    connection, far = shell_pairs()
    far.sendall(_bytes({"t": "error", "reason": "bye"}))
    far.close()  # the peer's last frame, then the end of the stream
    time.sleep(0.05)
    assert spin_wait(connection, 5)
    assert connection.receive().header == {"t": "error", "reason": "bye"}  # what came before the end first
    assert spin_wait(connection, 5)
    with pytest.raises(errors.ConnectionLost, match="the peer closed the connection"):
        connection.receive()


def test_a_look_finds_what_has_come_at_once_and_keeps_finding_it_until_received(shell_pairs):
    """``readable()`` answers at the first look once a frame has come, or frames wait already received
    (two came in one read), or the stream has ended, or malformed bytes came: each keeps it readable
    until a receive takes the frame or raises the loss. A spin wait then costs no extra poll."""
    connection, far = shell_pairs()
    far.sendall(_bytes({"t": "reply", "n": 0}) + _bytes({"t": "reply", "n": 1}))
    time.sleep(0.05)
    assert connection.readable() and connection.readable()
    assert connection.receive().header == {"t": "reply", "n": 0}
    assert connection.readable()  # the second frame came with the first
    assert connection.receive().header == {"t": "reply", "n": 1}
    assert not connection.readable()
    far.sendall(b"EMBX" + bytes(12))
    time.sleep(0.05)
    assert connection.readable() and connection.readable()  # malformed: the receive will say so
    with pytest.raises(errors.ProtocolError, match="bad frame magic b'EMBX'"):
        connection.receive()
    connection, far = shell_pairs()
    far.close()
    time.sleep(0.05)
    assert connection.readable() and connection.readable()  # the end of the stream
    with pytest.raises(errors.ConnectionLost, match="the peer closed"):
        connection.receive()


def test_a_close_ends_a_receive_blocked_in_another_thread_and_closing_again_does_nothing(shell_pairs):
    """A stopping server closes its sessions' connections under their threads: the receive each
    thread is blocked in reports the loss at once; a connection closed twice stays closed quietly."""
    connection, far = shell_pairs()
    lost = []

    def receive():
        try:
            connection.receive()
        except errors.ConnectionLost as error:
            lost.append(error)
    waiting = threading.Thread(target=receive)
    waiting.start()
    time.sleep(0.05)
    started = time.monotonic()
    connection.close()
    waiting.join(5)
    assert not waiting.is_alive() and len(lost) == 1 and time.monotonic() - started < 5  # not its 10 s timeout
    connection.close()
    with pytest.raises(errors.ConnectionLost):
        connection.receive()


def test_the_spin_window_comes_from_the_environment(monkeypatch):
    from ember.wire.tcp import spin_window
    monkeypatch.delenv("EMBER_SPIN_US", raising=False)
    assert spin_window() == pytest.approx(200e-6)
    for text, seconds in (("0", 0.0), ("50", 50e-6), (" ", 200e-6), ("1e6", 1.0)):
        monkeypatch.setenv("EMBER_SPIN_US", text)
        assert spin_window() == pytest.approx(seconds)
    for text in ("soon", "-1", "inf", "nan", "1000001"):
        monkeypatch.setenv("EMBER_SPIN_US", text)
        with pytest.raises(em.ArgumentError, match="EMBER_SPIN_US must be microseconds from 0 to 1000000"):
            spin_window()
