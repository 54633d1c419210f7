"""``deepspeed.moe``: a dense model's parameter groups pass through DeepSpeed's MoE helper as DeepSpeed
returns them (a list, named groups kept), an expert-marked parameter and the MoE layer are refused."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerompi.deepspeed as deepspeed
from zerompi.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from zerompi.errors import UsageError


def test_dense_groups_pass_through():
    net = nn.Linear(3, 2)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": iter(net.parameters()), "name": "p"})
    assert isinstance(groups, list) and len(groups) == 1 and groups[0]["name"] == "p"
    assert groups[0]["params"] == list(net.parameters())
    two = ({"params": [net.weight], "name": "a"}, {"params": [net.bias], "name": "b"})
    assert [g["name"] for g in split_params_into_different_moe_groups_for_optimizer(two)] == ["a", "b"]
    with pytest.raises(ValueError):
        split_params_into_different_moe_groups_for_optimizer(net.weight)


def test_experts_are_refused():
    p = nn.Parameter(torch.zeros(2))
    p.allreduce = False  # DeepSpeed's mark on an expert's parameter
    assert deepspeed.moe.utils.is_moe_param(p)
    with pytest.raises(UsageError, match="expert"):
        split_params_into_different_moe_groups_for_optimizer([{"params": [p], "name": "e"}])
    with pytest.raises(UsageError, match="mixture-of-experts"):
        deepspeed.moe.layer.MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=2)
