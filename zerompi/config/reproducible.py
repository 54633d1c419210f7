"""What ``micro_batches`` and ``reproducible=True`` need of the rest of the config, checked once.

``micro_batches`` deals a global batch of G micro-batches over the ranks, in rounds
(shard/rounds.py): the same micro-batches at any world size, which is what lets the
survivors of a lost rank train the same global batch. ``reproducible=True`` adds
the promise of parameters and optimizer state bitwise equal at every world size N in
1..micro_batches. A setting the rounds do not run, or whose arithmetic depends on N,
is refused here, named, with what is allowed instead.
"""
from __future__ import annotations

from typing import Any

from zerompi.config.choices import DType, Hierarchy
from zerompi.errors import ConfigError

_KERNEL_KEYS = ("fused", "foreach")


def check_reproducible(cfg: Any) -> None:
    if cfg.reproducible and cfg.micro_batches is None:
        raise ConfigError("reproducible=True needs micro_batches, the number of micro-batches per step over all "
                          "ranks (the global batch); allowed: an int >= 1")
    if cfg.micro_batches is None:
        return
    mode = "reproducible=True" if cfg.reproducible else f"micro_batches={cfg.micro_batches}"
    refused = _dealt_refusals(cfg) + (_bitwise_refusals(cfg) if cfg.reproducible else [])
    if refused:
        raise ConfigError(f"{mode} cannot keep its guarantee with: " + "; ".join(
            f"{what} ({why}; allowed: {allowed})" for what, why, allowed in refused))


def _dealt_refusals(cfg: Any) -> list[tuple[str, str, str]]:
    """What the rounds of a dealt global batch do not run (either mode)."""
    refused = []
    if cfg.grad_accum_steps != 1:
        refused.append((f"grad_accum_steps={cfg.grad_accum_steps}", "micro_batches and the world size set how "
                        "many micro-batches each rank runs", "1"))
    if cfg.dtype == DType.FP16:
        refused.append(("dtype='fp16'", "its loss scaling is not covered yet", "'fp32' or 'bf16'"))
    for key in ("quantize_weights", "quantize_grads"):
        if getattr(cfg, key).bits is not None:
            refused.append((f"{key}={getattr(cfg, key).value!r}", "quantizing a rank's gradient or shard depends "
                            "on how the batch is split", "'none'"))
    if cfg.prefetch_units:
        refused.append((f"prefetch_units={cfg.prefetch_units}", "a rank with one micro-batch fewer replays the "
                        "gathers of its last round, which prefetching makes differ from round to round", "0"))
    if cfg.optimizer_in_backward:
        refused.append(("optimizer_in_backward=True", "the update waits for every micro-batch", "False"))
    return refused


def _bitwise_refusals(cfg: Any) -> list[tuple[str, str, str]]:
    """What would make reproducible=True's bits depend on the world size or the node layout."""
    refused = []
    if cfg.hierarchy != Hierarchy.FLAT:
        refused.append((f"hierarchy={cfg.hierarchy.value!r}", "a two-level sum depends on the node layout", "'flat'"))
    if cfg.cpu_threads is None:
        refused.append(("cpu_threads=None", "the default gives each rank its share of the cores, so the kernels' "
                        "threads (and their summation order) would change with the ranks per node", "an int >= 1"))
    kernels = [k for k in _KERNEL_KEYS if cfg.optimizer_kwargs.get(k)]
    if kernels:
        refused.append((f"optimizer_kwargs {kernels}", "a fused or multi-tensor kernel treats a shard's last "
                        "elements apart, where shard boundaries fall with the world size", "leave them unset"))
    return refused
