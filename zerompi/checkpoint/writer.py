"""Atomic, verified save of an engine's state.

Protocol (a job killed at any moment leaves the previous checkpoint loadable):
1. every rank writes ``ROOT/.tmp-TAG-NONCE/rankNNNNN.h5`` (or its part of the
   shared ``shards.h5``, see shared.py), flushes, fsyncs, re-reads it and
   checks every checksum;
2. rank 0 writes ``index.h5`` the same way, then renames the directory to
   ``ROOT/TAG`` (one ``rename``) and fsyncs the root;
3. last, ``ROOT/latest`` is replaced through a temporary file and ``rename``.
Failures on any rank are agreed on before the next step, so every rank raises.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerompi.errors import CheckpointError, UsageError, all_ranks_ok
from zerompi.checkpoint import schema, shared
from zerompi.checkpoint.index import CheckpointIndex

# Per-rank RNG datasets: the CPU generator, the current CUDA device's, and how many devices it saw.
CPU_RNG, CUDA_RNG, CUDA_DEVICES = "rng/torch_cpu", "rng/torch_cuda", "rng/cuda_device_count"


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (h5py does not expose its descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """CPU numpy copy; 16-bit floats widen to fp32 (exact) since numpy has no bfloat16."""
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.contiguous().numpy()


def _my_part(bucket, t: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's shard of a per-element tensor (stage 0 holds it whole: write only our slice)."""
    if bucket.where.stage >= 1:
        return t
    rng = bucket.layout.shard(rank)
    return t[rng.start:rng.stop]


def _scalar(v) -> list | None:
    if isinstance(v, torch.Tensor) and v.dim() == 0:
        return [v.item(), str(v.dtype).removeprefix("torch.")]
    if isinstance(v, (int, float, bool)):
        return [v, type(v).__name__]
    return None


def optimizer_meta(engine) -> dict[str, Any]:
    """Param group options, per-element state keys, and scalar state per bucket (JSON)."""
    inner = engine.optimizer.inner
    groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, tuple, list))}
              for g in inner.param_groups]
    keys: list[str] = []
    scalars = []
    for b in engine.sharded.buckets:
        per_bucket = {}
        for k, v in inner.state.get(b.master, {}).items():
            s = _scalar(v)
            if s is not None:
                per_bucket[k] = s
            elif isinstance(v, torch.Tensor) and v.dim() == 1:  # per-element (possibly swapped out)
                if k not in keys:
                    keys.append(k)
            else:
                raise CheckpointError(f"optimizer state {k!r} of type {type(v).__name__} cannot be saved: "
                                      "only per-element tensors and scalars are supported")
        scalars.append(per_bucket)
    return {"groups": groups, "state_keys": keys, "scalars": scalars}


def _parts(engine, keys: list[str]):
    """(dataset name, this rank's data) for everything a rank saves, one bucket in memory at a time."""
    rank = engine.groups.shard.rank
    inner = engine.optimizer.inner
    for i, b in enumerate(engine.sharded.buckets):
        with engine.optimizer.store.resident(i):  # offloaded state: one bucket in memory at a time
            yield f"b{b.layout.index}/master", to_numpy(_my_part(b, b.master, rank))
            state = inner.state.get(b.master, {})
            for k in keys:
                if k in state:
                    yield f"b{b.layout.index}/state/{k}", to_numpy(_my_part(b, state[k], rank))
    yield CPU_RNG, torch.get_rng_state().numpy()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # the current device: the engine's
        yield CUDA_RNG, torch.cuda.get_rng_state().numpy()
        yield CUDA_DEVICES, np.array([torch.cuda.device_count()], dtype=np.int64)


def _write_rank_file(engine, path: Path, keys: list[str], save_id: str) -> None:
    with schema.open_h5(path, "w") as f:
        schema.write_header(f, "shard")
        f.attrs["save_id"] = schema.text_attr(save_id)
        f.attrs["rank"] = engine.groups.shard.rank
        f.attrs["world_size"] = engine.groups.shard.size
        for name, data in _parts(engine, keys):
            schema.write_array(f, name, data)
    fsync_path(path)
    verify_file(path)


def _write_shared(engine, path: Path, keys: list[str], save_id: str) -> None:
    """Collective over the writing ranks: one file through the mpio driver; each rank verifies its part."""
    writer = shared.SharedWriter(path, engine.groups.shard, save_id)
    try:
        for name, data in _parts(engine, keys):
            writer.put(name, data)
    finally:
        writer.close()
    fsync_path(path)
    files = shared.SharedFile(path.parent, engine.groups.shard.size, save_id)
    try:
        files.verify([engine.groups.shard.rank])
    finally:
        files.close()


