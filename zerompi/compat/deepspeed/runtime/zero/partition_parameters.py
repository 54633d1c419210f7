"""``deepspeed.runtime.zero.partition_parameters``: ``ZeroParamStatus``, the enum DeepSpeed 0.19.8 keeps in a
ZeRO-3 parameter's ``ds_status``, and the tensor-constructor wrapper that transformers swaps around ``zero.Init``.

Scripts import it to pick the parameters to gather, with ``hasattr(p, "ds_id") and p.ds_status ==
ZeroParamStatus.NOT_AVAILABLE``. zerompi's parameters carry no ``ds_id`` (its stage 3 shards flat buckets, not
parameters), so such a test selects none: that is right at stages 0-2, where every parameter is whole; at stage 3
a parameter read outside forward needs ``deepspeed.zero.GatheredParameters`` on the parameters themselves.
"""
from __future__ import annotations

from enum import Enum
from typing import Callable

import torch

__all__ = ["ZeroParamStatus", "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange  # what transformers compares a constructor with (its RoPE buffers)


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype | None = None,
                                           target_device: torch.device | None = None) -> Callable:
    """DeepSpeed's ``zero.Init`` wraps torch's tensor constructors to cast what they make; zerompi's leaves
    them alone (only parameters go to the meta device), so this returns ``fn``. transformers replaces the
    name around ``from_pretrained`` (``prevent_arange_dtype_change``), so it must exist."""
    return fn


class ZeroParamStatus(Enum):
    """A ZeRO-3 parameter's state under DeepSpeed (the names and values of DeepSpeed 0.19.8)."""

    AVAILABLE = 1  # gathered: the full tensor is in place
    NOT_AVAILABLE = 2  # partitioned: only this rank's shard is held
    INFLIGHT = 3  # an all-gather is under way
