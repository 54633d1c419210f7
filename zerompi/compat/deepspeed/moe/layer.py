"""``deepspeed.moe.layer``: ``MoE`` is named so that scripts import, and refuses to be built."""
from __future__ import annotations

from typing import Any

from zerompi.errors import UsageError

__all__ = ["MoE"]


class MoE:
    """DeepSpeed's mixture-of-experts layer: not offered (no expert parallelism in zerompi)."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise UsageError("deepspeed.moe.layer.MoE: zerompi has no mixture-of-experts layer and no expert "
                         "parallelism (ep_size); build the experts as ordinary modules")
