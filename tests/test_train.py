"""The MLP example trains on every device, to the same losses, and the optimizers behave."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ember as em
from ember.spirals import init_params, train, two_spirals

from .conftest import torch_available
from .peers import Peer

EXAMPLE = Path(__file__).parent.parent / "examples" / "train_mlp.py"


def test_the_example_reaches_95_percent():
    result = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "400", "--log-every", "100"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = float(result.stdout.split("accuracy ")[1].split()[0])
    assert accuracy >= 0.95 and "step   300" in result.stdout


def test_short_runs_agree_on_every_device():
    reference = train("numpy", steps=30)["losses"]
    assert reference[-1] < reference[0]
    runs = {"numpy jit": train("numpy", steps=30, use_jit=True)["losses"]}
    if torch_available():
        runs["torch"] = train("torch:cpu", steps=30)["losses"]
    with Peer() as peer:
        runs["remote"] = train(peer.url(), steps=30)["losses"]
        runs["remote ws jit"] = train(peer.url("ws"), steps=30, use_jit=True)["losses"]
    np.testing.assert_allclose(runs.pop("remote"), reference, rtol=0, atol=1e-5)  # the bar: 1e-5 in float64
    for name, losses in runs.items():
        np.testing.assert_allclose(losses, reference, rtol=1e-9, atol=1e-9, err_msg=name)


def test_the_jitted_step_on_jax_matches_numpy():
    """The training step (forward, backward, Adam) compiled by jax.jit: the numpy device's loss curve within 1e-6."""
    pytest.importorskip("jax")
    reference = train("numpy", steps=30, use_jit=True)["losses"]
    run = train("jax:cpu", steps=30, use_jit=True)
    np.testing.assert_allclose(run["losses"], reference, rtol=0, atol=1e-6)
    assert run["params"][0].device == em.device("jax:cpu")


def test_losses_match_a_pytorch_run():
    """The same MLP, data, initial weights and Adam written in plain PyTorch: an independent reference for the losses."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    points, labels = two_spirals(200, seed=0)
    x, y = torch.tensor(points), torch.tensor(labels)
    params = [torch.tensor(p, requires_grad=True) for p in init_params(seed=0, dtype=np.float64)]
    opt = torch.optim.Adam(params, lr=0.01)
    expected = []
    for _ in range(30):
        h = x
        for w, b in zip(params[:-2:2], params[1:-2:2]):
            h = F.gelu(F.linear(h, w, b), approximate="tanh")
        loss = F.cross_entropy(F.linear(h, params[-2], params[-1]), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert expected[-1] < expected[0]
    losses = train("numpy", steps=30, lr=0.01, seed=0, dtype=np.float64, n_per_class=200)["losses"]
    np.testing.assert_allclose(losses, expected, rtol=1e-12, atol=1e-12)


def test_eager_optimizers_update_tracked_parameters():
    device = em.autodiff("numpy")
    w = em.asarray([1.0, -2.0], device=device).requires_grad_()
    for opt in (em.optim.SGD([w], lr=0.1, momentum=0.9), em.optim.Adam([w], lr=0.1)):
        for _ in range(50):
            opt.zero_grad()
            em.sum(w * w).backward()
            opt.step()
        assert float(em.linalg.vector_norm(w)) < 0.5 and w.requires_grad
    with pytest.raises(em.ArgumentError, match="no .grad"):
        w.grad = None
        em.optim.SGD([w]).step()
