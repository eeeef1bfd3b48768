"""Check ember's CUDA paths on a machine with an NVIDIA GPU, in one run of under 8 minutes.

    python tools/cuda_check.py                  # on the GPU machine: every step below
    python tools/cuda_check.py --dry-run        # anywhere: torch:cuda runs as torch:cpu, jax:gpu as jax:cpu
    python tools/cuda_check.py --steps torch,peer --mib 16    # some steps, smaller transfers

Each step is timed under its own budget (together 450 s, so a hung GPU or peer cannot take the run past
8 minutes); a failing step prints its exception and the next one runs:

  torch     torch:cuda locally: elementwise ops, a matmul, reductions and indexing against NumPy on the
            same float32 data, em.grad against the gradient worked out in NumPy, em.jit, and a 256 MiB
            float32 array uploaded and downloaded (GB/s)
  peer      the same through a peer started as ``ember serve --device torch:cuda``, plus the round trips
            of a 1000-op chain and its read (one: the library's promise)
  jax       the checks of ``torch`` on jax:gpu ("skipped" where JAX has no GPU backend)
  frontend  ember.torch: an MLP and a CNN (Conv2d, BatchNorm2d, MaxPool2d, Dropout) trained 20 Adam
            steps on a torch:cuda peer and on torch:cuda locally, losses against torch eager on the CPU
  bench     ``ember bench --quick core``: no suite of ``ember bench`` takes a device, so the shortest one

The summary lists each step (ok, FAILED or skipped), its seconds and its figure; the exit status is 1
if a step FAILED. Without a CUDA device (and without --dry-run) it says so and exits 0, having checked
nothing. The dry run takes about 20 s on a 2-CPU VM; a GPU run adds CUDA's start-up in this process and
in each peer (not yet timed on a GPU), and the budgets cap it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import NamedTuple

# JAX takes 75 % of the GPU's memory at its first use unless told not to: torch here and the peers need it too.
# cuDNN's convolutions (PyTorch's default) and XLA's float32 matmuls run in TF32 on GPUs since Ampere, about 1e-3
# off, which would drown ember's own errors in the comparisons. The peers inherit these; the caller's settings win.
for name, value in (("XLA_PYTHON_CLIENT_PREALLOCATE", "false"), ("NVIDIA_TF32_OVERRIDE", "0"),
                    ("JAX_DEFAULT_MATMUL_PRECISION", "highest")):
    os.environ.setdefault(name, value)

import numpy as np  # noqa: E402
from ember.benchmarks.core import chain  # noqa: E402 — the chain ember bench times

import ember as em  # noqa: E402
from ember.remote.spawn import PeerProcess  # noqa: E402

MIB = 1 << 20
CPU_FOR = {"torch:cuda": "torch:cpu", "jax:gpu": "jax:cpu"}  # what --dry-run runs in place of each CUDA device
TRAINING_STEPS = 20


class Machine(NamedTuple):
    """What this run may use: the backends with a GPU (dry: those installed, run on the CPU), the transfer size."""
    dry_run: bool
    found: set  # of "torch" (torch:cuda), "jax" (jax:gpu)
    mib: int

    def device(self, name: str) -> str:
        return CPU_FOR[name] if self.dry_run else name


class OverBudget(BaseException):
    """Raised in the main thread when a step outlives its budget: a BaseException, so that no
    ``except Exception`` inside ember or torch swallows it on the way out."""


def _close(got, want, what: str, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    np.testing.assert_allclose(em.asnumpy(got) if isinstance(got, em.Array) else got, want, rtol=rtol, atol=atol,
                               err_msg=what)


def check_arrays(device) -> None:
    """Ops on ``device`` against NumPy on the same float32 data (float32 tolerances: GPU kernels sum in other orders)."""
    rng = np.random.default_rng(0)
    a_host, b_host = rng.standard_normal((2, 128, 128), dtype=np.float32)
    a, b = em.asarray(a_host, device=device), em.asarray(b_host, device=device)
    assert a.device == em.device(device) and a.dtype == em.float32
    _close(em.exp(a) * 2 + em.sin(b) - a / (1 + b * b), np.exp(a_host) * 2 + np.sin(b_host) - a_host / (1 + b_host * b_host),
           "elementwise")
    _close(a @ b, a_host @ b_host, "matmul", rtol=1e-4, atol=1e-3)
    _close(em.sum(a, axis=0), a_host.sum(axis=0), "sum", atol=1e-4)
    _close(em.mean(a), a_host.mean(), "mean", atol=1e-6)
    _close(em.std(a, axis=1), a_host.std(axis=1), "std")
    _close(em.max(a), a_host.max(), "max")
    np.testing.assert_array_equal(em.asnumpy(em.argmax(a, axis=1)), a_host.argmax(axis=1), err_msg="argmax")
    rows = np.array([5, 0, 127, 5])
    _close(a[3:100:7, ::-2], a_host[3:100:7, ::-2], "slicing", rtol=0, atol=0)
    _close(a[em.asarray(rows, device=device)], a_host[rows], "integer array indexing", rtol=0, atol=0)
    _close(a[a > 1.5], a_host[a_host > 1.5], "boolean mask", rtol=0, atol=0)
    c, c_host = em.asarray(a_host.copy(), device=device), a_host.copy()
    c[::2, 5], c_host[::2, 5] = 0, 0
    _close(c, c_host, "setitem", rtol=0, atol=0)

    x_host, w_host = 0.3 * rng.standard_normal((64, 32), dtype=np.float32), rng.standard_normal((32, 16), dtype=np.float32)
    x, w = em.asarray(x_host, device=device), em.asarray(w_host, device=device)
    gradient = em.grad(lambda w: em.sum(em.tanh(x @ w)))(w)  # d/dw Σ tanh(xw) = xᵀ(1 − tanh²(xw))
    exact = x_host.astype(np.float64).T @ (1 - np.tanh(x_host.astype(np.float64) @ w_host) ** 2)
    assert gradient.shape == w.shape and gradient.device == w.device
    _close(gradient, exact, "em.grad", rtol=1e-4, atol=1e-4)
    jitted = em.jit(lambda x, w: em.tanh(x @ w) * 2 - 1)
    for call in ("first (captured)", "second (replayed)"):
        _close(jitted(x, w), np.tanh(x_host @ w_host) * 2 - 1, f"em.jit, {call} call", atol=1e-5)


def transfer(device, mib: int) -> str:
    """A ``mib`` MiB float32 array up to ``device`` and back, unchanged: the GB/s of each way."""
    host = np.random.default_rng(1).random(mib * MIB // 4, dtype=np.float32)
    start = time.perf_counter()
    big = em.asarray(host, device=device)
    float(big[-1])  # a read that waits until the upload is done, on every kind of device
    up = time.perf_counter() - start
    start = time.perf_counter()
    back = em.asnumpy(big)
    down = time.perf_counter() - start
    assert np.array_equal(back, host), "the array came back changed"
    return f"{mib} MiB up {host.nbytes / up / 1e9:.2f} GB/s, down {host.nbytes / down / 1e9:.2f} GB/s"


def chain_round_trips(device) -> int:
    """The round trips of a 1000-op chain and its one read, its values checked against NumPy's."""
    host = np.random.default_rng(2).random(1000, dtype=np.float32)
    x = em.asarray(host, device=device)
    em.sync(device)
    before = em.stats(device)["round_trips"]
    result = em.asnumpy(chain(em, x, 1000))
    trips = em.stats(device)["round_trips"] - before
    _close(result, chain(np, host, 1000), "1000-op chain", atol=1e-4)
    assert trips == 1, f"a 1000-op chain and one read took {trips} round trips, not 1"
    return trips


