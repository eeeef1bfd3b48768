"""``ember bench`` suites run end to end at their quick size: the report's structure and the
properties that are not times (no tensor byte through the client on peer-to-peer rows). Times
are never asserted: the machines are shared."""

from __future__ import annotations

import json
import math
import sys

import pytest
from ember.benchmarks import SUITES
from ember.benchmarks.timing import STOLEN_NOTE, Report, Row, combined_table, cpu_ticks, meets, spread_table, stolen_share

from ember.cli import main
from ember.wire.protocol import PREFIX_SIZE


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """``ember bench fleet --quick --json FILE``: three peers and a raw-socket pair, ~10 s."""
    path = tmp_path_factory.mktemp("bench") / "fleet.json"
    assert main(["bench", "fleet", "--quick", "--json", str(path)]) == 0
    (report,) = json.loads(path.read_text())
    return report


def test_fleet_is_a_suite_of_ember_bench():
    assert "fleet" in SUITES


def test_fleet_reports_every_row_with_a_finite_ratio(fleet):
    assert fleet["suite"] == "fleet"
    names = [row["name"] for row in fleet["rows"]]
    for expected in ("(a) move 16 MiB A → B, peer to peer", "(a) move 16 MiB A → B, peer to peer vs via client",
                     "(a) move 64 KiB A → B, peer to peer", "(b) all_reduce 4 MiB f32, 3 peers, vs via client",
                     "(b) all_reduce 1 MiB f32, 3 peers, vs via client", "(c) data-parallel MLP step, 2 peers vs 1",
                     "(c) data-parallel MLP step, 3 peers vs 1"):
        assert expected in names
    for row in fleet["rows"]:
        assert row["ember"] > 0 and row["baseline"] > 0 and math.isfinite(row["ratio"]), row
    assert next(r for r in fleet["rows"] if r["name"] == "(a) move 16 MiB A → B, peer to peer")["target"] == "≥ 0.80x"
    assert any("sharing its CPUs" in note for note in fleet["notes"])  # the rows are ratios, not speed-ups


def test_fleet_peer_to_peer_rows_move_no_tensor_byte_through_the_client(fleet):
    rows = [row for row in fleet["rows"] if row["peer_to_peer"]]
    assert len(rows) == len(fleet["rows"])
    for row in rows:
        if row["name"].startswith("(c)"):  # a data-parallel step reads its loss: one float64
            assert row["client_bytes_down"] == PREFIX_SIZE + 8, row
            assert 0 < row["client_bytes_up"] < 64 << 10, row  # the ops of the step, no tensor
            continue
        # syncs answered: frame prefixes only, no segment; up: grants, fetches, ops and syncs, no segment
        assert 0 < row["client_bytes_down"] < 1024 and row["client_bytes_down"] % PREFIX_SIZE == 0, row
        assert 0 < row["client_bytes_up"] < 16 << 10 and row["client_bytes_up"] < row["payload"] // 4, row


def test_fleet_baselines_through_the_client_carry_the_tensors(fleet):
    for row in fleet["rows"]:
        if row["baseline_name"] == "client":
            copies = 3 if row["name"].startswith("(b)") else 1  # all_reduce: each peer's buffer down, the total up to each
            assert row["baseline_client_bytes_down"] >= copies * row["payload"], row
            assert row["baseline_client_bytes_up"] >= copies * row["payload"], row


def test_fleet_rows_carry_the_share_of_cpu_time_the_hypervisor_took(fleet):
    """On Linux each row carries its share, or None where no clock tick of CPU time was counted while
    it was timed (stolen_share: nothing to tell; a --quick row can be that short): at least one has
    a share. Elsewhere none does."""
    shares = [row["stolen"] for row in fleet["rows"]]
    if sys.platform == "linux":
        assert all(share is None or 0.0 <= share <= 1.0 for share in shares), shares
        assert any(share is not None for share in shares), shares
    else:
        assert shares == [None] * len(shares)


def test_cpu_ticks_reads_steal_and_the_time_wanted_from_the_first_line_of_proc_stat(tmp_path):
    # user nice system idle iowait irq softirq steal guest guest_nice: idle and iowait are not wanted
    stat = tmp_path / "stat"
    stat.write_text("cpu  700 10 200 5000 300 5 15 70 0 0\ncpu0 350 5 100 2500 150 2 7 35 0 0\n")
    assert cpu_ticks(str(stat)) == (70, 700 + 10 + 200 + 5 + 15 + 70)
    assert cpu_ticks(str(tmp_path / "missing")) is None


def test_stolen_share_is_the_steal_over_the_time_wanted_between_two_readings():
    assert stolen_share((70, 1000), (100, 1200)) == pytest.approx(30 / 200)
    assert stolen_share((70, 1000), (70, 1000)) is None  # no tick passed: nothing to tell
    assert stolen_share(None, (70, 1000)) is None


