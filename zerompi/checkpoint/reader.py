"""Load a checkpoint into an engine of any world size, stage or bucket size.

Loading happens in two phases so that nothing is half-loaded: every rank
first reads and verifies everything it needs into temporary arrays (only
its own shard, located through the index's layout), the ranks agree that
every read succeeded, and only then is the engine's state overwritten. What
is read and applied is the checkpoint's entries (entries.py), in order; the
reader itself knows the index and the tensors it holds whole.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerompi.checkpoint import optimizer_record, paths, retention, schema
from zerompi.checkpoint.entries import LoadContext, entries
from zerompi.checkpoint.frozen import FrozenSource
from zerompi.checkpoint.held import HeldCheckpoint, HeldFiles
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.checkpoint.rawio import Reads
from zerompi.checkpoint.snapshot import Counters, EngineSnapshot, Entry
from zerompi.checkpoint.stores import ShardFiles, store_named
from zerompi.errors import CheckpointError, all_ranks_ok
from zerompi.log import get_logger

logger = get_logger(__name__)


def resolve(root: str | os.PathLike, tag: str | None) -> Path:
    """The directory of ``tag`` (``latest`` when None), checked to be a plain child of ``root``
    that does not lead outside it through a symbolic link."""
    root = Path(root)
    if tag is None:
        pointer, tag = root / schema.LATEST, schema.read_latest(root)
        if tag is None:
            raise CheckpointError(f"{pointer}: missing: no checkpoint was completed under {root}")
        schema.check_tag(tag, f"{pointer} names")
    else:
        schema.check_tag(tag)
    directory = root / tag
    if not paths.directory_in(root, directory):
        # a save killed while replacing this tag leaves the complete previous copy aside
        aside = sorted(p for p in root.glob(f".old-{tag}-*")
                       if paths.directory_in(root, p) and (p / schema.INDEX).is_file())
        if aside:
            return aside[-1]
        raise CheckpointError(f"{directory}: missing")
    return directory


def open_shards(directory: Path, index: CheckpointIndex) -> ShardFiles:
    """The shard files of a checkpoint, whatever its layout: ``dataset(rank, name)``."""
    store = store_named(index.layout, directory / schema.INDEX)
    return store.open(directory, index)


def _check_compatible(engine, snap: EngineSnapshot, index: CheckpointIndex, directory: Path) -> None:
    named = [(n, tuple(p.shape), p.requires_grad) for n, p in engine.module.named_parameters()]
    problem = index.describe_mismatch(named)
    if problem:
        raise CheckpointError(f"{directory}: checkpoint of a different model: {problem}")
    optimizer_record.check(index.optimizer, index.config, snap.view, snap.recorded, directory)


@dataclass
class Loaded:
    index: CheckpointIndex
    entries: list[tuple[Entry, Any]]  # each entry with what it read
    replicated: dict[str, np.ndarray]
    context: LoadContext


def prepare(engine, snap: EngineSnapshot, directory: Path) -> Loaded:
    """Read and verify everything this rank needs; touches no engine state."""
    index = CheckpointIndex.read(directory / schema.INDEX)
    _check_compatible(engine, snap, index, directory)
    files = open_shards(directory, index)
    source = FrozenSource(index, files, directory)
    # every bucket's reads in flight while the next datasets are opened and checked
    ctx = LoadContext(index, files, directory, Reads(), source, engine.group.rank, engine.group.size)
    try:
        read = [(entry, entry.read(ctx)) for entry in entries(snap, index.optimizer)]
        replicated = _read_replicated(engine, snap, index, directory, source)
    finally:
        _quietly(ctx.reads.wait)  # no read may still use a file (a failure above is the one reported)
        source.close()
        files.close()
    return Loaded(index, read, replicated, ctx)


def _read_held(engine, snap: EngineSnapshot, held: HeldCheckpoint, files: HeldFiles,
               buffers: dict[str, np.ndarray]) -> Loaded:
    """``prepare`` over a recovery point held in memory: the same entries, read from ``files``."""
    ctx = LoadContext(held.index, files, held.directory, Reads(), FrozenSource(held.index, files, held.directory),
                      engine.group.rank, engine.group.size)
    try:
        read = [(entry, entry.read(ctx)) for entry in entries(snap, held.index.optimizer)]
    finally:
        _quietly(ctx.reads.wait)
    return Loaded(held.index, read, buffers, ctx)


def _held_buffers(engine, held: HeldCheckpoint) -> dict[str, np.ndarray]:
    """The buffers of the point (it has no frozen parameters), checked to be the model's."""
    params = {p["name"] for p in held.index.params}
    saved = {n: a for n, a in held.replicated.items() if n not in params}
    _check_buffers({n: b.numel() for n, b in engine.module.named_buffers()}, {n: a.size for n, a in saved.items()},
                   held.directory)
    return saved


