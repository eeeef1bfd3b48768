"""PyTorch's OpInfo judge of ember.torch, every judged entry on numpy and on a peer, written to docs/torch-opinfo.md.

    .venv/bin/python tools/opinfo_report.py [--only NAME ...] [--out PATH]

The judge and the judged entries are tests/test_torch_opinfo.py's own (imported, not copied): the op_db entries whose
aten op the lowering table holds, and those whose first sample ember runs through torch's decompositions. Each runs
all its float32 samples — values, shapes, dtypes, gradients — against torch eager, on "numpy" and on an ``ember
serve`` peer (started here, stopped on exit). The page gives the totals, a row per entry and every failure's reason,
and the op_db entries not judged with why. An entry whose verdict disagrees with KNOWN_FAILURES (it fails and is not
listed, or is listed and passes) is printed, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EMBER_TIMEOUT", "60")  # as in the tests: a silent peer fails in a minute

import torch  # noqa: E402

import ember.torch as et  # noqa: E402
from ember.remote.spawn import PeerProcess  # noqa: E402
from ember.torch.lowering import LOWERINGS  # noqa: E402
from ember.torch.tensor import ALIASES  # noqa: E402
from tests.test_torch_opinfo import (  # noqa: E402
    DECOMPOSED,
    KNOWN_FAILURES,
    LOWERED_NAMES,
    OPINFOS,
    _first_sample,
    _leaves,
    _op_db,
    _opinfo_id,
    judge,
    why_not_run,
)

COMMAND = ".venv/bin/python tools/opinfo_report.py"
REASON_CHARS = 150
SUPPORTED = set(et.supported_ops())


def _clean(text: str, peer_url: str = "", limit: int | None = REASON_CHARS) -> str:
    """One line of a failure, without this machine's paths or the peer's port, at most ``limit`` characters long."""
    text = " ".join(text.replace(str(ROOT) + os.sep, "").split())
    if peer_url:
        text = text.replace(peer_url, "the peer")
    text = re.sub(r"/\S*/site-packages/", "site-packages/", text)
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    text = text.replace(" (ember.torch.supported_ops() lists the ops it lowers)", "")
    text = re.sub(r" — (called )?at \S+\.py:\d+: .*$", "", text).replace("|", "\\|")  # the user's line: the judge's
    return text if limit is None or len(text) <= limit else text[:limit - 1] + "…"


def _path(info) -> str:
    """How the entry's first sample reaches ember (forward): "lowered" where every aten op it dispatches to ember is in
    the table, else "decomposed", naming the ops torch._decomp (or a composite kernel) breaks up."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    class Reaching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(t, et.Tensor) for t in _leaves((args, kwargs))) and func not in reached:
                reached.append(func)
            return func(*args, **(kwargs or {}))

    reached: list = []
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        sample = _first_sample(info)
        if sample is None:
            return "no sample eager accepts"
        arguments = tree_map(lambda x: et.to_device(x, "numpy") if isinstance(x, torch.Tensor) else x,
                             (sample.input, sample.args, sample.kwargs))
        try:
            with Reaching():
                info.op(arguments[0], *arguments[1], **arguments[2])
        except Exception:  # noqa: BLE001 — the judge records it; the ops reached so far tell the path
            pass
    decomposed = [str(op) for op in reached if str(op) not in SUPPORTED and op not in ALIASES]
    if decomposed:
        return "decomposed: " + ", ".join(f"`{op}`" for op in decomposed)
    return "lowered" if info.aten_name in LOWERED_NAMES else "composite: PyTorch's own kernel, into lowered ops"


def _aten(info) -> str:
    """The entry's aten op, with the overloads the table lowers where it lowers some."""
    overloads = sorted(op._overloadname for op in LOWERINGS if op.overloadpacket.__name__.lstrip("_") == info.aten_name)
    return f"aten.{info.aten_name}" + (f" ({', '.join(overloads)})" if overloads else "")


def _verdicts(entries, devices: dict) -> list[dict]:
    rows = []
    for kind, info in entries:
        row = {"id": _opinfo_id(info), "info": info, "kind": kind, "path": _path(info), "results": {}}
        for label, device in devices.items():
            start = time.perf_counter()
            judged, failed, failures = judge(info, device)
            row["results"][label] = (judged, failed, [_clean(f, devices["peer"]) for f in failures],
                                     time.perf_counter() - start)
        print(f"{row['id']:<48} {kind:<10} " + "  ".join(
            f"{label} {r[0] - r[1]}/{r[0]} ({r[3]:.1f} s)" for label, r in row["results"].items()), flush=True)
        for label, r in row["results"].items():
            for failure in r[2][:3]:
                print(f"    {label}: {failure}", flush=True)
        rows.append(row)
    return rows


