"""The optimizer state of whole-tensor groups, per tensor, as a checkpoint entry.

An optimizer that sees whole tensors keeps its state per tensor, on the tensor's owner (optim/whole.py):
per-element tensors (Muon's momentum) and tensors of other shapes (Adafactor's factored row and column
statistics) alike. Each tensor's states are saved whole, by the rank whose written range holds the
tensor's first element (its owner at stages 1-3; at stage 0 the replica whose slice starts it), back to
back in that rank's one dataset ``t/states`` (fp32; 16-bit states widen exactly). The index records, per
tensor, that rank, the offset of its states there, and each state's shape and dtype
(``optimizer["tensor_states"]``), so that a load at any world size and stage reads each tensor's states
onto the rank that steps the tensor now, which gets exactly that tensor's state (tensors of one group
may keep different states: Adafactor's vectors and matrices).

Every rank writes ``t/states`` at the same length, the longest rank's (the rest zeros): the shared-file
and per-node layouts write a dataset of every rank together. Only owners know their tensors' state, so
what the index records of it (these records, each bucket's plain scalars) is gathered from every rank
(:func:`agreed`).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from zerompi.checkpoint import schema
from zerompi.checkpoint.shards import FP32, Part
from zerompi.checkpoint.snapshot import ShardStates, ShardView
from zerompi.checkpoint.taken import HostCopy
from zerompi.errors import CheckpointError

DTYPES = ("float32", "bfloat16", "float16")  # stored as fp32 exactly, restored as they were


def _written(view: ShardView, states: ShardStates) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(tensor name, its state) of the tensors this rank writes, in the order they are packed (a tensor's
    states by name: the index's JSON need not keep a dict's order)."""
    for i, shard in enumerate(view.shards):
        for name, offset, state in states.tensor_states(i):
            if shard.written.start <= shard.own.start + offset < shard.written.stop:
                yield name, dict(sorted(state.items()))


def meta(view: ShardView, states: ShardStates) -> dict[str, dict[str, Any]]:
    """The index's record of the tensor states this rank writes (the key is left out of indexes without any)."""
    out, at = {}, 0
    for name, state in _written(view, states):
        dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in state.items()}
        for k, dtype in dtypes.items():
            if dtype not in DTYPES:
                raise CheckpointError(f"optimizer state {k!r} of tensor {name!r} is {dtype}: a checkpoint holds "
                                      f"whole-tensor state of dtypes {list(DTYPES)}")
        out[name] = {"rank": view.group.rank, "offset": at,
                     "shapes": {k: list(v.shape) for k, v in state.items()}, "dtypes": dtypes}
        at += sum(v.numel() for v in state.values())
    return out


def _end(record: dict[str, Any]) -> int:
    return record["offset"] + sum(math.prod(s) for s in record["shapes"].values())


def agreed(group, states: ShardStates, mine: dict[str, Any]) -> dict[str, Any]:
    """Collective where owners alone hold some state: the optimizer metadata of every rank, merged (state
    names in rank order, each bucket's scalars from the first rank that has them, every tensor's record)."""
    if not states.partial_state:
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
        if not (isinstance(record, dict) and record.keys() == {"rank", "offset", "shapes", "dtypes"}):
            raise CheckpointError(f"{where} is {record!r}, not {{'rank', 'offset', 'shapes', 'dtypes'}}")
        rank, offset, shapes, dtypes = record["rank"], record["offset"], record["shapes"], record["dtypes"]
        if not (type(rank) is int and 0 <= rank < world_size):
            raise CheckpointError(f"{where}['rank'] = {rank!r} is not a rank of the {world_size} that wrote it")
        if not (type(offset) is int and offset >= 0):
            raise CheckpointError(f"{where}['offset'] = {offset!r} is not an offset")
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
    """Entry: the optimizer state of the whole-tensor groups, per tensor (see the module docstring).
    ``records``: the save's (gathered from every rank) or the index's ``tensor_states``."""

    what = "whole-tensor optimizer state"

    def __init__(self, view: ShardView, states: ShardStates, records: dict[str, dict[str, Any]] | None):
        self.view, self.states, self.records = view, states, records or {}

    def parts(self) -> Iterator[Part]:
        if not self.states.partial_state:
            return
        packed = np.zeros(max(map(_end, self.records.values()), default=0), dtype=np.float32)
        for name, state in _written(self.view, self.states):
            at = self.records[name]["offset"]
            for v in state.values():
                packed[at:at + v.numel()] = v.detach().float().cpu().reshape(-1).numpy()
                at += v.numel()
        yield schema.TENSOR_STATES, packed

    def take(self) -> HostCopy:
        """For an asynchronous save: packed now, into an array of its own (the next step changes the states)."""
        return HostCopy(tuple(self.parts()))

    def read(self, ctx) -> list[tuple[int, str, dict[str, np.ndarray]]]:
        """The saved state of every tensor this rank steps (each rank, stage 0: of every tensor): from each
        writer's ``t/states``, the span holding them read once (its checksum blocks checked once)."""
        saved = checked(self.records, ctx.index.world_size)
        wanted = [(i, slot.fqn, saved[slot.fqn]) for i, shard in enumerate(self.view.shards)
                  for slot in shard.layout.slots
                  if slot.fqn in saved and shard.own.start <= slot.offset < shard.own.stop]
        spans: dict[int, tuple[int, np.ndarray]] = {}
        for writer in {record["rank"] for _, _, record in wanted}:
            mine = [r for _, _, r in wanted if r["rank"] == writer]
            lo = min(r["offset"] for r in mine)
            spans[writer] = lo, schema.read_array(ctx.files.dataset(writer, schema.TENSOR_STATES, dtype=FP32),
                                                  lo, max(map(_end, mine)))
        out = []
        for i, name, record in wanted:
            lo, data = spans[record["rank"]]
            state, at = {}, record["offset"] - lo
            for k, shape in sorted(record["shapes"].items()):
                n = math.prod(shape)
                state[k] = data[at:at + n].reshape(shape)
                at += n
            out.append((i, name, state))
        return out

    def apply(self, data: list[tuple[int, str, dict[str, np.ndarray]]], ctx) -> None:
        for i, name, state in data:
            dtypes = self.records[name]["dtypes"]
            self.states.load_tensor_state(
                i, name, {k: torch.from_numpy(np.array(v)).to(getattr(torch, dtypes[k])) for k, v in state.items()})
