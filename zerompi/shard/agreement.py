"""Every rank must build the same model (parameter names, shapes, dtypes and trainability) from the
same config.

A rank whose model or config differs (another config file, another code version, an environment
variable read on one node) would shard, reduce and update the wrong elements silently, or meet its
peers' first broadcast with another size; one digest all-gather finds it, and a second gathers what
names the difference.
"""
from __future__ import annotations

import dataclasses
import hashlib

from torch import nn

from zerompi.comm.group import ProcessGroup
from zerompi.errors import ConfigError, ModelMismatchError, all_ranks_ok

# Keys that may differ between ranks: where each rank runs and writes, and how long it waits.
PER_RANK = frozenset({"cpu_threads", "nvme_path", "nvme_threads", "nvme_buffers", "pin_memory", "hang_dir",
                      "hang_floor", "collective_timeout", "abort_on_exception", "recovery_dir", "min_ranks",
                      "return_freed_memory", "checkpoint_direct_io", "checkpoint_align_kib",
                      "checkpoint_async_copy", "nvme_block_kib", "nvme_verify"})


def _signature(module: nn.Module) -> list[tuple]:
    params = [("param", n, tuple(p.shape), str(p.dtype), p.requires_grad)
              for n, p in module.named_parameters()]
    buffers = [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    return params + buffers


def check_models_agree(module: nn.Module, group: ProcessGroup) -> None:
    """Collective: every rank must hold the same parameter names, shapes and dtypes."""
    sig = _signature(module)
    digest = hashlib.sha256(repr(sig).encode()).hexdigest()
    digests = group.allgather_object(digest)
    if len(set(digests)) == 1:
        return
    reference = group.allgather_object(sig if group.rank == 0 else None)[0]
    problem = None
    if digest != digests[0]:
        ours, theirs = set(sig), set(reference)
        extra = sorted(ours - theirs, key=str)[:3]
        missing = sorted(theirs - ours, key=str)[:3]
        problem = f"model differs from rank 0's: only here {extra}, only on rank 0 {missing}"
    all_ranks_ok(group, problem, ModelMismatchError)


def check_configs_agree(cfg, group: ProcessGroup) -> None:
    """Collective: every key but PER_RANK's must be the same on every rank; the error names each key
    that differs with every rank's value, on every rank."""
    mine = {f.name: repr(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name not in PER_RANK}
    digest = hashlib.sha256(repr(sorted(mine.items())).encode()).hexdigest()
    if len(set(group.allgather_object(digest))) == 1:
        return
    every = group.allgather_object(mine)
    differ = [k for k in mine if len({d[k] for d in every}) > 1]
    lines = []
    for key in differ:
        by_value: dict[str, list[int]] = {}
        for rank, d in enumerate(every):
            by_value.setdefault(d[key], []).append(rank)
        lines.append(f"{key}: " + ", ".join(f"{v} on rank(s) {ranks}" for v, ranks in by_value.items()))
    raise ConfigError("the config differs between ranks: " + "; ".join(lines) + " (every rank must pass the "
                      "same config; only paths, threads, waits and I/O knobs may differ: agreement.PER_RANK)")
