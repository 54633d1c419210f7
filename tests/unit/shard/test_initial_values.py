"""Initial values that differ between ranks (shard/initial.py): every rank starts from rank 0's, as DDP
does, and rank 0 names the ranks whose values were replaced, at every stage, for trainable buckets,
frozen parameters and buffers alike; the same seed on every rank says nothing.

Break: drop the report (or compare the digest after the broadcast with itself) and the differing
ranks go unnamed."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zerompi
from zerompi.comm.local import run_ranks
from zerompi.config import ZeroConfig
from zerompi.shard.initial import digest


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.norm = nn.BatchNorm1d(8)  # buffers: running mean and var, and an integer counter
        g = torch.Generator().manual_seed(seed)  # not the global RNG: the ranks here are threads of one process
        with torch.no_grad():
            for fc in (self.fc1, self.fc2):
                fc.weight.copy_(torch.randn(fc.weight.shape, generator=g))
                fc.bias.copy_(torch.randn(fc.bias.shape, generator=g))

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


def _train(stage: int, seeds: list[int], frozen: bool = False):
    def rank(group):
        net = Net(seeds[group.rank])
        if frozen:
            net.fc1.requires_grad_(False)
        with torch.no_grad():
            net.norm.running_mean.add_(seeds[group.rank])  # a buffer that differs with the seed too
        engine = zerompi.initialize(net, ZeroConfig(stage=stage), group=group)
        full = {n: t.clone() for n, t in engine.full_state_dict().items()}
        engine.close()
        return full, engine.sharded.initial.replaced
    return run_ranks(len(seeds), rank)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ranks_whose_initial_values_differ_are_named_and_start_from_rank_0s(stage, caplog):
    with caplog.at_level(logging.WARNING, logger="zerompi"):
        results = _train(stage, [0, 0, 1])
    warned = [r.getMessage() for r in caplog.records if "initial values that differ" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("rank(s) 2 built initial values"), warned
    assert "on rank 2, 5 tensor(s): fc" in warned[0] and "torch.manual_seed" in warned[0], warned
    assert [bool(replaced) for _, replaced in results] == [False, False, True]
    # what a seed decides, the buffer too; the norm's weight and bias (ones, zeros) agree
    assert sorted(results[2][1]) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "norm.running_mean"]
    reference = Net(0).state_dict()
    for full, _ in results:
        for name in ("fc1.weight", "fc2.bias"):
            assert torch.equal(full[name].float(), reference[name]), name


@pytest.mark.parametrize("stage", [0, 3])
def test_the_same_seed_says_nothing_and_frozen_parameters_are_checked_too(stage, caplog):
    with caplog.at_level(logging.WARNING, logger="zerompi"):
        same = _train(stage, [5, 5], frozen=True)
        other = _train(stage, [5, 6], frozen=True)
    assert [bool(r) for _, r in same] == [False, False]
    assert any("fc1.weight" in w for w in other[1][1]), other[1][1]  # the frozen Linear's weight
    assert sum("initial values that differ" in r.getMessage() for r in caplog.records) == 1


def test_digest_tells_apart_what_a_seed_changes_and_not_what_it_does_not():
    a, b = (torch.randn(100, generator=torch.Generator().manual_seed(s)) for s in (0, 1))
    assert digest(a) == digest(a.clone()) and digest(a) != digest(b)
    assert digest(a.to(torch.bfloat16)) == digest(a.to(torch.bfloat16).clone())
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))  # bit patterns, not values
