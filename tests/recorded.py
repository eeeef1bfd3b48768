"""Recording the frames a real client sends a real peer (for the fuzz tests and tools/fuzz.py)."""

from __future__ import annotations

import gc

import numpy as np

import ember as em


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
