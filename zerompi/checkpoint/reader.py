"""Load a checkpoint into an engine of any world size, stage or bucket size.

Loading happens in two phases so that nothing is half-loaded: every rank
first reads and verifies everything it needs into temporary arrays (only
its own shard, located through the index's layout), the ranks agree that
every read succeeded, and only then is the engine's state overwritten.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerompi.errors import CheckpointError, all_ranks_ok
from zerompi.log import get_logger, log_rank0
from zerompi.checkpoint import feedback, paths, schema
from zerompi.checkpoint.frozen import FrozenSource
from zerompi.checkpoint.stores import ShardFiles, store_named
from zerompi.checkpoint.index import CheckpointIndex, Source
from zerompi.checkpoint.rawio import Reads, read_tasks
from zerompi.checkpoint.snapshot import Counters, EngineSnapshot, ShardSnapshot

logger = get_logger(__name__)
FP32 = "<f4"  # master shards and optimizer state are stored as little-endian fp32


def resolve(root: str | os.PathLike, tag: str | None) -> Path:
    """The directory of ``tag`` (``latest`` when None), checked to be a plain child of ``root``
    that does not lead outside it through a symbolic link."""
    root = Path(root)
    if tag is None:
        pointer = root / schema.LATEST
        if not pointer.exists() and not pointer.is_symlink():
            raise CheckpointError(f"{pointer}: missing: no checkpoint was completed under {root}")
        paths.regular_file(pointer, root, "checkpoint root")
        try:
            tag = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{pointer}: unreadable ({e})") from e
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
    return store.open(directory, index.world_size, index.save_id, index.version)


def merge(sources: list[Source]) -> list[Source]:
    """Join runs that are contiguous both in the file and in the destination (one read each)."""
    out: list[Source] = []
    for s in sorted(sources, key=lambda s: (s.rank, s.bucket, s.start)):
        last = out[-1] if out else None
        if (last and last.rank == s.rank and last.bucket == s.bucket and last.stop == s.start
                and last.dest + (last.stop - last.start) == s.dest):
            out[-1] = last._replace(stop=s.stop)
        else:
            out.append(s)
    return out


@dataclass
class BucketData:
    master: np.ndarray
    state: dict[str, np.ndarray] = field(default_factory=dict)
    scalars: dict[str, list] = field(default_factory=dict)


def _uncovered(numel: int, sources: list[Source]) -> list[tuple[int, int]]:
    """The ranges of a shard of ``numel`` elements that no source fills (its padding)."""
    gaps, at = [], 0
    for s in sorted(sources, key=lambda s: s.dest):
        if s.dest > at:
            gaps.append((at, s.dest))
        at = max(at, s.dest + s.stop - s.start)
    return gaps + ([(at, numel)] if at < numel else [])


def _read_bucket(shard: ShardSnapshot, index: CheckpointIndex, files, slot_of, reads: Reads) -> BucketData:
    """Bucket ``shard``'s arrays, the reads that fill them started in ``reads`` (the caller waits)."""
    own = shard.own
    sources = []
    for piece in shard.layout.pieces(own):
        sources += index.locate(slot_of, piece.fqn, piece.param_start, piece.numel, piece.local_start)
    sources = merge(sources)
    keys = index.optimizer.get("state_keys", [])
    data = BucketData(np.empty(own.numel, dtype=np.float32), {k: np.empty(own.numel, dtype=np.float32) for k in keys})
    for a, z in _uncovered(own.numel, sources):  # the reads fill the rest
        for arr in (data.master, *data.state.values()):
            arr[a:z] = 0
    for s in sources:  # straight into the arrays that become the engine's state (rawio.read_tasks)
        n, length = s.stop - s.start, index.shard_length(s.bucket)
        master = files.dataset(s.rank, schema.master(s.bucket), length, FP32)
        reads.add(read_tasks(master, s.start, s.stop, data.master[s.dest:s.dest + n]))
        for k in keys:
            ds = files.dataset(s.rank, schema.state(s.bucket, k), length, FP32)
            reads.add(read_tasks(ds, s.start, s.stop, data.state[k][s.dest:s.dest + n]))
    if sources:
        data.scalars = index.optimizer["scalars"][sources[0].bucket]
    return data


