"""Frozen parameters in a checkpoint: how their values are stored, and where a reader finds them.

A frozen parameter is stored where the writing job kept it: whole in
``index.h5`` (``replicated/NAME``, fp32) when it was replicated (stages 0-2,
or below the persistence threshold), or sharded in frozen buckets
(``f{i}/param`` in the shard files) at stage 3, in the compute dtype: fp32 as
``<f4``, fp16 as ``<f2``, bf16 as its raw bits in ``<u2`` (HDF5 has no bf16),
so a bf16 base costs 2 bytes per element on disk as in memory. A save with
``include_frozen=False`` stores none of them (the index still lists their names
and shapes, so a model of another shape is refused by name).

:class:`FrozenSource` hides the difference: ``read(name, start, stop)`` gives
elements of a frozen parameter as fp32 (exact for every compute dtype) from
whichever place holds them, so a checkpoint written at stage 3 loads at stage 1
and the other way round, at any world size.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from zerompi.checkpoint import schema
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.errors import CheckpointError

if TYPE_CHECKING:
    from zerompi.checkpoint.snapshot import FrozenHolder

ENCODING = {torch.float32: ("<f4", "float32"), torch.float16: ("<f2", "float16"),
            torch.bfloat16: ("<u2", "bfloat16")}
"""Compute dtype -> (stored element type, the name the index records)."""
_STORED = {name: stored for stored, name in ENCODING.values()}


def encode(t: torch.Tensor) -> np.ndarray:
    """A frozen shard as stored: its compute dtype's bits (bf16 as uint16)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


@dataclass(frozen=True)
class FrozenRead:
    """Stage 3's frozen shards as they are written, by a save or on an asynchronous save's thread
    (checkpoint/taken.py): no step changes them (a load does, and waits for a save in flight first), and
    ``frozen_shard`` may be read from another thread, so they are read in place, as they are written."""

    buckets: int  # how many (0: left out, include_frozen=False)
    holder: FrozenHolder

    def parts(self) -> Iterator[tuple[str, np.ndarray]]:
        for i in range(self.buckets):
            with self.holder.frozen_shard(i) as held:
                yield schema.frozen(i), encode(held)


def dtype_name(dtype: torch.dtype) -> str:
    """What the index records for frozen shards of ``dtype``."""
    return ENCODING[dtype][1]


def decode(raw: np.ndarray, name: str) -> np.ndarray:
    """Stored frozen values (dtype recorded as ``name``) as fp32: exact for each of them."""
    if name == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


class FrozenSource:
    """Where a checkpoint's frozen parameters are: ``index.h5`` (replicated) or frozen shards.

    Args:
        index: the checkpoint's index.
        files: its shard files (``ShardFiles``: ``dataset(rank, name, length, dtype)``).
        directory: the checkpoint's directory (``index.h5`` is opened on first use).
    """

    def __init__(self, index: CheckpointIndex, files, directory: Path):
        self.index, self.files, self.directory = index, files, directory
        self.slot_of = index.frozen_slot_of()
        self.replicated = set(index.replicated)
        self.numel = {p["name"]: int(np.prod(p["shape"], dtype=np.int64)) for p in index.params}
        self._index_file = None
        stored = _STORED.get(index.frozen_dtype) if index.frozen_buckets else None
        if index.frozen_buckets and stored is None:
            raise CheckpointError(f"{directory / schema.INDEX}: unknown frozen dtype {index.frozen_dtype!r}")
        self._stored = stored

    def has(self, name: str) -> bool:
        return name in self.slot_of or name in self.replicated

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of frozen parameter ``name`` (flattened), as fp32."""
        if name in self.slot_of:
            out = np.empty(stop - start, dtype=np.float32)
            for s in self.index.locate(self.slot_of, name, start, stop - start, 0, frozen=True):
                ds = self.files.dataset(s.rank, schema.frozen(s.bucket), self.index.frozen_length(s.bucket),
                                        self._stored)
                out[s.dest:s.dest + s.stop - s.start] = decode(schema.read_array(ds, s.start, s.stop),
                                                               self.index.frozen_dtype)
            return out
        if name not in self.replicated:
            raise CheckpointError(f"{self.directory}: holds no value of frozen parameter {name!r}"
                                  + ("" if self.index.frozen_saved else
                                     " (saved with include_frozen=False: the base comes from the model you built)"))
        if self._index_file is None:
            self._index_file = schema.open_h5(self.directory / schema.INDEX)
        ds = schema.replicated(name)
        arr = schema.open_array(self._index_file, ds, self.index.binding(ds), self.numel.get(name, -1))
        return schema.read_array(arr, start, stop).astype(np.float32)

    def close(self) -> None:
        if self._index_file is not None:
            self._index_file.close()
            self._index_file = None
