"""Atomic, verified save of an engine's state.

Protocol (a job killed at any moment leaves the previous checkpoint loadable):
1. every rank writes ``ROOT/.tmp-TAG-NONCE/rankNNNNN.h5`` (or its part of the
   shared ``shards.h5``, see shared.py) with each block's checksum computed from
   memory as it is written (rawio.py), flushes and fsyncs it (and, with
   ``checkpoint_verify``, drops it from the page cache and checks every checksum
   read back from the disk);
2. rank 0 writes ``index.h5`` the same way, then renames the directory to
   ``ROOT/TAG`` (one ``rename``) and fsyncs the root;
3. last, ``ROOT/latest`` is replaced through a temporary file and ``rename``.
Failures on any rank are agreed on before the next step, so every rank raises.
An asynchronous save (asynchronous.py) runs steps 1-3 on a thread, after :func:`begin`, from what
was taken at the call (taken.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from copy import deepcopy
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from zerompi.checkpoint import frozen as frozen_values
from zerompi.checkpoint import optimizer_record, schema
from zerompi.checkpoint.durable import fsync_path, verify_file
from zerompi.checkpoint.entries import entries
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.checkpoint.rawio import WriteOptions
from zerompi.checkpoint.shards import to_numpy
from zerompi.checkpoint.snapshot import EngineSnapshot, frozen_in_file_order
from zerompi.checkpoint.stores import ShardStore, store_for
from zerompi.checkpoint.taken import host_copy
from zerompi.comm.topology import node_placement
from zerompi.errors import CheckpointError, UsageError, all_ranks_ok


def parts(snap: EngineSnapshot, meta: dict[str, Any], include_frozen: bool) -> Iterator[tuple[str, np.ndarray]]:
    """(dataset name, this rank's data) of every entry (entries.py), one bucket in memory at a time
    (``meta``: the save's optimizer record, optimizer_record.gathered)."""
    for entry in entries(snap, meta, include_frozen):
        yield from entry.parts()


def _write_shards(store: ShardStore, snap: EngineSnapshot, group, directory: Path, meta: dict[str, Any],
                  save_id: str, include_frozen: bool) -> list[list[int]] | None:
    return store.write(directory, group, parts(snap, meta, include_frozen), save_id,
                       WriteOptions.from_policy(snap.view.config.checkpointing))


def _bucket_meta(shards) -> list[dict[str, Any]]:
    return [{"index": s.layout.index, "group": s.layout.group, "padded_numel": s.layout.padded_numel,
             "slots": [[slot.fqn, slot.offset, slot.numel] for slot in s.layout.slots]} for s in shards]


def build_index(engine, snap: EngineSnapshot, tag: str, client_state, meta: dict, save_id: str,
           kind: str, include_frozen: bool) -> CheckpointIndex:
    m = engine.module
    replicated = list(snap.replicated_frozen if include_frozen else ()) + [n for n, _ in m.named_buffers()]
    frozen = _bucket_meta(frozen_in_file_order(snap.view)) if include_frozen else []
    keys = snap.view.config.keys
    return CheckpointIndex(
        tag=tag, world_size=snap.view.group.size, stage=keys["stage"], dtype=keys["dtype"],
        steps=snap.counters.steps, skipped_steps=snap.counters.skipped_steps,
        params=[{"name": n, "shape": list(p.shape), "trainable": p.requires_grad} for n, p in m.named_parameters()],
        buckets=_bucket_meta(snap.view.shards), optimizer=meta, replicated=replicated, client_state=client_state,
        scaler=snap.counters.scaler, config=keys, save_id=save_id, layout=kind,
        scheduler=snap.counters.scheduler, frozen_buckets=frozen,
        frozen_dtype=frozen_values.dtype_name(snap.frozen_dtype) if frozen else "", frozen_saved=include_frozen)


class Replicated(NamedTuple):
    """A tensor index.h5 holds whole, on the host: its values as written (16-bit floats widened to fp32)."""

    data: np.ndarray
    dtype: str          # the tensor's torch dtype, without "torch."
    shape: list[int]


def replicated_tensors(engine, index: CheckpointIndex, copy: bool) -> dict[str, torch.Tensor]:
    """The frozen parameters and buffers the index lists (copies, for a save that writes them later)."""
    named = dict(engine.module.named_parameters())
    named.update(engine.module.named_buffers())
    return {n: named[n].detach().clone() if copy else named[n] for n in index.replicated}


def replicated_arrays(tensors: dict[str, torch.Tensor], copy: bool) -> Iterator[tuple[str, Replicated]]:
    """Each tensor on the host, one at a time (``copy``: an array of its own, for a save's thread; otherwise
    a view where the tensor is a CPU one)."""
    for n, t in tensors.items():
        yield n, Replicated(host_copy(t) if copy else to_numpy(t), str(t.dtype).removeprefix("torch."), list(t.shape))


def write_index(replicated: Iterable[tuple[str, Replicated]], path: Path, index: CheckpointIndex) -> None:
    with schema.open_h5(path, "w") as f:
        index.write(f)
        for name, tensor in replicated:  # the index's order
            ds = schema.replicated(name)
            schema.write_array(f, ds, tensor.data)
            f[ds].attrs["torch_dtype"] = schema.text_attr(tensor.dtype)
            f[ds].attrs["shape"] = tensor.shape
    fsync_path(path)


def _publish(root: Path, tmp: Path, tag: str) -> None:
    """Rank 0: move the finished directory into place, then point ``latest`` at it."""
    fsync_path(tmp)  # the rank files' names, before the directory is renamed into place
    final = root / tag
    old = None
    if final.exists():  # re-saving a tag: keep the old copy until the new one is in place
        old = root / f".old-{tag}-{tmp.name.rsplit('-', 1)[-1]}"
        final.rename(old)
    tmp.rename(final)
    fsync_path(root)
    pointer = root / f".{schema.LATEST}.tmp"
    pointer.write_text(tag + "\n")
    fsync_path(pointer)
    pointer.rename(root / schema.LATEST)
    fsync_path(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prepare_root(root: Path, tmp: Path) -> None:
    """Rank 0: clean up after killed saves (one job writes a root at a time), then make tmp.

    A save killed while replacing an existing tag can leave only ``.old-TAG-*``:
    that complete copy goes back in place rather than away.
    """
    if root.is_dir():
        for old in root.glob(".old-*"):
            tag = old.name[len(".old-"):].rsplit("-", 1)[0]
            if not (root / tag).exists():
                old.rename(root / tag)
            else:
                shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)


def agree_or_discard(group, error: str | None, tmp: Path, tag: str) -> None:
    """``all_ranks_ok`` for a save's step: where any rank failed (a full disk), rank 0 removes the save's
    partial files, which would otherwise hold the space until the next save (every rank has stopped
    writing: the check is collective), and every rank raises naming the tag and the directory."""
    try:
        all_ranks_ok(group, error, CheckpointError)
    except CheckpointError as e:
        raise discard(f"saving checkpoint {tag!r}", str(e), tmp, remove=group.rank == 0) from None


def discard(what: str, failed: str, tmp: Path, remove: bool) -> CheckpointError:
    """A failed save's error, every rank's alike; ``remove`` (rank 0, once every rank has stopped writing):
    its partial files go first."""
    if remove:
        shutil.rmtree(tmp, ignore_errors=True)
    return CheckpointError(f"{what} failed: {failed} (under {tmp.parent}: its partial files ({tmp.name}) are "
                           "removed, and 'latest' still names the last complete checkpoint)")


def _attempt(fn, *args) -> str | None:
    return _attempt_for(fn, *args)[1]


def _attempt_for(fn, *args) -> tuple[Any, str | None]:
    """``fn``'s result and None, or None and the failure to agree on: any exception, since a rank that raised
    alone would leave the others waiting (h5py reports a full disk at a flush as RuntimeError)."""
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - agreed by every rank, then raised as CheckpointError
        return None, f"{type(e).__name__}: {e}"


class Publication(NamedTuple):
    """What rank 0 publishes once every shard is written (plain data: an asynchronous save's thread gets it)."""

    root: Path
    tmp: Path
    tag: str
    index: CheckpointIndex
    replicated: Iterable[tuple[str, Replicated]]  # what the index holds besides the shards


class Job(NamedTuple):
    """A save after its collective start: where it writes, and what rank 0 indexes and publishes."""

    snap: EngineSnapshot
    root: Path
    tag: str
    tmp: Path                   # ROOT/.tmp-TAG-ID, made by rank 0
    save_id: str
    store: ShardStore
    meta: dict[str, Any]        # the optimizer's record (optimizer_record.py)
    index: CheckpointIndex | None           # rank 0
    replicated: dict[str, torch.Tensor]     # rank 0: what the index holds besides the shards (live)
    include_frozen: bool

    def publication(self, copy: bool = False) -> Publication:
        """What rank 0 publishes (``copy``: the replicated tensors' host copies, taken now, for a save's
        thread; otherwise each is read as index.h5 is written)."""
        arrays = replicated_arrays(self.replicated, copy)
        return Publication(self.root, self.tmp, self.tag, self.index, tuple(arrays) if copy else arrays)


def begin(engine, root: str | os.PathLike, tag: str | None, client_state: Any, store: ShardStore,
          copy: bool = False, include_frozen: bool = True) -> Job:
    """Collective: check the arguments, agree on the save's id, clean the root and make the temporary
    directory; read the metadata (rank 0: the index, with the replicated tensors; with ``copy``, the
    index is a copy that the next steps cannot change, and ``Job.publication(copy=True)`` copies the tensors)."""
    snap = engine.snapshot()
    if not snap.between_steps:
        raise UsageError("save_checkpoint() in the middle of a gradient-accumulation window: "
                         "call it after step()")
    tag = schema.check_tag(tag if tag is not None else schema.step_tag(snap.counters.steps))
    try:
        json.dumps(client_state)
    except (TypeError, ValueError) as e:
        raise UsageError(f"client_state must be JSON-serialisable ({e})") from e
    group, root = engine.group, Path(root)
    meta = optimizer_record.gathered(group, snap.view, snap.recorded)
    nonce = group.allgather_object(uuid.uuid4().hex[:12] if group.rank == 0 else None)[0]
    tmp = root / f".tmp-{tag}-{nonce}"
    error = _attempt(_prepare_root, root, tmp) if group.rank == 0 else None
    all_ranks_ok(group, error, CheckpointError)
    index, replicated = None, {}
    if group.rank == 0:
        index = build_index(engine, snap, tag, client_state, meta, nonce, store.kind.value, include_frozen)
        if copy:  # written on the save's thread: client_state and the scheduler's state_dict may share
            # dicts and lists that training changes in place (a data position, a scheduler's history)
            index = deepcopy(index)
        replicated = replicated_tensors(engine, index, copy=False)
    return Job(snap, root, tag, tmp, nonce, store, meta, index, replicated, include_frozen)


def publish(p: Publication) -> None:
    """Rank 0, once every shard is written: index.h5 (written, read back), then the directory and
    ``latest`` into place."""
    write_index(p.replicated, p.tmp / schema.INDEX, p.index)
    verify_file(p.tmp / schema.INDEX)
    _publish(p.root, p.tmp, p.tag)


def save(engine, root: str | os.PathLike, tag: str | None = None, client_state: Any = None, *,
         include_frozen: bool = True, layout=None) -> str:
    """Collective: write a checkpoint of ``engine`` under ``root``; returns the tag (``include_frozen``:
    see ``Engine.save_checkpoint``; ``layout``: a CheckpointLayout instead of the config's)."""
    node = node_placement(engine.info, engine.config.topology.ranks_per_node).node
    job = begin(engine, root, tag, client_state, store_for(layout or engine.config.checkpointing.layout, node),
                include_frozen=include_frozen)
    snap = job.snap
    # One file per shard (or per node); with hsdp only the first node's ranks write (the others hold replicas).
    files, error = _attempt_for(_write_shards, job.store, snap, snap.view.group, job.tmp, job.meta,
                                job.save_id, include_frozen) if snap.view.writes else (None, None)
    agree_or_discard(engine.group, error, job.tmp, job.tag)
    if files is not None and engine.group.rank == 0:  # per-node: which ranks each file holds
        job = job._replace(index=dataclasses.replace(job.index, files=files))
    error = _attempt(publish, job.publication()) if engine.group.rank == 0 else None
    agree_or_discard(engine.group, error, job.tmp, job.tag)
    return job.tag
