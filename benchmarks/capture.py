"""The capture benchmark.

(a) a 200-op step on small tensors called 100 times on a loopback compute peer: eager remote vs
    ``em.jit`` remote, where the graph is registered once and each call sends a reference and
    tensor ids (target: jit ≥ 3× faster per call);
(b) the cost of recording: capturing a 1000-op chain vs executing it on the local numpy device.
"""

from __future__ import annotations

import numpy as np

import ember as em
from ember.remote.spawn import PeerProcess

from .core import chain
from .timing import Report, Row, medians


def step(x, w):
    """200 ops: 40 rounds of a small affine map with a nonlinearity and a reduction."""
    for _ in range(40):
        x = em.tanh(x @ w + 0.1)          # matmul, add, tanh
        x = x - em.mean(x, axis=-1, keepdims=True) * 0.5   # mean, multiply, subtract
    return x


def run(quick: bool = False) -> Report:
    report = Report("capture")
    calls = 20 if quick else 100
    rng = np.random.default_rng(0)
    x_host, w_host = rng.standard_normal((8, 16)), rng.standard_normal((16, 16)) / 4
    jitted = em.jit(step)
    with PeerProcess() as peer:
        device = em.device(peer.url())
        x, w = em.asarray(x_host, device=device), em.asarray(w_host, device=device)
        np.testing.assert_allclose(em.asnumpy(jitted(x, w)), em.asnumpy(step(x, w)), rtol=1e-12)

        def eager_calls():
            for _ in range(calls):
                out = step(x, w)
            em.asnumpy(out)

        def jit_calls():
            for _ in range(calls):
                out = jitted(x, w)
            em.asnumpy(out)

        t = medians({"eager": eager_calls, "jit": jit_calls}, 3 if quick else 7)
        report.add(Row("(a) 200-op step, per call, jit vs eager (remote)", t["jit"] / calls, "eager", t["eager"] / calls,
                       "≤ 0.33x", stolen=t.stolen))
        report.notes.append(f"(a) jit is {t['eager'] / t['jit']:.1f}x faster per call (target ≥ 3x); "
                            f"{em.stats(device)['graphs_registered']} graph registration(s)")

    host = rng.random(1000, dtype=np.float32)
    local = em.asarray(host)

    def record():
        with em.capture() as cap:
            cap.output(chain(em, cap.input((1000,), em.float32, name="x"), 1000), name="y")
        return cap.graph

    t = medians({"record": record, "execute": lambda: em.asnumpy(chain(em, local, 1000))}, 5 if quick else 15)
    report.add(Row("(b) 1000-op chain: capture vs local execute", t["record"], "execute", t["execute"], stolen=t.stolen))
    return report
