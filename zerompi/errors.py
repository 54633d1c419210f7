"""The zerompi error family, and agreement on failure across ranks.

Every error a user can trigger derives from :class:`ZeroMPIError`. A check
whose outcome may differ between ranks must go through :func:`all_ranks_ok`
before the next collective, so that every rank raises together instead of
some ranks waiting forever in a collective the others never enter.
"""
from __future__ import annotations


class ZeroMPIError(RuntimeError):
    """Base class of every error raised by zerompi."""


class ConfigError(ZeroMPIError, ValueError):
    """A configuration key has a wrong value or is unknown."""


class CheckpointError(ZeroMPIError):
    """A checkpoint is missing, corrupt, or belongs to a different model."""


class UsageError(ZeroMPIError):
    """The engine was driven in the wrong order (e.g. step() before backward())."""


class ModelMismatchError(ZeroMPIError):
    """Ranks were given models that differ in names, shapes, dtypes or values."""


class RankLost(ZeroMPIError):
    """A rank of the job died (an MPI error of class ERR_PROC_FAILED or ERR_REVOKED) while this one
    communicated with it. Only raised with ``fault_tolerance=True``, and only inside zerompi: the
    engine recovers from it and raises :class:`Recovered` instead."""


class Recovered(ZeroMPIError):
    """``fault_tolerance=True``: a rank was lost, the survivors rebuilt the engine over themselves and
    reloaded the last recovery checkpoint. Training goes on from ``engine.stats.steps`` (the step of
    that checkpoint, which may be earlier than the step that failed); ``report`` says what happened."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


def all_ranks_ok(group, error: str | None, kind: type[ZeroMPIError] = ZeroMPIError) -> None:
    """Raise ``kind`` on every rank if ``error`` is set on any rank.

    ``error`` is this rank's message, or None when this rank is fine. The
    messages of all failing ranks are joined, each prefixed with its rank.
    One small all-gather; call it at points every rank reaches.
    """
    errors = group.allgather_object(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        lines = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise kind(lines)