@dataclass
class Loaded:
    index: CheckpointIndex
    buckets: list[BucketData]
    rng: np.ndarray | None
    replicated: dict[str, np.ndarray]
    cuda_rng: np.ndarray | None = None  # this rank's CUDA generator state, when it is to be restored
    frozen: list[np.ndarray] | None = None  # our frozen buckets' shards (None: the checkpoint has no frozen values)
    feedback: dict[int, np.ndarray] | None = None  # this rank's error-feedback residuals, when restored


def cuda_rng_decision(saved: np.ndarray | None, saved_devices: int | None, available: bool,
                      devices: int) -> tuple[bool, str | None]:
    """Whether to restore a saved CUDA RNG state, and what to warn about (None: nothing).

    A rank saves and restores only its current device's generator: its own stream,
    whatever device it runs on. Without CUDA here nothing draws from a CUDA generator,
    so the state is skipped, with a warning, rather than failing a resume on a CPU
    node. Another device count moves ranks to other devices, which does not change
    their streams: the state is restored, with a warning, because the random numbers
    of CUDA kernels (dropout masks) can also depend on the GPU model.
    """
    if saved is None:
        return False, None
    if not available:
        return False, ("the checkpoint holds a CUDA RNG state but CUDA is not available in this process: "
                       "not restored (only the CPU RNG state is)")
    if saved_devices is not None and saved_devices != devices:
        return True, (f"the checkpoint was written by processes seeing {saved_devices} CUDA devices, this one "
                      f"sees {devices}: this rank's saved CUDA RNG state is restored on its current device, but "
                      "CUDA random numbers (dropout masks) may differ on another GPU model")
    return True, None


def _read_cuda_rng(files, rank: int, where: Path) -> np.ndarray | None:
    """This rank's saved CUDA RNG state if it is to be restored here (warns when it is not)."""
    if not files.has(rank, schema.CUDA_RNG):
        return None
    saved = schema.read_array(files.dataset(rank, schema.CUDA_RNG, dtype="u1"))
    devices = (int(schema.read_array(files.dataset(rank, schema.CUDA_DEVICES, 1, "<i8"))[0])
               if files.has(rank, schema.CUDA_DEVICES) else None)  # older checkpoints do not record it
    available = torch.cuda.is_available()
    restore, warning = cuda_rng_decision(saved, devices, available, torch.cuda.device_count() if available else 0)
    if warning:
        logger.warning("%s: %s", where, warning)
    return saved if restore else None


def _check_compatible(engine, snap: EngineSnapshot, index: CheckpointIndex, directory: Path) -> None:
    named = [(n, tuple(p.shape), p.requires_grad) for n, p in engine.module.named_parameters()]
    problem = index.describe_mismatch(named)
    if problem:
        raise CheckpointError(f"{directory}: checkpoint of a different model: {problem}")
    saved = index.config.get("optimizer")
    ours = snap.config.to_dict()["optimizer"]
    if index.optimizer.get("state_keys") and saved != ours:
        raise CheckpointError(f"{directory}: optimizer state was written by {saved!r}, this job uses {ours!r}")


