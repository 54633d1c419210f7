"""What a checkpoint's index records of the optimizer (its ``optimizer`` section), and the check of a
saved record against the optimizer loading it (the snapshot's ``recorded``: it answers through
snapshot.py's ShardStates); the writer and reader only store and hand it on."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zerompi.checkpoint import tensors
from zerompi.checkpoint.snapshot import ShardStates, ShardView
from zerompi.errors import CheckpointError, all_ranks_ok


def _scalar(v) -> list | None:
    if isinstance(v, torch.Tensor) and v.dim() == 0:
        return [v.item(), str(v.dtype).removeprefix("torch.")]
    if isinstance(v, (int, float, bool)):
        return [v, type(v).__name__]
    return None


def record(view: ShardView, states: ShardStates) -> dict[str, Any]:
    """This rank's record: param group options, per-element state keys, and scalar state per bucket (JSON)."""
    keys: list[str] = []
    by_group: dict[int, list[str]] = {}  # a param group may run an optimizer of its own (optim/groups.py)
    scalars = []
    for i, shard in enumerate(view.shards):
        per_bucket, mine = {}, by_group.setdefault(shard.layout.group, [])
        for k, v in states.peek_state(i).items():  # names and scalars: nothing swapped in
            s = _scalar(v)
            if s is not None:
                per_bucket[k] = s
            elif isinstance(v, torch.Tensor) and v.dim() == 1:  # per-element (possibly swapped out)
                keys += [] if k in keys else [k]
                mine += [] if k in mine else [k]
            else:
                raise CheckpointError(f"optimizer state {k!r} of type {type(v).__name__} cannot be saved: "
                                      "only per-element tensors and scalars are supported")
        scalars.append(per_bucket)
    whole = tensors.meta(view, states)
    return {"groups": states.hyperparameters(), "state_keys": keys, "scalars": scalars,
            "group_state_keys": [by_group.get(g, []) for g in range(max(by_group, default=-1) + 1)],
            "group_optimizers": states.optimizer_names(), **({"tensor_states": whole} if whole else {})}


def gathered(group, view: ShardView, states: ShardStates) -> dict[str, Any]:
    """Collective over ``group``: ``record``, refused on every rank if any cannot save its state (a whole
    tensor's is on its owner alone), and merged over the ranks where owners alone hold some (tensors.py)."""
    meta, error = None, None
    try:
        meta = record(view, states)
    except CheckpointError as e:
        error = str(e)
    all_ranks_ok(group, error, CheckpointError)
    return tensors.agreed(group, states, meta)


def check(saved: dict[str, Any], saved_config: dict[str, Any], view: ShardView, states: ShardStates,
          directory: Path) -> None:
    """Raise CheckpointError if the state ``saved`` records was written by another optimizer than the one
    that would load it (``saved_config``: the index's config, for records older than per-group optimizers)."""
    if not saved.get("state_keys") and not saved.get("tensor_states"):
        return  # no state to misread
    names = saved.get("group_optimizers")
    if names is None:  # written before groups could choose: the config's optimizer ran every group
        name, ours = saved_config.get("optimizer"), view.config.keys["optimizer"]
        if name != ours:
            raise CheckpointError(f"{directory}: optimizer state was written by {name!r}, this job uses {ours!r}")
        return
    if not (isinstance(names, list) and all(isinstance(s, str) for s in names)):
        raise CheckpointError(f"{directory}: the index's group_optimizers {names!r} is not a list of class names")
    for i, (s, o) in enumerate(zip(names, states.optimizer_names())):
        if s != o:
            raise CheckpointError(f"{directory}: the optimizer state of param group {i} was written by {s}, "
                                  f"this job runs {o} there")
