"""The core benchmark: ember on its local numpy device against raw NumPy and array-api-strict.

(a) a chain of 1000 elementwise ops on a 1,000-element float32 array, then one read — per-op
    overhead (target: no slower than array-api-strict, a thin NumPy wrapper);
(b) 100 elementwise ops on 1,000,000 elements (target: within 1.10× raw NumPy);
(c) 512×512 float32 matmul ×10 (target: within 1.10× raw NumPy);
(d) the chains of (a) and (b) under ``em.jit``, replayed from a compiled plan, against the same
    raw NumPy eager run (targets: 0.80× on 1,000 elements, 0.50× on 1,000,000);
(e) the chain of (b) under ``em.jit`` on ``jax:cpu``, compiled by XLA into one fused loop, against
    the same raw NumPy eager run (target: 0.30×), where JAX is installed.
"""

from __future__ import annotations

import importlib.util

import numpy as np

import ember as em

from .timing import Report, Row, medians


def chain(xp, x, n_ops: int):
    """``n_ops`` elementwise ops written once for any Array API namespace."""
    for _ in range(n_ops // 4):
        x = x * 1.0001
        x = x + 0.5
        x = xp.sin(x)
        x = x - 0.25
    return x


def matmuls(xp, a, times: int):
    out = a
    for _ in range(times):
        out = xp.matmul(a, a)
    return out


def run(quick: bool = False) -> Report:
    """Measure (a), (b) and (c); ``quick`` uses fewer repeats (for smoke tests)."""
    report = Report("core")
    repeats = 5 if quick else 21
    small = np.random.default_rng(0).random(1000, dtype=np.float32)
    x = em.asarray(small)
    jitted = em.jit(lambda x: chain(em, x, 1000))
    candidates = {
        "ember": lambda: em.asnumpy(chain(em, x, 1000)),
        "jit": lambda: em.asnumpy(jitted(x)),
        "numpy": lambda: np.asarray(chain(np, small, 1000)),
    }
    try:
        import array_api_strict as strict
        xs = strict.asarray(small)
        candidates["array-api-strict"] = lambda: chain(strict, xs, 1000)._array
    except ImportError:
        report.notes.append("array-api-strict is not installed: pip install 'ember[bench]'")
    t = medians(candidates, repeats)
    report.add(Row("(a) 1000-op chain, 1e3 float32 + read", t["ember"], "numpy", t["numpy"], "≤ 2.00x", stolen=t.stolen))
    if "array-api-strict" in t:
        report.add(Row("(a) 1000-op chain, 1e3 float32 + read", t["ember"], "strict", t["array-api-strict"], "≤ 1.00x",
                       stolen=t.stolen))
    report.add(Row("(d) jit 1000-op chain, 1e3 float32 + read", t["jit"], "numpy", t["numpy"], "≤ 0.80x", stolen=t.stolen))
    report.notes.append(f"(a) per op: ember {t['ember'] * 1e3:.2f} µs, numpy {t['numpy'] * 1e3:.2f} µs"
                        + (f", array-api-strict {t['array-api-strict'] * 1e3:.2f} µs" if "array-api-strict" in t else ""))

    big = np.random.default_rng(1).random(1_000_000, dtype=np.float32)
    xb = em.asarray(big)
    jitted_big = em.jit(lambda x: chain(em, x, 100))
    t = medians({"ember": lambda: em.asnumpy(chain(em, xb, 100)), "numpy": lambda: np.asarray(chain(np, big, 100)),
                 "jit": lambda: em.asnumpy(jitted_big(xb))}, max(3, repeats // 3))
    report.add(Row("(b) 100 ops on 1e6 float32 + read", t["ember"], "numpy", t["numpy"], "≤ 1.10x", stolen=t.stolen))
    report.add(Row("(d) jit 100 ops on 1e6 float32 + read", t["jit"], "numpy", t["numpy"], "≤ 0.50x", stolen=t.stolen))
    if importlib.util.find_spec("jax") is not None:
        xj = em.asarray(big, device="jax:cpu")
        jitted_jax = em.jit(lambda x: chain(em, x, 100))
        t = medians({"jax": lambda: em.asnumpy(jitted_jax(xj)), "numpy": lambda: np.asarray(chain(np, big, 100))},
                    max(3, repeats // 3))
        report.add(Row("(e) jit 100 ops on 1e6 float32, jax:cpu + read", t["jax"], "numpy", t["numpy"], "≤ 0.30x",
                       stolen=t.stolen))
    else:
        report.notes.append("jax is not installed: pip install 'ember[jax]' for row (e)")

    m = np.random.default_rng(2).random((512, 512), dtype=np.float32)
    xm = em.asarray(m)
    t = medians({"ember": lambda: em.asnumpy(matmuls(em, xm, 10)), "numpy": lambda: np.asarray(matmuls(np, m, 10))},
                max(3, repeats // 2))
    report.add(Row("(c) 512x512 float32 matmul x10 + read", t["ember"], "numpy", t["numpy"], "≤ 1.10x", stolen=t.stolen))
    return report
