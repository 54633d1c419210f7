"""The sharding section: the ZeRO stage, bucket sizes, what stays gathered, and how ranks group.

Its keys are ZeroConfig's flat fields; ``cfg.sharding`` and ``cfg.topology`` are the policies built from
them once, what the engine's planner and comm/topology.py take."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from zerompi.config import checks
from zerompi.config.declare import build, key
from zerompi.config.choices import Hierarchy, Stage


@dataclass(frozen=True)
class ShardingPolicy:
    """What is sharded and in which pieces."""

    stage: Stage
    """0 plain data parallel; 1 shards optimizer state + fp32 master; 2 + grads; 3 + params."""
    bucket_mb: float
    """MiB per communication bucket (stage 3: the size at which a module becomes a gather unit)."""
    persistence_threshold: int
    """Stage 3: parameters with fewer elements stay gathered between uses."""
    max_live_params: int | None
    """Stage 3 with prefetch: the most elements gathered ahead at once (None: no bound)."""

    def bucket_numel(self, itemsize: int) -> int:
        """Elements of ``itemsize`` bytes that fit in one bucket of ``bucket_mb`` MiB (>= 1)."""
        if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
            raise ValueError(f"itemsize={itemsize!r} is not an int >= 1")
        return max(1, int(self.bucket_mb * 2**20 // itemsize))


@dataclass(frozen=True)
class TopologyPolicy:
    """How ranks are grouped for sharding."""

    hierarchy: Hierarchy
    """Flat, hsdp (shard in a node, replicate across) or hpz (secondary copy per node)."""
    ranks_per_node: int | None
    """Ranks per node; None takes nodes from MPI (shared memory)."""

    @property
    def is_flat(self) -> bool:
        """One shard group over all ranks."""
        return self.hierarchy is Hierarchy.FLAT


@dataclass(frozen=True, kw_only=True)
class ShardingKeys:
    """The sharding section's keys (ZeroConfig's fields) and its policy."""

    stage: Stage = key(Stage.PARAMETERS, checks.stage, spelled={"DeepSpeed": "zero_optimization.stage"})
    """0 plain data parallel; 1 shards optimizer state + fp32 master; 2 + grads; 3 + params."""
    bucket_mb: float = key(25.0, checks.positive)
    """MiB of gradients per communication bucket at stages 0-2. At stage 3 a module becomes
    a gather unit once its subtree's parameters not claimed by a smaller unit reach this."""
    param_persistence_threshold: int = key(0, checks.whole(0), policy="persistence_threshold")
    """Stage 3: trainable parameters with fewer elements than this stay gathered on every rank
    between uses (their optimizer state and gradients stay sharded, as at stage 2), which saves
    their many small all-gathers in forward and backward for c bytes each of memory; 0 shards
    every parameter. DeepSpeed's stage3_param_persistence_threshold."""
    max_live_params: int | None = key(None, checks.maybe(checks.whole(1), "no bound"))
    """Stage 3 with prefetch: the most parameter elements gathered by prefetching at once, the
    unit computing plus those gathered ahead (fewer units are prefetched when more would exceed
    it; a unit larger than the bound is still gathered, alone; enclosing units gathered around
    them are not counted). None: prefetch_units alone decides. DeepSpeed's
    stage3_max_live_parameters."""
    hierarchy: Hierarchy = key(Hierarchy.FLAT, checks.of(Hierarchy))
    """'flat': shard over all ranks; 'hsdp' (stages 1-3): shard within a node and replicate across
    nodes; 'hpz' (stage 3): flat shards plus a secondary parameter copy sharded within each node,
    so forward/backward all-gathers stay inside the node (ZeRO++). See comm/topology.py."""
    ranks_per_node: int | None = key(None, checks.maybe(checks.whole(1), "nodes from MPI"))
    """Ranks per node for 'hsdp'/'hpz': None takes nodes from MPI (shared memory); a number
    groups consecutive ranks, e.g. to emulate several nodes on one machine."""

    @cached_property
    def sharding(self) -> ShardingPolicy:
        """What is sharded and in which pieces."""
        return build(ShardingPolicy, self, ShardingKeys)

    @cached_property
    def topology(self) -> TopologyPolicy:
        """Grouping of ranks for sharding."""
        return build(TopologyPolicy, self, ShardingKeys)

    def bucket_numel(self, itemsize: int) -> int:
        """Elements of ``itemsize`` bytes that fit in one bucket of ``bucket_mb`` MiB (>= 1)."""
        return self.sharding.bucket_numel(itemsize)
