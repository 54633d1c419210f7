"""The reliability section: collective checks, the hang watchdog and aborting on an exception.

``cfg.reliability`` is the policy built from these keys once (services.py, the group)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from zerompi.config import checks
from zerompi.config.declare import build, key


@dataclass(frozen=True)
class ReliabilityPolicy:
    """What happens when communication goes wrong (a non-finite gradient: OptimizerPolicy.nonfinite)."""

    debug_collectives: bool
    """Check before every collective that all ranks are at the same one."""
    collective_timeout: float | None
    """Seconds a rank may wait in one collective before the watchdog aborts; overrides hang_floor."""
    abort_on_exception: bool
    """An uncaught exception on one rank calls MPI_Abort instead of hanging the others."""
    hang_floor: float | None
    """Least seconds of the automatic hang deadline (max with 3 median steps); None: off."""
    hang_dir: str | None
    """Where ranks write their records on a hang abort; None: a temporary directory per job."""


@dataclass(frozen=True, kw_only=True)
class ReliabilityKeys:
    """The reliability section's keys (ZeroConfig's fields) and its policy."""

    debug_collectives: bool = key(False, checks.boolean)
    """Before every collective, check that all ranks are at the same operation, bucket and
    size, and raise naming the module if not (one extra small all-gather each). Also on
    when the environment sets ZEROMPI_DEBUG=1."""
    collective_timeout: float | None = key(None, checks.maybe(checks.positive, "no watchdog"))
    """Seconds a rank may wait in one collective before the watchdog reports what it was
    waiting on, gathers the hang report and aborts the job; overrides the automatic deadline
    of hang_floor."""
    hang_floor: float | None = key(60.0, checks.maybe(checks.positive, "no automatic hang deadline"))
    """The automatic hang deadline: a rank waiting in one collective longer than
    max(hang_floor, 3 x the running median step time) starts the hang report (rank 0 names the
    culprit rank, its collective and stack) and the job aborts with exit code 4. Seconds; None
    turns the automatic deadline off (collective_timeout still applies)."""
    hang_dir: str | None = key(None, checks.maybe(checks.path, "a temporary directory per job"))
    """Directory where each rank writes its record (last collectives, stack) when a hang is
    diagnosed, for ``zerompi diagnose DIR``; None: a temporary directory named after the job.
    Use a shared directory to read every rank's record from one node."""
    abort_on_exception: bool = key(True, checks.boolean)
    """Install a sys.excepthook that prints an uncaught exception once and calls MPI_Abort,
    so one failing rank ends the job instead of hanging the others."""

    @cached_property
    def reliability(self) -> ReliabilityPolicy:
        """Collective checks, watchdog and abort."""
        return build(ReliabilityPolicy, self, ReliabilityKeys)
