"""A checkpoint written by an older zerompi loads bit for bit: the format does not change under a refactor.

``tests/data/old_checkpoint/<version>-<commit>/`` holds a checkpoint written at that commit by
``make.py`` (2 ranks, stage 3, a frozen layer) and what its load must give back. It is loaded here
at other world sizes and stages: one process, and three thread ranks of the in-process group.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

import zerompi
from zerompi.comm.local import run_ranks
from tests.data.old_checkpoint import make

DATA = Path(__file__).resolve().parents[2] / "data" / "old_checkpoint"
WRITTEN = sorted(p for p in DATA.iterdir() if (p / "expected.json").is_file())


def _digests(engine) -> dict[str, str]:
    return {n: hashlib.sha256(t.float().contiguous().numpy().tobytes()).hexdigest()
            for n, t in engine.full_state_dict().items()}


def _load_and_step(engine, where: Path) -> dict:
    client = engine.load_checkpoint(where / "ckpt")
    got = {"steps": engine.stats.steps, "params": _digests(engine), "client_state": client}
    x = torch.ones(5, 4)
    engine.backward(((engine(x) - 1.0) ** 2).mean())  # the loaded optimizer state steps on
    assert engine.step()
    state = [s for s in engine.optimizer.state.values() if s]
    got["adam_keys"] = sorted(state[0]) if state else []
    return got


@pytest.mark.parametrize("where", WRITTEN, ids=[p.name for p in WRITTEN])
@pytest.mark.parametrize("stage", [1, 3])
def test_loads_in_one_process(where, stage):
    expected = json.loads((where / "expected.json").read_text())
    engine = zerompi.initialize(make.model(), make.config().replace(stage=stage), comm=MPI.COMM_SELF)
    got = _load_and_step(engine, where)
    engine.close()
    assert {k: got[k] for k in expected} == expected
    assert got["adam_keys"] == ["exp_avg", "exp_avg_sq", "step"]


@pytest.mark.parametrize("where", WRITTEN, ids=[p.name for p in WRITTEN])
def test_loads_at_three_ranks(where):
    expected = json.loads((where / "expected.json").read_text())

    def rank(group):
        engine = zerompi.initialize(make.model(), make.config(), group=group)
        try:
            return _load_and_step(engine, where)
        finally:
            engine.close()
    for got in run_ranks(3, rank, timeout=120):
        assert {k: got[k] for k in expected} == expected