def test_the_table_shows_each_rows_stolen_share_and_says_what_it_is():
    report = Report("core")
    report.add(Row("(x) some chain", 2e-3, "numpy", 1e-3, "≤ 2.00x", stolen=0.123))
    report.add(Row("(y) an unmeasured share", 2e-3, "numpy", 1e-3))
    lines = combined_table([report]).splitlines()
    assert "stolen" in lines[0]
    assert "2.00x    12%  ≤ 2.00x" in lines[1]
    assert lines[2].rstrip().endswith("2.00x")
    assert lines[-1].strip() == STOLEN_NOTE
    assert STOLEN_NOTE not in combined_table([Report("core", [Row("(y) unmeasured", 1.0, "b", 1.0)])])


def test_a_target_is_met_by_the_ratios_on_its_side_of_the_bound():
    assert meets(1.99, "≤ 2.00x") and meets(2.0, "≤ 2.00x") and not meets(2.01, "≤ 2.00x")
    assert meets(0.9, "≥ 0.90x") and not meets(0.89, "≥ 0.90x")
    assert meets(1.0, "reported") is None and meets(1.0, "") is None and meets(1.0, "contrast") is None


def _run(chain_ratio: float, op_ratio: float, stolen: float) -> list[dict]:
    """One run of a suite as ``--json`` writes it: a chain row and a one-op row."""
    rows = [Row("(a) chain", chain_ratio * 1e-3, "local", 1e-3, "≤ 1.50x", stolen=stolen),
            Row("(c) one op", op_ratio * 20e-6, "raw echo", 20e-6, "≤ 2.00x", stolen=stolen),
            Row("(b) upload", 3e9, "raw", 2e9, "reported", unit="B/s", higher_is_better=True, stolen=None)]
    return [Report("remote", rows).as_dict()]


def test_the_spread_of_several_runs_gives_each_rows_median_range_and_runs_that_met_it():
    runs = [_run(1.2, 2.5, 0.0), _run(1.6, 1.8, 0.1), _run(1.4, 1.9, 0.3)]
    lines = spread_table(runs).splitlines()
    assert lines[0].split()[-5:] == ["ratio", "range", "met", "stolen", "target"]
    chain, one_op, upload = lines[1], lines[2], lines[3]
    assert "1.40x" in chain and "1.20–1.60x" in chain and " 2/3 " in chain and "10%" in chain  # 1.6 misses 1.5
    assert "1.90x" in one_op and "1.80–2.50x" in one_op and " 2/3 " in one_op
    assert "1.50x" in upload and "3.00 GB/s" in upload and "/3" not in upload  # reported: no count, no share
    assert "3 runs, each in a fresh process" in lines[-2] and lines[-1].strip().startswith("stolen:")


def test_bench_runs_its_suites_in_fresh_processes_and_prints_their_spread(tmp_path, capsys):
    path = tmp_path / "runs.json"
    assert main(["bench", "capture", "--quick", "--runs", "2", "--json", str(path)]) == 0
    runs = json.loads(path.read_text())
    assert len(runs) == 2 and all(run[0]["suite"] == "capture" for run in runs)
    out = capsys.readouterr()
    assert "run 2 of 2" in out.err and "2 runs, each in a fresh process" in out.out
    first = runs[0][0]["rows"][0]
    line = next(line for line in out.out.splitlines() if first["name"] in line)
    if meets(1.0, first["target"]) is not None:
        assert "/2" in line  # how many of the two runs met its target
    assert main(["bench", "capture", "--runs", "0"]) == 2


def test_torch_suite_reports_the_encoder_step_with_one_round_trip_a_step(tmp_path):
    """``ember bench torch --quick``: the Transformer-encoder step on a peer, on numpy and over a delay line."""
    pytest.importorskip("torch")
    path = tmp_path / "torch.json"
    assert main(["bench", "torch", "--quick", "--json", str(path)]) == 0
    (report,) = json.loads(path.read_text())
    rows = {row["name"]: row for row in report["rows"]}
    step = rows["(a) Transformer-encoder AdamW step, torch:cpu peer"]
    assert step["baseline_name"] == "torch eager" and step["target"] == "≤ 1.30x" and step["round_trips"] == 1
    line = rows["(c) the line's cost: step through it less the step straight"]
    assert line["baseline_name"] == "RTT" and line["round_trips"] == 1  # loss.item(): the step's one wait
    assert rows["(b) one op through ember.torch, numpy"]["ember"] > 0
    for row in report["rows"]:
        assert row["baseline"] > 0 and math.isfinite(row["ratio"]), row
    assert any("not built yet" in note for note in report["notes"])
