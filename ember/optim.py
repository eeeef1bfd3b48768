"""``ember.optim``: SGD with momentum and Adam over lists of arrays, on any device.

Each optimizer has a pure form — ``state = opt.init(params)``, ``params, state =
opt.update(params, grads, state)`` — that works inside ``em.jit`` (the state is arrays, the
step count included), and an eager form, ``opt.step()``, that updates the parameters in place
from their ``.grad`` (or from given gradients) like ``torch.optim``.
"""

from __future__ import annotations

from .array import Array
from .autodiff import no_grad
from .errors import ArgumentError
from .namespace.creation import zeros_like

__all__ = ["SGD", "Adam"]


class Optimizer:
    """The shared eager machinery; subclasses define ``init`` and ``update``."""

    def __init__(self, params=None):
        self.params = list(params) if params is not None else []
        self.state = None

    def init(self, params: list) -> tuple:
        raise NotImplementedError

    def update(self, params: list, grads: list, state) -> tuple[list, tuple]:
        raise NotImplementedError

    def step(self, grads: list | None = None) -> None:
        """Update ``self.params`` in place from ``grads`` (default: each parameter's ``.grad``)."""
        if grads is None:
            grads = [p.grad for p in self.params]
            if any(g is None for g in grads):
                raise ArgumentError("step: a parameter has no .grad; call loss.backward() first, or pass grads")
        if self.state is None:
            self.state = self.init(self.params)
        with no_grad():
            new, self.state = self.update(self.params, grads, self.state)
            for p, value in zip(self.params, new):
                p._rebind(value, "step")

    def zero_grad(self) -> None:
        """Forget the accumulated gradients."""
        for p in self.params:
            if p.requires_grad:
                p.grad = None


def _zeros_like(p: Array) -> Array:
    return zeros_like(p, device=p.device.inner())  # state is plain: never on an autodiff device


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum and weight decay."""

    def __init__(self, params=None, lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(params)
        if lr <= 0 or momentum < 0 or weight_decay < 0:
            raise ArgumentError(f"SGD: lr must be positive, momentum and weight_decay non-negative; "
                                f"got {lr}, {momentum}, {weight_decay}")
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay

    def init(self, params):
        return tuple(_zeros_like(p) for p in params) if self.momentum else ()

    def update(self, params, grads, state):
        grads = [g + self.weight_decay * p if self.weight_decay else g for p, g in zip(params, grads)]
        if not self.momentum:
            return [p - self.lr * g for p, g in zip(params, grads)], state
        velocity = tuple(self.momentum * v + g for v, g in zip(state, grads))
        return [p - self.lr * v for p, v in zip(params, velocity)], velocity


class Adam(Optimizer):
    """Adam (Kingma & Ba), with bias correction."""

    def __init__(self, params=None, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8):
        super().__init__(params)
        if lr <= 0 or not all(0 <= b < 1 for b in betas) or eps <= 0:
            raise ArgumentError(f"Adam: lr and eps must be positive and betas in [0, 1); got {lr}, {betas}, {eps}")
        self.lr, self.betas, self.eps = lr, tuple(betas), eps

    def init(self, params):
        from .namespace.creation import zeros
        device = params[0].device.inner() if params else None
        step = zeros((), dtype=params[0].dtype if params else None, device=device)
        return (step, tuple(_zeros_like(p) for p in params), tuple(_zeros_like(p) for p in params))

    def update(self, params, grads, state):
        from .namespace.elementwise import pow, sqrt
        b1, b2 = self.betas
        step, m, v = state
        step = step + 1
        m = tuple(b1 * mi + (1 - b1) * g for mi, g in zip(m, grads))
        v = tuple(b2 * vi + (1 - b2) * g * g for vi, g in zip(v, grads))
        c1 = 1 - pow(b1, step)
        c2 = 1 - pow(b2, step)
        new = [p - self.lr * (mi / c1) / (sqrt(vi / c2) + self.eps) for p, mi, vi in zip(params, m, v)]
        return new, (step, m, v)
