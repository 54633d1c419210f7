"""The built-in learning-rate schedules against rates worked out by hand, not by the code under test.

lr 1.0, warm-up W = 2, total T = 6, min_lr 0.1, so step k uses (module docstring of
zerompi/optim/schedules.py): k < W: (k + 1) / W; W <= k < T: 0.1 + 0.9 * d((k - W) / (T - W)) with
d(p) = (1 + cos(pi p)) / 2 or 1 - p; k >= T: 0.1. The cosine values: cos(pi/4) = 0.70710678...,
so d(1/4) = 0.85355339..., d(3/4) = 0.14644660...
"""
from __future__ import annotations

import pytest
import torch

import zerompi
from zerompi.optim.schedules import from_policy

EXPECTED = {
    "warmup_cosine": [0.5, 1.0, 1.0, 0.86819805153394639, 0.55, 0.23180194846605361, 0.1, 0.1, 0.1],
    "warmup_linear": [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1],
    "constant": [1.0] * 9,
}


@pytest.mark.parametrize("schedule", sorted(EXPECTED))
def test_rates_by_hand(schedule):
    cfg = zerompi.ZeroConfig(lr=1.0, lr_schedule=schedule, warmup_steps=2, total_steps=6, min_lr=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    factory = from_policy(cfg.lr_policy)
    sched = factory(opt) if factory else None
    rates = []
    for _ in EXPECTED[schedule]:
        rates.append(opt.param_groups[0]["lr"])  # the rate this step uses
        opt.step()
        if sched:
            sched.step()
    assert rates == pytest.approx(EXPECTED[schedule], rel=1e-14, abs=0)


def test_min_lr_is_a_ratio_of_each_groups_lr():
    """Two groups (lr 1.0 and 0.5): min_lr / lr scales both, as DeepSpeed's and HF's schedules do."""
    cfg = zerompi.ZeroConfig(lr=1.0, lr_schedule="warmup_linear", warmup_steps=2, total_steps=6, min_lr=0.1)
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.5}], lr=1.0)
    sched = from_policy(cfg.lr_policy)(opt)
    rates = []
    for _ in range(8):
        rates.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    hand = EXPECTED["warmup_linear"][:8]
    assert [a for a, _ in rates] == pytest.approx(hand, rel=1e-14, abs=0)
    assert [b for _, b in rates] == pytest.approx([r / 2 for r in hand], rel=1e-14, abs=0)
