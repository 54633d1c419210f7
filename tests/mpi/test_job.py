"""The main job, end to end on 2 real ranks: it trains, logs, and its loss falls."""
from __future__ import annotations

import json

import pytest

from .launcher import run_mpi


@pytest.mark.parametrize("stage", (1, 3))
def test_train_gpt_tiny(tmp_path, stage):
    proc = run_mpi(2, "jobs/train_gpt.py", "--config", "jobs/configs/tiny.toml", "--out", str(tmp_path),
                   "--stage", str(stage))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 1 and records[-1]["step"] == 20
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, [r["loss"] for r in records]
    assert any("val_loss" in r for r in records)
    last = records[-1]
    assert last["model_state_bytes"] > 0
    kinds = set(last["bytes_sent_total"])
    assert {"all_gather", "reduce_scatter"} <= kinds
    assert "done: 20 steps, world size 2, stage %d" % stage in proc.stdout + proc.stderr
