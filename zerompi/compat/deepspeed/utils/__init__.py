"""``deepspeed.utils``: the logger and rank-filtered logging (``deepspeed.utils.logging``, where
DeepSpeed keeps them, and read from here as ``deepspeed.utils.logger``, as scripts do)."""
from zerompi.compat.deepspeed.utils import logging  # noqa: F401  Lightning sets deepspeed.utils.logging.logger's level
from zerompi.compat.deepspeed.utils.logging import log_dist, logger, print_dist

__all__ = ["log_dist", "logger", "logging", "print_dist"]
