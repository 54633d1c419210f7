"""reproducible=True's deal of micro-batches over ranks (shard/rounds.py), and its refusals."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerompi
from zerompi.comm.local import run_ranks
from zerompi.errors import ConfigError
from zerompi.shard.rounds import MicroBatchPlan


@pytest.mark.parametrize("g,n", [(6, 1), (6, 4), (12, 5), (7, 7)])
def test_round_robin_covers_every_index_once(g, n):
    plans = [MicroBatchPlan(g, n, r) for r in range(n)]
    assert sorted(i for p in plans for i in p.indices) == list(range(g))
    for k in range(plans[0].rounds):  # round k: indices kN.., one per rank with a micro-batch, in rank order
        ran = [p.indices[k] for p in plans if k < len(p.indices)]
        assert ran == list(range(k * n, k * n + plans[0].sources(k)))
    assert plans[0].loss_factor == 1.0 / g


def test_seeds_depend_on_seed_step_and_index_only():
    s = MicroBatchPlan.seed
    assert s(0, 3, 5) == s(0, 3, 5) and len({s(0, 3, 5), s(1, 3, 5), s(0, 4, 5), s(0, 3, 6)}) == 4
    assert 0 <= s(2**40, 10**9, 10**6) < 2**63


def test_fewer_micro_batches_than_ranks_is_refused_on_every_rank():
    cfg = zerompi.ZeroConfig(stage=2, reproducible=True, micro_batches=1, cpu_threads=1, device="cpu")

    def rank(group):
        with pytest.raises(ConfigError, match="micro_batches=1 is smaller than the world size 2"):
            zerompi.initialize(nn.Linear(2, 2), cfg, group=group)
        return True
    assert run_ranks(2, rank) == [True, True]


def test_step_before_every_micro_batch_ran_is_refused():
    cfg = zerompi.ZeroConfig(stage=2, reproducible=True, micro_batches=3, cpu_threads=1, device="cpu",
                             abort_on_exception=False)

    def rank(group):
        engine = zerompi.initialize(nn.Linear(2, 2), cfg, group=group)
        assert engine.micro_batch_indices() == [0, 1, 2]
        engine.backward(engine(torch.ones(1, 2)).sum())
        with pytest.raises(zerompi.UsageError, match=r"after 1 of this rank's 3 micro-batches \[0, 1, 2\]"):
            engine.step()
        return True
    assert run_ranks(1, rank) == [True]


def test_a_micro_batch_more_than_given_is_refused_before_any_collective():
    cfg = zerompi.ZeroConfig(stage=3, reproducible=True, micro_batches=4, cpu_threads=1, device="cpu",
                             abort_on_exception=False)

    def rank(group):
        engine = zerompi.initialize(nn.Linear(2, 2), cfg, group=group)
        for _ in engine.micro_batch_indices():
            engine.backward(engine(torch.ones(1, 2)).sum())
        with pytest.raises(zerompi.UsageError, match=r"forward of a micro-batch beyond this rank's 2 micro-batches "
                           r"\[%d, %d\]" % (group.rank, group.rank + 2)):
            engine(torch.ones(1, 2))  # refused before stage 3 gathers anything
        with torch.no_grad():
            engine(torch.ones(1, 2))  # evaluation is not a micro-batch
        return engine.step()
    assert run_ranks(2, rank) == [True, True]  # the refused call left nothing behind
