"""The frames a real client sends a real peer, recorded, and ways to mutate them (for the fuzz
tests and tools/fuzz.py)."""

from __future__ import annotations

import gc

import numpy as np

import ember as em
from ember.wire import protocol as wire
from ember.wire.protocol import FrameReader


def register_message(gid: int, graph, ops=None, outputs=None) -> tuple:
    """The message registering ``graph`` as graph ``gid``, as the client builds it (its constants
    as segments 0…); ``ops`` and ``outputs`` replace the graph's own, to craft bad ones."""
    return ("graph", gid, tuple((i, m.dtype, m.shape) for _, i, m in graph.inputs),
            tuple(i for _, i in graph.outputs) if outputs is None else outputs,
            tuple(op[:4] for op in graph.ops) if ops is None else ops, tuple((i, k) for k, i in enumerate(graph.constants)))


def record_traffic() -> list[bytes]:
    """The bytes of every frame a client sent an in-process peer on 127.0.0.1 after its handshake,
    for a small job: uploads, elementwise and linear-algebra ops, reads, a jitted function
    registered and run twice, and dropped arrays."""
    server = em.Server("numpy", "127.0.0.1:0").start()
    sent: list[bytes] = []
    try:
        device = em.device(f"ember://{server.address}/0")
        connection = device.engine.connection
        original = connection.send

        def recording(buffers):
            sent.append(b"".join(bytes(b) for b in buffers))
            return original(buffers)
        connection.send = recording
        rng = np.random.default_rng(0)
        x = em.asarray(rng.standard_normal((8, 8)), device=device)
        y = em.matmul(x, x.mT) + 1.0
        em.asnumpy(em.sum(y, axis=0))
        step = em.jit(lambda a, b: em.tanh(a @ b) * 0.5 - b)
        for _ in range(2):
            em.asnumpy(step(x, em.ones((8, 8), device=device)))
        z = em.where(y > 2.0, y, -y)
        del x, y
        gc.collect()
        em.asnumpy(em.concat([z, z], axis=0)[3:, ::2])
        em.sync(device)
        connection.send = original
        device.engine.close() if hasattr(device.engine, "close") else None
    finally:
        server.stop()
    return sent


ODD_VALUES = [None, True, -1, 0, 2**63 - 1, -2**63, 1.5, float("nan"), "", "op", "float64", b"\x00", (), (1,), ((),),
              {}, {"axis": 0}, (1.0, "float64"), (1.0, "no_such_dtype"), tuple(range(70)), em.float64, 1j]


def _leaves(value, path=()):
    """Paths to every leaf and container of a decoded header, for replacing one."""
    yield path
    if isinstance(value, tuple):
        for k, item in enumerate(value):
            yield from _leaves(item, path + (k,))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, path + (key,))


def _replaced(value, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, tuple):
        return value[:head] + (_replaced(value[head], rest, new),) + value[head + 1:]
    return {**value, head: _replaced(value[head], rest, new)}


def mutate_message(data: bytes, where: int, odd: int) -> bytes:
    """``data``'s frame with one value anywhere in its header replaced by an odd one, re-encoded."""
    (frame,) = FrameReader().feed(data)
    header = {k: v for k, v in frame.header.items() if k != "seg"}
    paths = list(_leaves(header))[1:]  # not the header itself: a frame's header is a map by construction here
    header = _replaced(header, paths[where % len(paths)], ODD_VALUES[odd % len(ODD_VALUES)])
    return b"".join(bytes(b) for b in wire.encode_frame(header, frame.segments))


def mutate(data: bytes, mutations) -> bytes:
    """``data`` with each mutation applied at its position (modulo the length)."""
    for kind, position, value in mutations:  # message-level ones first, while the frame still decodes
        if kind == "message":
            data = mutate_message(data, position, value)
    data = bytearray(data)
    for kind, position, value in mutations:
        at = position % max(len(data), 1)
        if kind == "flip" and data:
            data[at] ^= value
        elif kind == "truncate":
            del data[at:]
        elif kind == "repeat":
            data[at:at] = data[at:at + value]
        elif kind == "insert":
            data[at:at] = bytes([value])
    return bytes(data)
