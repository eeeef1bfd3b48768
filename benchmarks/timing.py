"""Interleaved median timing and the result table every benchmark prints."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field


def medians(candidates: dict, repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each candidate, running them in turn each repeat (ABAB…)
    so that machine noise falls on all of them alike."""
    for function in candidates.values():
        for _ in range(warmup):
            function()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, function in candidates.items():
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


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

    @property
    def ratio(self) -> float:
        return self.ember / self.baseline if self.baseline else float("inf")


@dataclass
class Report:
    suite: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, row: Row) -> None:
        self.rows.append(row)

    def table(self) -> str:
        lines = [f"{'benchmark':<46} {'ember':>11} {'baseline':>22} {'ratio':>7}  target"]
        for r in self.rows:
            lines.append(f"{r.name:<46} {_fmt(r.ember, r.unit):>11} {r.baseline_name + ' ' + _fmt(r.baseline, r.unit):>22} "
                         f"{r.ratio:>6.2f}x  {r.target}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

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


def combined_table(reports: list[Report]) -> str:
    """One table of every suite's rows and notes."""
    lines = [f"{'suite':<8} {'benchmark':<46} {'ember':>11} {'baseline':>22} {'ratio':>7}  target"]
    for report in reports:
        for r in report.rows:
            lines.append(f"{report.suite:<8} {r.name:<46} {_fmt(r.ember, r.unit):>11} "
                         f"{r.baseline_name + ' ' + _fmt(r.baseline, r.unit):>22} {r.ratio:>6.2f}x  {r.target}")
    for report in reports:
        lines += [f"  {report.suite}: {n}" for n in report.notes]
    return "\n".join(lines)
