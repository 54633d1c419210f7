"""What ``reproducible=True`` needs of the rest of the config, checked once.

The mode promises parameters and optimizer state bitwise equal at every world size N in
1..micro_batches. A setting whose arithmetic depends on N, or that this mode does not run yet,
is refused here, named, with what is allowed instead.
"""
from __future__ import annotations

from typing import Any

from zerompi.config.choices import DType, Hierarchy
from zerompi.errors import ConfigError

_KERNEL_KEYS = ("fused", "foreach")


def check_reproducible(cfg: Any) -> None:
    if not cfg.reproducible:
        if cfg.micro_batches is not None:
            raise ConfigError(f"micro_batches={cfg.micro_batches!r} sets the global batch of reproducible=True, "
                              "which is off; allowed: None, or reproducible=True")
        return
    if cfg.micro_batches is None:
        raise ConfigError("reproducible=True needs micro_batches, the number of micro-batches per step over all "
                          "ranks (the global batch); allowed: an int >= 1")
    refused = []
    if cfg.grad_accum_steps != 1:
        refused.append((f"grad_accum_steps={cfg.grad_accum_steps}", "micro_batches and the world size set how "
                        "many micro-batches each rank runs", "1"))
    if cfg.dtype == DType.FP16:
        refused.append(("dtype='fp16'", "its loss scaling is not covered yet", "'fp32' or 'bf16'"))
    if cfg.hierarchy != Hierarchy.FLAT:
        refused.append((f"hierarchy={cfg.hierarchy.value!r}", "a two-level sum depends on the node layout", "'flat'"))
    for key in ("quantize_weights", "quantize_grads"):
        if getattr(cfg, key).bits is not None:
            refused.append((f"{key}={getattr(cfg, key).value!r}", "quantizing a rank's gradient or shard depends "
                            "on how the batch is split", "'none'"))
    if cfg.prefetch_units:
        refused.append((f"prefetch_units={cfg.prefetch_units}", "a rank with one micro-batch fewer replays the "
                        "gathers of its last round, which prefetching makes differ from round to round", "0"))
    if cfg.optimizer_in_backward:
        refused.append(("optimizer_in_backward=True", "the update waits for every micro-batch", "False"))
    if cfg.cpu_threads is None:
        refused.append(("cpu_threads=None", "the default gives each rank its share of the cores, so the kernels' "
                        "threads (and their summation order) would change with the ranks per node", "an int >= 1"))
    kernels = [k for k in _KERNEL_KEYS if cfg.optimizer_kwargs.get(k)]
    if kernels:
        refused.append((f"optimizer_kwargs {kernels}", "a fused or multi-tensor kernel treats a shard's last "
                        "elements apart, where shard boundaries fall with the world size", "leave them unset"))
    if refused:
        raise ConfigError("reproducible=True cannot keep its guarantee with: " + "; ".join(
            f"{what} ({why}; allowed: {allowed})" for what, why, allowed in refused))
