"""Every rank passes the same config (shard/agreement.py): checked in one all-gather at initialize."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import zerompi
from zerompi.comm.local import run_ranks
from zerompi.errors import ConfigError
from zerompi.shard.agreement import PER_RANK, check_configs_agree

BASE = zerompi.ZeroConfig(stage=2, device="cpu", cpu_threads=1)


def test_the_same_config_passes():
    assert run_ranks(3, lambda group: check_configs_agree(BASE, group)) == [None] * 3


def test_a_key_that_differs_is_named_with_every_ranks_value_on_every_rank():
    def rank(group):
        cfg = dataclasses.replace(BASE, lr=1e-2 if group.rank == 1 else 1e-3, stage=3 if group.rank == 2 else 2)
        with pytest.raises(ConfigError) as e:
            check_configs_agree(cfg, group)
        return str(e.value)
    messages = run_ranks(3, rank)
    assert len(set(messages)) == 1
    assert "lr: 0.001 on rank(s) [0, 2], 0.01 on rank(s) [1]" in messages[0]
    assert "stage: 2 on rank(s) [0, 1], 3 on rank(s) [2]" in messages[0]


def test_per_rank_keys_may_differ():
    def rank(group):
        check_configs_agree(dataclasses.replace(BASE, hang_dir=f"/tmp/h{group.rank}", cpu_threads=group.rank + 1),
                            group)
        return True
    assert run_ranks(2, rank) == [True, True]
    assert PER_RANK <= {f.name for f in dataclasses.fields(BASE)}


def test_initialize_refuses_ranks_with_another_config():
    def rank(group):
        torch.manual_seed(0)
        cfg = dataclasses.replace(BASE, bucket_mb=1.0 if group.rank == 0 else 2.0)
        with pytest.raises(ConfigError, match="bucket_mb: 1.0 on rank"):
            zerompi.initialize(torch.nn.Linear(4, 4), cfg, group=group)
        return True
    assert run_ranks(2, rank) == [True, True]
