"""``deepspeed.moe.utils``: DeepSpeed's parameter-group helpers for a model without experts.

An expert parameter is one DeepSpeed's MoE layer marked ``allreduce = False``; zerompi builds
none, and refuses one it is handed (its gradient would need the expert-parallel group).
"""
from __future__ import annotations

from typing import Any

import torch

from zerompi.errors import UsageError

__all__ = ["is_moe_param", "is_moe_param_group", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's test: the parameter carries ``allreduce = False``."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict) -> bool:
    return param_group.get("moe", False)


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any,
                                                         max_group_size: int | float | None = 178956971) -> list:
    """The groups as a list (a dict is one group, a tuple becomes a list), as DeepSpeed returns them.

    Without expert parameters DeepSpeed adds no group, and neither does this; with one it raises.
    """
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in param_groups:
        group["params"] = list(group["params"])  # DeepSpeed rebuilds each group's list too
        if any(is_moe_param(p) for p in group["params"]):
            raise UsageError("split_params_into_different_moe_groups_for_optimizer: a parameter is marked "
                             "as an expert's (allreduce=False); zerompi has no expert parallelism")
    return param_groups
