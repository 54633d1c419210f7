"""The overlap section: how communication overlaps computation, and when buckets are updated.

``cfg.overlap`` is the policy built from these keys once (the sharded model, the services)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from zerompi.config import checks
from zerompi.config.declare import build, key
from zerompi.config.choices import Progress, UpdateSchedule


@dataclass(frozen=True)
class OverlapPolicy:
    """How communication overlaps computation."""

    grad_reduce: bool
    """Start each bucket's gradient reduce-scatter non-blocking as soon as backward fills it."""
    prefetch_units: int
    """Stage 3: gather units gathered ahead, non-blocking (0 = on demand)."""
    progress: Progress
    """How non-blocking collectives progress while Python computes."""
    update: UpdateSchedule = UpdateSchedule.AFTER_BACKWARD
    """When buckets are updated: in ``step()``, or during the backward that ends a window."""


@dataclass(frozen=True, kw_only=True)
class OverlapKeys:
    """The overlap section's keys (ZeroConfig's fields) and its policy."""

    overlap_grad_reduce: bool = key(False, checks.boolean, policy="grad_reduce")
    """Start each bucket's gradient reduce-scatter non-blocking as soon as backward has filled it,
    and wait for all of them when backward ends (stages 1-3), instead of reducing in place."""
    optimizer_in_backward: bool = key(False, checks.boolean)
    """Stages 2-3: update each bucket during the backward that ends an accumulation window, as soon
    as its gradient is reduced, instead of all buckets in ``step()``. Same arithmetic, bit for bit;
    under NVMe offload the gradient shard never goes to the swap file (its write and read-back: 8
    bytes per element and step at fp32) and the master and optimizer state stream in and out while
    backward computes.
    Needs what a per-bucket update cannot know in advance to be absent: no gradient clipping (the
    global norm), no fp16 (its overflow skips the step) and nonfinite='raise' (a NaN/Inf gradient
    still raises, from ``step()``, but the buckets before it are updated by then). ``step()``
    completes the step: the global norm, the counters, the lr schedule."""
    prefetch_units: int = key(0, checks.whole(0, 8))
    """Stage 3: gather this many gather units ahead, non-blocking (0 = gather on demand, up to 8);
    the order is recorded on the first step. With offload_params='nvme' the units' shards are
    read from the swap file this many units ahead (0 there means 3), and with
    optimizer_in_backward so is their optimizer state in backward."""
    mpi_progress: Progress = key(Progress.NONE, checks.of(Progress), policy="progress")
    """How non-blocking collectives progress while Python computes: 'none' (by the MPI library
    alone; with MPICH, MPIR_CVAR_ASYNC_PROGRESS=1 adds a progress thread), 'test' (MPI_Test
    from every gradient hook) or 'thread' (one communication thread per process runs every
    collective as a blocking call, in issue order; needs MPI_THREAD_MULTIPLE). See
    benchmarks/results/overlap.md for what each costs."""

    @cached_property
    def overlap(self) -> OverlapPolicy:
        """Overlap of communication with computation."""
        update = UpdateSchedule.IN_BACKWARD if self.optimizer_in_backward else UpdateSchedule.AFTER_BACKWARD
        return build(OverlapPolicy, self, OverlapKeys, update=update)
