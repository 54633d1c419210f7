"""The per-rank layout: each writing rank's shards in its own ``rankNNNNN.h5`` (any h5py)."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from zerompi.checkpoint import schema
from zerompi.checkpoint.durable import fsync_path, verify_file
from zerompi.errors import CheckpointError

KIND = "shard"  # the header kind of a rank file


def write_rank_file(path: Path, rank: int, world_size: int, parts: Iterable[tuple[str, np.ndarray]],
                    save_id: str) -> None:
    """Write one rank's datasets with their checksums, fsync, and re-read every checksum."""
    with schema.open_h5(path, "w") as f:
        schema.write_header(f, KIND)
        f.attrs["save_id"] = schema.text_attr(save_id)
        f.attrs["rank"] = rank
        f.attrs["world_size"] = world_size
        for name, data in parts:
            schema.write_array(f, name, data)
    fsync_path(path)
    verify_file(path)


class RankFiles:
    """Opens the writing ranks' files on demand, checking each header once."""

    def __init__(self, directory: Path, world_size: int, save_id: str = ""):
        self.directory = directory
        self.save_id = save_id
        self._open: dict[int, Any] = {}
        for r in range(world_size):
            if not (directory / schema.rank_file(r)).is_file():
                raise CheckpointError(f"{directory / schema.rank_file(r)}: missing rank file "
                                      f"(the checkpoint was written by {world_size} ranks)")

    def __call__(self, rank: int):
        if rank not in self._open:
            f = schema.open_h5(self.directory / schema.rank_file(rank))
            schema.check_header(f, KIND)
            if int(f.attrs.get("rank", -1)) != rank:
                raise CheckpointError(f"{f.filename}: holds rank {f.attrs.get('rank')}, expected {rank}")
            if f.attrs.get("save_id") != schema.text_attr(self.save_id):
                raise CheckpointError(f"{f.filename}: belongs to another save than {self.directory / schema.INDEX}")
            self._open[rank] = f
        return self._open[rank]

    def has(self, rank: int, name: str) -> bool:
        return name in self(rank)

    def dataset(self, rank: int, name: str):
        f = self(rank)
        if name not in f:
            raise CheckpointError(f"{f.filename}: missing dataset {name}")
        return f[name]

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
