"""The training benchmark: per-step time of the spirals MLP (ember/spirals.py), float64, full
batch — eager and jit local, eager remote and jit remote on a loopback peer, and jit on jax:cpu (the whole
step compiled by XLA) where JAX is installed, against PyTorch eager (autograd + torch.optim.Adam) on
the same CPU for the same model."""

from __future__ import annotations

import importlib.util
import time

import numpy as np

from ember.optim import Adam
from ember.remote.spawn import PeerProcess
from ember.spirals import init_params, make_step, train, two_spirals

from .timing import Report, Row


def _torch_seconds_per_step(steps: int) -> float | None:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    points, labels = two_spirals()
    x, y = torch.from_numpy(points), torch.from_numpy(labels)
    params = [torch.from_numpy(p.copy()).requires_grad_() for p in init_params()]
    optimizer = torch.optim.Adam(params, lr=0.01)

    def step():
        optimizer.zero_grad()
        h = x
        for i in range(0, len(params) - 2, 2):
            h = F.gelu(F.linear(h, params[i], params[i + 1]), approximate="tanh")
        loss = F.cross_entropy(F.linear(h, params[-2], params[-1]), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    for _ in range(5):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def _jax_seconds_per_step(steps: int) -> float:
    """The spirals step under em.jit on jax:cpu, timed after its first calls (capture, XLA compile),
    as PyTorch's is after its warm-up: the steady state of a training loop."""
    import ember as em
    points, labels = two_spirals()
    x, y = em.asarray(points, device="jax:cpu"), em.asarray(labels, device="jax:cpu")
    params = [em.asarray(p, device="jax:cpu") for p in init_params()]
    optimizer = Adam(lr=0.01)
    state = optimizer.init(params)
    step = make_step(optimizer, use_jit=True)
    for _ in range(5):
        loss, params, state = step(params, state, x, y)
        float(loss)
    start = time.perf_counter()
    for _ in range(steps):
        loss, params, state = step(params, state, x, y)
        float(loss)  # each step reads its loss, as the other rows do
    return (time.perf_counter() - start) / steps


def run(quick: bool = False) -> Report:
    report = Report("train")
    steps = 20 if quick else 100
    torch_step = _torch_seconds_per_step(steps)
    local = np.median([train("numpy", steps=steps)["seconds_per_step"] for _ in range(3)])
    local_jit = np.median([train("numpy", steps=steps, use_jit=True)["seconds_per_step"] for _ in range(3)])
    with PeerProcess() as peer:
        train(peer.url(), steps=3, use_jit=True)  # warm the peer
        remote = np.median([train(peer.url(), steps=steps)["seconds_per_step"] for _ in range(3)])
        remote_jit = np.median([train(peer.url(), steps=steps, use_jit=True)["seconds_per_step"] for _ in range(3)])
    jax_jit = _jax_seconds_per_step(steps) if importlib.util.find_spec("jax") is not None else None
    if torch_step is not None:
        report.add(Row("MLP step, eager local (numpy) vs PyTorch eager", local, "torch", torch_step))
        report.add(Row("MLP step, jit local (numpy) vs PyTorch eager", local_jit, "torch", torch_step, "≤ 1.00x"))
        report.add(Row("MLP step, eager remote vs PyTorch eager", remote, "torch", torch_step))
        report.add(Row("MLP step, jit remote vs PyTorch eager", remote_jit, "torch", torch_step))
        if jax_jit is not None:
            report.add(Row("MLP step, jit jax:cpu vs PyTorch eager", jax_jit, "torch", torch_step, "≤ 0.50x"))
    report.add(Row("MLP step, eager remote vs eager local", remote, "local", local))
    report.add(Row("MLP step, jit remote vs eager remote", remote_jit, "eager remote", remote))
    report.notes.append("each step reads its loss (one round trip on a peer); 2-64-64-2 GELU MLP, 400 points, float64")
    return report
