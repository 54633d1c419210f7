"""What a checkpoint reads from an engine and gives back to it: public snapshots, no privates.

The engine produces an :class:`EngineSnapshot` (``engine.snapshot()``) between
steps: its counters, a :class:`ShardView` of where this rank's shards lie, and the
components that hold checkpointed state (:class:`StateSource`). Each component
declares the kinds of state it holds (state/declared.py) and entries.py makes their
entries: the optimizer its buckets' masters and state, the sharded model its frozen
shards and the codecs' residuals, the process its RNG. The writer, the reader, the background save and the
recovery points iterate those entries; counters go back through
``engine.restore(Counters)``.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from zerompi.offload.fence import ShardFence
from zerompi.offload.residency import ShardState
from zerompi.comm.group import ProcessGroup
from zerompi.config.sections import CheckpointPolicy, TopologyPolicy
from zerompi.shard.layout import BucketLayout, ShardRange
from zerompi.state.declared import Declared


class Counters(NamedTuple):
    """The engine's step counters and fp16 loss-scaler state."""

    steps: int
    skipped_steps: int
    scaler: dict[str, Any] | None  # {"scale", "good_steps", "hysteresis_left"}, or None without fp16
    scheduler: dict[str, Any] | None = None  # the lr scheduler's state_dict, or None without one


class SavedConfig(NamedTuple):
    """What a checkpoint needs of the config: the keys it records, and the two sections it follows."""

    keys: dict[str, Any]            # ZeroConfig.to_dict(), written to the index as it is
    checkpointing: CheckpointPolicy  # how files are laid out and written
    topology: TopologyPolicy        # the groups the shards were written under (error-feedback residuals)

    @classmethod
    def of(cls, cfg: Any) -> SavedConfig:
        return cls(cfg.to_dict(), cfg.checkpointing, cfg.topology)


class ShardSnapshot(NamedTuple):
    """One bucket as a checkpoint sees it on this rank."""

    layout: BucketLayout
    own: ShardRange      # the elements of the bucket this rank holds (stage 0: all of them)
    written: ShardRange  # the part of ``own`` this rank saves (stage 0 replicas save their shard)


class ShardStates(Protocol):
    """Access to each bucket's master and optimizer state (the engine's optimizer)."""

    streams: bool
    """The state comes from a swap file one bucket at a time (NVMe offload), not from memory."""

    def shard_state(self, index: int) -> AbstractContextManager[ShardState]:
        """Bucket ``index``'s state, in memory for the block."""

    def peek_state(self, index: int) -> dict[str, Any]:
        """Bucket ``index``'s optimizer state as it is between steps, for its keys and scalars (an
        offloaded tensor may hold no data): nothing is read or written."""

    def fenced_state(self, index: int) -> AbstractContextManager[ShardState]:
        """Bucket ``index``'s state for a reader on another thread while a fence holds the bucket: the
        live tensors, or (``streams``) fresh copies read from the swap file; nothing is written back."""

    def load_shard(self, index: int, master: torch.Tensor, state: dict[str, Any]) -> None:
        """Overwrite bucket ``index``'s master and state, and publish it to the parameters."""

    partial_state: bool
    """Some buckets' state is on their tensors' owners alone (what the index records is gathered)."""

    def tensor_states(self, index: int) -> list[tuple[str, int, dict[str, torch.Tensor]]]:
        """(parameter name, offset in the shard, state tensors) of the tensors of bucket ``index`` that this
        rank steps, when the bucket's optimizer sees whole tensors (its state is kept per tensor)."""

    def load_tensor_state(self, index: int, name: str, saved: dict[str, torch.Tensor]) -> None:
        """Add tensor ``name``'s saved state tensors, after ``load_shard`` of its bucket."""

    def optimizer_names(self) -> list[str]:
        """Each optimizer param group's optimizer class, as ``module.QualName``."""

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Each optimizer param group's options (without the params)."""

    def load_hyperparameters(self, saved: list[dict[str, Any]]) -> None:
        """Restore the numeric options of each param group."""


