"""benchmarks/peers/cluster_report.py, the cluster benchmark's model (t = t0 + k 8X / beta), on rows made here
with a known k: the fit recovers it, rows and runs are read as bench_cluster.py writes them, and rows are
named as the results table names them."""
from __future__ import annotations

import json

import pytest

from benchmarks.peers import cluster_report as report

K, T0 = 0.62, {"z3-hsdp": 0.40, "z3-flat": 0.55, "ddp": 0.30}
BYTES = {"z3-hsdp": 2.0e6, "z3-flat": 6.0e6, "ddp": 4.0e6}  # out of the busiest node per step


def _row(run: int, nodes: int, mbit: int, row: str, **extra) -> dict:
    wire = 8 * BYTES[row] / (mbit * 1e6)
    return dict(kind="row", run=run, nodes=nodes, mbit=mbit, row=row, step_s=T0[row] + K * wire,
                link_tx={"node1": BYTES[row], "node2": BYTES[row] / 2}, link_rx={"node1": 1.0, "node2": 2.0},
                collectives_per_step=7, **extra)


def test_the_fit_recovers_k_from_the_two_rates_differences():
    """t0 cancels between the rates: the least-squares k through the origin is the one the rows were made with,
    and each point is (row, wire-time difference, step-time difference)."""
    lines = [_row(1, 2, m, r) for m in (1000, 10000) for r in T0]
    k, pts = report.fit(report.fold(lines), 2, [1000, 10000])
    assert k == pytest.approx(K, rel=1e-12)
    assert sorted(r for r, _, _ in pts) == sorted(T0)
    assert all(dt == pytest.approx(K * dw, rel=1e-12) for _, dw, dt in pts)


def test_a_fit_without_both_rates_has_no_k():
    assert report.fit(report.fold([_row(1, 2, 1000, "ddp")]), 2, [1000, 10000]) == (None, [])


def test_rows_of_the_last_run_are_read_and_errors_kept_apart(tmp_path):
    path = tmp_path / "cluster.jsonl"
    lines = [_row(1, 2, 1000, "ddp"), {"kind": "alpha", "run": 2}, _row(2, 2, 1000, "ddp"),
             _row(2, 2, 1000, "z3-flat", error="timed out")]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rows = report.load(path)
    assert [x["run"] for x in rows] == [2, 2]
    cells = report.fold(rows)
    assert cells[(2, 1000, "ddp")]["tx"] == [BYTES["ddp"]]  # the busiest node's counter
    assert cells[(2, 1000, "ddp")]["calls"] == 7
    assert cells[(2, 1000, "z3-flat")]["errors"] == ["timed out"] and cells[(2, 1000, "z3-flat")]["times"] == []


def test_rows_are_named_as_the_table_names_them():
    assert report.label("ddp") == "DDP" and report.label("ds3-hpz") == "DeepSpeed ZeRO++ hpZ"
    assert report.label("z3-hsdp") == "zerompi stage 3 hsdp"
    assert report.label("z3-hsdp-q") == "zerompi stage 3 hsdp int8 w+g"
    assert report.spread([3.0, 1.0, 2.0], "{:.1f}") == "2.0 (1.0-3.0)" and report.spread([]) == ""