def prepare(engine, snap: EngineSnapshot, directory: Path) -> Loaded:
    """Read and verify everything this rank needs; touches no engine state."""
    index = CheckpointIndex.read(directory / schema.INDEX)
    _check_compatible(engine, snap, index, directory)
    files = open_shards(directory, index)
    source = FrozenSource(index, files, directory)
    reads = Reads()  # every bucket's reads in flight while the next datasets are opened and checked
    try:
        slot_of = index.slot_of()
        buckets = [_read_bucket(shard, index, files, slot_of, reads) for shard in snap.shards]
        reads.wait()
        frozen = [_read_frozen(shard, source) for shard in snap.frozen] if index.frozen_saved else None
        replicated = _read_replicated(engine, snap, index, directory, source)
        rng = cuda_rng = None  # per-rank RNG streams come back when the job has the same flat layout
        if index.world_size == engine.group.size and not snap.hierarchical:
            rng = schema.read_array(files.dataset(engine.group.rank, schema.CPU_RNG, dtype="u1"))
            cuda_rng = _read_cuda_rng(files, engine.group.rank, directory)
        else:  # rank r's saved stream is rank r's of another world: each rank keeps its own (seed + rank)
            log_rank0(logger, logging.INFO, "%s: RNG state not restored (written by %d ranks, hierarchical "
                      "layout: %s); each rank keeps its current RNG state", directory, index.world_size,
                      snap.hierarchical)
        residuals = feedback.read(snap, index, files, directory)
    finally:
        _quietly(reads.wait)  # no read may still use a file (a failure above is the one reported)
        source.close()
        files.close()
    return Loaded(index, buckets, rng, replicated, cuda_rng, frozen, residuals)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - raised again by the caller's own wait, or superseded
        pass


def _read_frozen(shard: ShardSnapshot, source: FrozenSource) -> np.ndarray:
    """This rank's shard of one of our frozen buckets, from wherever the checkpoint keeps the values."""
    data = np.zeros(shard.own.numel, dtype=np.float32)
    for piece in shard.layout.pieces(shard.own):
        end = piece.param_start + piece.numel
        data[piece.local_start:piece.local_start + piece.numel] = source.read(piece.fqn, piece.param_start, end)
    return data


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
        theirs = {n: a.length for n, a in arrays.items()}
        if set(ours) != set(saved) or ours != theirs:
            diff = sorted(set(ours) ^ set(saved)) or sorted(n for n in ours if ours[n] != theirs[n])
            raise CheckpointError(f"{directory}: checkpoint of a different model: buffers differ "
                                  f"({', '.join(diff[:5])})")
        for name, arr in arrays.items():
            out[name] = schema.read_array(arr)
    if index.frozen_saved:
        tensors = dict(engine.module.named_parameters())
        for name in snap.replicated_frozen:
            out[name] = source.read(name, 0, tensors[name].numel())
    return out


def _scalar_tensor(value, dtype: str):
    if dtype in ("int", "float", "bool"):
        return {"int": int, "float": float, "bool": bool}[dtype](value)
    return torch.tensor(value, dtype=getattr(torch, dtype))


def apply(engine, snap: EngineSnapshot, loaded: Loaded) -> None:
    """Overwrite the engine's state with what ``prepare`` read (all ranks succeeded)."""
    for i, data in enumerate(loaded.buckets):
        state = {k: torch.from_numpy(v) for k, v in data.state.items()}
        state.update({k: _scalar_tensor(*v) for k, v in data.scalars.items()})
        snap.states.load_shard(i, torch.from_numpy(data.master), state)
    for i, data in enumerate(loaded.frozen or []):  # the same buckets on every rank (hpZ: collective)
        snap.frozen_states.load_frozen(i, torch.from_numpy(data))
    snap.states.load_hyperparameters(loaded.index.optimizer.get("groups", []))
    feedback.restore(snap, loaded.feedback)
    index = loaded.index
    engine.restore(Counters(index.steps, index.skipped_steps, index.scaler or None, index.scheduler))
    if loaded.rng is not None:
        torch.set_rng_state(torch.from_numpy(loaded.rng.copy()))
    if loaded.cuda_rng is not None:
        try:  # the current device: the engine's (initialize set it), as when it was saved
            torch.cuda.set_rng_state(torch.from_numpy(loaded.cuda_rng.copy()))
        except RuntimeError as e:  # e.g. another torch's generator state format; the rest is loaded
            logger.warning("the saved CUDA RNG state was not restored: %s", e)
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
    all_ranks_ok(engine.group, error, CheckpointError)
    apply(engine, snap, loaded)
    return loaded.index.client_state
