"""Verified replay: run one graph on several devices, keep every intermediate, and name the first op
whose outputs disagree beyond the dtype's tolerance (``CapturedGraph.verify``, ``ember graph verify``).

Each device replays a copy of the graph whose outputs are all of its ops' outputs, so what is compared
is what each device computed op by op from the same inputs — a compute peer included. The first
device is the reference; ops are compared in graph order, so the op reported is where a difference
starts, not where it has spread to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import dtypes as dt
from ..devices import device as as_device
from ..errors import ArgumentError
from ..interop import asnumpy
from ..namespace.creation import asarray
from ..ops.records import LITERAL_METAS
from ..ops.table import fmt_shape

# (rtol, atol) by dtype: the tolerances of the op table's cross-backend tests (tests/test_op_table.py); atol scales
# with the reference's magnitude; integers and bools must be equal
TOLERANCES = {dt.float32: (2e-4, 1e-5), dt.complex64: (2e-4, 1e-5), dt.float64: (1e-9, 1e-11), dt.complex128: (1e-9, 1e-11)}


@dataclass
class Divergence:
    """The first op whose output differs between the reference device and another."""

    index: int
    op: str
    output: int
    inputs: list  # [(shape, dtype name)] of the op's inputs
    max_abs: float
    max_rel: float
    reference: str
    device: str

    def __str__(self) -> str:
        shown = ", ".join(f"{fmt_shape(s)} {d}" for s, d in self.inputs) or "no inputs"
        return (f"op {self.index} ({self.op}, output {self.output}) diverges: {self.device} vs {self.reference}: "
                f"max abs error {self.max_abs:.3g}, max rel error {self.max_rel:.3g}; inputs {shown}")


@dataclass
class VerifyReport:
    devices: list
    ops: int
    divergence: Divergence | None
    max_errors: dict = field(default_factory=dict)  # dtype name -> (max abs, max rel) over every compared output

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def __str__(self) -> str:
        head = f"verified {self.ops} ops on {', '.join(self.devices)} (reference {self.devices[0]})"
        errors = "; ".join(f"{d}: max abs {a:.3g}, max rel {r:.3g}" for d, (a, r) in sorted(self.max_errors.items()))
        if self.divergence is None:
            return f"{head}: every intermediate agrees within its dtype's tolerance" + (f" ({errors})" if errors else "")
        return f"{head}: {self.divergence}"


def sample_inputs(graph, seed: int = 0) -> list:
    """Inputs to verify with when none are given: floats from a standard normal, integers in [0, 3), bools
    at random (small integers stay valid as indices of most graphs)."""
    rng = np.random.default_rng(seed)
    values = []
    for _, _, meta in graph.inputs:
        native = dt.NUMPY[meta.dtype]
        if meta.dtype.kind == dt.BOOL:
            values.append(rng.random(meta.shape) < 0.5)
        elif meta.dtype.kind in (dt.SIGNED, dt.UNSIGNED):
            values.append(rng.integers(0, 3, meta.shape).astype(native))
        elif meta.dtype.kind == dt.COMPLEX:
            values.append((rng.standard_normal(meta.shape) + 1j * rng.standard_normal(meta.shape)).astype(native))
        else:
            values.append(rng.standard_normal(meta.shape).astype(native))
    return values


def _every_intermediate(graph):
    outputs = [(f"op{k}.{j}", node) for k, op in enumerate(graph.ops) for j, node in enumerate(op.outputs)]
    return type(graph)(graph.inputs, outputs, graph.ops, graph.constants, graph.metas)  # a CapturedGraph


def _errors(actual: np.ndarray, expected: np.ndarray) -> tuple[float, float, bool]:
    """(max abs error, max rel error, within tolerance); NaNs in the same places agree."""
    if actual.size == 0:
        return 0.0, 0.0, True
    if expected.dtype.kind in "biu":
        gap = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
        size = np.abs(expected.astype(np.float64))
        rtol = atol = 0.0
    else:
        same = (actual == expected) | (np.isnan(actual) & np.isnan(expected))
        gap = np.abs(np.where(same, 0, actual) - np.where(same, 0, expected)).astype(np.float64)  # no inf - inf
        size = np.abs(expected).astype(np.float64)
        size = np.where(np.isnan(size), 0.0, size)  # a NaN's tolerance is none (rtol · NaN would refuse even a NaN it meets)
        rtol, atol = TOLERANCES[dt.FROM_NUMPY[expected.dtype]]
        finite = size[np.isfinite(size)]
        atol *= max(1.0, float(finite.max(initial=0)))
    gap = np.where(np.isnan(gap), np.inf, gap)
    rel = np.where(size > 0, gap / np.where(size > 0, size, 1), np.where(gap > 0, np.inf, 0))
    return float(gap.max()), float(rel.max()), bool(np.all(gap <= atol + rtol * size))


def verify(graph, devices, inputs=None) -> VerifyReport:
    """Replay ``graph`` on each of ``devices`` (the first is the reference) from the same ``inputs`` (host
    arrays by position or name; by default :func:`sample_inputs`) and compare every op's outputs."""
    devices = [as_device(d) for d in devices]
    if len(devices) < 2:
        raise ArgumentError(f"verify: give at least two devices to compare, got {[str(d) for d in devices]}")
    if inputs is None:
        inputs = sample_inputs(graph)
    elif isinstance(inputs, dict):
        inputs = [inputs[name] for name, _, _ in graph.inputs]
    inputs = [np.asarray(v) for v in inputs]  # host arrays, or ember arrays of any device (read once)
    full = _every_intermediate(graph)
    results = []
    for device in devices:
        outs = full(*[asarray(v, device=device) for v in inputs], device=device)  # () for a graph without ops
        outs = outs if isinstance(outs, tuple) else (outs,)
        results.append([asnumpy(o) for o in outs])
    reference, first, max_errors = results[0], None, {}
    position = 0
    for k, op in enumerate(graph.ops):
        determined = op.row.determined
        for j in range(len(op.outputs)):
            expected = reference[position]
            position += 1
            if determined is not None and j not in determined:
                continue  # e.g. eigenvector signs: any is right
            for device, values in zip(devices[1:], results[1:]):
                max_abs, max_rel, within = _errors(values[position - 1], expected)
                worst = max_errors.get(expected.dtype.name, (0.0, 0.0))
                max_errors[expected.dtype.name] = (max(worst[0], max_abs), max(worst[1], max_rel))
                if not within and first is None:
                    metas = [graph.metas[i] if type(i) is int else LITERAL_METAS[i[1]] for i in op.inputs]
                    first = Divergence(k, op.name, j, [(m.shape, m.dtype.name) for m in metas], max_abs, max_rel,
                                       str(devices[0]), str(device))
    return VerifyReport([str(d) for d in devices], len(graph.ops), first, max_errors)
