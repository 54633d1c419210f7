"""DeepSpeed's schedulers as zerompi LambdaLR factors: the learning rate of every optimizer step.

Each step's learning rates are read off the optimizer before the step, then the scheduler
steps (as both engines do after an optimizer step). They are checked against numbers worked
out by hand from DeepSpeed's formulas (zerompi/compat/deepspeed/lr_schedules.py), and, when the peers
venv has DeepSpeed (tests/peers.py), against DeepSpeed's own scheduler classes on the same
param groups. WarmupCosineLR multiplies each group's lr by the same ratio on both sides, so
it must agree exactly; WarmupLR/WarmupDecayLR set absolute rates, which LambdaLR reaches as
group lr x (rate / group lr): equal within a few units in the last place.
"""
from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
import torch

from zerompi.compat.deepspeed.schedule import read_schedule
from zerompi.errors import ConfigError
from zerompi.compat.deepspeed.lr_schedules import scheduler_factory

from tests.peers import deepspeed_python


def lr_sequence(kind: str, params: dict, group_lrs: list[float], steps: int, auto_warmup: bool = False):
    spec = read_schedule({"scheduler": {"type": kind, "params": params}}, auto_warmup)
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in group_lrs])
    sched = scheduler_factory(spec)(opt)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


def first_group(seq):
    return [lrs[0] for lrs in seq]


C = (1 + math.cos(math.pi / 4)) / 2  # the cosine factor a quarter of the way


@pytest.mark.parametrize("kind,params,expected", [
    # The first step runs at the warm-up start, and so does the second (gamma(0) = 0).
    ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=4, warmup_type="linear"),
     [0.001, 0.001, 0.00325, 0.0055, 0.00775, 0.01, 0.01]),
    ("WarmupLR", dict(warmup_max_lr=1.0, warmup_num_steps=4),  # log warm-up, DeepSpeed's default
     [0.0, 0.0, 0.5, math.log(3) / math.log(4), 1.0, 1.0]),
    ("WarmupLR", dict(warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear"),  # W becomes max(2, 1)
     [0.0, 0.0, 0.5, 1.0]),
    ("WarmupDecayLR", dict(total_num_steps=6, warmup_max_lr=1.0, warmup_num_steps=2, warmup_type="linear"),
     [0.0, 0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]),
    ("WarmupCosineLR", dict(total_num_steps=6, warmup_num_steps=2, warmup_type="linear", cos_min_ratio=0.0),
     [0.0, 0.0, 0.5, C, 0.5, 1 - C, 0.0, 0.0]),
    ("WarmupCosineLR", dict(total_num_steps=6, warmup_num_steps=2, warmup_type="linear", cos_min_ratio=0.2,
                            warmup_min_ratio=0.4),
     [0.0, 0.4, 0.7, 0.2 + 0.8 * C, 0.6, 0.2 + 0.8 * (1 - C), 0.2, 0.2]),
])
def test_lr_sequence_matches_the_formulas(kind, params, expected):
    got = first_group(lr_sequence(kind, params, [1.0], len(expected)))
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_auto_warmup_of_zero_means_no_warmup():
    # An "auto" warm-up resolved to zerompi's warmup_steps=0: the "after" formulas from step 0.
    assert first_group(lr_sequence("WarmupLR", dict(warmup_num_steps=0), [0.3], 3, auto_warmup=True)) == [0.3] * 3
    cos = lr_sequence("WarmupCosineLR", dict(total_num_steps=4, warmup_num_steps=0, cos_min_ratio=0.0), [1.0], 6,
                      auto_warmup=True)
    assert first_group(cos) == pytest.approx([1.0, C, 0.5, 1 - C, 0.0, 0.0], abs=1e-15)
    decay = lr_sequence("WarmupDecayLR", dict(total_num_steps=4, warmup_max_lr=1.0, warmup_num_steps=0), [1.0], 6,
                        auto_warmup=True)
    assert first_group(decay) == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps=0"):
        lr_sequence("WarmupLR", dict(warmup_num_steps=0), [0.3], 1)  # DeepSpeed refuses an explicit 0