@contextlib.contextmanager
def cuda_peer(machine: Machine):
    """Device 0 of an ``ember serve --device torch:cuda`` child; if the step fails, the peer's last log lines."""
    with PeerProcess("--device", machine.device("torch:cuda")) as peer:
        device = em.device(peer.url())
        try:
            yield device
        except (Exception, OverBudget):  # not on Ctrl-C
            print("  the peer's last log lines:\n" + "".join(f"    {line}" for line in list(peer.log)[-20:]).rstrip(), flush=True)
            raise
        finally:
            with contextlib.suppress(em.EmberError):
                device.engine.close()


def local_step(name: str):
    """The step that checks the local device ``name`` (torch:cuda, jax:gpu)."""
    def step(machine: Machine) -> str:
        check_arrays(machine.device(name))
        return transfer(machine.device(name), machine.mib)
    return step


def step_peer(machine: Machine) -> str:
    with cuda_peer(machine) as device:
        check_arrays(device)
        trips = chain_round_trips(device)
        return f"{trips} round trip; " + transfer(device, machine.mib)


def train(device, model_name: str) -> list[float]:
    """A model's losses over 20 Adam steps (cross-entropy, batch of 16); ``device`` None is torch eager on the CPU.
    The loop is PyTorch's own: only the ``to_device`` line differs."""
    import torch

    import ember.torch as et
    nn = torch.nn
    torch.manual_seed(0)
    if model_name == "mlp":
        model, x = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), torch.randn(16, 4)
    else:  # tests/test_torch_frontend.py's CNN: convolutions without bias, as before any batch norm
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(4, 6, 3, bias=False), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2, stride=1),
                              nn.Flatten(), nn.Dropout(0.25), nn.Linear(6, 3))
        x = torch.randn(16, 3, 8, 8)
    y = torch.randint(0, 3, (16,))
    if device is not None:
        model, x, y = et.to_device(model, device), et.to_device(x, device), et.to_device(y, device)
    optimizer, loss_of = torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss()
    model.train()
    losses = []
    for _ in range(TRAINING_STEPS):
        optimizer.zero_grad()
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def step_frontend(machine: Machine) -> str:
    worst = 0.0
    with cuda_peer(machine) as peer:
        for model_name in ("mlp", "cnn"):
            eager = train(None, model_name)
            for where, device in (("the peer", peer), (machine.device("torch:cuda"), machine.device("torch:cuda"))):
                losses = train(device, model_name)
                _close(losses, eager, f"{model_name} losses on {where} vs torch eager", rtol=1e-3, atol=1e-5)
                assert losses[-1] < losses[0], f"the {model_name} did not learn on {where}: {losses}"
                worst = max(worst, float(np.max(np.abs(np.subtract(losses, eager)) / np.abs(eager))))
    return f"mlp, cnn × peer, local: largest loss difference {worst:.1e} (relative)"


