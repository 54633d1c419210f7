"""``deepspeed.checkpointing``: activation checkpointing as torch's non-reentrant ``checkpoint``.

DeepSpeed's own options (partitioning activations over model-parallel ranks, keeping
them on the CPU, contiguous buffers) change where activations wait, never the values
computed; zerompi keeps them on the device and accepts the options. Model parallelism
(``mpu_``) does not exist here.
"""
from __future__ import annotations

from typing import Any

import torch.utils.checkpoint

from zerompi.errors import UsageError

__all__ = ["checkpoint", "configure", "is_configured", "reset"]

_configured = False


def checkpoint(function, *args: Any, **kwargs: Any):
    """``function(*args, **kwargs)`` whose activations are recomputed in backward (RNG state kept)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Accept DeepSpeed's activation-checkpointing options (they place activations; see above)."""
    global _configured
    if mpu_ is not None:
        raise UsageError("deepspeed.checkpointing.configure(mpu_=...): zerompi is data parallel only; pass None")
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """Nothing is buffered between forwards here."""
