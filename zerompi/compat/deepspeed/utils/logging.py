"""``deepspeed.utils.logging``: the logger and rank-filtered logging scripts use."""
from __future__ import annotations

import logging
from collections.abc import Sequence

from zerompi.compat.deepspeed import comm
from zerompi.log import get_logger

__all__ = ["log_dist", "logger", "print_dist"]

logger = get_logger("zerompi.deepspeed")
"""Scripts' messages (``deepspeed.utils.logger``), under zerompi's logger: ``zerompi.log.configure`` shows them."""


def _should_log(ranks: Sequence[int] | None) -> bool:
    """DeepSpeed's rule: everyone before init_distributed; after it, the ranks listed ([-1]: all)."""
    if not comm.is_initialized():
        return True
    ranks = list(ranks or [])
    return bool(ranks) and (ranks[0] == -1 or comm.get_rank() in ranks)


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ``ranks`` listed (``[-1]``: every rank), prefixed by the rank."""
    if _should_log(ranks):
        logger.log(level, "[Rank %d] %s", comm.get_rank(), message)


def print_dist(message: str, ranks: Sequence[int] | None = None) -> None:
    """Print ``message`` on the ``ranks`` listed, whatever the log level."""
    if _should_log(ranks):
        print(f"[Rank {comm.get_rank()}] {message}", flush=True)
