"""Param groups that choose their own optimizer (zerompi/optim/groups.py).

Judged against the independent reference of the reproducible mode: the plain single-process loop
(``(loss / G).backward()`` over the G micro-batches in order, then each group's own torch optimizer,
for-loop kernels) trains the same bits as the engine at stages 0-3 and N = 1..3 ranks, a checkpoint
written at 2 ranks and resumed at 3 included. A choice the engine cannot run is refused naming the group.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerompi
from zerompi.comm.local import run_ranks
from zerompi.config import ZeroConfig
from zerompi.errors import ConfigError, UsageError

from .loop import G, Template, plain, train

STEPS = 3
CFG = dict(optimizer="adamw", lr=1e-2, weight_decay=0.01, cpu_threads=1, device="cpu", reproducible=True,
           micro_batches=G, bucket_mb=1e-4, checkpoint_layout="per_rank")


_net = Template(lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)))


def _groups(net: nn.Sequential) -> list[dict]:
    return [{"params": list(net[0].parameters()), "optimizer": torch.optim.SGD, "lr": 0.05, "momentum": 0.9},
            {"params": list(net[2].parameters()), "optimizer": "torch.optim.Adagrad"},
            {"params": list(net[4].parameters()), "weight_decay": 0.0}]  # the config's AdamW


def _plain(steps: int) -> dict[str, torch.Tensor]:
    """Each group's torch optimizer on its own parameters: SGD with the group's options, Adagrad with the
    config's lr, AdamW with the config's options under the group's weight_decay."""
    net = _net()
    opts = [torch.optim.SGD(net[0].parameters(), lr=0.05, momentum=0.9, foreach=False),
            torch.optim.Adagrad(net[2].parameters(), lr=1e-2, foreach=False),
            torch.optim.AdamW(net[4].parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                              foreach=False)]
    return plain(net, opts, steps)


def _engine(group, stage: int):
    net = _net()
    return zerompi.initialize(net, ZeroConfig(stage=stage, **CFG), group=group, param_groups=_groups(net))


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_group_trains_as_its_own_optimizer_bit_for_bit(stage, n):
    want = _plain(STEPS)

    def rank(group):
        engine = _engine(group, stage)
        train(engine, range(STEPS))
        got = engine.full_state_dict()
        engine.close()
        return got
    for got in run_ranks(n, rank):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), \
            {k: float((got[k] - want[k]).abs().max()) for k in want}


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offloaded_groups_train_the_same_bits(tmp_path, offload):
    """The offload stores find each group's state by its master shard, whichever optimizer made it."""
    want = _plain(STEPS)
    extra = dict(offload_optimizer=offload, **({"nvme_path": str(tmp_path)} if offload == "nvme" else {}))

    def rank(group):
        net = _net()
        engine = zerompi.initialize(net, ZeroConfig(stage=2, **CFG, **extra), group=group, param_groups=_groups(net))
        train(engine, range(STEPS))
        got = engine.full_state_dict()
        engine.close()
        return got
    for got in run_ranks(2, rank):
        assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_of_mixed_groups_resumes_at_another_world_size(tmp_path, stage):
    """Saved at 2 ranks after 2 steps (SGD's momentum, Adagrad's sums, AdamW's moments), loaded at 3: the
    third step ends in the plain loop's bits."""
    def save(group):
        engine = _engine(group, stage)
        train(engine, range(2))
        engine.save_checkpoint(tmp_path, "step2")
        engine.close()

    def resume(group):
        engine = _engine(group, stage)
        engine.load_checkpoint(tmp_path, "step2")
        train(engine, range(2, 3))
        got = engine.full_state_dict()
        engine.close()
        return got
    run_ranks(2, save)
    want = _plain(3)
    for got in run_ranks(3, resume):
        assert all(torch.equal(got[k], want[k]) for k in want), \
            {k: float((got[k] - want[k]).abs().max()) for k in want}


def test_a_checkpoint_is_refused_by_a_job_whose_group_runs_another_optimizer(tmp_path):
    def save(group):
        engine = _engine(group, 2)
        train(engine, range(1))
        engine.save_checkpoint(tmp_path, "s")
        engine.close()

    def load(group):
        net = _net()
        groups = _groups(net)
        groups[1]["optimizer"] = torch.optim.RMSprop
        engine = zerompi.initialize(net, ZeroConfig(stage=2, **CFG), group=group, param_groups=groups)
        with pytest.raises(zerompi.CheckpointError, match=r"param group 1.*Adagrad.*RMSprop"):
            engine.load_checkpoint(tmp_path, "s")
        engine.close()
    run_ranks(2, save)
    run_ranks(2, load)


@pytest.mark.parametrize("value,match", [
    (torch.optim.LBFGS, r"param_groups\[1\]\['optimizer'\]=.*LBFGS.*cannot run here: .*closure"),
    ("torch.optim.Muon", r"param_groups\[1\]\['optimizer'\]: Muon refuses parameter '2.bias'"),
    ("torch.optim.NoSuchThing", r"param_groups\[1\]\['optimizer'\]"),
])
def test_a_group_optimizer_the_engine_cannot_run_is_refused_naming_the_group(value, match):
    def rank(group):
        net = _net()
        groups = _groups(net)
        groups[1]["optimizer"] = value
        with pytest.raises(ConfigError, match=match):
            zerompi.initialize(net, ZeroConfig(stage=2, **CFG), group=group, param_groups=groups)
    run_ranks(2, rank)


def test_a_key_the_group_optimizer_does_not_take_is_refused():
    def rank(group):
        net = _net()
        groups = _groups(net)
        groups[0]["betas"] = (0.9, 0.99)  # SGD's group: an Adam option, kept and used for nothing by torch
        with pytest.raises(UsageError, match=r"param_groups\[0\] sets 'betas', which SGD does not take"):
            zerompi.initialize(net, ZeroConfig(stage=2, **CFG), group=group, param_groups=groups)
    run_ranks(2, rank)


def test_a_group_kernel_the_reproducible_mode_cannot_use_is_refused():
    def rank(group):
        net = _net()
        groups = _groups(net)
        groups[0]["foreach"] = True
        with pytest.raises(ConfigError, match=r"param_groups\[0\]\['foreach'\]=True with reproducible=True"):
            zerompi.initialize(net, ZeroConfig(stage=2, **CFG), group=group, param_groups=groups)
    run_ranks(2, rank)
