"""The training benchmark: per-step time of the spirals MLP (ember/spirals.py), float64, full
batch — eager and jit local, eager remote and jit remote on a loopback peer, and jit on jax:cpu (the whole
step compiled by XLA) where JAX is installed, against PyTorch eager (autograd + torch.optim.Adam) on
the same CPU for the same model."""

from __future__ import annotations

import importlib.util

import numpy as np

from ember.remote.spawn import PeerProcess
from ember.spirals import Training, init_params, train, two_spirals

from .timing import Report, Row, Timings, cpu_ticks, medians, stolen_share


def _torch_step():
    """PyTorch eager's spirals step (autograd + torch.optim.Adam, its loss read), as a function of no
    arguments that trains on; None where PyTorch is not installed."""
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
    return step


def _in_turn(candidates: dict, steps: int, rounds: int = 3) -> dict:
    """Seconds per step of each candidate: blocks of ``steps`` steps taken in turn, ``rounds`` times, the
    median block of each, after five steps each (a jitted step's capture and compile). Blocks, not single
    steps in turn: the step after PyTorch's pays for its intra-op threads, which keep a vCPU busy a while."""
    for step in candidates.values():
        for _ in range(5):
            step()
    blocks = {name: (lambda step=step: [step() for _ in range(steps)]) for name, step in candidates.items()}
    timed = medians(blocks, rounds, warmup=0)
    per_step = Timings((name, seconds / steps) for name, seconds in timed.items())
    per_step.stolen = timed.stolen
    return per_step


def run(quick: bool = False) -> Report:
    report = Report("train")
    steps = 20 if quick else 100
    # PyTorch's steps and ember's local ones in turn, a block each, so the VM's changing speed falls on both
    candidates = {"local": Training("numpy").step, "local_jit": Training("numpy", use_jit=True).step}
    if importlib.util.find_spec("jax") is not None:
        candidates["jax_jit"] = Training("jax:cpu", use_jit=True).step
    torch = _torch_step()
    if torch is not None:
        candidates["torch"] = torch
    t = _in_turn(candidates, steps)
    local, local_jit, jax_jit, torch_step = t["local"], t["local_jit"], t.get("jax_jit"), t.get("torch")
    with PeerProcess() as peer:
        train(peer.url(), steps=3, use_jit=True)  # warm the peer
        before = cpu_ticks()
        remote = np.median([train(peer.url(), steps=steps)["seconds_per_step"] for _ in range(3)])
        remote_jit = np.median([train(peer.url(), steps=steps, use_jit=True)["seconds_per_step"] for _ in range(3)])
        stolen = stolen_share(before, cpu_ticks())  # the remote rows' minutes; the local rows carry t's
    if torch_step is not None:
        report.add(Row("MLP step, eager local (numpy) vs PyTorch eager", local, "torch", torch_step, stolen=t.stolen))
        report.add(Row("MLP step, jit local (numpy) vs PyTorch eager", local_jit, "torch", torch_step, "≤ 1.00x",
                       stolen=t.stolen))
        report.add(Row("MLP step, eager remote vs PyTorch eager", remote, "torch", torch_step, stolen=stolen))
        report.add(Row("MLP step, jit remote vs PyTorch eager", remote_jit, "torch", torch_step, stolen=stolen))
        if jax_jit is not None:
            report.add(Row("MLP step, jit jax:cpu vs PyTorch eager", jax_jit, "torch", torch_step, "≤ 0.50x", stolen=t.stolen))
    report.add(Row("MLP step, eager remote vs eager local", remote, "local", local, stolen=stolen))
    report.add(Row("MLP step, jit remote vs eager remote", remote_jit, "eager remote", remote, stolen=stolen))
    report.notes.append("each step reads its loss (one round trip on a peer); 2-64-64-2 GELU MLP, 400 points, float64; "
                        f"local rows: the median of three blocks of {steps} steps, taken in turn with PyTorch's")
    return report
