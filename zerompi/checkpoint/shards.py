"""The optimizer's shards as a checkpoint entry: each bucket's fp32 master and optimizer state.

Written as ``b<i>/master`` and ``b<i>/state/<key>``, the part of each bucket this rank
owns (a stage-0 replica writes its slice), one bucket in memory at a time. Read back
at any world size, stage or bucket size: each of our buckets' own range is located,
parameter by parameter, in the saved buckets (the index's layouts) and read straight
into the arrays that become the engine's state (rawio.read_tasks).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zerompi.checkpoint import schema
from zerompi.checkpoint.index import CheckpointIndex, Source
from zerompi.checkpoint.rawio import Reads, read_tasks
from zerompi.checkpoint.snapshot import ShardSnapshot, ShardStates, ShardView
from zerompi.errors import CheckpointError

FP32 = "<f4"  # master shards and optimizer state are stored as little-endian fp32
Part = tuple[str, np.ndarray]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """CPU numpy copy; 16-bit floats widen to fp32 (exact) since numpy has no bfloat16."""
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.contiguous().numpy()


def merge(sources: list[Source]) -> list[Source]:
    """Join runs that are contiguous both in the file and in the destination (one read each)."""
    out: list[Source] = []
    for s in sorted(sources, key=lambda s: (s.rank, s.bucket, s.start)):
        last = out[-1] if out else None
        if (last and last.rank == s.rank and last.bucket == s.bucket and last.stop == s.start
                and last.dest + (last.stop - last.start) == s.dest):
            out[-1] = last._replace(stop=s.stop)
        else:
            out.append(s)
    return out


def _uncovered(numel: int, sources: list[Source]) -> list[tuple[int, int]]:
    """The ranges of a shard of ``numel`` elements that no source fills (its padding)."""
    gaps, at = [], 0
    for s in sorted(sources, key=lambda s: s.dest):
        if s.dest > at:
            gaps.append((at, s.dest))
        at = max(at, s.dest + s.stop - s.start)
    return gaps + ([(at, numel)] if at < numel else [])


def _my_part(shard: ShardSnapshot, t: torch.Tensor) -> torch.Tensor:
    """The part of a per-element tensor this rank writes (a stage-0 replica writes its slice)."""
    start = shard.written.start - shard.own.start
    return t[start:start + shard.written.numel]


@dataclass
class BucketData:
    master: np.ndarray
    state: dict[str, np.ndarray] = field(default_factory=dict)
    scalars: dict[str, list] = field(default_factory=dict)


def _scalar_tensor(value, dtype: str):
    if dtype in ("int", "float", "bool"):
        return {"int": int, "float": float, "bool": bool}[dtype](value)
    return torch.tensor(value, dtype=getattr(torch, dtype))


def state_keys(meta: dict[str, Any], group: int) -> list[str]:
    """The per-element state names a checkpoint holds for the buckets of param ``group`` (every group's,
    in checkpoints written before groups could run optimizers of their own)."""
    per_group = meta.get("group_state_keys")
    if per_group is None:
        return meta.get("state_keys", [])
    keys = per_group[group] if isinstance(per_group, list) and group < len(per_group) else []
    if not (isinstance(per_group, list) and isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise CheckpointError(f"the index's group_state_keys {per_group!r} is not a list of name lists")
    return keys


def _bucket_parts(shard: ShardSnapshot, held, keys: tuple[str, ...]) -> list[tuple[str, torch.Tensor]]:
    """(dataset name, tensor) of one bucket this rank writes: its master and per-element state ``keys``."""
    index = shard.layout.index
    return [(schema.master(index), _my_part(shard, held.master))] + \
        [(schema.state(index, k), _my_part(shard, held.state[k])) for k in keys if k in held.state]


@dataclass(frozen=True)
class FencedBuckets:
    """The optimizer's buckets as an asynchronous save's thread reads them (checkpoint/taken.py): the fence
    holds every one from the call, and each is read only while held, then released: written from the live
    tensors (the default: no memory; a step waits only for buckets not yet written), copied into host
    memory first (``checkpoint_async_copy``: all buckets before the first is written, so that steps wait
    only for the copies), or, when the state streams from the swap file, read from it (a private copy)
    and written before the next is read (one bucket in memory)."""

    view: ShardView
    states: ShardStates
    keys: tuple[str, ...]

    def parts(self) -> Iterator[Part]:
        view, states = self.view, self.states
        copy = view.config.checkpointing.async_copy
        streams, taken, last = states.streams, [], len(view.shards) - 1
        private = streams or copy
        for i, shard in enumerate(view.shards):
            if not view.fence.held(i):  # the save alone releases it: a step may have changed it since
                raise CheckpointError(f"bucket {i} was released before the asynchronous save read it")
            with states.fenced_state(i) as held:
                parts = _bucket_parts(shard, held, self.keys)
                if not private:  # written before the bucket is released
                    yield from ((name, to_numpy(t)) for name, t in parts)
                elif copy and not streams:
                    parts = [(name, t.detach().to("cpu", copy=True)) for name, t in parts]
            view.fence.release(i)
            taken += [parts] if private else []
            while taken and (streams or i == last):
                yield from ((name, to_numpy(t)) for name, t in taken.pop(0))


class OptimizerShards:
    """Entry: every trainable bucket's master and optimizer state (``keys``: the per-element state
    names, from the save's optimizer metadata)."""

    what = "optimizer shards"

    def __init__(self, view: ShardView, states: ShardStates, keys: list[str]):
        self.view, self.states, self.keys = view, states, keys

    def parts(self) -> Iterator[Part]:
        for i, shard in enumerate(self.view.shards):
            with self.states.shard_state(i) as held:  # offloaded state: one bucket in memory at a time
                yield from ((name, to_numpy(t)) for name, t in _bucket_parts(shard, held, tuple(self.keys)))

    def take(self) -> FencedBuckets:
        """For an asynchronous save: every bucket is held at the fence from now until its thread has it."""
        self.view.fence.hold(range(len(self.view.shards)))
        return FencedBuckets(self.view, self.states, tuple(self.keys))

    def read(self, ctx) -> list[BucketData]:
        """Every bucket's arrays, read and checked (the reads run on ``ctx.reads``' threads)."""
        slot_of = ctx.index.slot_of()
        buckets = [self._read_bucket(shard, ctx.index, ctx.files, slot_of, ctx.reads) for shard in self.view.shards]
        ctx.reads.wait()
        return buckets

    def _read_bucket(self, shard: ShardSnapshot, index: CheckpointIndex, files, slot_of, reads: Reads) -> BucketData:
        own = shard.own
        sources = []
        for piece in shard.layout.pieces(own):
            sources += index.locate(slot_of, piece.fqn, piece.param_start, piece.numel, piece.local_start)
        sources = merge(sources)
        keys = state_keys(index.optimizer, shard.layout.group)
        data = BucketData(np.empty(own.numel, dtype=np.float32),
                          {k: np.empty(own.numel, dtype=np.float32) for k in keys})
        for a, z in _uncovered(own.numel, sources):  # the reads fill the rest
            for arr in (data.master, *data.state.values()):
                arr[a:z] = 0
        for s in sources:  # straight into the arrays that become the engine's state
            n, length = s.stop - s.start, index.shard_length(s.bucket)
            master = files.dataset(s.rank, schema.master(s.bucket), length, FP32)
            reads.add(read_tasks(master, s.start, s.stop, data.master[s.dest:s.dest + n]))
            for k in keys:
                ds = files.dataset(s.rank, schema.state(s.bucket, k), length, FP32)
                reads.add(read_tasks(ds, s.start, s.stop, data.state[k][s.dest:s.dest + n]))
        if not sources:  # a shard of padding alone: its scalars (Adam's step) are its bucket's first parameter's
            first = shard.layout.slots[0]
            sources = index.locate(slot_of, first.fqn, 0, 1, 0)
        if sources:
            data.scalars = index.optimizer["scalars"][sources[0].bucket]
        return data

    def apply(self, buckets: list[BucketData], ctx) -> None:
        for i, data in enumerate(buckets):
            state = {k: torch.from_numpy(v) for k, v in data.state.items()}
            state.update({k: _scalar_tensor(*v) for k, v in data.scalars.items()})
            self.states.load_shard(i, torch.from_numpy(data.master), state)
        self.states.load_hyperparameters(ctx.index.optimizer.get("groups", []))
