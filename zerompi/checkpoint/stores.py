"""Where the writing ranks' shards go: a store per layout, chosen once.

A store writes one rank's datasets durably and verified (``write``) and opens a
checkpoint's shards for reading (``open``), answering ``dataset(rank, name)``
whatever the layout, so the reader's arithmetic is the same for all of them:

* :class:`PerRankStore`: one ``rankNNNNN.h5`` per writing rank (any h5py);
* :class:`SharedStore`: one ``shards.h5`` written collectively through h5py's
  ``mpio`` driver (needs a parallel h5py to write; any h5py reads it);
* :class:`PerNodeStore`: one ``nodeNNNNN.h5`` per node, written by the node's
  first rank from its ranks' gathered datasets (any h5py).

A new store is one class here and one member of ``CheckpointLayout``.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from zerompi.checkpoint import schema, shared
from zerompi.checkpoint.durable import fsync_path
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.checkpoint.per_node import NodeFiles, write_nodes
from zerompi.checkpoint.per_rank import RankFiles, write_rank_file
from zerompi.checkpoint.rawio import WriteOptions
from zerompi.config.choices import CheckpointLayout
from zerompi.comm.group import ProcessGroup
from zerompi.errors import CheckpointError, UsageError

Parts = Iterable[tuple[str, np.ndarray]]


class ShardFiles(Protocol):
    """A checkpoint's shards opened for reading."""

    def dataset(self, rank: int, name: str, length: int = -1, dtype: str | None = None) -> schema.Array:
        """Writer ``rank``'s dataset ``name``, checked to be stored plainly in the checkpoint (objects.py)
        and, when given, to hold ``length`` elements of ``dtype``; schema.read_array reads it."""

    def has(self, rank: int, name: str) -> bool: ...

    def close(self) -> None: ...


class ShardStore(Protocol):
    kind: CheckpointLayout

    def write(self, directory: Path, group: ProcessGroup, parts: Parts, save_id: str,
              options: WriteOptions) -> list[list[int]] | None:
        """This rank's datasets, durable, checksummed as written, read back from the disk with
        ``options.verify`` (collective over ``group`` where the layout is). Returns what the index
        records of the files (per-node: the ranks each file holds, on ``group``'s rank 0), or None."""

    def open(self, directory: Path, index: CheckpointIndex) -> ShardFiles: ...

    def verify(self, directory: Path, index: CheckpointIndex) -> None:
        """Re-read every writer's datasets, checking every checksum (``zerompi ckpt inspect``)."""


class PerRankStore:
    kind = CheckpointLayout.PER_RANK

    def write(self, directory: Path, group: ProcessGroup, parts: Parts, save_id: str, options: WriteOptions) -> None:
        write_rank_file(directory / schema.rank_file(group.rank), group.rank, group.size, parts, save_id, options)

    def open(self, directory: Path, index: CheckpointIndex) -> ShardFiles:
        return RankFiles(directory, index.world_size, index.save_id, index.version)

    def verify(self, directory: Path, index: CheckpointIndex) -> None:
        files = RankFiles(directory, index.world_size, index.save_id, index.version)
        try:
            files.verify()
        finally:
            files.close()


class PerNodeStore:
    """``node``: this rank's node (topology.node_placement), whose first writing rank writes its file."""

    kind = CheckpointLayout.PER_NODE

    def __init__(self, node: int = 0):
        self.node = node

    def write(self, directory: Path, group: ProcessGroup, parts: Parts, save_id: str,
              options: WriteOptions) -> list[list[int]] | None:
        return write_nodes(directory, group, self.node, parts, save_id, options)

    def open(self, directory: Path, index: CheckpointIndex) -> ShardFiles:
        return NodeFiles(directory, index.world_size, index.save_id, index.version, index.files)

    def verify(self, directory: Path, index: CheckpointIndex) -> None:
        files = self.open(directory, index)
        try:
            files.verify()
        finally:
            files.close()


class SharedStore:
    kind = CheckpointLayout.SHARED

    def write(self, directory: Path, group: ProcessGroup, parts: Parts, save_id: str, options: WriteOptions) -> None:
        path = directory / shared.SHARED
        writer = shared.SharedWriter(path, group, save_id)
        try:
            for name, data in parts:
                writer.put(name, data)
        finally:
            writer.close()
        fsync_path(path, evict=options.verify)
        if not options.verify:  # the checksums were computed from memory as the data was written
            return
        files = shared.SharedFile(directory, group.size, save_id, schema.VERSION)
        try:
            files.verify([group.rank])  # each rank re-reads its own part
        finally:
            files.close()

    def open(self, directory: Path, index: CheckpointIndex) -> ShardFiles:
        return shared.SharedFile(directory, index.world_size, index.save_id, index.version)

    def verify(self, directory: Path, index: CheckpointIndex) -> None:
        files = shared.SharedFile(directory, index.world_size, index.save_id, index.version)
        try:
            files.verify(range(index.world_size))
        finally:
            files.close()


_STORES: dict[CheckpointLayout, ShardStore] = {s.kind: s for s in (PerRankStore(), SharedStore(), PerNodeStore())}


def store_for(setting: CheckpointLayout, node: int = 0) -> ShardStore:
    """The store a save writes with: ``checkpoint_layout``, 'auto' resolved by what h5py can do
    (``node``: this rank's node, for the per-node layout)."""
    setting = CheckpointLayout(setting)
    if setting == CheckpointLayout.PER_NODE:
        return PerNodeStore(node)
    if setting == CheckpointLayout.AUTO:
        setting = CheckpointLayout.SHARED if shared.available() else CheckpointLayout.PER_RANK
    elif setting == CheckpointLayout.SHARED and not shared.available():
        raise UsageError("checkpoint_layout='shared' needs h5py built with MPI (h5py.get_config().mpi is "
                         "False here); allowed here: 'per_rank' or 'auto'. docs/checkpoints.md says how to build it")
    return _STORES[setting]


def store_named(kind: str, where: Path) -> ShardStore:
    """The store of a checkpoint whose index says ``kind`` (the index has validated it)."""
    try:
        return _STORES[CheckpointLayout(kind)]
    except (ValueError, KeyError):
        raise CheckpointError(f"{where}: unknown shard layout {kind!r}") from None