def test_groups_follow_deepspeed():
    # WarmupLR without warmup_max_lr warms each group up to its own lr; with one, every group to it.
    own = lr_sequence("WarmupLR", dict(warmup_num_steps=2, warmup_type="linear"), [0.1, 0.02], 4)
    assert own[-1] == pytest.approx([0.1, 0.02])
    same = lr_sequence("WarmupLR", dict(warmup_num_steps=2, warmup_max_lr=0.05, warmup_type="linear"), [0.1, 0.02], 4)
    assert same[-1] == pytest.approx([0.05, 0.05])
    cos = lr_sequence("WarmupCosineLR", dict(total_num_steps=5, warmup_num_steps=2), [0.1, 0.02], 4)
    assert [a / 0.1 for a, _ in cos] == pytest.approx([b / 0.02 for _, b in cos])


def test_state_is_json_and_resumes():
    spec = read_schedule({"scheduler": {"type": "WarmupDecayLR", "params": dict(total_num_steps=9)}}, False)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = scheduler_factory(spec)(opt)
    for _ in range(3):
        opt.step()
        sched.step()
    state = json.loads(json.dumps(sched.state_dict()))
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched2 = scheduler_factory(spec)(opt2)
    sched2.load_state_dict(state)
    for o, s in ((opt, sched), (opt2, sched2)):
        o.step()
        s.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.parametrize("params,match", [
    (dict(type="OneCycle"), r"scheduler.type='OneCycle' is not one of 'WarmupLR'"),
    (dict(params={"warmup_num_steps": 3}), r"scheduler.type=\(missing\)"),
    (dict(type="WarmupLR", params={"total_num_steps": 3, "cos_min_ratio": 0.1}), r"scheduler.params.cos_min_ratio"),
    (dict(type="WarmupDecayLR", params={}), r"scheduler.params.total_num_steps is missing"),
    (dict(type="WarmupLR", params={"warmup_type": "cosine"}), r"warmup_type='cosine' is not one of 'log', 'linear'"),
    (dict(type="WarmupLR", params={"warmup_num_steps": 2.5}), r"scheduler.params.warmup_num_steps=2.5"),
    (dict(type="WarmupLR", params={"warmup_max_lr": [0.1, 0.2]}), r"scheduler.params.warmup_max_lr="),
])
def test_schedule_errors_name_the_key(params, match):
    with pytest.raises(ConfigError, match=match):
        read_schedule({"scheduler": params}, False)


# ---- against DeepSpeed's own classes (peers venv) -------------------------------------------

CASES = [
    ("WarmupLR", dict(warmup_num_steps=5), [0.1, 0.02]),
    ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=4, warmup_type="linear"), [0.01, 0.005]),
    ("WarmupLR", dict(warmup_num_steps=1, warmup_max_lr=3e-4), [1e-3]),
    ("WarmupDecayLR", dict(total_num_steps=12, warmup_num_steps=3, warmup_min_lr=1e-4, warmup_max_lr=0.05,
                           warmup_type="linear"), [0.05]),
    ("WarmupDecayLR", dict(total_num_steps=10), [0.3, 0.1]),  # warm-up (1000) longer than the run
    ("WarmupDecayLR", dict(total_num_steps=4, warmup_num_steps=8, warmup_max_lr=0.2), [0.2]),
    ("WarmupCosineLR", dict(total_num_steps=12, warmup_num_steps=3, warmup_min_ratio=0.1, cos_min_ratio=0.05,
                            warmup_type="linear"), [0.1, 0.02]),
    ("WarmupCosineLR", dict(total_num_steps=10, warmup_num_steps=4), [3e-4]),
]
STEPS = 16

_DEEPSPEED_SIDE = """
import json, sys, torch
from deepspeed.runtime import lr_schedules
out = []
for kind, params, lrs, steps in json.load(sys.stdin):
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs])
    sched = getattr(lr_schedules, kind)(opt, **params)
    seq = []
    for _ in range(steps):
        seq.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    out.append(seq)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def deepspeed_sequences():
    python = deepspeed_python()
    proc = subprocess.run([str(python), "-c", _DEEPSPEED_SIDE], input=json.dumps([[*c, STEPS] for c in CASES]),
                          capture_output=True, text=True, timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_lr_sequence_matches_deepspeed(deepspeed_sequences, case):
    kind, params, lrs = CASES[case]
    ours = lr_sequence(kind, params, lrs, STEPS)
    theirs = deepspeed_sequences[case]
    if kind == "WarmupCosineLR":
        assert ours == theirs
    else:
        assert ours == [pytest.approx(row, rel=4 * 2**-52, abs=0) for row in theirs]
