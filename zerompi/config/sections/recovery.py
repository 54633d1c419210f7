"""The recovery section: surviving a lost rank without a relaunch (ULFM) and its recovery points.

``cfg.recovery`` is the policy built from these keys once (recovery/engine.py)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from zerompi.config import checks
from zerompi.config.declare import build, key
from zerompi.config.choices import RecoverySource


@dataclass(frozen=True)
class RecoveryPolicy:
    """Whether and how the survivors of a lost rank go on."""

    enabled: bool
    """fault_tolerance: survive lost ranks (ULFM)."""
    every: int
    """Steps between recovery points."""
    source: RecoverySource
    """Recovery points in memory (with a buddy copy) or in files."""
    directory: str | None
    """Where recovery files go; None: a fresh directory under rank 0's temporary directory."""
    min_ranks: int
    """The fewest ranks training goes on with."""


@dataclass(frozen=True, kw_only=True)
class RecoveryKeys:
    """The recovery section's keys (ZeroConfig's fields) and its policy."""

    fault_tolerance: bool = key(False, checks.boolean, policy="enabled")
    """Survive lost ranks without a relaunch (ULFM, Open MPI's ``--with-ft ulfm``): the survivors shrink, rebuild,
    reload the last recovery checkpoint and raise ``zerompi.Recovered``; the loop goes on from ``engine.stats.steps``.
    Needs micro_batches (re-dealt over the survivors; with reproducible=True the bits of the failure-free run).
    See docs/fault-tolerance.md ("Surviving a lost rank")."""
    recovery_every: int = key(1, checks.whole(1), policy="every")
    """fault_tolerance: steps between recovery checkpoints (>= 1); a failure replays at most this many."""
    recovery_source: RecoverySource = key(RecoverySource.MEMORY, checks.of(RecoverySource), policy="source")
    """fault_tolerance: 'memory', recovery checkpoints in memory with a copy on a buddy rank; 'disk', files."""
    recovery_dir: str | None = key(None, checks.maybe(checks.path, "a temporary directory"), policy="directory")
    """fault_tolerance: where recovery files go (every rank must read every rank's: a shared filesystem across
    nodes); None: a fresh directory under rank 0's temporary directory. 'memory' writes nothing there."""
    min_ranks: int = key(1, checks.whole(1))
    """fault_tolerance: the fewest ranks training goes on with; fewer survivors abort the job, >= 1."""

    @cached_property
    def recovery(self) -> RecoveryPolicy:
        """Surviving a lost rank."""
        return build(RecoveryPolicy, self, RecoveryKeys)