class FrozenHolder(Protocol):
    """Access to stage 3's frozen parameter shards (the engine's sharded model)."""

    def frozen_shard(self, index: int) -> AbstractContextManager[torch.Tensor]:
        """Frozen bucket ``index``'s parameter shard in the compute dtype, in memory for the block; safe
        on another thread while training runs (a background save): nothing shared is changed."""

    def load_frozen(self, index: int, shard: torch.Tensor) -> None:
        """Collective: overwrite frozen bucket ``index``'s shard (every rank, in bucket order)."""


class ShardView(NamedTuple):
    """Where this rank's shards lie, as every entry reads it."""

    group: ProcessGroup     # the group the buckets are sharded over (one writer per member)
    writes: bool            # this rank saves a shard (with hsdp only the first node's ranks do)
    hierarchical: bool      # hsdp/hpz groups: per-rank RNG streams are not restored
    buckets: tuple[ShardSnapshot, ...]  # every bucket, trainable ones first (whether it trains is its layout's)
    config: SavedConfig
    fence: ShardFence | None  # what a background save holds until it has each bucket

    @property
    def shards(self) -> tuple[ShardSnapshot, ...]:
        """The trainable buckets, by index: the optimizer's, and the file's ``b<i>``."""
        return tuple(s for s in self.buckets if s.layout.trainable)


def frozen_in_file_order(view: ShardView) -> tuple[ShardSnapshot, ...]:
    """Stage 3's frozen buckets as the file numbers them (``f<i>``, apart from the trainable ``b<i>``): the
    file format's numbering, kept at this edge; the engine holds one list of buckets."""
    return tuple(sorted((s for s in view.buckets if not s.layout.trainable), key=lambda s: s.layout.index))


class Taken(Protocol):
    """What an entry hands a background save's thread at the call: one of the kinds checkpoint/taken.py
    allows (host copies, the fenced buckets, the frozen shards), and nothing else."""

    def parts(self) -> Iterator[tuple[str, Any]]:
        """(dataset name, numpy data) of the entry, on the save's thread."""


class Entry(Protocol):
    """One kind of checkpointed state (entries.py has the engine's own)."""

    what: str
    """How messages name it."""

    def parts(self) -> Iterator[tuple[str, Any]]:
        """(dataset name, numpy data) this rank writes, now."""

    def take(self) -> Taken:
        """For a background save, on the caller's thread: what its thread writes of this entry, taken now
        (checkpoint/taken.py: host copies, or the fenced buckets or the frozen shards read in place)."""

    def read(self, ctx: Any) -> Any:
        """Phase 1 (``ctx``: entries.py's LoadContext): read and check this rank's part; touch no engine state."""

    def apply(self, data: Any, ctx: Any) -> None:
        """Phase 2 (every rank read successfully): overwrite the engine's state with ``data``."""


class StateSource(Protocol):
    """A component that holds checkpointed state: it declares its kinds (state/declared.py), and
    entries.py makes each kind's entry, which reads and writes it through the holder's methods."""

    def declared_state(self) -> tuple[Declared, ...]:
        """Its kinds of state, in the order their datasets are written and applied."""


@dataclass(frozen=True)
class EngineSnapshot:
    """What a save needs of an engine, taken between steps."""

    counters: Counters
    view: ShardView
    between_steps: bool     # no accumulation window is open (a save needs this)
    recorded: ShardStates   # the optimizer: its record in the index (optimizer_record.py; one of the sources)
    sources: tuple[StateSource, ...]  # the components whose entries the files hold, in order
    replicated_frozen: tuple[str, ...] = ()    # frozen parameters held whole (in index.h5)
    frozen_dtype: torch.dtype = torch.float32  # the compute dtype the frozen shards hold
