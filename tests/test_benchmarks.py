"""``ember bench`` suites run end to end at their quick size: the report's structure and the
properties that are not times (no tensor byte through the client on peer-to-peer rows). Times
are never asserted: the machines are shared."""

from __future__ import annotations

import json
import math

import pytest
from ember.benchmarks import SUITES

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
