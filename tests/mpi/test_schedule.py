"""Learning-rate schedules through the engine, against single-process PyTorch with the same scheduler.

Stages 0-3 on 1-3 ranks, two param groups (one with its own lr), clipping on: the config's
warm-up + cosine schedule and a user SequentialLR (LinearLR then ExponentialLR) given as
``initialize(lr_scheduler=fn)``. Each step's learning rates must equal the reference's exactly
(the same torch scheduler code on the same group values); the parameters are judged by the
order-noise bound of the parity matrix (tests/mpi/tolerance.py). Resumed mid-schedule (after
the warm-up's first steps) a job continues with bitwise the same learning rates, and at the same
world size bitwise the same losses and parameters; at another world size the learning rates.
"""
from __future__ import annotations

import json

import pytest

from .batch import Batch, selected
from .tolerance import check_parity

WORLDS = (1, 2, 3)
SCHEDULES = ("config", "user")
# The config schedule's rates worked out by hand (lr 1e-2 and the second group's 5e-3; warm-up 2, total 5,
# min_lr 1e-4, so a floor of 1 %): k < 2: (k + 1) / 2; then 0.01 + 0.99 * (1 + cos(pi (k - 2) / 3)) / 2,
# i.e. 1, 0.7525, 0.2575 at k = 2, 3, 4; k >= 5: 0.01. Not computed by optim/schedules, which the
# reference also uses.
BY_HAND = [0.5, 1.0, 1.0, 0.7525, 0.2575, 0.01]


def _key(rows: list[dict]) -> dict:
    return {(r["stage"], r["schedule"]): r for r in rows}


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """workers/schedule.py's runs as one job per world size (tests/mpi/batch.py): the parity rows at each
    world size the selected tests name, and the mid-schedule save (2 ranks) and resumes (2 and 3 ranks)
    in the jobs of their world sizes. ``jobs(name)`` checks a run and returns its rows by (stage, schedule)."""
    batch = Batch("schedule.py", tmp_path_factory, whole_file=True)
    where = tmp_path_factory.mktemp("schedule")
    tests = selected(request)
    for world in sorted({i.callspec.params["world"] for i in tests if i.originalname == "test_schedule_parity"}):
        batch.add(f"np{world}", world, "--out", where / f"np{world}.json")
    if any(i.originalname == "test_resume_mid_schedule" for i in tests):
        common = ("--root", where / "ckpt")
        batch.add("save", 2, "--out", where / "save.json", "--mode", "save", *common)
        batch.add("same", 2, "--out", where / "same.json", "--mode", "resume", *common, after=["save"])
        batch.add("other", 3, "--out", where / "other.json", "--mode", "resume", *common, after=["save"])
    batch.run()

    def rows(name: str) -> dict:
        batch.check(name)
        return _key(json.loads((where / f"{name}.json").read_text()))
    return rows


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stage", range(4))
def test_schedule_parity(jobs, world, stage, schedule):
    r = jobs(f"np{world}")[(stage, schedule)]
    assert r["lrs"] == r["ref_lrs"]
    if schedule == "config":
        assert [a for a, _ in r["lrs"]] == pytest.approx([1e-2 * f for f in BY_HAND], rel=1e-12, abs=0)
        assert [b for _, b in r["lrs"]] == pytest.approx([5e-3 * f for f in BY_HAND], rel=1e-12, abs=0)
    assert len({tuple(x) for x in r["lrs"]}) > 2  # the schedule moved the learning rates
    assert r["lrs"][0][1] != r["lrs"][0][0]  # two groups, two learning rates
    check_parity(r)


@pytest.fixture(scope="module")
def resumed(jobs):
    return jobs("save"), jobs("same"), jobs("other")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stage", range(4))
def test_resume_mid_schedule(resumed, stage, schedule):
    saved, same, other = (rows[(stage, schedule)] for rows in resumed)
    assert same["lrs"] == saved["lrs"][3:]
    assert other["lrs"] == saved["lrs"][3:]
    assert same["losses"] == saved["losses"][3:]
    assert same["params"] == saved["params"]
