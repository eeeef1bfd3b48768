"""The delay line (benchmarks/delayline.py) and ``ember bench wan`` at a small delay: bytes pass
intact and in order, and each workload costs the round trips it should (counts, never times)."""

import socket
import threading

import numpy as np
import pytest
from ember.benchmarks import wan
from ember.benchmarks.delayline import DelayLine


def _echo_server():
    """A loopback echo server for one connection, in a thread; returns its address and thread."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve():
        conn, _ = listener.accept()
        with conn, listener:
            while data := conn.recv(1 << 16):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)  # the client's EOF came through: answer with ours

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", thread


def test_a_delay_line_carries_a_stream_intact_in_order_and_half_closes():
    payload = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    target, server = _echo_server()
    with DelayLine(0.002, bandwidth=200e6) as line:
        host, _, port = line.route(target).rpartition(":")
        with socket.create_connection((host, int(port))) as sock:
            sender = threading.Thread(target=lambda: (sock.sendall(payload), sock.shutdown(socket.SHUT_WR)))
            sender.start()
            received = bytearray()
            while chunk := sock.recv(1 << 16):  # ends when the server's EOF has come back through the line
                received += chunk
            sender.join(10)
    server.join(10)
    assert bytes(received) == payload


def test_a_delay_line_forwards_to_loopback_only():
    with DelayLine(0.001) as line:
        with pytest.raises(ValueError, match="loopback only"):
            line.route("192.0.2.1:80")
    with pytest.raises(ValueError, match="delay ≥ 0"):
        DelayLine(-1.0)


def test_the_wan_suite_counts_one_round_trip_per_workload():
    delay = 0.002
    report = wan.run(quick=True, delay=delay)
    rows = {row.name: row for row in report.rows}
    assert list(rows) == ["(a) 1000-op chain + read", "(b) one small op + read", "(c) jitted MLP training step + loss read",
                          "(d) 8 MiB upload, beyond the link's time", "(d) 8 MiB upload, throughput",
                          "(e) RPC per op: 1000-op chain, extrapolated"]
    for name in ("(a) 1000-op chain + read", "(b) one small op + read", "(c) jitted MLP training step + loss read",
                 "(d) 8 MiB upload, beyond the link's time"):
        assert rows[name].round_trips == 1, name
        assert rows[name].baseline_name == "RTT" and rows[name].baseline >= 2 * delay  # the line never delivers early
        assert rows[name].target.startswith("≤")
    assert rows["(e) RPC per op: 1000-op chain, extrapolated"].round_trips == 1000  # one per op
    assert rows["(d) 8 MiB upload, throughput"].unit == "B/s"
    assert any("measured RTT" in note for note in report.notes)
    assert report.as_dict()["rows"][0]["round_trips"] == 1
