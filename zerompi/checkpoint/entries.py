"""What a rank's checkpoint file holds, as entries: the writer, the reader and the background save iterate them.

Each component that holds checkpointed state declares its kinds (``declared_state()``,
snapshot.py's ``StateSource``, in state/declared.py's vocabulary); here each kind becomes
its entry, which reads only its holder's public methods and the engine's ``ShardView``:

- the optimizer: ``OptimizerShards`` (shards.py), every bucket's fp32 master and optimizer
  state, and ``TensorStates`` (tensors.py), the state of optimizers that see whole tensors;
- the sharded model: ``FrozenShards``, stage 3's frozen parameter shards, and ``Residuals``,
  its codecs' error-feedback residuals on this rank (feedback.py);
- the process: ``RngState``, its CPU (and CUDA) generator state (``PROCESS_RNG``).

An entry says which datasets this rank writes (``parts``, one bucket in memory at a
time), what a background save takes at the call for its thread to write (``take``: host
copies, the fenced buckets or the frozen shards, checkpoint/taken.py), what a load reads
and checks while touching nothing (``read``, phase 1)
and how that is applied once every rank has read (``apply``, phase 2). The index
(counters, loss scaler, scheduler, the tensors every rank holds whole) is rank 0's and
stays with the writer and the reader. A new kind of state is a new ``StateKind``, its
entry here and the component that declares it; the writer and reader do not change.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerompi.checkpoint import feedback, schema
from zerompi.checkpoint.frozen import FrozenRead, FrozenSource
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.checkpoint.rawio import Reads
from zerompi.checkpoint.shards import OptimizerShards, Part
from zerompi.checkpoint.snapshot import (EngineSnapshot, Entry, FrozenHolder, ShardSnapshot, ShardView,
                                         frozen_in_file_order)
from zerompi.checkpoint.taken import HostCopy
from zerompi.checkpoint.tensors import TensorStates
from zerompi.log import get_logger, log_rank0
from zerompi.state.declared import Declared, HeldResiduals, StateKind

logger = get_logger(__name__)


@dataclass
class LoadContext:
    """What phase 1 of a load reads from."""

    index: CheckpointIndex
    files: Any              # the shard files (stores.ShardFiles)
    directory: Path
    reads: Reads            # reads in flight on shared threads
    frozen: FrozenSource    # where the frozen parameters' values are
    rank: int               # this rank in the group the engine is sharded over (and saved with)
    world_size: int


class FrozenShards:
    """Entry: stage 3's frozen parameter shards (``f<i>/param``, in the compute dtype), read as they are
    written, by a background save too (frozen.py's FrozenRead: no step changes them)."""

    what = "frozen shards"

    def __init__(self, view: ShardView, holder: FrozenHolder, include: bool):
        self.view, self.holder, self.include = view, holder, include

    def parts(self) -> Iterator[Part]:
        return self.take().parts()

    def take(self) -> FrozenRead:
        return FrozenRead(len(frozen_in_file_order(self.view)) if self.include else 0, self.holder)

    def read(self, ctx: LoadContext) -> list[np.ndarray] | None:
        if not ctx.index.frozen_saved:
            return None
        return [_read_frozen(shard, ctx.frozen) for shard in frozen_in_file_order(self.view)]

    def apply(self, data: list[np.ndarray] | None, ctx: LoadContext) -> None:
        for i, shard in enumerate(data or []):  # the same buckets on every rank (hpZ: collective)
            self.holder.load_frozen(i, torch.from_numpy(shard))


def _read_frozen(shard: ShardSnapshot, source: FrozenSource) -> np.ndarray:
    """This rank's shard of one of our frozen buckets, from wherever the checkpoint keeps the values."""
    data = np.zeros(shard.own.numel, dtype=np.float32)
    for piece in shard.layout.pieces(shard.own):
        end = piece.param_start + piece.numel
        data[piece.local_start:piece.local_start + piece.numel] = source.read(piece.fqn, piece.param_start, end)
    return data


class Residuals:
    """Entry: this rank's error-feedback residuals, restored only where they still mean something."""

    what = "error-feedback residuals"

    def __init__(self, view: ShardView, residuals: HeldResiduals):
        self.view, self.residuals = view, residuals

    def parts(self) -> Iterator[Part]:
        return feedback.parts(self.residuals)

    def take(self) -> HostCopy:
        return HostCopy.of(feedback.parts(self.residuals))  # copies: the next backward changes them

    def read(self, ctx: LoadContext) -> dict[int, np.ndarray] | None:
        return feedback.read(self.view, self.residuals, ctx.index, ctx.files, ctx.directory)

    def apply(self, data: dict[int, np.ndarray] | None, ctx: LoadContext) -> None:
        feedback.restore(self.residuals, data)


class RngState:
    """Entry: this process's RNG state, restored when the job has the same flat layout (rank r's
    saved stream is rank r's of another world otherwise: each rank keeps its own, seed + rank)."""

    what = "RNG state"

    def __init__(self, view: ShardView):
        self.view = view

    def parts(self) -> Iterator[Part]:
        return iter(rng_parts())

    def take(self) -> HostCopy:
        return HostCopy.of(rng_parts())

    def read(self, ctx: LoadContext) -> tuple[np.ndarray, np.ndarray | None] | None:
        if ctx.index.world_size != ctx.world_size or self.view.hierarchical:
            log_rank0(logger, logging.INFO, "%s: RNG state not restored (written by %d ranks, hierarchical "
                      "layout: %s); each rank keeps its current RNG state", ctx.directory, ctx.index.world_size,
                      self.view.hierarchical)
            return None
        cpu = schema.read_array(ctx.files.dataset(ctx.rank, schema.CPU_RNG, dtype="u1"))
        return cpu, _read_cuda_rng(ctx.files, ctx.rank, ctx.directory)

    def apply(self, data: tuple[np.ndarray, np.ndarray | None] | None, ctx: LoadContext) -> None:
        if data is None:
            return
        cpu, cuda = data
        torch.set_rng_state(torch.from_numpy(cpu.copy()))
        if cuda is not None:
            try:  # the current device: the engine's (initialize set it), as when it was saved
                torch.cuda.set_rng_state(torch.from_numpy(cuda.copy()))
            except RuntimeError as e:  # e.g. another torch's generator state format; the rest is loaded
                logger.warning("the saved CUDA RNG state was not restored: %s", e)


def rng_parts() -> list[Part]:
    """This process's RNG state datasets, read now (copies)."""
    out = [(schema.CPU_RNG, torch.get_rng_state().numpy())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # the current device: the engine's
        out += [(schema.CUDA_RNG, torch.cuda.get_rng_state().numpy()),
                (schema.CUDA_DEVICES, np.array([torch.cuda.device_count()], dtype=np.int64))]
    return out


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


class ProcessRng:
    """The process's generators as a state source: not a component of any one engine."""

    def declared_state(self) -> tuple[Declared, ...]:
        return (Declared(StateKind.PROCESS_RNG),)


PROCESS_RNG = ProcessRng()


def _entry(declared: Declared, view: ShardView, meta: dict[str, Any], include_frozen: bool) -> Entry:
    """The entry that writes and reads one declared kind of state."""
    holder = declared.holder
    match declared.kind:
        case StateKind.OPTIMIZER_SHARDS:
            return OptimizerShards(view, holder, meta.get("state_keys", []))
        case StateKind.TENSOR_STATES:
            return TensorStates(view, holder, meta.get("tensor_states"))
        case StateKind.FROZEN_SHARDS:
            return FrozenShards(view, holder, include_frozen)
        case StateKind.RESIDUALS:
            return Residuals(view, holder.residuals())
        case StateKind.PROCESS_RNG:
            return RngState(view)
    raise AssertionError(f"no entry for {declared.kind}")


def entries(snap: EngineSnapshot, meta: dict[str, Any], include_frozen: bool = True) -> list[Entry]:
    """The entries of an engine's checkpoint: each source's declared kinds, in the snapshot's order (``meta``:
    the optimizer metadata of the save, or the index's of the load: its per-element state names, and where
    each whole tensor's state lies)."""
    return [_entry(declared, snap.view, meta, include_frozen)
            for source in snap.sources for declared in source.declared_state()]
