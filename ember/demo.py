"""``ember demo``: the whole job in one command.

It starts a compute peer on 127.0.0.1 in a child process, connects to it as a remote device,
and shows: one Array API computation on a local and a remote device (results compared, round
trips counted); an MLP trained on the peer with autodiff; one training step captured, summarised,
saved, rendered and replayed on the peer with ``em.jit``; the refusal to serve a capture device;
and a closing table. The peer stops on exit, Ctrl-C included. Exit status 1 if a comparison fails.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import ember as em

from .graphs import format_bytes
from .progress import Progress
from .remote.spawn import PeerProcess
from .spirals import init_params, loss_fn, make_step, train, two_spirals


class Demo:
    def __init__(self, local: str, peer_device: str, steps: int, size: int, out: Path | None, out_stream=None):
        self.local, self.peer_device, self.steps, self.size = local, peer_device, steps, size
        self.out = out
        self.stream = out_stream or sys.stdout
        self.phases: list[tuple[str, float, dict]] = []
        self.failures: list[str] = []

    def say(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)

    def check(self, ok: bool, what: str) -> None:
        self.say(f"  {'✓' if ok else '✗'} {what}")
        if not ok:
            self.failures.append(what)

    def phase(self, name: str, remote, work) -> None:
        before = em.stats(remote) if remote is not None else {}
        start = time.perf_counter()
        work()
        after = em.stats(remote) if remote is not None else {}
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("ops", "round_trips", "bytes_up", "bytes_down")}
        self.phases.append((name, time.perf_counter() - start, delta))

    # --- the sections ---------------------------------------------------------------------------

    def compute(self, remote) -> None:
        self.say("\n[1] One Array API computation, on a local and on a remote device")
        rng = np.random.default_rng(0)
        a_host = rng.standard_normal((self.size, self.size))

        def program(xp, a):
            b = xp.tanh(a @ a.mT / a.shape[0]) + 0.1 * xp.eye(a.shape[0], device=a.device)
            x = xp.linalg.solve(b, xp.ones(a.shape[0], device=a.device))
            return xp.sum(x * x), xp.linalg.vector_norm(b @ x - 1.0)

        local = em.device(self.local)
        expected = [float(v) for v in program(em, em.asarray(a_host, device=local))]
        trips = em.stats(remote)["round_trips"]
        a = em.asarray(a_host, device=remote)
        total, residual = program(em, a)
        self.say(f"  on {remote}: result shape {total.shape}, dtype {total.dtype} — known before any round trip")
        got = [float(v) for v in em.asnumpy(em.stack([total, residual]))]  # one read for both
        used = em.stats(remote)["round_trips"] - trips
        self.say(f"  local {self.local}: sum(x²) = {expected[0]:.10g}, residual {expected[1]:.2e}")
        self.say(f"  remote:        sum(x²) = {got[0]:.10g}, residual {got[1]:.2e}")
        self.check(np.isclose(got[0], expected[0], rtol=1e-9) and got[1] < 1e-8, "local and remote results agree")
        self.say(f"  blocking round trips for the whole computation and its reads: {used}")

    def train(self, remote) -> None:
        self.say(f"\n[2] An MLP trained on the peer with autodiff ({self.steps} steps, two spirals, Adam)")
        losses: list[float] = []
        with Progress(self.steps, "training", stream=self.stream) as bar, em.profile() as waits:
            def on_step(i, loss):
                losses.append(loss)
                bar.update(i + 1, f"loss {loss:.4f}")
            result = train(remote, steps=self.steps, on_step=on_step)
        marks = sorted({0, self.steps // 4, self.steps // 2, 3 * self.steps // 4, self.steps - 1})
        self.say("  loss: " + "  ".join(f"{i}: {losses[i]:.4f}" for i in marks))
        self.say(f"  accuracy {result['accuracy']:.3f}, {result['seconds_per_step'] * 1e3:.1f} ms per step")
        self.say("  where the training waited for the peer (em.profile()):")
        self.say("  " + waits.table(limit=3).replace("\n", "\n  "))
        self.check(losses[-1] < losses[0] / 4, "the loss fell")
        self.check(result["accuracy"] >= 0.9, f"accuracy ≥ 0.90 (got {result['accuracy']:.3f})")

    def capture(self, remote) -> None:
        self.say("\n[3] One training step captured, saved, rendered and replayed on the peer with em.jit")
        points, labels = two_spirals()
        x, y = em.asarray(points, device=remote), em.asarray(labels, device=remote)
        params = [em.asarray(p, device=remote) for p in init_params()]
        optimizer = em.optim.Adam(lr=0.01)
        state = optimizer.init(params)
        eager, jitted = make_step(optimizer, False), make_step(optimizer, True)
        loss_j, params_j, _ = jitted(params, state, x, y)
        graph, _ = next(iter(jitted.graphs.values()))
        self.say("  " + str(graph).replace("\n", "\n  "))
        directory = self.out or Path(tempfile.mkdtemp(prefix="ember-demo-"))
        directory.mkdir(parents=True, exist_ok=True)
        saved = graph.save(directory / "train_step.ember")
        graph.save(directory / "train_step.json")
        picture = directory / ("train_step.svg" if shutil.which("dot") else "train_step.dot")
        graph.render(picture)
        self.say(f"  saved {saved} (+ .json); rendered {picture}"
                 + ("" if picture.suffix == ".svg" else " (install graphviz for an SVG)"))
        self.onnx_step(graph, directory, (params, state, x, y), float(loss_j), em.asnumpy(params_j[0]))
        reloaded = em.load_graph(saved)
        loss_e, params_e, _ = eager(params, state, x, y)
        self.check(np.allclose(em.asnumpy(params_j[0]), em.asnumpy(params_e[0]), rtol=1e-12) and
                   np.isclose(float(loss_j), float(loss_e), rtol=1e-12), "jit replay equals the eager step")
        self.check(len(reloaded.ops) == len(graph.ops), "the saved graph loads back")
        calls = 10

        def timed(step):
            start = time.perf_counter()
            for _ in range(calls):
                loss, _, _ = step(params, state, x, y)
            float(loss)
            return (time.perf_counter() - start) / calls

        timed(jitted)
        t_eager, t_jit = timed(eager), timed(jitted)
        self.say(f"  per step on the peer: eager {t_eager * 1e3:.1f} ms, jit {t_jit * 1e3:.1f} ms "
                 f"({t_eager / t_jit:.1f}x); the graph was registered once, each call sends a reference and ids")

    def onnx_step(self, graph, directory: Path, args, loss: float, first_weight) -> None:
        """The captured step as an ONNX model, run by ONNX Runtime from the same inputs (with ``ember[onnx]``:
        ONNX Runtime 1.26 or newer, which needs Python 3.11; older releases lack a float64 kernel it uses)."""
        try:
            import onnxruntime
        except ImportError:
            where = "" if sys.version_info >= (3, 11) else " on Python 3.11 or newer, where ONNX Runtime 1.26+ is"
            self.say(f"  (pip install 'ember[onnx]'{where} to also export the step to ONNX and run it with ONNX Runtime)")
            return
        from .trees import flatten
        path = graph.to_onnx(directory / "train_step.onnx")
        leaves: list = []
        flatten((args, {}), leaves)
        feeds = {name: em.asnumpy(leaf) for (name, _, _), leaf in zip(graph.inputs, leaves)}
        try:
            outs = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
        except Exception as error:  # onnxruntime's own errors derive from Exception alone
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            self.say(f"  exported {path}; ONNX Runtime {onnxruntime.__version__} could not run it ({first:.160}); "
                     f"1.26 and newer do")
            return
        self.say(f"  exported {path} ({len(graph.ops)} ops → ONNX opset 18); ONNX Runtime's loss {float(outs[0]):.10g}")
        self.check(np.isclose(float(outs[0]), loss, rtol=1e-9) and np.allclose(outs[1], first_weight, rtol=1e-9, atol=1e-12),
                   "ONNX Runtime's step equals ember's")

    def refusal(self) -> None:
        self.say("\n[4] Serving a capture device is refused, as a user would meet it")
        self.say("  $ ember serve --device capture --listen 127.0.0.1:0")
        result = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--device", "capture", "--listen", "127.0.0.1:0"],
                                capture_output=True, text=True, timeout=120)
        for line in result.stderr.strip().splitlines():
            self.say(f"  {line}")
        self.check(result.returncode == 2 and "capture" in result.stderr, f"exit status {result.returncode} (2 expected)")

    def table(self) -> None:
        self.say("\n[5] What it cost")
        self.say(f"  {'phase':<40}{'time':>9}{'ops sent':>10}{'round trips':>13}{'bytes up':>12}{'bytes down':>12}")
        totals = {"ops": 0, "round_trips": 0, "bytes_up": 0, "bytes_down": 0}
        for name, seconds, delta in self.phases:
            for k in totals:
                totals[k] += delta.get(k, 0)
            self.say(f"  {name:<40}{seconds:>8.2f}s{delta.get('ops', 0):>10}{delta.get('round_trips', 0):>13}"
                     f"{format_bytes(delta.get('bytes_up', 0)):>12}{format_bytes(delta.get('bytes_down', 0)):>12}")
        total_time = sum(s for _, s, _ in self.phases)
        self.say(f"  {'total':<40}{total_time:>8.2f}s{totals['ops']:>10}{totals['round_trips']:>13}"
                 f"{format_bytes(totals['bytes_up']):>12}{format_bytes(totals['bytes_down']):>12}")

    def run(self) -> int:
        self.say(f"ember demo — starting a compute peer ({self.peer_device}) on 127.0.0.1 in a child process …")
        with PeerProcess("--device", self.peer_device) as peer:
            remote = em.device(peer.url())
            self.say(f"  peer up at {peer.address}; remote device {remote} hosts {remote.engine.info['device']}")
            self.phase("[1] same computation, local vs remote", remote, lambda: self.compute(remote))
            self.phase("[2] training on the peer", remote, lambda: self.train(remote))
            self.phase("[3] capture, save, render, jit replay", remote, lambda: self.capture(remote))
            self.phase("[4] serving refusal", None, self.refusal)
            self.table()
            remote.engine.close()
        self.say("\npeer stopped.")
        if self.failures:
            self.say(f"FAILED: {'; '.join(self.failures)}")
            return 1
        self.say("all checks passed.")
        return 0


def run(local: str = "numpy", peer_device: str = "numpy", steps: int = 300, size: int = 200, out: str | None = None) -> int:
    """Run the demo; returns the exit status."""
    try:
        return Demo(local, peer_device, steps, size, Path(out) if out else None).run()
    except KeyboardInterrupt:
        print("\ninterrupted; the peer was stopped.", file=sys.stderr)
        return 130


__all__ = ["run", "loss_fn"]