def step_bench(machine: Machine) -> str:
    from ember.benchmarks.timing import meets
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "ember.cli", "bench", "--quick", "core", "--json", f"{folder}/core.json"]
        # a session of its own, so that its whole group (any peer it starts too) is killed after it, on a timeout or Ctrl-C
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            for line in child.stdout:  # as it comes: on a timeout, what it did print is shown
                print(f"    {line}", end="", flush=True)
            child.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            child.stdout.close()
        if child.returncode:
            raise RuntimeError(f"ember bench exited with status {child.returncode}")
        with open(f"{folder}/core.json") as f:
            (report,) = json.load(f)
    verdicts = [meets(row["ratio"], row["target"]) for row in report["rows"]]
    return f"{len(verdicts)} rows, {verdicts.count(True)} of {len(verdicts) - verdicts.count(None)} targets met"


class Step(NamedTuple):
    name: str
    title: str
    budget: float  # seconds
    needs: str | None  # "torch" (torch:cuda) or "jax" (jax:gpu)
    run: Callable[[Machine], str]


STEPS = [
    Step("torch", "torch:cuda locally", 60, "torch", local_step("torch:cuda")),
    Step("peer", "a torch:cuda peer", 90, "torch", step_peer),
    Step("jax", "jax:gpu locally", 60, "jax", local_step("jax:gpu")),
    Step("frontend", "ember.torch on a torch:cuda peer and on torch:cuda", 120, "torch", step_frontend),
    Step("bench", "ember bench --quick core", 120, None, step_bench),
]


