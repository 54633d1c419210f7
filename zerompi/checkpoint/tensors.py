"""The optimizer state of whole-tensor groups, per tensor, as a checkpoint entry.

An optimizer that sees whole tensors keeps its state per tensor, on the tensor's owner (optim/whole.py):
per-element tensors (Muon's momentum) and tensors of other shapes (Adafactor's factored row and column
statistics) alike. Each is saved whole, under its tensor's name (``t/<name>/<key>``), by the rank whose
written range holds the tensor's first element: its owner (stages 1-3), or at stage 0 the replica whose
slice starts it. The index records, per tensor, that rank and each state's shape and dtype
(``optimizer["tensor_states"]``), so that a load at any world size and stage reads each tensor's state
from the file that has it, onto the rank that steps the tensor now, which gets exactly that tensor's
state (tensors of one group may keep different states: Adafactor's vectors and matrices).

Only owners know their tensors' state, so what the index records of it (these, and each bucket's plain
scalars) is gathered from every rank (:func:`agreed`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from zerompi.checkpoint import schema
from zerompi.checkpoint.shards import Part, to_numpy
from zerompi.checkpoint.snapshot import EngineSnapshot
from zerompi.errors import CheckpointError

DTYPES = ("float32", "float64", "bfloat16", "float16")  # what a state is restored as (stored as <f4 or <f8)


def _stored(dtype: str) -> str:
    return "<f8" if dtype == "float64" else "<f4"


def _written(snap: EngineSnapshot) -> Iterator[tuple[int, str, dict[str, torch.Tensor]]]:
    """(bucket, tensor name, per-tensor state) of the tensors this rank writes."""
    for i, shard in enumerate(snap.shards):
        for name, offset, state in snap.states.tensor_states(i):
            if shard.written.start <= shard.own.start + offset < shard.written.stop:
                yield i, name, state


def meta(snap: EngineSnapshot) -> dict[str, dict[str, Any]]:
    """The index's record of the tensor states this rank writes (the key is left out of indexes without any)."""
    return {name: {"rank": snap.shard_group.rank, "shapes": {k: list(v.shape) for k, v in state.items()},
                   "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in state.items()}}
            for _, name, state in _written(snap)}


def agreed(group, snap: EngineSnapshot, mine: dict[str, Any]) -> dict[str, Any]:
    """Collective where owners alone hold some state: the optimizer metadata of every rank, merged (state
    names in rank order, each bucket's scalars from the first rank that has them, every tensor's record)."""
    if not snap.states.partial_state:
        return mine
    metas = group.allgather_object(mine)
    out = dict(mine)
    out["state_keys"] = list(dict.fromkeys(k for m in metas for k in m["state_keys"]))
    out["group_state_keys"] = [list(dict.fromkeys(k for m in metas for k in m["group_state_keys"][g]))
                               for g in range(len(mine["group_state_keys"]))]
    out["scalars"] = [next((m["scalars"][i] for m in metas if m["scalars"][i]), {})
                      for i in range(len(mine["scalars"]))]
    whole = {k: v for m in metas for k, v in m.get("tensor_states", {}).items()}
    return {**out, "tensor_states": whole} if whole else out


def checked(saved: Any, world_size: int) -> dict[str, dict[str, Any]]:
    """The index's ``tensor_states``, checked field by field (absent in checkpoints without any)."""
    saved = {} if saved is None else saved
    if not isinstance(saved, dict):
        raise CheckpointError(f"the index's optimizer tensor_states {saved!r} is not a dict")
    for name, record in saved.items():
        where = f"the index's optimizer tensor_states[{name!r}]"
        if not (isinstance(record, dict) and record.keys() == {"rank", "shapes", "dtypes"}):
            raise CheckpointError(f"{where} is {record!r}, not {{'rank', 'shapes', 'dtypes'}}")
        rank, shapes, dtypes = record["rank"], record["shapes"], record["dtypes"]
        if not (type(rank) is int and 0 <= rank < world_size):
            raise CheckpointError(f"{where}['rank'] = {rank!r} is not a rank of the {world_size} that wrote it")
        if not (isinstance(shapes, dict) and isinstance(dtypes, dict) and shapes.keys() == dtypes.keys()
                and all(isinstance(k, str) and k for k in shapes)):
            raise CheckpointError(f"{where}: shapes {shapes!r} and dtypes {dtypes!r} must name the same states")
        for k in shapes:
            if not (isinstance(shapes[k], list) and all(type(d) is int and d >= 0 for d in shapes[k])):
                raise CheckpointError(f"{where}['shapes'][{k!r}] = {shapes[k]!r} is not a shape")
            if dtypes[k] not in DTYPES:
                raise CheckpointError(f"{where}['dtypes'][{k!r}] = {dtypes[k]!r} is not one of {list(DTYPES)}")
    return saved


class TensorStates:
    """Entry: the optimizer state of the whole-tensor groups, per tensor (see the module docstring)."""

    what = "whole-tensor optimizer state"

    def __init__(self, snap: EngineSnapshot):
        self.snap = snap

    def parts(self) -> Iterator[Part]:
        for _, name, state in _written(self.snap):
            for k, v in state.items():
                yield schema.tensor_state(name, k), to_numpy(v).reshape(-1)

    def later(self) -> Callable[[], Iterator[Part]]:
        copies = [(name, data.copy()) for name, data in self.parts()]  # the next step changes them
        return lambda: iter(copies)

    def read(self, ctx) -> list[tuple[int, str, dict[str, np.ndarray]]]:
        """The saved state of every tensor this rank steps (each rank, stage 0: of every tensor)."""
        saved = checked(ctx.index.optimizer.get("tensor_states"), ctx.index.world_size)
        out = []
        for i, shard in enumerate(self.snap.shards):
            for slot in shard.layout.slots:
                record = saved.get(slot.fqn)
                if record is None or not shard.own.start <= slot.offset < shard.own.stop:
                    continue
                state = {}
                for k, shape in record["shapes"].items():
                    ds = ctx.files.dataset(record["rank"], schema.tensor_state(slot.fqn, k), math.prod(shape),
                                           _stored(record["dtypes"][k]))
                    state[k] = schema.read_array(ds).reshape(shape)
                out.append((i, slot.fqn, state))
        return out

    def apply(self, data: list[tuple[int, str, dict[str, np.ndarray]]], ctx) -> None:
        saved = ctx.index.optimizer.get("tensor_states") or {}
        for i, name, state in data:
            dtypes = saved[name]["dtypes"]
            self.snap.states.load_tensor_state(
                i, name, {k: torch.from_numpy(np.ascontiguousarray(v)).to(getattr(torch, dtypes[k]))
                          for k, v in state.items()})
