"""DeepSpeed's offload and ``aio`` settings as zerompi's swap settings.

zerompi has one ``nvme_path`` and one ``pin_memory`` for both offload blocks, so the two blocks must
agree on them. ``aio.block_size`` (bytes per I/O request) is ``nvme_block_kib`` when it is a whole
number of 4 KiB pages from 4 KiB to 256 MiB, and ``aio.intra_op_parallelism`` (threads serving one
swap operation) is ``nvme_threads`` in 1..64; other values of them are tuning with no effect here.
The buffer counts and sizes of the offload blocks are not mapped: DeepSpeed's swap buffers hold whole
tensors of ``buffer_size`` elements, zerompi's staging buffers are I/O blocks of ``nvme_block_kib``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerompi.compat.deepspeed.screen import get
from zerompi.config.checks import integer
from zerompi.config.zero import CHECKS
from zerompi.errors import ConfigError

_BLOCKS = ("offload_optimizer", "offload_param")


def whole(value: Any) -> Any:
    """A float with an integral value as an int (1e5 in JSON is a float); anything else unchanged."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def read_swap(d: Mapping[str, Any], kwargs: dict[str, Any]) -> list[str]:
    """Set the swap fields the document gives; return the aio keys given that have no effect."""
    for name in ("nvme_path", "pin_memory"):
        seen = {}
        for block in _BLOCKS:
            dotted = f"zero_optimization.{block}.{name}"
            found, value = get(d, dotted)
            if found:
                seen[dotted] = kwargs[name] = CHECKS[name](dotted, value)
        if len(seen) == 2 and len(set(seen.values())) == 2:
            raise ConfigError(" and ".join(f"{k}={v!r}" for k, v in seen.items())
                              + f" differ; allowed: the same {name} in both blocks")
    no_effect = []
    found, value = get(d, "aio.block_size")
    if found:
        size = integer("aio.block_size", whole(value), 1)
        if size % 4096 == 0 and size <= 256 * 2**20:
            kwargs["nvme_block_kib"] = size // 1024
        else:
            no_effect.append("aio.block_size")
    found, value = get(d, "aio.intra_op_parallelism")
    if found:
        threads = integer("aio.intra_op_parallelism", whole(value), 1)
        if threads <= 64:
            kwargs["nvme_threads"] = threads
        else:
            no_effect.append("aio.intra_op_parallelism")
    return no_effect
