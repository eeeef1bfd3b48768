"""Interleaved median timing and the result table every benchmark prints."""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, field


def cpu_ticks(path: str = "/proc/stat") -> tuple[int, int] | None:
    """Clock ticks of all CPUs so far: (stolen, wanted) — the time the hypervisor ran other
    guests while a vCPU of this machine had work (Linux's ``steal``), and that plus the time the
    CPUs worked. None where there is no ``/proc/stat`` (not Linux)."""
    try:
        with open(path) as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    return steal, user + nice + system + irq + softirq + steal


def stolen_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the CPU time wanted between two :func:`cpu_ticks` readings that the
    hypervisor gave to other guests (0 on a machine of its own); None where unknown."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


class Timings(dict):
    """Median seconds per call by candidate name, and ``stolen``: the :func:`stolen_share` of
    the minutes they were timed in. On a shared VM a ratio measured while the hypervisor took
    a large share is the machine's as much as ember's."""

    stolen: float | None = None


def medians(candidates: dict, repeats: int, warmup: int = 1) -> Timings:
    """Median seconds per call of each candidate, running them in turn each repeat (ABAB…)
    so that machine noise falls on all of them alike."""
    for function in candidates.values():
        for _ in range(warmup):
            function()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    before = cpu_ticks()
    for _ in range(repeats):
        for name, function in candidates.items():
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    result = Timings((name, statistics.median(t)) for name, t in times.items())
    result.stolen = stolen_share(before, cpu_ticks())
    return result


@dataclass
class Row:
    """One comparison: ember's median against a baseline's, and the target for the ratio."""
    name: str
    ember: float
    baseline_name: str
    baseline: float
    target: str = ""
    unit: str = "s"
    higher_is_better: bool = False
    round_trips: int | None = None  # the blocking waits ember counted for one call, where a row counts them
    stolen: float | None = None  # the hypervisor's share of the CPU time while it was timed (Timings.stolen)

    @property
    def ratio(self) -> float:
        return self.ember / self.baseline if self.baseline else float("inf")


def meets(ratio: float, target: str) -> bool | None:
    """Whether ``ratio`` meets a target written ``≤ 2.00x`` or ``≥ 0.90x``; None for a row
    without one ("reported", "contrast", "")."""
    match = re.fullmatch(r"([≤≥]) ([0-9.]+)x", target.strip())
    if match is None:
        return None
    bound = float(match.group(2))
    return ratio <= bound if match.group(1) == "≤" else ratio >= bound


@dataclass
class Report:
    suite: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, row: Row) -> None:
        self.rows.append(row)

    def as_dict(self) -> dict:
        return {"suite": self.suite, "notes": self.notes,
                "rows": [{**r.__dict__, "ratio": r.ratio} for r in self.rows]}


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        if value < 1e-3:
            return f"{value * 1e6:.1f} µs"
        if value < 1:
            return f"{value * 1e3:.2f} ms"
        return f"{value:.2f} s"
    if unit == "B/s":
        return f"{value / 1e9:.2f} GB/s"
    return f"{value:.3g} {unit}"


STOLEN_NOTE = ("stolen: the share of the CPU time wanted while a row was timed that the hypervisor gave to other "
               "guests (Linux's steal time); where it is large, the ratio tells of the machine as much as of ember")


def combined_table(reports: list[Report]) -> str:
    """One table of every suite's rows and notes."""
    lines = [f"{'suite':<8} {'benchmark':<46} {'ember':>11} {'baseline':>22} {'ratio':>7} {'stolen':>6}  target"]
    for report in reports:
        for r in report.rows:
            stolen = "" if r.stolen is None else f"{r.stolen:.0%}"
            lines.append(f"{report.suite:<8} {r.name:<46} {_fmt(r.ember, r.unit):>11} "
                         f"{r.baseline_name + ' ' + _fmt(r.baseline, r.unit):>22} {r.ratio:>6.2f}x {stolen:>6}  {r.target}")
    for report in reports:
        lines += [f"  {report.suite}: {n}" for n in report.notes]
    if any(r.stolen is not None for report in reports for r in report.rows):
        lines.append(f"  {STOLEN_NOTE}")
    return "\n".join(lines)


def spread_table(runs: list[list[dict]]) -> str:
    """One table of several runs of the same suites (each run as ``--json`` writes it): for
    every row the median of its runs' ember and baseline figures and ratios, the ratios' range,
    how many runs met its target, and the median stolen share."""
    rows: dict[tuple, list[dict]] = {}
    for run in runs:
        for report in run:
            for row in report["rows"]:
                rows.setdefault((report["suite"], row["name"], row["baseline_name"]), []).append(row)
    lines = [f"{'suite':<8} {'benchmark':<46} {'ember':>11} {'baseline':>22} {'ratio':>7} {'range':>13} "
             f"{'met':>6} {'stolen':>6}  target"]
    for (suite, name, baseline_name), found in rows.items():
        ratios = [row["ratio"] for row in found]
        unit, target = found[0]["unit"], found[0]["target"]
        verdicts = [meets(ratio, target) for ratio in ratios]
        met = "" if verdicts[0] is None else f"{sum(verdicts)}/{len(found)}"
        shares = [row["stolen"] for row in found if row.get("stolen") is not None]
        stolen = f"{statistics.median(shares):.0%}" if shares else ""
        ember = _fmt(statistics.median(row["ember"] for row in found), unit)
        baseline = f"{baseline_name} {_fmt(statistics.median(row['baseline'] for row in found), unit)}"
        spread = f"{min(ratios):.2f}–{max(ratios):.2f}x"
        lines.append(f"{suite:<8} {name:<46} {ember:>11} {baseline:>22} {statistics.median(ratios):>6.2f}x {spread:>13} "
                     f"{met:>6} {stolen:>6}  {target}")
    lines.append(f"  {len(runs)} runs, each in a fresh process: per row the median of the runs' medians, the range of "
                 f"their ratios, and in how many runs the ratio met the target")
    lines.append(f"  {STOLEN_NOTE} (the median over the runs)")
    return "\n".join(lines)