def _summary(row) -> str:
    """A KNOWN_FAILURES reason for a failing row: its distinct kinds of failure, with the samples failed."""
    kinds: dict[str, None] = {}
    for _, _, failures, _ in row["results"].values():
        for failure in failures:
            text = re.sub(r"^sample \d+'s gradient", "the gradient", re.sub(r"^sample \d+: ", "", failure))
            text = re.sub(r"\((\d+, )*\d*\)", "(…)", text).replace(" — called at", "").split(" (ember.torch.sup")[0]
            kinds.setdefault(text.removeprefix("sample 0's ")[:110], None)
    counts = ", ".join(f"{label} {r[1]}/{r[0]}" for label, r in row["results"].items())
    return f"{'; '.join(list(kinds)[:2])} (samples failed: {counts})"


def _runs(numbers) -> str:
    """Sample numbers with their runs joined: 0-4, 9, 12-13."""
    if not all(n.isdigit() for n in numbers):
        return ", ".join(numbers)
    runs: list[list[int]] = []
    for n in map(int, numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _passes(row) -> bool:
    return all(judged and not failures for judged, _, failures, _ in row["results"].values())


def _page(rows: list[dict], skipped: list[tuple[str, str]], seconds: float) -> str:
    devices = list(rows[0]["results"]) if rows else ["numpy", "peer"]
    judged = {kind: [r for r in rows if r["kind"] == kind] for kind in ("lowered", "decomposed")}
    lines = [
        "# ember.torch judged by PyTorch's OpInfo tests",
        "",
        "Generated by `tools/opinfo_report.py`; regenerate with",
        "",
        "    " + COMMAND,
        "",
        "PyTorch's own op tests as the judge of `ember.torch`: for each entry of PyTorch's OpInfo database "
        "(`torch.testing._internal.common_methods_invocations.op_db`) whose aten op the lowering table holds "
        "(*lowered*), or whose first sample ember runs through `torch._decomp`'s decompositions (or a composite "
        "kernel) into lowered ops (*decomposed*, found by trying it at collection), every float32 sample runs on ember "
        "and is compared with torch eager: values (rtol 1e-5, atol 1e-5), shapes, dtypes, and gradients through "
        "`torch.autograd.grad` (rtol 1e-4). An entry passes when all its samples do. The judge is "
        "`tests/test_torch_opinfo.py` (`judge`); an entry that fails is a strict xfail there (`KNOWN_FAILURES`), "
        "with the reason given below.",
        "",
        "The *lowered/decomposed* column says how an entry's first sample reaches ember: `lowered` (every aten op it "
        "dispatches to ember is in the table), `composite` (PyTorch's own CompositeImplicitAutograd kernel breaks it "
        "up above dispatch, into lowered ops), or `decomposed:` and the aten ops that `torch._decomp` breaks up on the "
        "way.",
        "",
        f"torch {torch.__version__}, on {' and '.join(devices)} (an `ember serve --device numpy` peer on 127.0.0.1); "
        f"{seconds:.0f} s to generate.",
        "",
        "## Totals",
        "",
        "| | entries judged | pass on " + " | pass on ".join(devices) + " | known failures (xfail) | samples judged | "
        + " | ".join(f"samples passed on {d}" for d in devices) + " |",
        "|---|---:|" + "---:|" * len(devices) + "---:|---:|" + "---:|" * len(devices),
    ]
    for kind, group in [*judged.items(), ("all", rows)]:
        def passing(device, group=group):
            return sum(1 for r in group if r["results"][device][0] and not r["results"][device][2])
        samples = {d: sum(r["results"][d][0] for r in group) for d in devices}
        passed = {d: sum(r["results"][d][0] - r["results"][d][1] for r in group) for d in devices}
        known = sum(1 for r in group if r["id"] in KNOWN_FAILURES)
        lines.append(f"| {kind} | {len(group)} | " + " | ".join(str(passing(d)) for d in devices)
                     + f" | {known} | {samples[devices[0]]} | " + " | ".join(str(passed[d]) for d in devices) + " |")
    lines += ["", f"op_db entries with float32 samples not judged: {len(skipped)} (the last section, with why).", ""]

    for kind, group in judged.items():
        lines += [f"## {kind.capitalize()} entries", "",
                  "| op_db entry | aten op | lowered/decomposed | samples judged | "
                  + " | ".join(f"passed on {d}" for d in devices) + " | known failure (xfail reason) |",
                  "|---|---|---|---:|" + "---:|" * len(devices) + "---|"]
        for r in group:
            res = r["results"]
            lines.append(f"| `{r['id']}` | `{_aten(r['info'])}` | {r['path']} | {res[devices[0]][0]} | "
                         + " | ".join(f"{res[d][0] - res[d][1]}" for d in devices)
                         + f" | {_clean(KNOWN_FAILURES.get(r['id'], ''), limit=None)} |")
        lines.append("")

    failing = [r for r in rows if not _passes(r)]
    lines += ["## Failures", "",
              "Every failed sample with its reason: one line for each reason, with the samples (their numbers in "
              "`sample_inputs` order) and devices it holds for.", ""]
    for r in failing:
        lines += [f"### `{r['id']}`", ""]
        reasons: dict[str, dict[str, list[str]]] = {}  # reason → device → the samples it failed
        for d in devices:
            judged_count, _, failures, _ = r["results"][d]
            for failure in failures or ([] if judged_count else ["sample -: no sample eager accepts"]):
                number, gradient, reason = re.match(r"sample (\S+?)('s gradient)?: (.*)", failure).groups()
                samples = reasons.setdefault(("the gradient: " if gradient else "") + reason, {}).setdefault(d, [])
                if number not in samples:
                    samples.append(number)
        for reason, by_device in reasons.items():
            groups: dict[tuple, list[str]] = {}  # the same samples on several devices: one line
            for d, samples in by_device.items():
                groups.setdefault(tuple(samples), []).append(d)
            for samples, ds in groups.items():
                label = "sample" if len(samples) == 1 else "samples"
                lines.append(f"- {', '.join(ds)}, {label} {_runs(samples)}: {reason}")
        lines.append("")
    if not failing:
        lines += ["None.", ""]

    lines += ["## Not judged", "",
              "The op_db entries with float32 samples that are in neither set: their first sample meets an aten op "
              "ember neither lowers nor decomposes into lowered ones, or holds no tensor, or does not build here.", "",
              "| op_db entry | why not |", "|---|---|"]
    lines += [f"| `{name}` | {_clean(why)} |" for name, why in skipped]
    return "\n".join(lines) + "\n"


def main() -> int:
    warnings.simplefilter("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="judge only these op_db entries (their ids); writes no page")
    parser.add_argument("--known", action="store_true", help="print a KNOWN_FAILURES entry for each failing entry")
    parser.add_argument("--out", default=str(ROOT / "docs" / "torch-opinfo.md"))
    arguments = parser.parse_args()
    if not OPINFOS:
        print("torch.testing's op_db needs the expecttest package", file=sys.stderr)
        return 2
    entries = [("lowered", info) for info in OPINFOS] + [("decomposed", info) for info in DECOMPOSED]
    if arguments.only:
        entries = [(kind, info) for kind, info in entries if _opinfo_id(info) in arguments.only]
    start = time.perf_counter()
    with PeerProcess("--device", "numpy") as peer:
        rows = _verdicts(entries, {"numpy": "numpy", "peer": peer.url()})
    seconds = time.perf_counter() - start
    judged_ids = {_opinfo_id(info) for _, info in entries}
    unexpected = [r["id"] for r in rows if not _passes(r) and r["id"] not in KNOWN_FAILURES]
    fixed = [r["id"] for r in rows if _passes(r) and r["id"] in KNOWN_FAILURES]
    if not arguments.only:
        for name in sorted(set(KNOWN_FAILURES) - judged_ids):
            print(f"NOT JUDGED, in KNOWN_FAILURES: {name}", file=sys.stderr)
    for name in unexpected:
        print(f"FAILS, not in KNOWN_FAILURES: {name}", file=sys.stderr)
    if arguments.known:
        print("KNOWN_FAILURES = {")
        for r in rows:
            if not _passes(r):
                print(f"    {r['id']!r}: {_summary(r)!r},")
        print("}")
    for name in fixed:
        print(f"PASSES, in KNOWN_FAILURES: {name}", file=sys.stderr)
    if not arguments.only:
        skipped = [(_opinfo_id(info), why_not_run(info) or "") for info in _op_db()
                   if _opinfo_id(info) not in judged_ids and info.aten_name not in LOWERED_NAMES]
        Path(arguments.out).write_text(_page(rows, skipped, seconds))
        print(f"wrote {arguments.out}: {len(rows)} entries judged in {seconds:.0f} s")
    return 1 if unexpected or fixed else 0


if __name__ == "__main__":
    sys.exit(main())
