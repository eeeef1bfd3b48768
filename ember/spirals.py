"""A small, complete training job: an MLP learning two interleaved spirals (generated in code,
no downloads), with autodiff and Adam, on any device, eagerly or with ``em.jit`` — or data
parallel over several compute peers (:func:`train_data_parallel`).

Used by ``examples/train_mlp.py``, ``examples/data_parallel.py``, ``ember demo`` and ``ember bench train``.
"""

from __future__ import annotations

import time

import numpy as np

from . import dtypes as dt
from .array import Array
from .autodiff import value_and_grad
from .devices import device as as_device
from .distributed import all_reduce, broadcast
from .graphs import jit as make_jit
from .interop import asnumpy
from .namespace import nn
from .namespace.creation import asarray
from .namespace.manipulation import concat, reshape
from .namespace.searching import argmax
from .namespace.statistical import mean
from .optim import Adam


def two_spirals(n_per_class: int = 200, noise: float = 0.15, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Points (2·n, 2) of two interleaved spirals and their class labels (2·n,)."""
    rng = np.random.default_rng(seed)
    t = np.sqrt(rng.random(n_per_class)) * 3 * np.pi
    arm = np.stack([t * np.cos(t), t * np.sin(t)], axis=1) / (3 * np.pi)
    points = np.concatenate([arm, -arm]) + rng.normal(scale=noise / (3 * np.pi) * 3, size=(2 * n_per_class, 2))
    labels = np.concatenate([np.zeros(n_per_class, np.int64), np.ones(n_per_class, np.int64)])
    return points, labels


def init_params(sizes=(2, 64, 64, 2), seed: int = 0, dtype=np.float64) -> list[np.ndarray]:
    """He-initialised weights (out, in) and zero biases, as host arrays."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append((rng.standard_normal((fan_out, fan_in)) * np.sqrt(2 / fan_in)).astype(dtype))
        params.append(np.zeros(fan_out, dtype))
    return params


def logits(params: list, x: Array) -> Array:
    """The MLP: linear → GELU → linear → GELU → linear."""
    h = x
    for i in range(0, len(params) - 2, 2):
        h = nn.gelu(nn.linear(h, params[i], params[i + 1]), approximate="tanh")
    return nn.linear(h, params[-2], params[-1])


def loss_fn(params: list, x: Array, y: Array) -> Array:
    return nn.cross_entropy(logits(params, x), y)


def make_step(optimizer: Adam, use_jit: bool):
    """One training step, as a pure function of (params, state, x, y)."""
    def step(params, state, x, y):
        loss, grads = value_and_grad(loss_fn)(params, x, y)
        params, state = optimizer.update(params, grads, state)
        return loss, params, state
    return make_jit(step) if use_jit else step


def accuracy(params: list, x: Array, y: Array) -> float:
    return float(mean(asarray(argmax(logits(params, x), axis=-1) == y, dtype=dt.float64)))


class Training:
    """The spirals MLP on ``device`` from a fixed seed, ready to train: :meth:`step` takes one Adam
    step (through ``em.jit`` with ``use_jit``) and returns its loss as a float, a read (one round
    trip on a peer). ``params``, ``state``, ``x`` and ``y`` are the arrays it trains with."""

    def __init__(self, device="numpy", use_jit: bool = False, lr: float = 0.01, seed: int = 0,
                 dtype=np.float64, n_per_class: int = 200):
        self.device = as_device(device)
        points, labels = two_spirals(n_per_class, seed=seed)
        self.x, self.y = asarray(points.astype(dtype), device=self.device), asarray(labels, device=self.device)
        self.params = [asarray(p, device=self.device) for p in init_params(seed=seed, dtype=dtype)]
        optimizer = Adam(lr=lr)
        self.state = optimizer.init(self.params)
        self._step = make_step(optimizer, use_jit)

    def step(self) -> float:
        """One training step; its loss."""
        loss, self.params, self.state = self._step(self.params, self.state, self.x, self.y)
        return float(loss)


def train(device="numpy", steps: int = 600, use_jit: bool = False, lr: float = 0.01, seed: int = 0,
          dtype=np.float64, n_per_class: int = 200, on_step=None) -> dict:
    """Train from a fixed seed; returns the loss of every step, the final accuracy and timings.

    ``on_step(i, loss)`` is called after each step (a progress bar, a log line)."""
    training = Training(device, use_jit, lr, seed, dtype, n_per_class)
    losses = []
    start = time.perf_counter()
    for i in range(steps):
        losses.append(training.step())
        if on_step is not None:
            on_step(i, losses[-1])
    seconds = time.perf_counter() - start
    return {"losses": losses, "accuracy": accuracy(training.params, training.x, training.y), "seconds": seconds,
            "seconds_per_step": seconds / max(steps, 1), "params": training.params, "device": training.device}


def shard_loss(params: list, x: Array, y: Array, weight: float) -> Array:
    """A shard's share of the whole batch's mean loss: its mean loss times its share of the rows."""
    return loss_fn(params, x, y) * weight


def train_data_parallel(devices, steps: int = 600, lr: float = 0.01, seed: int = 0, dtype=np.float64,
                        n_per_class: int = 200, on_step=None) -> dict:
    """:func:`train`, with the batch split across ``devices`` (compute peers) and the gradients
    all-reduced peer to peer; the same losses as :func:`train` on the whole batch, up to rounding.

    Each peer holds a replica of the parameters (uploaded to the first, broadcast to the others)
    and its rows of the batch (``np.array_split`` order). A step: each replica computes the
    gradient of its shard's loss weighted by the shard's share of the rows, so the shards' losses
    and gradients *sum* to the whole batch's mean; the loss and the gradients, flattened into one
    buffer per peer (one collective per step, like DDP's buckets), are all-reduced with
    ``op="sum"``; every replica then takes the same Adam step on the same bits, so the replicas stay
    identical. The loss is read from the first peer: one round trip per step, and no tensor byte
    through the client but the shards and the initial parameters. Returns the loss of every step
    and the replicas' parameters (a list per device)."""
    devices = [as_device(d) for d in devices]
    points, labels = two_spirals(n_per_class, seed=seed)
    rows = np.array_split(np.arange(len(labels)), len(devices))
    weights = [len(r) / len(labels) for r in rows]
    xs = [asarray(points[r].astype(dtype), device=d) for r, d in zip(rows, devices)]
    ys = [asarray(labels[r], device=d) for r, d in zip(rows, devices)]
    first = [asarray(p, device=devices[0]) for p in init_params(seed=seed, dtype=dtype)]
    copies = [broadcast(p, devices) for p in first]
    replicas = [[copy[k] for copy in copies] for k in range(len(devices))]
    shapes = [p.shape for p in first]
    bounds = np.cumsum([1] + [p.size for p in first]).tolist()  # the loss first, then each gradient
    optimizer = Adam(lr=lr)
    states = [optimizer.init(params) for params in replicas]
    shard_grad = value_and_grad(shard_loss)
    losses = []
    start = time.perf_counter()
    for i in range(steps):
        buffers = []
        for params, x, y, weight in zip(replicas, xs, ys, weights):
            loss, grads = shard_grad(params, x, y, weight)
            buffers.append(concat([reshape(loss, (1,))] + [reshape(g, (g.size,)) for g in grads], axis=0))
        totals = all_reduce(buffers, op="sum")
        for k, total in enumerate(totals):
            grads = [reshape(total[lo:hi], shape) for lo, hi, shape in zip(bounds[:-1], bounds[1:], shapes)]
            replicas[k], states[k] = optimizer.update(replicas[k], grads, states[k])
        losses.append(float(totals[0][0]))
        if on_step is not None:
            on_step(i, losses[-1])
    seconds = time.perf_counter() - start
    return {"losses": losses, "params": replicas, "devices": devices, "seconds": seconds,
            "seconds_per_step": seconds / max(steps, 1)}


__all__ = ["two_spirals", "init_params", "logits", "loss_fn", "make_step", "accuracy", "Training", "train", "asnumpy",
           "shard_loss", "train_data_parallel"]
