#!/usr/bin/env python3
"""The figures docs/onnx.md reports: which op rows export to ONNX, how closely ONNX Runtime agrees with
ember's replay (max errors by dtype over the op table's example recipes and three whole models), and
the time of the spirals forward pass replayed by ember against ONNX Runtime (medians).

    python tools/onnx_figures.py                 # 50 examples a row
    python tools/onnx_figures.py --examples 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' recipes and helpers

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ember as em  # noqa: E402
from ember.errors import OnnxError  # noqa: E402
from ember.graphs.onnx import exportable_rows, missing_rows, to_model  # noqa: E402
from ember.ops import OPS  # noqa: E402
from tests.generators import Drawer  # noqa: E402
from tests.recipes import EXAMPLES  # noqa: E402
from tests.test_onnx import ORT_DTYPES, assert_agree, attention, capture_row, conv_net, spirals_forward  # noqa: E402


def relative_errors(graph, arrays) -> dict:
    """Scaled error by dtype: the max abs error over max(1, the largest |value| of ember's output) — what the tests'
    tolerance bounds (elementwise relative errors are meaningless where a result is near 0: gelu far left, an
    underflowing product)."""
    from tests.test_onnx import run_onnxruntime
    expected = graph(*[em.asarray(a) for a in arrays], device="numpy")
    expected = [em.asnumpy(e) for e in (expected if isinstance(expected, tuple) else (expected,))]
    actual = run_onnxruntime(to_model(graph), {n: a for (n, _, _), a in zip(graph.inputs, arrays)})
    out = {}
    for e, a in zip(expected, actual):
        if e.dtype.kind == "f" and e.size:
            mask = np.isfinite(e)
            scale = max(1.0, float(np.abs(e[mask]).max(initial=0)))
            error = float(np.max(np.abs(a[mask] - e[mask]), initial=0) / scale)
            out[e.dtype.name] = max(out.get(e.dtype.name, 0.0), error)
    return out


def agreement(examples: int) -> tuple[dict, int]:
    worst_abs: dict = defaultdict(float)
    worst_rel: dict = defaultdict(float)
    worst_row: dict = {}
    counter = [0]
    for name in exportable_rows():
        if not EXAMPLES.get(name):
            continue
        sampler(OPS[name], name, examples, worst_abs, worst_rel, worst_row, counter)()
    return {d: (worst_abs[d], worst_rel.get(d, 0.0), worst_row.get(d, 'every row exact')) for d in worst_abs}, counter[0]


def sampler(op, name, examples, worst_abs, worst_rel, worst_row, counter):
    """Examples of one row, each exported, run by ONNX Runtime and compared, the worst errors kept."""
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def sample(data):
        arrays, attrs = EXAMPLES[name](Drawer(data, ORT_DTYPES if op.inputs else em.dtypes.ALL))
        _, metas = op.infer(tuple(em.asarray(a)._meta for a in arrays), {**op.attrs, **attrs})
        assume(metas and all(m.dtype in ORT_DTYPES for m in metas))
        graph = capture_row(op, arrays, attrs)
        try:
            to_model(graph)
        except OnnxError:
            assume(False)
        if op.determined == ():
            return  # `empty`: no value to compare
        for dtype, error in assert_agree(graph, arrays, name, determined=op.determined).items():
            worst_abs[dtype] = max(worst_abs[dtype], error)
        for dtype, error in relative_errors(graph, arrays).items():
            if error > worst_rel[dtype]:
                worst_rel[dtype], worst_row[dtype] = error, name
        counter[0] += 1
    return sample


def _median_seconds(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def timings(repeats: int = 200) -> list:
    """ember's replay is timed before any ONNX Runtime session exists: ONNX Runtime's worker threads spin
    between runs, and on a small machine they slow whatever runs beside them (NumPy's BLAS threads)."""
    import onnxruntime as ort
    cases = []
    for dtype in (np.float64, np.float32):
        graph, points = spirals_forward(batch=400, dtype=dtype)
        x = em.asarray(points)
        cases.append((np.dtype(dtype).name, graph, points, _median_seconds(lambda: em.asnumpy(graph(x)), repeats)))
    rows = []
    for name, graph, points, replay in cases:
        session = ort.InferenceSession(to_model(graph).SerializeToString(), providers=["CPUExecutionProvider"])
        run = session.run
        rows.append((name, {"ember replay (numpy)": replay,
                            "onnxruntime": _median_seconds(lambda: run(None, {"points": points}), repeats)}))
    return rows


def main() -> int:
    import warnings
    warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's warnings on the examples' nan and inf
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=50)
    args = parser.parse_args()
    import onnx
    import onnxruntime
    print(f"onnx {onnx.__version__}, onnxruntime {onnxruntime.__version__}")
    exportable, missing = exportable_rows(), missing_rows()
    print(f"\nrows with an ONNX form: {len(exportable)} of {len(OPS)}; without ({len(missing)}):")
    for name, why in missing.items():
        print(f"  {name}: {why}")
    figures, count = agreement(args.examples)
    print(f"\nONNX Runtime vs ember's replay, {count} examples drawn from the op table's recipes:")
    for dtype, (abs_error, rel_error, row) in sorted(figures.items()):
        print(f"  {dtype:8} max abs error {abs_error:.3g}, max scaled error {rel_error:.3g} (row {row})")
    print("\nwhole models (max abs error / max scaled error):")
    for label, make in (("spirals forward", lambda d: spirals_forward(dtype=em.dtypes.NUMPY[d])),
                        ("conv net", conv_net), ("attention", attention)):
        for dtype in (em.float32, em.float64):
            graph, data = make(dtype)
            data = [np.asarray(a, dtype=em.dtypes.NUMPY[dtype]) for a in (data if isinstance(data, tuple) else (data,))]
            abs_error = assert_agree(graph, data, label)[dtype.name]
            print(f"  {label:16} {dtype.name:8} {abs_error:.3g} / {relative_errors(graph, data)[dtype.name]:.3g}")
    import os
    load = os.getloadavg()[0]
    print(f"\nspirals forward pass, batch 400, medians of 200 runs (load average {load:.1f} on {os.cpu_count()} cores; "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}):")
    for dtype, seconds in timings():
        parts = ", ".join(f"{label} {s * 1e6:.0f} µs" for label, s in seconds.items())
        ratio = seconds["ember replay (numpy)"] / seconds["onnxruntime"]
        print(f"  {dtype}: {parts} (ember / onnxruntime = {ratio:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
