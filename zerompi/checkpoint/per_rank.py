"""The per-rank layout: each writing rank's shards in its own ``rankNNNNN.h5`` (any h5py)."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from zerompi.checkpoint import objects, paths, schema
from zerompi.checkpoint.rawio import DataFile, WriteOptions
from zerompi.errors import CheckpointError

KIND = "shard"  # the header kind of a rank file


def write_rank_file(path: Path, rank: int, world_size: int, parts: Iterable[tuple[str, np.ndarray]],
                    save_id: str, options: WriteOptions = WriteOptions()) -> None:
    """Write one rank's datasets with their checksums (computed once, from memory, as they are
    written: rawio.py) and fsync; with ``options.verify``, read every checksum back from the disk."""
    out = DataFile(path, options)
    try:
        schema.write_header(out.h5, KIND)
        out.h5.attrs["save_id"] = schema.text_attr(save_id)
        out.h5.attrs["rank"] = rank
        out.h5.attrs["world_size"] = world_size
        for name, data in parts:
            out.put(name, data)
    except BaseException:
        out.abandon()
        raise
    out.close()


class RankFiles:
    """Opens the writing ranks' files on demand, checking each header once.

    A loading rank touches only the files that hold its shard: at N writers and M loaders each
    rank opens about N/M + 1 of them, not all N (N stats on every rank were N^2 metadata
    operations on the filesystem per load)."""

    def __init__(self, directory: Path, world_size: int, save_id: str, version: int):
        self.directory, self.world_size = directory, world_size
        self.save_id, self.version = save_id, version
        self._open: dict[int, Any] = {}

    def __call__(self, rank: int):
        if rank not in self._open:
            path = self.directory / schema.rank_file(rank)
            if not 0 <= rank < self.world_size or (not path.exists() and not path.is_symlink()):
                raise CheckpointError(f"{path}: missing rank file (the checkpoint was written by "
                                      f"{self.world_size} ranks)")
            paths.regular_file(path)
            f = schema.open_h5(path)
            try:
                self._check(f, rank)
            except BaseException:
                f.close()
                raise
            self._open[rank] = f
        return self._open[rank]

    def _check(self, f, rank: int) -> None:
        version = schema.check_header(f, KIND)
        if version != self.version:
            raise CheckpointError(f"{f.filename}: format version {version}, the index's is {self.version}")
        if objects.attr(f, "rank", "int") != rank:
            raise CheckpointError(f"{f.filename}: holds rank {f.attrs.get('rank')}, expected {rank}")
        if schema.save_id_of(f) != self.save_id:
            raise CheckpointError(f"{f.filename}: belongs to another save than {self.directory / schema.INDEX}")

    def has(self, rank: int, name: str) -> bool:
        return objects.exists(self(rank), name)

    def dataset(self, rank: int, name: str, length: int = -1, dtype: str | None = None) -> schema.Array:
        """Writer ``rank``'s dataset ``name``, checked (and of ``length`` elements of ``dtype`` when given)."""
        return schema.open_array(self(rank), name, schema.Binding(name, self.save_id, rank, self.version),
                                 length, dtype)

    def verify(self) -> None:
        """Read every dataset of every rank file, checking every checksum."""
        for r in range(self.world_size):
            for name in objects.walk(self(r)):
                schema.read_array(self.dataset(r, name))

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