WHY_NOT = {"torch": "torch has no CUDA device here", "jax": "jax has no GPU backend here"}


def run_step(step: Step, machine: Machine) -> tuple[str, float, str]:
    """(result, seconds, figure) of one step, run under its budget."""
    if step.needs and step.needs not in machine.found:
        reason = f"{step.needs} is not installed" if machine.dry_run else WHY_NOT[step.needs]
        print(f"  skipped: {reason}", flush=True)
        return "skipped", 0.0, reason
    start = time.perf_counter()
    try:
        signal.setitimer(signal.ITIMER_REAL, step.budget)
        try:
            figure = step.run(machine)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        result = "ok"
    except OverBudget:
        result, figure = "FAILED", f"over its {step.budget:.0f} s budget"
    except Exception as error:  # noqa: BLE001 — reported, and the next step runs
        traceback.print_exc(file=sys.stdout)
        result, figure = "FAILED", f"{type(error).__name__}: {' '.join(str(error).split())}"
    seconds = time.perf_counter() - start
    print(f"  {result} in {seconds:.1f} s{': ' + figure if figure else ''}", flush=True)
    return result, seconds, figure[:110]


def probe(dry_run: bool) -> set:
    """The backends among torch and jax with a GPU device (in a dry run: those installed)."""
    if dry_run:
        return {name for name in ("torch", "jax") if importlib.util.find_spec(name) is not None}
    from ember.backends import available_devices  # torch:cuda:N and jax:gpu:N for each GPU the backends see
    names = available_devices()
    return {name for name, gpu in (("torch", "torch:cuda"), ("jax", "jax:gpu")) if any(n.startswith(gpu) for n in names)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run torch:cuda as torch:cpu and jax:gpu as jax:cpu")
    names = ", ".join(s.name for s in STEPS)
    parser.add_argument("--steps", default=names.replace(", ", ","),
                        help=f"the steps to run, comma-separated; they run in the order {names} (default: all)")
    parser.add_argument("--mib", type=int, default=256, help="the size of the transfers, in MiB (default 256)")
    args = parser.parse_args(argv)
    unknown = set(args.steps.split(",")) - {s.name for s in STEPS}
    if unknown:
        parser.error(f"unknown step {sorted(unknown)[0]!r}; choose from {names}")
    chosen = [s for s in STEPS if s.name in args.steps.split(",")]
    machine = Machine(args.dry_run, probe(args.dry_run), args.mib)
    if not args.dry_run and not machine.found:
        print("cuda_check: no CUDA device found (torch sees none, JAX has no GPU backend): skipped, nothing was checked")
        return 0
    if args.dry_run:
        print("cuda_check: dry run: " + ", ".join(f"{gpu} runs as {cpu}" for gpu, cpu in CPU_FOR.items()))

    def over_budget(*_):
        raise OverBudget

    previous = signal.signal(signal.SIGALRM, over_budget)
    results, start = [], time.perf_counter()
    try:
        for number, step in enumerate(chosen, 1):
            print(f"[{number}/{len(chosen)}] {step.name}: {step.title} (budget {step.budget:.0f} s)", flush=True)
            results.append((step.name, *run_step(step, machine)))
    except KeyboardInterrupt:  # the peers stopped on the way out of their with blocks
        results += [(s.name, "skipped", 0.0, "interrupted") for s in chosen[len(results):]]
        print("\ninterrupted", flush=True)
    finally:
        signal.signal(signal.SIGALRM, previous)
    print(f"\n{'step':<9} {'result':<8} {'seconds':>7}  figure")
    for name, result, seconds, figure in results:
        print(f"{name:<9} {result:<8} {seconds:>7.1f}  {figure}")
    print(f"total {time.perf_counter() - start:.0f} s{' (dry run)' if args.dry_run else ''}", flush=True)
    if any(figure == "interrupted" for *_, figure in results):
        return 130
    return 1 if any(result == "FAILED" for _, result, *_ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