def layout(config) -> str:
    """The layout a save writes: ``checkpoint_layout``, with 'auto' resolved by what h5py can do."""
    if config.checkpoint_layout == "auto":
        return "shared" if shared.available() else "per_rank"
    if config.checkpoint_layout == "shared" and not shared.available():
        raise UsageError("checkpoint_layout='shared' needs h5py built with MPI (h5py.get_config().mpi is "
                         "False here); allowed here: 'per_rank' or 'auto'. README.md says how to build it")
    return config.checkpoint_layout


def verify_file(path: Path) -> None:
    """Re-read every dataset of an HDF5 file and check its checksums."""
    def visit(_name, obj):
        if hasattr(obj, "shape"):
            schema.read_array(obj)
    try:
        with schema.open_h5(path) as f:
            f.visititems(visit)
    except CheckpointError:
        raise
    except schema.H5_ERRORS as e:
        raise schema.damaged(str(path), e) from e


def _index(engine, tag: str, client_state, meta: dict, save_id: str, kind: str) -> CheckpointIndex:
    m = engine.module
    replicated = [n for n, p in m.named_parameters() if not p.requires_grad] + [n for n, _ in m.named_buffers()]
    buckets = [{"index": b.layout.index, "group": b.layout.group, "padded_numel": b.layout.padded_numel,
                "slots": [[s.fqn, s.offset, s.numel] for s in b.layout.slots]} for b in engine.sharded.buckets]
    scaler = engine.optimizer.scaler
    return CheckpointIndex(
        tag=tag, world_size=engine.groups.shard.size, stage=engine.config.stage, dtype=engine.config.dtype,
        steps=engine.stats.steps, skipped_steps=engine.stats.skipped_steps,
        params=[{"name": n, "shape": list(p.shape), "trainable": p.requires_grad} for n, p in m.named_parameters()],
        buckets=buckets, optimizer=meta, replicated=replicated, client_state=client_state,
        scaler=None if scaler is None else {"scale": scaler.scale, "good_steps": scaler.good_steps,
                                            "hysteresis_left": scaler.hysteresis_left},
        config=engine.config.to_dict(), save_id=save_id, layout=kind)


def _write_index(engine, path: Path, index: CheckpointIndex) -> None:
    tensors = dict(engine.module.named_parameters())
    tensors.update(engine.module.named_buffers())
    with schema.open_h5(path, "w") as f:
        index.write(f)
        for name in index.replicated:
            schema.write_array(f, f"replicated/{name}", to_numpy(tensors[name]))
            f[f"replicated/{name}"].attrs["torch_dtype"] = schema.text_attr(
                str(tensors[name].dtype).removeprefix("torch."))
            f[f"replicated/{name}"].attrs["shape"] = list(tensors[name].shape)
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


def _attempt(fn, *args) -> str | None:
    try:
        fn(*args)
    except (OSError, CheckpointError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def save(engine, root: str | os.PathLike, tag: str | None = None, client_state: Any = None) -> str:
    """Collective: write a checkpoint of ``engine`` under ``root``; returns the tag."""
    if engine._micro != 0:
        raise UsageError("save_checkpoint() in the middle of a gradient-accumulation window: "
                         "call it after step()")
    tag = schema.check_tag(tag if tag is not None else f"step{engine.stats.steps:08d}")
    try:
        json.dumps(client_state)
    except (TypeError, ValueError) as e:
        raise UsageError(f"client_state must be JSON-serialisable ({e})") from e
    group, root, kind = engine.group, Path(root), layout(engine.config)
    nonce = group.allgather_object(uuid.uuid4().hex[:12] if group.rank == 0 else None)[0]
    tmp = root / f".tmp-{tag}-{nonce}"
    error = _attempt(_prepare_root, root, tmp) if group.rank == 0 else None
    all_ranks_ok(group, error, CheckpointError)
    meta = optimizer_meta(engine)
    # One file per shard; with hsdp only the first node's ranks write (the other nodes hold replicas).
    writes = engine.groups.replicate is None or engine.groups.replicate.rank == 0
    if not writes:
        error = None
    elif kind == "shared":
        error = _attempt(_write_shared, engine, tmp / shared.SHARED, meta["state_keys"], nonce)
    else:
        error = _attempt(_write_rank_file, engine, tmp / schema.rank_file(engine.groups.shard.rank),
                         meta["state_keys"], nonce)
    all_ranks_ok(group, error, CheckpointError)
    error = None
    if group.rank == 0:
        index = _index(engine, tag, client_state, meta, nonce, kind)
        error = _attempt(lambda: (_write_index(engine, tmp / schema.INDEX, index),
                                  verify_file(tmp / schema.INDEX), _publish(root, tmp, tag)))
    all_ranks_ok(group, error, CheckpointError)
    return tag