def load_held(engine, held: HeldCheckpoint) -> None:
    """Collective over the survivors: the recovery point ``held`` (held.py) checked, read and applied
    as a load applies files; each rank first learns what it asks for, then one exchange serves it."""
    snap, error, asking, buffers = engine.snapshot(), None, held.asking(), {}
    try:
        if held.index is None:
            raise CheckpointError(f"{held.where}: no survivor holds old rank 0's index")
        _check_compatible(engine, snap, held.index, held.directory)
        buffers = _held_buffers(engine, held)
        _read_held(engine, snap, held, asking, buffers)
    except CheckpointError as e:
        error = str(e)
    all_ranks_ok(engine.group, error, CheckpointError)
    served, loaded = held.serve(asking.asked), None
    try:
        loaded = _read_held(engine, snap, held, served, buffers)
    except CheckpointError as e:
        error = str(e)
    all_ranks_ok(engine.group, error, CheckpointError)
    apply(engine, snap, loaded)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - raised again by the caller's own wait, or superseded
        pass


def _read_replicated(engine, snap: EngineSnapshot, index: CheckpointIndex, directory: Path,
                     source: FrozenSource) -> dict[str, np.ndarray]:
    """Buffers, and the frozen parameters this engine holds whole: checked to match the model before
    anything is read or overwritten (frozen ones only when the checkpoint holds them)."""
    params = {p["name"] for p in index.params}
    ours = {n: b.numel() for n, b in engine.module.named_buffers()}
    saved = [n for n in index.replicated if n not in params]  # the checkpoint's buffers
    out = {}
    with schema.open_h5(directory / schema.INDEX) as f:
        arrays = {n: schema.open_array(f, schema.replicated(n), index.binding(schema.replicated(n)))
                  for n in saved if n in ours}
        _check_buffers(ours, {n: arrays[n].length if n in arrays else -1 for n in saved}, directory)
        for name, arr in arrays.items():
            out[name] = schema.read_array(arr)
    if index.frozen_saved:
        tensors = dict(engine.module.named_parameters())
        for name in snap.replicated_frozen:
            out[name] = source.read(name, 0, tensors[name].numel())
    return out


def _check_buffers(ours: dict[str, int], theirs: dict[str, int], directory: Path) -> None:
    """The checkpoint's buffers (name: elements) are the model's."""
    if ours != theirs:
        diff = sorted(set(ours) ^ set(theirs)) or sorted(n for n in ours if ours[n] != theirs[n])
        raise CheckpointError(f"{directory}: checkpoint of a different model: buffers differ ({', '.join(diff[:5])})")


def apply(engine, snap: EngineSnapshot, loaded: Loaded) -> None:
    """Overwrite the engine's state with what ``prepare`` read (all ranks succeeded)."""
    for entry, data in loaded.entries:
        entry.apply(data, loaded.context)
    index = loaded.index
    engine.restore(Counters(index.steps, index.skipped_steps, index.scaler or None, index.scheduler))
    tensors = dict(engine.module.named_parameters())
    tensors.update(engine.module.named_buffers())
    with torch.no_grad():
        for name, value in loaded.replicated.items():
            t = tensors[name]
            t.copy_(torch.from_numpy(value).view(t.shape))


def load(engine, root: str | os.PathLike, tag: str | None = None) -> Any:
    """Collective: load ``root/tag`` (``latest`` when None); returns the saved client_state."""
    loaded, error = None, None
    snap = engine.snapshot()
    try:
        loaded = prepare(engine, snap, resolve(root, tag))
    except CheckpointError as e:
        error = str(e)
    except schema.H5_ERRORS as e:  # damaged HDF5 structures, or well-formed files with bad contents
        error = str(schema.damaged(str(root), e))
    if error is not None:
        try:
            error += retention.others_hint(root, tag)
        except (CheckpointError, *schema.H5_ERRORS):
            pass  # the error itself is what matters
    all_ranks_ok(engine.group, error, CheckpointError)
    apply(engine, snap, loaded)
    return loaded.index.client_state
