"""The shared-file layout: all shards in one ``shards.h5``, written collectively.

Written through h5py's ``mpio`` driver (h5py built against a parallel HDF5),
read back with any h5py: the file is plain HDF5. Dataset ``b{i}/master`` (and
``b{i}/state/{k}``, ``rng/torch_cpu``) holds every writer's part back to back:
rank r writes elements ``[r*L, (r+1)*L)``, exactly what ``rankNNNNN.h5`` holds
in the per-rank layout, so the index's arithmetic locates data in both.

A checksum block must not span two writers, so each rank's slice has its own
CRC blocks, kept in ``crc/<dataset>`` as a (world_size, blocks) array, one row
per rank, bound to that rank. :meth:`SharedFile.dataset` shows rank r's slice
with its row as an ordinary checksummed ``schema.Array``, and the reader needs
no other change.
"""
from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from zerompi.checkpoint import objects, schema
from zerompi.comm.group import ProcessGroup
from zerompi.errors import CheckpointError

SHARED = "shards.h5"
KIND = "shared"


def available() -> bool:
    """Whether this h5py can write through the ``mpio`` driver (built with MPI)."""
    return bool(h5py.get_config().mpi)


class SharedWriter:
    """Collective writes into one file; every call is made by every writing rank in the same order.

    A write that fails on one rank is reported at the next call, on every rank, so that no rank
    goes on into a collective the others have left.
    """

    def __init__(self, path: Path, group: ProcessGroup, save_id: str):
        self.path, self.group, self.rank, self.size = path, group, group.rank, group.size
        self.save_id = save_id
        self.error = ""
        try:
            self.f = h5py.File(path, "w", driver="mpio", comm=group.h5py_comm())
            schema.write_header(self.f, KIND)
            self.f.attrs["save_id"] = schema.text_attr(save_id)
            self.f.attrs["world_size"] = self.size
        except (OSError, RuntimeError) as e:
            self.error = f"cannot create it through the mpio driver ({e})"
        self._agree(None)

    def _agree(self, what: tuple | None) -> None:
        seen = self.group.allgather_object((what, self.error))
        failed = [f"rank {r}: {err}" for r, (_, err) in enumerate(seen) if err]
        if failed:
            raise CheckpointError(f"{self.path}: writing the shared checkpoint file failed: " + "; ".join(failed))
        if any(w != what for w, _ in seen):
            raise CheckpointError(f"{self.path}: ranks disagree on the next dataset: "
                                  + "; ".join(f"rank {r}: {w}" for r, (w, _) in enumerate(seen)))

    def put(self, name: str, data: np.ndarray) -> None:
        """Write this rank's ``data`` (1-D) as its slice of dataset ``name``, and its checksums."""
        flat = np.ascontiguousarray(data).reshape(-1)
        # Dataset creation is collective: a rank with another name, dtype or length would
        # corrupt the file's metadata, so the ranks compare before creating anything.
        self._agree((name, flat.dtype.str, flat.shape[0]))
        binding = schema.Binding(name, self.save_id, self.rank, schema.VERSION)
        n, crcs = flat.shape[0], schema.block_crcs(flat, binding)
        ds = self.f.create_dataset(name, shape=(self.size * n,), dtype=flat.dtype)
        crc = self.f.create_dataset(schema.shared_crc(name), shape=(self.size, crcs.shape[0]), dtype=np.uint32)
        try:
            with ds.collective:  # one MPI-IO collective write: what parallel filesystems do best
                ds[self.rank * n:(self.rank + 1) * n] = flat
            crc[self.rank] = crcs
        except (OSError, RuntimeError) as e:
            self.error = f"{name}: {e}"

    def close(self) -> None:
        """Collective: close the file; raises on every rank when any rank's write failed."""
        try:
            self._agree(None)
        finally:
            self.f.close()


class SharedFile:
    """The reader's view of ``shards.h5``: the same ``dataset(rank, name)`` as per-rank files.

    Rank r's part of a dataset is checked with row r of its checksums, bound to rank r
    (schema.Binding): a row or a part moved to another rank does not verify.
    """

    def __init__(self, directory: Path, world_size: int, save_id: str, version: int):
        path = directory / SHARED
        if not path.exists() and not path.is_symlink():
            raise CheckpointError(f"{path}: missing (the index says the shards are in one shared file)")
        self.f = schema.open_h5(path)
        try:
            found = schema.check_header(self.f, KIND)
            if found != version:
                raise CheckpointError(f"{path}: format version {found}, the index's is {version}")
            if objects.attr(self.f, "world_size", "int") != world_size:
                raise CheckpointError(f"{path}: written by {self.f.attrs.get('world_size')} ranks, "
                                      f"the index says {world_size}")
            if schema.save_id_of(self.f) != save_id:
                raise CheckpointError(f"{path}: belongs to another save than {directory / schema.INDEX}")
        except BaseException:
            self.f.close()
            raise
        self.world_size, self.save_id, self.version = world_size, save_id, version

    def has(self, rank: int, name: str) -> bool:
        return objects.exists(self.f, name)

    def dataset(self, rank: int, name: str, length: int = -1, dtype: str | None = None) -> schema.Array:
        """Rank ``rank``'s part of ``name``, checked (and of ``length`` elements of ``dtype`` when given)."""
        filename, n = self.f.filename, self.world_size
        ds = objects.dataset(self.f, name)
        crc = objects.dataset(self.f, schema.shared_crc(name))
        objects.check_shape(ds, name, (-1 if length == -1 else n * length,), dtype)
        part = ds.shape[0] // n
        if ds.shape[0] % n:
            raise CheckpointError(f"{filename}: {name}: {ds.shape[0]} elements do not split into {n} ranks")
        objects.check_shape(crc, schema.shared_crc(name), (n, schema.blocks(part)), "<u4")
        return schema.Array(ds, crc[rank], schema.Binding(name, self.save_id, rank, self.version),
                            offset=rank * part, length=part)

    def names(self) -> list[str]:
        """Every data set (not the checksum tables), refusing any link but hard ones."""
        return [n for n in objects.walk(self.f) if not n.startswith(schema.SHARED_CRC_PREFIX)]

    def verify(self, ranks) -> None:
        """Read ``ranks``' slices of every dataset, checking every checksum."""
        for name in self.names():
            for r in ranks:
                schema.read_array(self.dataset(r, name))

    def close(self) -> None:
        self.f.close()
