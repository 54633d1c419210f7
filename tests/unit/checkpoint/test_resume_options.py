"""An optimizer option the config changed between a save and its resume: the checkpoint's value wins,
as in torch's ``Optimizer.load_state_dict`` and DeepSpeed's ``load_checkpoint``, and rank 0 says so,
naming the group, the key, both values and how to train on with the new one. A schedule's lr moves by
design and is compared at its base (``initial_lr``), so an unchanged config under a schedule says nothing.

Break: drop the warning (or compare ``lr`` under a schedule) and the first (or the last) test fails."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zerompi
from zerompi.comm.local import run_ranks
from zerompi.config import ZeroConfig
from zerompi.optim.groups import changed_on_resume


def _resume(tmp_path, saved: dict, loaded: dict, caplog) -> tuple[list[float], list[str]]:
    """Train 3 steps under ``saved``, save; build under ``loaded`` and load: each rank's lr, and the
    warnings of the load."""
    def rank(group):
        torch.manual_seed(0)
        engine = zerompi.initialize(nn.Linear(4, 2), ZeroConfig(stage=1, **saved), group=group)
        for _ in range(3):
            engine.backward(engine(torch.ones(3, 4)).sum())
            engine.step()
        engine.save_checkpoint(tmp_path, tag="t")
        engine.close()
        torch.manual_seed(0)
        engine = zerompi.initialize(nn.Linear(4, 2), ZeroConfig(stage=1, **loaded), group=group)
        engine.load_checkpoint(tmp_path, tag="t")
        lr = engine.optimizer.param_groups[0]["lr"]
        engine.close()
        return lr
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zerompi"):
        lrs = run_ranks(2, rank)
    return lrs, [r.getMessage() for r in caplog.records if "optimizer options differ" in r.getMessage()]


def test_a_changed_lr_is_named_and_the_checkpoints_wins(tmp_path, caplog):
    lrs, warned = _resume(tmp_path, dict(lr=0.01), dict(lr=0.02, weight_decay=0.5), caplog)
    assert lrs == [0.01, 0.01]  # the checkpoint's, on every rank
    assert len(warned) == 1, warned  # rank 0's
    assert "group 0: lr 0.02 here, 0.01 in the checkpoint" in warned[0], warned
    assert "weight_decay 0.5 here" in warned[0] and "param_groups[i][key] = value" in warned[0], warned


@pytest.mark.parametrize("schedule", [dict(), dict(lr_schedule="warmup_cosine", warmup_steps=2, total_steps=10)])
def test_the_same_config_says_nothing_also_under_a_schedule(tmp_path, caplog, schedule):
    lrs, warned = _resume(tmp_path, dict(lr=0.01, **schedule), dict(lr=0.01, **schedule), caplog)
    assert warned == [] and lrs[0] == lrs[1]


def test_changed_on_resume_compares_a_scheduled_groups_base_lr():
    now = [{"lr": 0.0, "initial_lr": 0.02, "betas": (0.9, 0.99), "foreach": True}]
    then = [{"lr": 0.005, "initial_lr": 0.01, "betas": [0.9, 0.999], "foreach": False}]
    assert changed_on_resume(now, then) == ["group 0: initial_lr 0.02 here, 0.01 in the checkpoint",
                                            "group 0: betas (0.9, 0.99) here, (0.9, 0.999) in the checkpoint"]
    assert changed_on_resume([{"lr": 0.1}], [{"lr": 0.1}]) == []
