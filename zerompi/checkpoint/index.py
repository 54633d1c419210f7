"""CheckpointIndex: what a checkpoint holds, independent of who wrote it.

The index records every parameter's name and global shape, and the bucket
layout of the writing job (slots with their offsets, padded sizes, the
world size). Rank r's file holds shard ``layout.shard(r)`` of every bucket,
so any element of any parameter can be located in the files by arithmetic:
:meth:`CheckpointIndex.locate` turns "elements [a, b) of parameter p" into
"(rank file, dataset, [i, j))" pieces. That is what lets a job of any world
size, stage or bucket size load a checkpoint.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import h5py

from zerompi.errors import CheckpointError
from zerompi.shard.layout import BucketLayout, ParamSlot
from zerompi.checkpoint import schema


class Source(NamedTuple):
    """Where a run of elements lives: rank file, bucket, and the range within that shard."""

    rank: int
    bucket: int
    start: int
    stop: int
    dest: int  # offset of this run in the caller's destination range


@dataclass
class CheckpointIndex:
    """Contents of ``index.h5``; :meth:`write` and :meth:`read` are inverses."""

    tag: str
    world_size: int
    stage: int
    dtype: str
    steps: int
    skipped_steps: int
    params: list[dict[str, Any]]            # {"name", "shape", "trainable"} in named_parameters order
    buckets: list[dict[str, Any]]           # {"index", "group", "padded_numel", "slots": [[fqn, offset, numel]]}
    optimizer: dict[str, Any] = field(default_factory=dict)   # param group options, state keys, scalars
    scaler: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    client_state: Any = None
    replicated: list[str] = field(default_factory=list)      # frozen parameters and buffers, in index.h5
    save_id: str = ""  # written into every file of the save: a file of another save is refused
    layout: str = "per_rank"  # "per_rank": rankNNNNN.h5 files; "shared": one shards.h5 (shared.py);
    # "per_node": nodeNNNNN.h5 files (per_node.py)
    scheduler: Any = None     # the lr scheduler's state_dict (JSON), when the engine had one
    frozen_buckets: list[dict[str, Any]] = field(default_factory=list)  # stage 3's frozen shards, as buckets
    frozen_dtype: str = ""    # their stored dtype (frozen.py): "float32", "float16" or "bfloat16"
    frozen_saved: bool = True  # False: saved with include_frozen=False, no frozen values at all
    files: list[list[int]] = field(default_factory=list)  # per_node: the writing ranks node file i holds
    version: int = field(default=schema.VERSION, compare=False)  # the files' format (header, not meta)

    # ---- layout ----------------------------------------------------------
    def layouts(self) -> list[BucketLayout]:
        shapes = {p["name"]: tuple(p["shape"]) for p in self.params}
        out = []
        for b in self.buckets:
            slots = tuple(ParamSlot(fqn, shapes[fqn], numel, offset) for fqn, offset, numel in b["slots"])
            out.append(BucketLayout(b["index"], b["group"], slots, sum(s.numel for s in slots),
                                    b["padded_numel"], self.world_size))
        return out

    def slot_of(self) -> dict[str, tuple[int, int]]:
        """fqn -> (bucket index, offset of the parameter in that bucket)."""
        return {fqn: (b["index"], offset) for b in self.buckets for fqn, offset, _ in b["slots"]}

    def frozen_slot_of(self) -> dict[str, tuple[int, int]]:
        """The same for the frozen buckets (numbered apart from the trainable ones)."""
        return {fqn: (b["index"], offset) for b in self.frozen_buckets for fqn, offset, _ in b["slots"]}

    def locate(self, slot_of: dict[str, tuple[int, int]], fqn: str, start: int, numel: int,
               dest: int, *, frozen: bool = False) -> list[Source]:
        """Split elements ``[start, start+numel)`` of ``fqn`` into runs of single rank files
        (``frozen``: of a frozen bucket, ``slot_of`` being ``frozen_slot_of()``)."""
        bucket, offset = slot_of[fqn]
        shard = (self.frozen_length if frozen else self.shard_length)(bucket)
        out, pos, end = [], offset + start, offset + start + numel
        while pos < end:
            rank = pos // shard
            stop = min(end, (rank + 1) * shard)
            out.append(Source(rank, bucket, pos - rank * shard, stop - rank * shard, dest + pos - offset - start))
            pos = stop
        return out

    # ---- file ------------------------------------------------------------
    _SCALARS = ("tag", "world_size", "stage", "dtype", "steps", "skipped_steps")

    def write(self, f: h5py.File) -> None:
        schema.write_header(f, "index")
        for key in self._SCALARS:  # for people browsing the file; the reader trusts only the checksummed JSON
            value = getattr(self, key)
            f.attrs[key] = schema.text_attr(value) if isinstance(value, str) else value
        f.attrs["save_id"] = schema.text_attr(self.save_id)
        schema.write_json(f, "meta", {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "version"})

    @classmethod
    def read(cls, path: Path) -> "CheckpointIndex":
        try:
            with schema.open_h5(path) as f:
                version = schema.check_header(f, "index")
                save_id = schema.save_id_of(f)
                meta = schema.read_json(f, "meta", schema.Binding("meta", save_id, schema.INDEX_RANK, version))
        except CheckpointError:
            raise
        except schema.H5_ERRORS as e:
            raise schema.damaged(str(path), e) from e
        fields = set(cls.__dataclass_fields__) - {"version"}
        required = {n for n, f in cls.__dataclass_fields__.items()
                    if f.default is MISSING and f.default_factory is MISSING}
        if not isinstance(meta, dict) or not required <= set(meta) <= fields:
            raise CheckpointError(f"{path}: index metadata has unexpected fields")
        if meta.get("layout", "per_rank") not in ("per_rank", "shared", "per_node"):
            raise CheckpointError(f"{path}: unknown shard layout {meta['layout']!r}")
        if meta.get("save_id", "") != save_id:
            raise CheckpointError(f"{path}: the header's save id {save_id!r} differs from the metadata's")
        return cls(**meta, version=version)

    def binding(self, name: str, rank: int = schema.INDEX_RANK) -> schema.Binding:
        """What the checksums of dataset ``name`` written by ``rank`` of this save are bound to."""
        return schema.Binding(name, self.save_id, rank, self.version)

    def shard_length(self, bucket: int) -> int:
        """Elements of bucket ``bucket`` each writing rank holds (its datasets' length)."""
        return self.buckets[bucket]["padded_numel"] // self.world_size

    def frozen_length(self, bucket: int) -> int:
        """Elements of frozen bucket ``bucket`` each writing rank holds."""
        return self.frozen_buckets[bucket]["padded_numel"] // self.world_size

    def describe_mismatch(self, named: list[tuple[str, tuple[int, ...], bool]]) -> str | None:
        """Why this checkpoint cannot load into a model with these (name, shape, trainable), in
        the model's parameter order (the first mismatching tensor first)."""
        ours = {n: (tuple(s), t) for n, s, t in named}
        theirs = {p["name"]: (tuple(p["shape"]), bool(p["trainable"])) for p in self.params}
        problems = []
        missing = [n for n in ours if n not in theirs]
        extra = [n for n in theirs if n not in ours]
        if missing:
            problems.append(f"parameters missing from the checkpoint: {', '.join(missing[:5])}")
        if extra:
            problems.append(f"parameters the model does not have: {', '.join(extra[:5])}")
        for name in (n for n in ours if n in theirs):
            if ours[name][0] != theirs[name][0]:
                problems.append(f"{name}: shape {theirs[name][0]} in the checkpoint, {ours[name][0]} in the model")
            elif ours[name][1] != theirs[name][1]:
                problems.append(f"{name}: requires_grad differs (checkpoint {theirs[name][1]})")
        if problems and not self.frozen_saved:
            problems.append("the checkpoint was saved with include_frozen=False: it holds no frozen parameters "
                            "and loads only onto the base it was trained on, built by you with the same "
                            "frozen tensors")
        return "; ".join(problems[:8]) or None
