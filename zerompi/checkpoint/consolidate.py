"""Offline reading of a checkpoint: full fp32 parameters, one tensor at a time.

Every parameter the checkpoint holds, by its ``named_parameters()`` name:
trainable ones from the fp32 masters, frozen ones from wherever the writer kept
them (frozen.py); a save with ``include_frozen=False`` holds the trainable
parameters alone (e.g. LoRA adapters), and so does its consolidated file.

Needs only h5py and numpy (and torch for the tensors it returns): no MPI, no
model code, no pickle. :class:`FullStateDict` is a lazy mapping: each
parameter is assembled from the rank files when it is accessed, so iterating
over it, or consolidating to a file, keeps memory near the largest single
tensor rather than the model.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import h5py
import numpy as np
import torch

from zerompi.errors import CheckpointError
from zerompi.checkpoint import safetensors, schema
from zerompi.checkpoint.frozen import FrozenSource
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.checkpoint.reader import open_shards, resolve
from zerompi.checkpoint.shards import FP32, merge


class FullStateDict(Mapping):
    """``{name: full fp32 tensor}`` for every parameter of a checkpoint, loaded on access."""

    def __init__(self, root: str | os.PathLike, tag: str | None = None):
        self.directory = resolve(root, tag)
        try:
            self.index = CheckpointIndex.read(self.directory / schema.INDEX)
            self._slot_of = self.index.slot_of()
            self._shapes = {p["name"]: tuple(p["shape"]) for p in self.index.params
                            if p["trainable"] or self.index.frozen_saved}
        except CheckpointError:
            raise
        except schema.H5_ERRORS as e:
            raise schema.damaged(str(self.directory), e) from e
        self._files = open_shards(self.directory, self.index)
        self._frozen = FrozenSource(self.index, self._files, self.directory)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        try:
            return self._load(name)
        except CheckpointError:
            raise
        except schema.H5_ERRORS as e:
            raise schema.damaged(f"{self.directory}: tensor {name}", e) from e

    def _load(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        numel = int(np.prod(shape, dtype=np.int64))
        out = np.empty(numel, dtype=np.float32)
        if name in self._slot_of:
            for s in merge(self.index.locate(self._slot_of, name, 0, numel, 0)):
                ds = self._files.dataset(s.rank, schema.master(s.bucket), self.index.shard_length(s.bucket), FP32)
                out[s.dest:s.dest + s.stop - s.start] = schema.read_array(ds, s.start, s.stop)
        else:  # frozen: whole in the index, or in frozen shards
            out[:] = self._frozen.read(name, 0, numel)
        return torch.from_numpy(out).view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def close(self) -> None:
        self._frozen.close()
        self._files.close()


def load_full_state_dict(path: str | os.PathLike, tag: str | None = None) -> FullStateDict:
    """No MPI needed: every parameter as a full fp32 tensor (a lazy mapping; ``dict()`` it to keep all)."""
    return FullStateDict(path, tag)


def _write_h5(full: FullStateDict, out: Path) -> None:
    with h5py.File(out, "w") as f:
        f.attrs["source"] = str(full.directory)
        f.attrs["steps"] = full.index.steps
        for name in full:
            f.create_dataset(name, data=full[name].numpy())


def _write_safetensors(full: FullStateDict, out: Path) -> None:
    """The safetensors layout, fp32, streamed one tensor at a time."""
    safetensors.write(out, [safetensors.Entry(n, tuple(full.shape(n)), "F32") for n in full],
                      lambda n: memoryview(full[n].numpy().astype("<f4", copy=False)).cast("B"),
                      {"steps": str(full.index.steps)})


def consolidate(path: str | os.PathLike, out: str | os.PathLike, tag: str | None = None) -> Path:
    """Write every parameter in full fp32 to ``out`` (``.h5`` or ``.safetensors``), one at a time."""
    out = Path(out)
    writers = {".h5": _write_h5, ".hdf5": _write_h5, ".safetensors": _write_safetensors}
    if out.suffix not in writers:
        raise CheckpointError(f"{out}: output must end in .h5, .hdf5 or .safetensors")
    full = load_full_state_dict(path, tag)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        writers[out.suffix](full, tmp)
        tmp.rename(out)
    finally:
        full.close()
        tmp.unlink(missing_ok=True)
    return out
