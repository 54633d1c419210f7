"""A checkpoint held in memory: fault_tolerance's ``recovery_source='memory'``.

:func:`take` copies this rank's datasets, exactly those a per-rank save with
``include_frozen=False`` would write (entries.py), into one byte tensor: a JSON header (names, dtypes, shapes, offsets; on
rank 0 also the index and the buffers), then the data. That tensor is
what MPI hands to a buddy rank (the group's ``shift``), and what stays in memory.
Nothing is written, even when a rank is lost: the survivors serve the rebuilt engine's reads
from the replicas they hold (held.py), resharding N -> M through the same entries as a
per-rank checkpoint's files. No pickle: the header is JSON and the data raw bytes, as in a
checkpoint file.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

import numpy as np
import torch

from zerompi.checkpoint import optimizer_record, schema
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.checkpoint.writer import build_index, parts, replicated_tensors
from zerompi.config.choices import CheckpointLayout
from zerompi.errors import CheckpointError, UsageError

_LENGTH = 8  # bytes of the header's length, little-endian, before the header


class Replica(NamedTuple):
    """One rank's state at ``step``, unpacked from its bytes (views of them, nothing copied)."""

    step: int
    rank: int          # in the group that took it
    world_size: int
    save_id: str
    parts: list[tuple[str, np.ndarray]]
    index: CheckpointIndex | None          # rank 0's
    replicated: dict[str, torch.Tensor]    # rank 0's: the buffers (held whole)


def take(engine, save_id: str) -> torch.Tensor:
    """This rank's replica of ``engine`` now (between steps), packed: one copy of its shard state."""
    snap = engine.snapshot()
    if not snap.between_steps:
        raise UsageError("a recovery replica in the middle of a gradient-accumulation window: take it after step()")
    meta = optimizer_record.gathered(engine.group, snap.view, snap.recorded)
    # Frozen parameters are left out (a save's include_frozen=False): training never changes them, and the
    # rebuild starts from the model as initialize had it. Views of memory-resident state (NVMe is refused).
    data = list(parts(snap, meta, False))
    header: dict[str, Any] = dict(step=snap.counters.steps, rank=snap.view.group.rank,
                                  world_size=snap.view.group.size, save_id=save_id, index=None)
    blobs = [(name, np.ascontiguousarray(a).reshape(-1).view(np.uint8), a.dtype.str, list(a.shape)) for name, a in data]
    if engine.group.rank == 0:
        index = build_index(engine, snap, schema.step_tag(snap.counters.steps), None, meta, save_id, CheckpointLayout.PER_RANK.value, False)
        header["index"] = dataclasses.asdict(index)  # a deep copy: later steps cannot change it
        for name, t in replicated_tensors(engine, index, copy=False).items():
            raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            blobs.append((f"replicated/{name}", raw, str(t.dtype).removeprefix("torch."), list(t.shape)))
    offset, table = 0, []
    for name, raw, dtype, shape in blobs:
        table.append([name, dtype, shape, offset, raw.nbytes])
        offset += raw.nbytes
    header["blobs"] = table
    text = json.dumps(header).encode()
    out = torch.empty(_LENGTH + len(text) + offset, dtype=torch.uint8)
    buf = out.numpy()
    buf[:_LENGTH] = np.frombuffer(len(text).to_bytes(_LENGTH, "little"), np.uint8)
    buf[_LENGTH:_LENGTH + len(text)] = np.frombuffer(text, np.uint8)
    base = _LENGTH + len(text)
    for (_, raw, _, _), (_, _, _, start, nbytes) in zip(blobs, table):
        buf[base + start:base + start + nbytes] = raw
    return out


def unpack(packed: torch.Tensor) -> Replica:
    """The replica ``take`` packed (checked to be whole: a truncated or foreign buffer is refused)."""
    buf = packed.numpy()
    try:
        length = int.from_bytes(buf[:_LENGTH].tobytes(), "little")
        header = json.loads(buf[_LENGTH:_LENGTH + length].tobytes())
        base = _LENGTH + length
        arrays, replicated = [], {}
        for name, dtype, shape, start, nbytes in header["blobs"]:
            if base + start + nbytes > buf.size:
                raise ValueError(f"blob {name!r} ends past the buffer")
            raw = buf[base + start:base + start + nbytes]
            if name.startswith("replicated/"):
                t = torch.from_numpy(raw.copy()).view(getattr(torch, dtype)).reshape(shape)
                replicated[name.removeprefix("replicated/")] = t
            else:
                arrays.append((name, raw.view(np.dtype(dtype)).reshape(shape)))
        index = CheckpointIndex(**header["index"]) if header["index"] is not None else None
        return Replica(header["step"], header["rank"], header["world_size"], header["save_id"], arrays, index,
                       replicated)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"a recovery replica of {packed.numel()} bytes cannot be read: {e}") from e
