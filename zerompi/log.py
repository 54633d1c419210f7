"""Rank-aware logging: ``get_logger(__name__)`` everywhere, ``log_rank0`` for once-per-job lines."""
from __future__ import annotations

import logging
import os

_RANK = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) or 0)


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _RANK
        return True


def set_rank(rank: int) -> None:
    """Record this process's rank for log prefixes (called once MPI is up)."""
    global _RANK
    _RANK = rank


def get_logger(name: str) -> logging.Logger:
    """A logger under ``zerompi`` whose records carry the rank (``%(rank)s``)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    return logger


def configure(level: str | int | None = None) -> None:
    """Attach a rank-prefixed stderr handler to the ``zerompi`` logger.

    The level comes from ``level`` or ``ZEROMPI_LOG_LEVEL`` (default WARNING).
    Libraries should not configure logging behind the user's back, so the
    engine never calls this; jobs and tests do.
    """
    root = logging.getLogger("zerompi")
    level = level or os.environ.get("ZEROMPI_LOG_LEVEL", "WARNING")
    root.setLevel(level)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)


def log_rank0(logger: logging.Logger, level: int, msg: str, *args) -> None:
    """Log on rank 0 only: for facts that are the same on every rank."""
    if _RANK == 0:
        logger.log(level, msg, *args)
