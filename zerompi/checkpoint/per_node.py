"""The per-node layout: one ``nodeNNNNN.h5`` per node, written by the node's first rank.

At a thousand ranks one file per rank is a thousand creates, opens and fsyncs hitting
a parallel filesystem's metadata servers at once; one file per node divides that by
the ranks per node. Each rank of a node hands its datasets to the node's first rank
(one ``MPI_Gather`` per dataset, over the node's ranks alone, one dataset in memory
at a time), which writes them under ``rNNNNN/`` (the writing rank) with the
checksums a rank file would hold: bound to that rank (schema.Binding), so a part
moved to another rank does not verify. ``index.h5`` lists the ranks each file holds
(``CheckpointIndex.files``), so the reader's arithmetic is the per-rank layout's.

Before each dataset the node's ranks compare its name, type and length, and any
failure so far (a rank whose data could not be produced, a file that could not be
written), so a rank that fails never leaves the others waiting in a gather.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerompi.checkpoint import objects, schema
from zerompi.checkpoint.rawio import DataFile, WriteOptions
from zerompi.comm.group import ProcessGroup
from zerompi.errors import CheckpointError

KIND = "node"  # the header kind of a node file
_END = ("", np.empty(0, dtype=np.uint8))


def write_nodes(directory: Path, group: ProcessGroup, node: int, parts: Iterable[tuple[str, np.ndarray]],
                save_id: str, options: WriteOptions) -> list[list[int]] | None:
    """Collective over ``group`` (the writing ranks): the ranks of each ``node`` write one file.

    Returns, on the node writers (``group``'s rank 0 among them), the writing ranks each file holds,
    file i being ``schema.node_file(i)``; None on the other ranks."""
    ranks_of_node = group.split(node, group.rank, "node")
    try:
        ranks = ranks_of_node.allgather_object(group.rank)
        first = ranks_of_node.rank == 0
        writers = group.split(0 if first else 1, group.rank, "node_writers")
        try:  # the files in the order of their first ranks; only the node writers take part
            files = writers.allgather_object(ranks) if first else None
        finally:
            writers.free()
        path = directory / schema.node_file(files.index(ranks)) if first else None
        NodeWriter(path, ranks_of_node, ranks, group.size, save_id, options).write(parts)
    finally:
        ranks_of_node.free()
    return files


class NodeWriter:
    """One node's part of a save; ``path`` is None on every rank but the node's first."""

    def __init__(self, path: Path | None, node: ProcessGroup, ranks: list[int], world_size: int,
                 save_id: str, options: WriteOptions):
        self.path, self.node, self.ranks, self.save_id = path, node, ranks, save_id
        self.out: DataFile | None = None
        self.error = ""
        if path is None:
            return
        try:
            self.out = DataFile(path, options)
            schema.write_header(self.out.h5, KIND)
            self.out.h5.attrs["save_id"] = schema.text_attr(save_id)
            self.out.h5.attrs["world_size"] = world_size
            self.out.h5.attrs["ranks"] = np.asarray(ranks, dtype=np.int64)
        except (OSError, RuntimeError, CheckpointError) as e:
            self.error = f"cannot create {path} ({e})"

    def write(self, parts: Iterable[tuple[str, np.ndarray]]) -> None:
        """Collective over the node: every rank's datasets into the node's file, durable."""
        try:
            for name, flat in self._agreed(iter(parts)):
                self._gather(name, flat)
            self._close()
        except BaseException:
            if self.out is not None:
                self.out.abandon()
            raise

    def _agreed(self, items: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """This rank's datasets, each once every rank of the node has one of the same name, type and
        length and none has failed (else CheckpointError on every rank of the node)."""
        while True:
            name, flat = _END
            if not self.error:
                try:
                    name, data = next(items, _END)
                    flat = np.ascontiguousarray(data).reshape(-1)
                except Exception as e:  # noqa: BLE001 - reported on every rank of the node, below
                    self.error = f"{type(e).__name__}: {e}"
            what = (name, flat.dtype.str, flat.shape[0]) if name else None
            seen = self.node.allgather_object((what, self.error))
            failed = [f"rank {self.ranks[i]}: {err}" for i, (_, err) in enumerate(seen) if err]
            if failed:
                raise CheckpointError("writing the node's checkpoint file failed: " + "; ".join(failed))
            if any(w != what for w, _ in seen):
                raise CheckpointError("the ranks of a node disagree on the next dataset: "
                                      + "; ".join(f"rank {self.ranks[i]}: {w}" for i, (w, _) in enumerate(seen)))
            if what is None:
                return
            yield name, flat

    def _gather(self, name: str, flat: np.ndarray) -> None:
        raw = torch.from_numpy(flat.view(np.uint8))
        out = torch.empty(raw.numel() * self.node.size, dtype=torch.uint8) if self.out is not None else None
        self.node.gather(raw, out, 0, kind="checkpoint", what=name)
        if self.out is None:
            return
        rows = out.numpy().view(flat.dtype).reshape(self.node.size, -1)
        for rank, row in zip(self.ranks, rows):
            try:
                binding = schema.Binding(name, self.save_id, rank, schema.VERSION)
                self.out.put(schema.node_dataset(rank, name), row, binding)
            except (OSError, RuntimeError, CheckpointError) as e:
                self.error = f"{name} of rank {rank}: {e}"
                return

    def _close(self) -> None:
        if self.out is not None and not self.error:
            try:
                self.out.close()  # fsync, and with options.verify every checksum read back
            except (OSError, CheckpointError) as e:
                self.error = f"{self.path}: {e}"
            self.out = None
        failed = [e for e in self.node.allgather_object(self.error) if e]
        if failed:
            raise CheckpointError("writing the node's checkpoint file failed: " + "; ".join(failed))


class NodeFiles:
    """The reader's view of the node files: ``dataset(rank, name)`` as per-rank files answer it.

    ``files`` (the index's) lists the writing ranks each file holds; a file is opened, and its
    header checked against the index, the first time one of its ranks is read."""

    def __init__(self, directory: Path, world_size: int, save_id: str, version: int, files: list[list[int]]):
        self.directory, self.world_size, self.save_id, self.version = directory, world_size, save_id, version
        self.files = files
        held = sorted(r for ranks in files for r in ranks)
        if held != list(range(world_size)):
            raise CheckpointError(f"{directory / schema.INDEX}: the node files hold ranks {_short(held)}, "
                                  f"expected each of 0..{world_size - 1} once")
        self._file_of = {r: i for i, ranks in enumerate(files) for r in ranks}
        self._open: dict[int, Any] = {}

    def _file(self, rank: int):
        i = self._file_of[rank]
        if i not in self._open:
            f = schema.open_h5(self.directory / schema.node_file(i))
            try:
                self._check(f, i)
            except BaseException:
                f.close()
                raise
            self._open[i] = f
        return self._open[i]

    def _check(self, f, i: int) -> None:
        version = schema.check_header(f, KIND)
        if version != self.version:
            raise CheckpointError(f"{f.filename}: format version {version}, the index's is {self.version}")
        if schema.save_id_of(f) != self.save_id:
            raise CheckpointError(f"{f.filename}: belongs to another save than {self.directory / schema.INDEX}")
        ranks = objects.attr(f, "ranks", "<i8", (len(self.files[i]),))
        if ranks is None or list(ranks) != self.files[i]:
            raise CheckpointError(f"{f.filename}: holds ranks {_short(list(ranks) if ranks is not None else [])}, "
                                  f"the index says {_short(self.files[i])}")

    def has(self, rank: int, name: str) -> bool:
        return objects.exists(self._file(rank), schema.node_dataset(rank, name))

    def dataset(self, rank: int, name: str, length: int = -1, dtype: str | None = None) -> schema.Array:
        """Writer ``rank``'s dataset ``name``, checked (and of ``length`` elements of ``dtype`` when given)."""
        arr = schema.open_array(self._file(rank), schema.node_dataset(rank, name),
                                schema.Binding(name, self.save_id, rank, self.version), length, dtype)
        arr.where = f"{arr.ds.file.filename}: {name} (rank {rank}'s part)"
        return arr

    def verify(self) -> None:
        """Read every dataset of every node file, checking every checksum."""
        for ranks in self.files:
            f = self._file(ranks[0])
            for path in objects.walk(f):
                rank, name = schema.node_part(path) or (-1, path)
                if rank not in ranks:
                    raise CheckpointError(f"{f.filename}: {path}: not a dataset of the ranks this file holds")
                schema.read_array(self.dataset(rank, name))

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:8]))}, ... ({len(ranks)})]"
