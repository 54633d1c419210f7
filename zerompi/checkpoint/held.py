"""A recovery point applied from memory: the survivors' replicas read through the checkpoint's
entries, with no file written (fault_tolerance's ``recovery_source='memory'``).

Each rank's point is packed in its own memory and copied to its buddy (replica.py). After a failure
every old rank's replica is held by some survivor; the new group loads from them as it loads a per-rank
checkpoint, resharding N -> M bit for bit, except that each read is served by the survivor holding
that old rank's replica:

1. the survivors agree on the replicas (:class:`HeldCheckpoint`: each old rank's datasets, their types
   and lengths, who serves them; the index and buffers from old rank 0's);
2. each rank runs the entries' reads once to learn the ranges it asks for (nothing is read: zeros);
3. a pairwise exchange (one round per distance between ranks) carries every asked range from the
   survivor serving it, one pair's bytes in memory at a time;
4. the entries read again, from what arrived, and the reader applies that as it applies files.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from zerompi.checkpoint.index import CheckpointIndex
from zerompi.checkpoint.replica import Replica
from zerompi.checkpoint.shards import to_numpy
from zerompi.comm.group import ProcessGroup
from zerompi.errors import CheckpointError

Asked = tuple[int, str, int, int]  # old rank, dataset, [start, stop)


class HeldArray:
    """One dataset of an old rank's replica, read as schema.Array is (schema.read_array, rawio.read_tasks)."""

    def __init__(self, where: str, length: int, dtype: np.dtype, fetch: Callable[[int, int], np.ndarray]):
        self.where, self.length, self.dtype, self._fetch = where, length, dtype, fetch

    def read(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= self.length:
            raise CheckpointError(f"{self.where}: range [{start}, {stop}) outside [0, {self.length})")
        return self._fetch(start, stop)


class HeldFiles:
    """The replicas as ``stores.ShardFiles``: asking (every range read is recorded, zeros returned) or
    served (each range from what the exchange brought)."""

    def __init__(self, held: "HeldCheckpoint", pieces: dict[Asked, np.ndarray] | None = None):
        self.held, self.pieces, self.asked = held, pieces, []

    def dataset(self, rank: int, name: str, length: int = -1, dtype: str | None = None) -> HeldArray:
        where = f"{self.held.where}: old rank {rank}'s {name}"
        if (rank, name) not in self.held.toc:
            raise CheckpointError(f"{where}: not in any survivor's replica")
        kind, size = self.held.toc[rank, name]
        if (length >= 0 and size != length) or (dtype is not None and np.dtype(dtype) != np.dtype(kind)):
            raise CheckpointError(f"{where}: {size} x {kind}, expected {length} x {dtype}")
        return HeldArray(where, size, np.dtype(kind), lambda a, b: self._fetch((rank, name, a, b), kind))

    def _fetch(self, asked: Asked, kind: str) -> np.ndarray:
        if self.pieces is None:
            self.asked.append(asked)
            return np.zeros(asked[3] - asked[2], dtype=kind)
        if asked not in self.pieces:
            raise CheckpointError(f"{self.held.where}: {asked} was read but not asked for")
        return self.pieces[asked]

    def has(self, rank: int, name: str) -> bool:
        return (rank, name) in self.held.toc

    def close(self) -> None:
        pass


class HeldCheckpoint:
    """Collective over the survivors: the recovery point of ``step`` that ``offered`` (this rank's
    unpacked replicas: its own, and the copy it holds of a lost rank) and the others' make whole."""

    def __init__(self, group: ProcessGroup, offered: list[Replica], step: int):
        self.group = group
        self.where = f"the recovery point of step {step} in memory"
        tables = group.allgather_object([(rep.rank, rep.world_size, [(n, a.dtype.str, a.size) for n, a in rep.parts])
                                         for rep in offered])
        self.offered_by = [[rank for rank, _, _ in table] for table in tables]  # old ranks, per survivor
        self.files = max((size for table in tables for _, size, _ in table), default=0)  # hsdp: a node's ranks
        self.server: dict[int, int] = {}  # old rank -> the survivor that serves it (the first that holds it)
        self.toc: dict[tuple[int, str], tuple[str, int]] = {}
        for survivor, table in enumerate(tables):
            for rank, _, names in table:
                self.server.setdefault(rank, survivor)
                self.toc.update(((rank, n), (kind, size)) for n, kind, size in names)
        self.mine = {rep.rank: {n: a.reshape(-1) for n, a in rep.parts} for rep in offered}
        head = next((rep for rep in offered if rep.index is not None), None)
        sent = group.allgather_object(None if head is None else (
            dataclasses.asdict(head.index), {n: to_numpy(t).reshape(-1) for n, t in head.replicated.items()}))
        found = next((s for s in sent if s is not None), None)
        self.index = CheckpointIndex(**found[0]) if found else None
        self.replicated: dict[str, np.ndarray] = found[1] if found else {}

    @property
    def directory(self) -> Path:
        """What messages name in place of a checkpoint's directory."""
        return Path(f"<{self.where}>")

    def asking(self) -> HeldFiles:
        return HeldFiles(self)

    def serve(self, asked: list[Asked]) -> HeldFiles:
        """Collective: every rank's asked ranges, each from the survivor serving its old rank, in a
        pairwise exchange: round k sends what this rank serves to the rank k places on and receives from
        the rank k places back (one pair's bytes in memory at a time, whatever the state's size)."""
        requests = self.group.allgather_object(asked)
        size, me = self.group.size, self.group.rank
        pieces: dict[Asked, np.ndarray] = {}
        for k in range(size):
            to, by = (me + k) % size, (me - k) % size
            served = [self.mine[r][n][a:b].view(np.uint8) for r, n, a, b in requests[to] if self.server[r] == me]
            out = torch.from_numpy(np.concatenate(served) if served else np.empty(0, np.uint8))
            got = (out if k == 0 else self.group.shift(
                out, k, kind="recovery", what="the recovery point's pieces for the rank this far on")).numpy()
            at = 0
            for r, n, a, b in asked:
                if self.server[r] == by:
                    kind = self.toc[r, n][0]
                    count = (b - a) * np.dtype(kind).itemsize
                    pieces[r, n, a, b] = got[at:at + count].copy().view(kind)
                    at += count
        return HeldFiles(self, pieces)
